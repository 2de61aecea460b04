/* ARM64 NEON operations of the inference engine (see pocket_model_ops.h): the products on
 * tiled weights with int8 activation digits, on the dot-product extension (SDOT, ARMv8.2-A
 * +dotprod). Every NEON function carries its own target attribute: this file is compiled for the
 * baseline ARMv8.0 like the rest of the build, and the engine only selects these where the neon
 * kernel level is supported (HWCAP_ASIMDDP, checked at run time in pocket_kernels.c).
 *
 * What is NEON here and what is not:
 *   matmul_tiled, digits 1 and 2   SDOT kernels below (INT4, INT5 and INT8 weights);
 *   matmul_planes                  the same kernels on a screened head's nibble planes
 *                                  (recombined INT8 codes, or the high plane's estimate);
 *   matmul_tiled, digits 0         pm_matmul_tiled_portable (the engine does not build tiled
 *                                  weights for float activations at this level unless a
 *                                  weight is INT5, see pocket_model.c: float products go
 *                                  through the kernel table, i.e. the scalar kernels);
 *   quant_act, block_sums          the portable functions (identical results by contract);
 *   lora_down, lora_up             the portable loops, float16 adapters converted by FCVTL;
 *   rmsnorm, attn, glu, matmul_f32, to_f16   the portable operations (pm_*_portable).
 *
 * The SDOT product. One `vdotq_laneq_s32(acc, w, x, L)` adds, for each of its 4 int32 lanes e,
 * the dot product of the 4 bytes 4e..4e+3 of w with the 4 bytes of 32-bit word L of x. A 64-byte
 * chunk vector of a tile record (pocket_model_ops.h: chunk k of row i = the 4 bytes at lane i)
 * is 4 registers of 16 bytes, register r holding rows 4r..4r+3; so 4 SDOTs with the chunk's 4
 * activation bytes as word L of x cover the 16 rows of the tile, accumulator r lane e = row
 * 4r + e. The 32 int8 activations of a block are two registers xa (columns 0..15, chunks 0..3)
 * and xb (columns 16..31, chunks 4..7): chunk c is word c % 4 of (c < 4 ? xa : xb).
 *   INT4: vector m holds chunk 2m in its low nibbles and chunk 2m + 1 in its high nibbles;
 *         values 0..15 are valid s8 operands as they are (AND 0x0F, shift right by 4).
 *   INT5: the INT4 vectors plus, per vector m, two 64-bit masks (bit 4i + j: the 5th bit of
 *         byte 4i + j of the low / high nibbles); register r takes mask bytes 2r and 2r + 1,
 *         spread over its 16 bytes with a bit-select test, and adds 16 where set: 0..31.
 *   INT8: vector k holds chunk k as q + 128 (u8); XOR 0x80 turns it into q as s8, so the
 *         integer sums are those of the true weights q and the offset term corr of pm_act is
 *         not needed: with u = q + 128 and S the block's digit sum,
 *           128 * sum(u x1) + sum(u x2) - corr = 128 * sum(q x1) + sum(q x2)   (corr = 128 S),
 *         the same int32 value the portable kernel computes (no overflow either way: at most
 *         32 * 255 * 127 * 129 < 2^31).
 * Per block the int32 total T = 128 i1 + i2 (digits 2) or i1 (digits 1) is exact. The float
 * epilogue then repeats the portable kernel's operations in its order, row by row (a NEON lane
 * per row): acc += (float)T * (scale * dd[b]); xs += bsum[b] over the group; INT4:
 * macc += min * xs per group; y = acc + macc. Conversions and products are the same IEEE
 * operations (SCVTF and FCVTL round like C's casts; FMUL / FADD, no fused multiply-add: like the
 * portable file, this one relies on the build's -std=c11, which turns off GCC's contraction of
 * a * b + c), so the results are bit-identical to pm_matmul_tiled_portable.
 */
#include "pocket_internal.h"
#include "pocket_model_ops.h"

#if PM_HAVE_NEON

#include <arm_neon.h>

#if defined(__clang__)
#define TGT /* the target has +dotprod already (see PM_HAVE_NEON) */
#else
#define TGT __attribute__((target("arch=armv8.2-a+dotprod")))
#endif
#define AI __attribute__((always_inline))

/* acc[0..3] += the chunk in w[0..3] (rows 0..15) times word LANE of xv (a literal 0..3). */
#define SDOT16(acc, w, xv, LANE)                                                                \
    do {                                                                                        \
        (acc)[0] = vdotq_laneq_s32((acc)[0], (w)[0], (xv), LANE);                               \
        (acc)[1] = vdotq_laneq_s32((acc)[1], (w)[1], (xv), LANE);                               \
        (acc)[2] = vdotq_laneq_s32((acc)[2], (w)[2], (xv), LANE);                               \
        (acc)[3] = vdotq_laneq_s32((acc)[3], (w)[3], (xv), LANE);                               \
    } while (0)

/* The INT5 high bits of register r (bytes 16r..16r+15) from a vector's 64-bit mask k: 16 where
 * bit 16r + byte is set, else 0. */
static inline TGT AI uint8x16_t high_bits(const uint8_t *k, int r) {
    static const uint8_t sel[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t b = vcombine_u8(vdup_n_u8(k[2 * r]), vdup_n_u8(k[2 * r + 1]));
    return vandq_u8(vtstq_u8(b, vld1q_u8(sel)), vdupq_n_u8(16));
}

/* INT4 (or INT5) vector MM of the block: low nibbles = chunk 2 MM (word LO of X), high nibbles
 * = chunk 2 MM + 1 (word LO + 1), both digits, T tokens. */
#define Q4_VEC(MM, X, LO)                                                                       \
    do {                                                                                        \
        int8x16_t lo_[4], hi_[4];                                                               \
        for (int r_ = 0; r_ < 4; r_++) {                                                        \
            const uint8x16_t v_ = vld1q_u8(blk + 64 * (MM) + 16 * r_);                          \
            uint8x16_t l_ = vandq_u8(v_, m4), h_ = vshrq_n_u8(v_, 4);                           \
            if (BITS == 5) {                                                                    \
                l_ = vaddq_u8(l_, high_bits(blk + 256 + 16 * (MM), r_));                        \
                h_ = vaddq_u8(h_, high_bits(blk + 256 + 16 * (MM) + 8, r_));                    \
            }                                                                                   \
            lo_[r_] = vreinterpretq_s8_u8(l_);                                                  \
            hi_[r_] = vreinterpretq_s8_u8(h_);                                                  \
        }                                                                                       \
        for (int t_ = 0; t_ < T; t_++) {                                                        \
            SDOT16(i1[t_], lo_, X##1[t_], LO);                                                  \
            SDOT16(i1[t_], hi_, X##1[t_], LO + 1);                                              \
            if (DIG == 2) {                                                                     \
                SDOT16(i2[t_], lo_, X##2[t_], LO);                                              \
                SDOT16(i2[t_], hi_, X##2[t_], LO + 1);                                          \
            }                                                                                   \
        }                                                                                       \
    } while (0)

/* INT8 vector K of the block (chunk K = word LANE of X), stored q + 128 -> q, T tokens. */
#define Q8_VEC(K, X, LANE)                                                                      \
    do {                                                                                        \
        int8x16_t q_[4];                                                                        \
        for (int r_ = 0; r_ < 4; r_++)                                                          \
            q_[r_] = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(blk + 64 * (K) + 16 * r_), sgn));    \
        for (int t_ = 0; t_ < T; t_++) {                                                        \
            SDOT16(i1[t_], q_, X##1[t_], LANE);                                                 \
            if (DIG == 2) SDOT16(i2[t_], q_, X##2[t_], LANE);                                   \
        }                                                                                       \
    } while (0)

/* INT8 vector K of an INT8 matrix held as nibble planes (pm_ops.matmul_planes): chunk K from
 * plane vector K / 2 of the high plane (blk) and the low one (blk2), the low nibbles of both
 * (K even) or the high ones (K odd) recombined into q + 128, then as Q8_VEC. */
#define PL_VEC(K, X, LANE)                                                                      \
    do {                                                                                        \
        int8x16_t q_[4];                                                                        \
        for (int r_ = 0; r_ < 4; r_++) {                                                        \
            const uint8x16_t h_ = vld1q_u8(blk + 64 * ((K) >> 1) + 16 * r_);                    \
            const uint8x16_t l_ = vld1q_u8(blk2 + 64 * ((K) >> 1) + 16 * r_);                   \
            const uint8x16_t u_ = (K) & 1 ? vorrq_u8(vandq_u8(h_, vdupq_n_u8(0xF0)),            \
                                                     vshrq_n_u8(l_, 4))                         \
                                          : vorrq_u8(vshlq_n_u8(h_, 4), vandq_u8(l_, m4));      \
            q_[r_] = vreinterpretq_s8_u8(veorq_u8(u_, sgn));                                    \
        }                                                                                       \
        for (int t_ = 0; t_ < T; t_++) {                                                        \
            SDOT16(i1[t_], q_, X##1[t_], LANE);                                                 \
            if (DIG == 2) SDOT16(i2[t_], q_, X##2[t_], LANE);                                   \
        }                                                                                       \
    } while (0)

/* The 8 INT8 vectors of a block through VEC (Q8_VEC or PL_VEC): chunk k is word k % 4 of xa
 * (k < 4) or xb. */
#define INT8_VECS(VEC)                                                                          \
    do {                                                                                        \
        VEC(0, xa, 0);                                                                          \
        VEC(1, xa, 1);                                                                          \
        VEC(2, xa, 2);                                                                          \
        VEC(3, xa, 3);                                                                          \
        VEC(4, xb, 0);                                                                          \
        VEC(5, xb, 1);                                                                          \
        VEC(6, xb, 2);                                                                          \
        VEC(7, xb, 3);                                                                          \
    } while (0)

/* 4 float16 values (rows 4r..4r+3 of a scale / min group) as float32, exactly. */
static inline TGT AI float32x4_t load_f16x4(const uint16_t *p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}

/* One tile of 16 rows for T (1 or 2) tokens i0 .. i0 + T - 1. BITS: INT4 (u8 nibbles), INT5
 * (nibbles and high-bit masks) or INT8 (q + 128) weights, or the planes of an INT8 matrix (w
 * the high plane, w2 the low one: PM_BITS_ESTIMATE, an INT4 product of scale 16 s and minimum
 * -120.5 s on the first digit, as pm_matmul_planes_portable; PM_BITS_PLANES, recombined into
 * the INT8 codes); DIG: activation digits (1 or 2). Float accumulators acc / macc: [token]
 * [r] lane e = row 4r + e of the tile, as in the portable kernel's acc / macc of that row. */
static inline TGT AI void tiled_tile(const int BITS, const int DIG, const int T,
                                     const pm_tiled *w, const pm_tiled *w2, const pm_act *a,
                                     int i0, float *y, size_t ystride, int tile,
                                     const uint16_t *steps) {
    const int EST = BITS == PM_BITS_ESTIMATE, PL = BITS == PM_BITS_PLANES;
    const int Q4 = BITS != 8 && !PL;
    const size_t BB = PM_BLOCK_BYTES(EST || PL ? 4 : BITS);
    const uint16_t *sc, *mn;
    const uint8_t *rec = pm_tile_record(w, tile, &sc, &mn);
    if (steps) { /* a coded tile's steps, decoded */
        sc = steps;
        mn = steps + (size_t)w->ng * 16;
    }
    const uint8_t *rec2 = PL ? w2->data + (size_t)tile * w2->tile_bytes : NULL;
    const int nb = w->nb, ng = w->ng, gpb = w->gpb;
    const float zp = -(float)w->zero_point; /* implicit minimums: -zero_point * scale */
    const uint8x16_t m4 = vdupq_n_u8(0x0F), sgn = vdupq_n_u8(0x80);
    const int8_t *p1[2], *p2[2];
    const float *dd[2], *bs[2];
    for (int t = 0; t < T; t++) {
        p1[t] = a->q1 + (size_t)(i0 + t) * a->cols;
        p2[t] = DIG == 2 ? a->q2 + (size_t)(i0 + t) * a->cols : p1[t];
        dd[t] = a->dd + (size_t)(i0 + t) * nb;
        bs[t] = a->bsum + (size_t)(i0 + t) * nb;
    }
    float32x4_t acc[2][4], macc[2][4];
    for (int t = 0; t < T; t++)
        for (int r = 0; r < 4; r++) acc[t][r] = macc[t][r] = vdupq_n_f32(0.0f);
    for (int g = 0; g < ng; g++) {
        float32x4_t s1[4], s[4];
        for (int r = 0; r < 4; r++) {
            s1[r] = load_f16x4(sc + 16 * g + 4 * r);
            s[r] = EST ? vmulq_n_f32(s1[r], PM_EST_SCALE(a)) : s1[r];
        }
        float xs[2] = {0.0f, 0.0f};
        for (int jb = 0; jb < gpb; jb++) {
            const int b = g * gpb + jb;
            const uint8_t *blk = rec + (size_t)b * BB;
            const uint8_t *blk2 = PL ? rec2 + (size_t)b * BB : NULL;
            (void)blk2;
            int32x4_t i1[2][4], i2[2][4];
            int8x16_t xa1[2], xb1[2], xa2[2], xb2[2];
            for (int t = 0; t < T; t++) {
                for (int r = 0; r < 4; r++) i1[t][r] = i2[t][r] = vdupq_n_s32(0);
                xa1[t] = vld1q_s8(p1[t] + 32 * b);
                xb1[t] = vld1q_s8(p1[t] + 32 * b + 16);
                xa2[t] = vld1q_s8(p2[t] + 32 * b);
                xb2[t] = vld1q_s8(p2[t] + 32 * b + 16);
            }
            if (Q4) {
                Q4_VEC(0, xa, 0);
                Q4_VEC(1, xa, 2);
                Q4_VEC(2, xb, 0);
                Q4_VEC(3, xb, 2);
            } else if (PL) {
                INT8_VECS(PL_VEC);
            } else {
                INT8_VECS(Q8_VEC);
            }
            for (int t = 0; t < T; t++) {
                const float db = dd[t][b];
                for (int r = 0; r < 4; r++) {
                    const int32x4_t tot =
                        DIG == 2 ? vaddq_s32(vshlq_n_s32(i1[t][r], 7), i2[t][r]) : i1[t][r];
                    const float32x4_t sd = vmulq_n_f32(s[r], db);
                    acc[t][r] = vaddq_f32(acc[t][r], vmulq_f32(vcvtq_f32_s32(tot), sd));
                }
                xs[t] += bs[t][b];
            }
        }
        if (Q4)
            for (int r = 0; r < 4; r++) {
                const float32x4_t mv =
                    EST  ? vmulq_n_f32(s1[r], -120.5f)
                    : zp ? vmulq_n_f32(s1[r], zp) /* implicit minimums: exact */
                         : load_f16x4(mn + 16 * g + 4 * r);
                for (int t = 0; t < T; t++)
                    macc[t][r] = vaddq_f32(macc[t][r], vmulq_n_f32(mv, xs[t]));
            }
    }
    const int r0 = 16 * tile, nr = pm_tile_rows(w, tile);
    for (int t = 0; t < T; t++) {
        float *yt = y + (size_t)(i0 + t) * ystride + r0;
        if (nr == 16) {
            for (int r = 0; r < 4; r++) vst1q_f32(yt + 4 * r, vaddq_f32(acc[t][r], macc[t][r]));
        } else {
            float out[16];
            for (int r = 0; r < 4; r++) vst1q_f32(out + 4 * r, vaddq_f32(acc[t][r], macc[t][r]));
            memcpy(yt, out, (size_t)nr * sizeof(float));
        }
    }
}

/* float16 bits of 4 float32 values, rounded to nearest even (FCVTN under the default FPCR) */
static inline TGT AI void store_f16x4(uint16_t *out, float32x4_t v) {
    vst1_u16(out, vreinterpret_u16_f16(vcvt_f16_f32(v)));
}

/* The float16 scales and minimums of coded tile record rec (pm_tiled_steps, bit for bit: the
 * code times the row's step in float32, rounded to nearest even once). */
static TGT void coded_steps_neon(const pm_tiled *w, const uint8_t *rec, uint16_t *out) {
    const pm_coded c = pm_coded_parts(w, rec);
    float32x4_t d[4], dm[4];
    for (size_t g = 0; g < c.ng; g++) {
        if (g % c.gps == 0) /* the next run's steps */
            for (int r = 0; r < 4; r++) {
                d[r] = load_f16x4(c.st + 32 * (g / c.gps) + 4 * r);
                dm[r] = load_f16x4(c.st + 32 * (g / c.gps) + 16 + 4 * r);
            }
        const uint8x16_t s8 = vld1q_u8(c.sc + 16 * g);
        const int8x16_t m8 = vld1q_s8(c.mc + 16 * g);
        const uint16x8_t s16[2] = {vmovl_u8(vget_low_u8(s8)), vmovl_u8(vget_high_u8(s8))};
        const int16x8_t m16[2] = {vmovl_s8(vget_low_s8(m8)), vmovl_s8(vget_high_s8(m8))};
        for (int r = 0; r < 4; r++) {
            const uint16x8_t sh = s16[r / 2];
            const int16x8_t mh = m16[r / 2];
            const uint32x4_t s32 = r % 2 ? vmovl_u16(vget_high_u16(sh)) : vmovl_u16(vget_low_u16(sh));
            const int32x4_t m32 = r % 2 ? vmovl_s16(vget_high_s16(mh)) : vmovl_s16(vget_low_s16(mh));
            store_f16x4(out + 16 * g + 4 * (size_t)r, vmulq_f32(vcvtq_f32_u32(s32), d[r]));
            store_f16x4(out + 16 * (c.ng + g) + 4 * (size_t)r, vmulq_f32(vcvtq_f32_s32(m32), dm[r]));
        }
    }
}

/* Tiles [tb, te), tokens in pairs (the pair shares each weight load), an odd last one alone;
 * a coded tile's steps decoded once per tile. */
static inline TGT AI void tiled_range(const int BITS, const int DIG, const pm_tiled *w,
                                      const pm_tiled *w2, const pm_act *a, float *y,
                                      size_t ystride, int tb, int te) {
    uint16_t buf[2 * 16 * PM_CODED_MAX_GROUPS];
    const int coded = BITS == 4 && w->coded;
    for (int tile = tb; tile < te; tile++) {
        const uint16_t *st = NULL;
        if (coded) {
            coded_steps_neon(w, w->data + (size_t)tile * w->tile_bytes, buf);
            st = buf;
        }
        int i0 = 0;
        for (; i0 + 2 <= a->n; i0 += 2)
            tiled_tile(BITS, DIG, 2, w, w2, a, i0, y, ystride, tile, st);
        if (i0 < a->n) tiled_tile(BITS, DIG, 1, w, w2, a, i0, y, ystride, tile, st);
    }
}

static TGT void matmul_tiled_neon(const pm_tiled *w, const pm_act *a, float *y, size_t ystride,
                                  int tb, int te) {
    if (a->digits != 1 && a->digits != 2) {
        pm_matmul_tiled_portable(w, a, y, ystride, tb, te);
        return;
    }
    /* the bits and digits as literals: one specialised copy of the kernel each */
    switch (w->bits * 10 + a->digits) {
    case 42: tiled_range(4, 2, w, NULL, a, y, ystride, tb, te); break;
    case 41: tiled_range(4, 1, w, NULL, a, y, ystride, tb, te); break;
    case 52: tiled_range(5, 2, w, NULL, a, y, ystride, tb, te); break;
    case 51: tiled_range(5, 1, w, NULL, a, y, ystride, tb, te); break;
    case 82: tiled_range(8, 2, w, NULL, a, y, ystride, tb, te); break;
    default: tiled_range(8, 1, w, NULL, a, y, ystride, tb, te); break;
    }
}

/* pm_ops.matmul_planes: the planes recombined into the INT8 codes (pm_matmul_planes_portable's
 * bits, as the INT8 tiles'), or the high plane's estimate on the first digit. */
static TGT void matmul_planes_neon(const pm_tiled *hi, const pm_tiled *lo, const pm_act *a,
                                   float *y, size_t ystride, int tb, int te) {
    PM_PLANES_DISPATCH(tiled_range, hi, lo, a, y, ystride, tb, te);
}

/* float16 -> float32: FCVTL (baseline ARMv8), exact like pm_from_f16_portable. */
static void from_f16_neon(const uint16_t *h, float *out, size_t len) {
    size_t k = 0;
    for (; k + 4 <= len; k += 4)
        vst1q_f32(out + k, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h + k))));
    for (; k < len; k++) out[k] = pocket_f16_to_f32(h[k]);
}

static void lora_down_neon(const pocket_weight *w, const float *x, int i0, int i1, float *t) {
    pm_lora_down_conv(from_f16_neon, w, x, i0, i1, t);
}

static void lora_up_neon(const pocket_weight *w, const float *t, int n, float *y, size_t ys,
                         int c0, int c1) {
    pm_lora_up_conv(from_f16_neon, w, t, n, y, ys, c0, c1);
}

const pm_ops pm_ops_neon = PM_OPS("neon", pm_attn_portable, pm_glu_portable,
                                  pm_quant_act_portable, matmul_tiled_neon, lora_down_neon,
                                  lora_up_neon, matmul_planes_neon);

#endif /* PM_HAVE_NEON */
