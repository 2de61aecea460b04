/* AVX2 operations of the inference engine (see pocket_model_ops.h): the products on tiled
 * weights with int8 activation digits, for x86-64 CPUs without AVX-512 (the avx2 kernel level).
 * Before these, such CPUs ran the products in the portable C loop (smollm2-135m decoded ~4
 * tokens/s) and attention and the GLU in plain C.
 *
 * What is AVX2 here and what is not:
 *   matmul_tiled, digits 1 and 2   the kernels below (INT4, INT5 and INT8 weights), with the
 *                                  AVX-VNNI dot product where the CPU has it (Alder Lake and
 *                                  later), else AVX2's multiply-add pair;
 *   matmul_tiled, digits 0         pm_matmul_tiled_portable (float activations at this level
 *                                  use the kernel table's AVX2 products; tiles exist for them
 *                                  only with INT5 weights, see pocket_model.c);
 *   attn, glu                      AVX2 + FMA versions of the portable loops (below);
 *   quant_act                      the portable function's operations, 8 values at a time
 *                                  (identical results by contract);
 *   block_sums                     the portable function;
 *   matmul_f32                     register-blocked AVX2, bit-identical to the portable
 *                                  loop (below);
 *   lora_down, lora_up             8 lanes at a time, float16 adapters converted with F16C,
 *                                  bit-identical to the portable loops (below; also the
 *                                  avx512 level's);
 *   rmsnorm, to_f16                the portable operations.
 *
 * The integer product. A 64-byte chunk vector of a tile record (pocket_model_ops.h: chunk k of
 * row i = the 4 bytes at lane i) is two 256-bit registers, rows 0-7 and rows 8-15; the chunk's 4
 * activation bytes are broadcast to every 32-bit lane, and each lane gets the dot product of its
 * 4 weight bytes with them:
 *   AVX-VNNI: vpdpbusd (u8 x s8, summed into the int32 lane);
 *   AVX2:     vpmaddubsw (u8 x s8, adjacent pairs summed to int16), the int16 pair sums of up
 *             to 8 chunks added in int16, then vpmaddwd (the pairs to int32, PM_AVX2_RUN).
 *             Nothing saturates: INT4 / INT5 weights are 0..31 and the digits at most 127 in
 *             magnitude (2 x 31 x 127 < 2^15 per pair; the runs are sized to stay below
 *             2^15). Before the runs every chunk paid its own vpmaddwd: two multiplies per dot
 *             product instead of one (prefill 1.2-1.5x slower on one core).
 *   INT8 weights are stored as q + 128; XOR 0x80 gives q as s8, and the product runs on |q|
 *   (u8, at most 128) and the digit with q's sign (vpsignb), so that 2 x 128 x 127 < 2^15 holds
 *   for vpmaddubsw too. The lane sums are then those of the true q, and the offset term corr of
 *   pm_act is not needed: 128 * sum(u x1) + sum(u x2) - corr = 128 * sum(q x1) + sum(q x2), the
 *   int32 value the portable kernel computes.
 * Per block the int32 total T = 128 i1 + i2 (digits 2) or i1 (digits 1) is exact. The float
 * epilogue repeats the portable kernel's operations in its order, lane by lane (a lane per row):
 * acc += (float)T * (scale * dd[b]); xs += bsum[b] over the group; INT4 / INT5:
 * macc += min * xs per group; y = acc + macc. Separate multiplies and adds (no fused
 * multiply-add: this file, like the portable one, is built with -std=c11, which keeps GCC from
 * contracting a * b + c), so the results are bit-identical to pm_matmul_tiled_portable.
 */
#include "pocket_internal.h"
#include "pocket_model_ops.h"

#if PM_HAVE_AVX2

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "pocket_simd.h"

#define TGT __attribute__((target("avx2,fma,f16c")))
#if PM_HAVE_AVXVNNI
#define TGTV __attribute__((target("avx2,fma,f16c,avxvnni")))
#endif
#define AI __attribute__((always_inline))

/* One dot product of each lane's 4 bytes of w (u8) with the broadcast word x (s8): PAIRS adds
 * vpmaddubsw's two int16 pair sums per lane to J (widened by PM_AVX2_WIDEN), else DOT adds the
 * lane's sum to I. */
#define PM_AVX2_DOT(PAIRS, DOT, I, J, w, x)                                                     \
    do {                                                                                        \
        if (PAIRS) {                                                                            \
            (J) = _mm256_add_epi16((J), _mm256_maddubs_epi16((w), (x)));                        \
            __asm__("" : "+x"(J)); /* in this order: GCC's reassociated sums spill */           \
        } else                                                                                  \
            (I) = DOT((I), (w), (x));                                                           \
    } while (0)
/* TOT += 128 J1 + J2 (DIG 2) or J1 (DIG 1), the int16 pairs widened to int32 lane sums */
#define PM_AVX2_WIDEN(DIG, TOT, J1, J2)                                                         \
    do {                                                                                        \
        if ((DIG) == 2) {                                                                       \
            (TOT) = _mm256_add_epi32((TOT), _mm256_madd_epi16((J1), _mm256_set1_epi16(128)));   \
            (TOT) = _mm256_add_epi32((TOT), _mm256_madd_epi16((J2), _mm256_set1_epi16(1)));     \
        } else {                                                                                \
            (TOT) = _mm256_add_epi32((TOT), _mm256_madd_epi16((J1), _mm256_set1_epi16(1)));     \
        }                                                                                       \
        (J1) = (J2) = _mm256_setzero_si256();                                                   \
    } while (0)
#define PM_AVX2_NODOT(acc, w, x) (acc) /* PAIRS never uses DOT */
#if PM_HAVE_AVXVNNI
static inline TGTV AI __m256i dot_vnni(__m256i acc, __m256i w, __m256i x) {
    return _mm256_dpbusd_avx_epi32(acc, w, x);
}
#endif

/* The INT5 high bits of 32 bytes from 32 mask bits (bit k: byte k): 16 where set, else 0. */
static inline TGT AI __m256i high_bits(const uint8_t *mask) {
    uint32_t m32;
    memcpy(&m32, mask, 4);
    const __m256i idx = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2,
                                         2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i sel = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)m32), idx);
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, sel), sel);
    return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

/* The 4 activation bytes of chunk c of a block as a broadcast word. */
static inline TGT AI __m256i chunk_word(const int8_t *x, int c) {
    int32_t v;
    memcpy(&v, x + 4 * c, 4);
    return _mm256_set1_epi32(v);
}

/* AVX2 without VNNI: vpmaddubsw's int16 pair sums are added in int16 for as many dot products
 * as cannot overflow, then widened by one vpmaddwd (by 128 for the first digit): a pair sum is
 * at most 2 x 15 x 127 = 3,810 (INT4) or 2 x 31 x 127 = 7,874 (INT5) in magnitude, so 8 (INT4:
 * a block's whole tile half) or 4 (INT5) of them stay under 2^15; INT8 (2 x 128 x 127) widens
 * every one. One multiply per dot product instead of two, the same int32 sums. */
#define PM_AVX2_RUN(BITS) ((BITS) == 4 ? 8 : (BITS) == 5 ? 4 : 1)

/* One tile of 16 rows for T (1 or 2) tokens i0 .. i0 + T - 1; a 256-bit lane per row, so the
 * tile is two halves of 8 rows. For one token (decode) both halves go through the loop
 * together; for two, one half after the other (each reads its own 32 bytes of every 64-byte
 * chunk vector, so only the activations' broadcasts are repeated) so that a pass's
 * accumulators fit in AVX2's 16 registers. Decode keeps both halves in one pass: the second
 * pass would run with no weight stream in flight. PAIRS: AVX2's multiply-add pairs summed in
 * int16 (above), else DOT (the AVX-VNNI dot product) into int32; BITS: INT4, INT5 or INT8
 * weights; DIG: activation digits (1 or 2). acc / macc [token][half] lane e = row
 * 8 half + e of the tile, as the portable kernel's acc / macc of that row. */
/* The float16 scales and minimums of coded tile record rec (pm_tiled_steps, bit for bit: the
 * code times the row's step in float32, rounded to nearest even once), 8 rows at a time. */
static TGT void coded_steps_avx2(const pm_tiled *w, const uint8_t *rec, uint16_t *out) {
    const pm_coded c = pm_coded_parts(w, rec);
    for (int h = 0; h < 2; h++) {
        __m256 d = _mm256_setzero_ps(), dm = d;
        for (size_t g = 0; g < c.ng; g++) {
            if (g % c.gps == 0) { /* the next run's steps */
                const uint16_t *sg = c.st + 32 * (g / c.gps) + 8 * h;
                d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sg));
                dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sg + 16)));
            }
            const __m256 s = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                    _mm_loadl_epi64((const __m128i *)(c.sc + 16 * g + 8 * (size_t)h)))),
                d);
            const __m256 m = _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                    _mm_loadl_epi64((const __m128i *)(c.mc + 16 * g + 8 * (size_t)h)))),
                dm);
            _mm_storeu_si128((__m128i *)(out + 16 * g + 8 * (size_t)h),
                             _mm256_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            _mm_storeu_si128((__m128i *)(out + 16 * (c.ng + g) + 8 * (size_t)h),
                             _mm256_cvtps_ph(m, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
    }
}

#define PM_AVX2_TILE(NAME, ATTR, PAIRS, DOT)                                                    \
    static inline ATTR AI void NAME(const int BITS, const int DIG, const int T,                 \
                                    const pm_tiled *w, const pm_tiled *w2, const pm_act *a,     \
                                    int i0, float *y, size_t ystride, int tile, int prefetch,   \
                                    const uint16_t *steps) {                                    \
        const int EST = BITS == PM_BITS_ESTIMATE, PL = BITS == PM_BITS_PLANES;                  \
        const int Q4 = BITS != 8 && !PL, RUN = PM_AVX2_RUN(EST ? 4 : PL ? 8 : BITS);            \
        const int HN = T == 1 ? 2 : 1;                                                          \
        const size_t BB = PM_BLOCK_BYTES(EST || PL ? 4 : BITS);                                 \
        const uint16_t *sc, *mn;                                                                \
        const uint8_t *rec = pm_tile_record(w, tile, &sc, &mn);                                 \
        if (steps) { /* a coded tile's steps, decoded */                                        \
            sc = steps;                                                                         \
            mn = steps + (size_t)w->ng * 16;                                                    \
        }                                                                                       \
        const uint8_t *rec2 = PL ? w2->data + (size_t)tile * w2->tile_bytes : NULL;             \
        const int nb = w->nb, ng = w->ng, gpb = w->gpb;                                         \
        const float zp = -(float)w->zero_point; /* implicit minimums: -zero_point * scale */    \
        const __m256i m4 = _mm256_set1_epi8(0x0F), sgn = _mm256_set1_epi8((char)0x80);          \
        const int8_t *p1[2], *p2[2];                                                            \
        const float *dd[2], *bs[2];                                                             \
        for (int t = 0; t < T; t++) {                                                           \
            p1[t] = a->q1 + (size_t)(i0 + t) * a->cols;                                         \
            p2[t] = DIG == 2 ? a->q2 + (size_t)(i0 + t) * a->cols : p1[t];                      \
            dd[t] = a->dd + (size_t)(i0 + t) * nb;                                              \
            bs[t] = a->bsum + (size_t)(i0 + t) * nb;                                            \
        }                                                                                       \
        if (prefetch)                                                                           \
            for (size_t o = w->scale_off; o < w->tile_bytes; o += 64)                           \
                PM_PREFETCH(rec + o);                                                           \
        const int r0 = 16 * tile, nr = pm_tile_rows(w, tile);                                   \
        for (int h0 = 0; h0 < 2 && 8 * h0 < nr; h0 += HN) {                                     \
            __m256 acc[2][2], macc[2][2];                                                       \
            for (int t = 0; t < T; t++)                                                         \
                for (int hh = 0; hh < HN; hh++) acc[t][hh] = macc[t][hh] = _mm256_setzero_ps(); \
            for (int g = 0; g < ng; g++) {                                                      \
                __m256 s[2];                                                                    \
                __m256 s1[2];                                                                   \
                for (int hh = 0; hh < HN; hh++) {                                               \
                    s1[hh] = _mm256_cvtph_ps(                                                   \
                        _mm_loadu_si128((const __m128i *)(sc + 16 * g + 8 * (h0 + hh))));       \
                    s[hh] = EST ? _mm256_mul_ps(s1[hh], _mm256_set1_ps(PM_EST_SCALE(a))) : s1[hh]; \
                }                                                                               \
                float xs[2] = {0.0f, 0.0f};                                                     \
                for (int jb = 0; jb < gpb; jb++) {                                              \
                    const int b = g * gpb + jb;                                                 \
                    const uint8_t *blk = rec + (size_t)b * BB;                                  \
                    const uint8_t *blk2 = PL ? rec2 + (size_t)b * BB : NULL;                    \
                    if (prefetch && h0 == 0)                                                    \
                        for (size_t o = 0; o < BB; o += 64) {                                   \
                            PM_PREFETCH(blk + o);                                               \
                            if (PL) PM_PREFETCH(blk2 + o);                                      \
                        }                                                                       \
                    for (int hh = 0; hh < HN; hh++) {                                           \
                        const int h = h0 + hh;                                                  \
                        /* PAIRS: tot the block's int32 total, j1 / j2 the int16 pair sums not  \
                         * yet in it; else i1 / i2 the digits' int32 sums */                    \
                        __m256i tot[2], i1[2], i2[2], j1[2], j2[2];                             \
                        for (int t = 0; t < T; t++)                                             \
                            tot[t] = i1[t] = i2[t] = j1[t] = j2[t] = _mm256_setzero_si256();    \
                        int run = 0;                                                            \
                        for (int c = 0; c < (Q4 ? 4 : 8); c++) {                                \
                            __m256i v;                                                          \
                            if (PL) { /* INT8 chunk c from the planes' vector c / 2: low      \
                                       * nibbles (c even) or high nibbles (c odd) of each */  \
                                const size_t o = 64 * (size_t)(c >> 1) + 32 * (size_t)h;        \
                                const __m256i vh = _mm256_loadu_si256((const __m256i *)(blk + o)); \
                                const __m256i vl = _mm256_loadu_si256((const __m256i *)(blk2 + o)); \
                                const __m256i h4 = _mm256_set1_epi8((char)0xF0);                \
                                v = c & 1 ? _mm256_or_si256(_mm256_and_si256(vh, h4),           \
                                                            _mm256_and_si256(                   \
                                                                _mm256_srli_epi16(vl, 4), m4))  \
                                          : _mm256_or_si256(                                    \
                                                _mm256_and_si256(_mm256_slli_epi16(vh, 4), h4), \
                                                _mm256_and_si256(vl, m4));                      \
                            } else {                                                            \
                                v = _mm256_loadu_si256((const __m256i *)(blk + 64 * c + 32 * h)); \
                            }                                                                   \
                            __m256i u0, u1 = v, q = v;                                          \
                            if (Q4) { /* chunks 2c (low nibbles) and 2c + 1 (high) */           \
                                u0 = _mm256_and_si256(v, m4);                                   \
                                u1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);             \
                                if (BITS == 5) {                                                \
                                    const uint8_t *k = blk + 256 + 16 * c + 4 * h;              \
                                    u0 = _mm256_add_epi8(u0, high_bits(k));                     \
                                    u1 = _mm256_add_epi8(u1, high_bits(k + 8));                 \
                                }                                                               \
                            } else { /* INT8 chunk c: |q| against the digit with q's sign */    \
                                q = _mm256_xor_si256(v, sgn);                                   \
                                u0 = _mm256_abs_epi8(q);                                        \
                            }                                                                   \
                            for (int t = 0; t < T; t++) {                                       \
                                const int8_t *x1 = p1[t] + 32 * b, *x2 = p2[t] + 32 * b;        \
                                if (Q4) {                                                       \
                                    PM_AVX2_DOT(PAIRS, DOT, i1[t], j1[t], u0,                   \
                                                chunk_word(x1, 2 * c));                         \
                                    PM_AVX2_DOT(PAIRS, DOT, i1[t], j1[t], u1,                   \
                                                chunk_word(x1, 2 * c + 1));                     \
                                    if (DIG == 2) {                                             \
                                        PM_AVX2_DOT(PAIRS, DOT, i2[t], j2[t], u0,               \
                                                    chunk_word(x2, 2 * c));                     \
                                        PM_AVX2_DOT(PAIRS, DOT, i2[t], j2[t], u1,               \
                                                    chunk_word(x2, 2 * c + 1));                 \
                                    }                                                           \
                                } else {                                                        \
                                    PM_AVX2_DOT(PAIRS, DOT, i1[t], j1[t], u0,                   \
                                                _mm256_sign_epi8(chunk_word(x1, c), q));        \
                                    if (DIG == 2)                                               \
                                        PM_AVX2_DOT(PAIRS, DOT, i2[t], j2[t], u0,               \
                                                    _mm256_sign_epi8(chunk_word(x2, c), q));    \
                                }                                                               \
                            }                                                                   \
                            run += Q4 ? 2 : 1;                                                  \
                            if (PAIRS && run == RUN) {                                          \
                                for (int t = 0; t < T; t++)                                     \
                                    PM_AVX2_WIDEN(DIG, tot[t], j1[t], j2[t]);                   \
                                run = 0;                                                        \
                            }                                                                   \
                        }                                                                       \
                        for (int t = 0; t < T; t++) {                                           \
                            if (!PAIRS)                                                         \
                                tot[t] = DIG == 2                                               \
                                             ? _mm256_add_epi32(_mm256_slli_epi32(i1[t], 7), i2[t]) \
                                             : i1[t];                                           \
                            const __m256 sd = _mm256_mul_ps(s[hh], _mm256_set1_ps(dd[t][b]));   \
                            acc[t][hh] = _mm256_add_ps(                                         \
                                acc[t][hh], _mm256_mul_ps(_mm256_cvtepi32_ps(tot[t]), sd));     \
                        }                                                                       \
                    }                                                                           \
                    for (int t = 0; t < T; t++) xs[t] += bs[t][b];                              \
                }                                                                               \
                if (Q4)                                                                         \
                    for (int hh = 0; hh < HN; hh++) {                                           \
                        const __m256 mv =                                                       \
                            EST  ? _mm256_mul_ps(s1[hh], _mm256_set1_ps(-120.5f))               \
                            : zp ? _mm256_mul_ps(s1[hh], _mm256_set1_ps(zp))                    \
                                 : _mm256_cvtph_ps(_mm_loadu_si128(                             \
                                       (const __m128i *)(mn + 16 * g + 8 * (h0 + hh))));        \
                        for (int t = 0; t < T; t++)                                             \
                            macc[t][hh] = _mm256_add_ps(macc[t][hh],                            \
                                                        _mm256_mul_ps(mv, _mm256_set1_ps(xs[t]))); \
                    }                                                                           \
            }                                                                                   \
            for (int t = 0; t < T; t++) {                                                       \
                float out[16];                                                                  \
                for (int hh = 0; hh < HN; hh++)                                                 \
                    _mm256_storeu_ps(out + 8 * hh, _mm256_add_ps(acc[t][hh], macc[t][hh]));     \
                const int n = nr - 8 * h0 < 8 * HN ? nr - 8 * h0 : 8 * HN;                      \
                memcpy(y + (size_t)(i0 + t) * ystride + r0 + 8 * h0, out, (size_t)n * sizeof(float)); \
            }                                                                                   \
        }                                                                                       \
    }

/* Tiles [tb, te), tokens in pairs (the pair shares each weight load), an odd last one alone;
 * the weight stream prefetched when few tokens share it (decode). A coded tile's steps are
 * decoded once per tile (coded_steps_avx2). */
#define PM_AVX2_RANGE(NAME, TILE, ATTR)                                                         \
    static inline ATTR AI void NAME(const int BITS, const int DIG, const pm_tiled *w,           \
                                    const pm_tiled *w2, const pm_act *a, float *y,              \
                                    size_t ystride, int tb, int te) {                           \
        const int prefetch = a->n <= 2;                                                         \
        const int coded = BITS == 4 && w->coded;                                                \
        uint16_t buf[2 * 16 * PM_CODED_MAX_GROUPS];                                             \
        for (int tile = tb; tile < te; tile++) {                                                \
            const uint16_t *st = NULL;                                                          \
            if (coded) {                                                                        \
                coded_steps_avx2(w, w->data + (size_t)tile * w->tile_bytes, buf);               \
                st = buf;                                                                       \
            }                                                                                   \
            int i0 = 0;                                                                         \
            for (; i0 + 2 <= a->n; i0 += 2)                                                     \
                TILE(BITS, DIG, 2, w, w2, a, i0, y, ystride, tile, prefetch, st);               \
            if (i0 < a->n) TILE(BITS, DIG, 1, w, w2, a, i0, y, ystride, tile, prefetch, st);    \
        }                                                                                       \
    }

/* The bits and digits as literals: one specialised copy of the kernel each. */
#define PM_AVX2_MATMUL(NAME, RANGE, ATTR)                                                       \
    static ATTR void NAME(const pm_tiled *w, const pm_act *a, float *y, size_t ystride, int tb, \
                          int te) {                                                             \
        if (a->digits != 1 && a->digits != 2) {                                                 \
            pm_matmul_tiled_portable(w, a, y, ystride, tb, te);                                 \
            return;                                                                             \
        }                                                                                       \
        switch (w->bits * 10 + a->digits) {                                                     \
        case 42: RANGE(4, 2, w, NULL, a, y, ystride, tb, te); break;                                  \
        case 41: RANGE(4, 1, w, NULL, a, y, ystride, tb, te); break;                                  \
        case 52: RANGE(5, 2, w, NULL, a, y, ystride, tb, te); break;                                  \
        case 51: RANGE(5, 1, w, NULL, a, y, ystride, tb, te); break;                                  \
        case 82: RANGE(8, 2, w, NULL, a, y, ystride, tb, te); break;                                  \
        default: RANGE(8, 1, w, NULL, a, y, ystride, tb, te); break;                                  \
        }                                                                                       \
    }

/* pm_ops.matmul_planes: the planes recombined into the INT8 codes in registers, then the INT8
 * operations (pm_matmul_planes_portable's bits, as the INT8 tiles'), or the high plane's
 * estimate through the INT4 operations. */
#define PM_AVX2_PLANES(NAME, RANGE, ATTR)                                                       \
    static ATTR void NAME(const pm_tiled *hi, const pm_tiled *lo, const pm_act *a, float *y,    \
                          size_t ystride, int tb, int te) {                                     \
        PM_PLANES_DISPATCH(RANGE, hi, lo, a, y, ystride, tb, te);                               \
    }

PM_AVX2_TILE(tile_avx2, TGT, 1, PM_AVX2_NODOT)
PM_AVX2_RANGE(range_avx2, tile_avx2, TGT)
PM_AVX2_MATMUL(matmul_tiled_avx2, range_avx2, TGT)
PM_AVX2_PLANES(matmul_planes_avx2, range_avx2, TGT)
#if PM_HAVE_AVXVNNI
PM_AVX2_TILE(tile_vnni, TGTV, 0, dot_vnni)
PM_AVX2_RANGE(range_vnni, tile_vnni, TGTV)
PM_AVX2_MATMUL(matmul_tiled_avxvnni, range_vnni, TGTV)
PM_AVX2_PLANES(matmul_planes_avxvnni, range_vnni, TGTV)
#endif

/* ---- attention and GLU ---------------------------------------------------------------------
 *
 * The portable attention's loops, vectorised: scores of up to 4 query heads per pass over a
 * block of 16 keys (each key vector loaded once for those heads), the online softmax with a
 * vector exponential, and the weighted values in registers, 16 columns of up to 4 heads per
 * pass over the chunk's keys. Not bit-identical to the portable code (another summation order
 * and exponential); tests/test_native_forward.py bounds every level against the numpy
 * reference. */

/* 8 cache values from element idx (format fmt: POCKET_KV_*; int8 times the scale vector sc) */
static inline TGT AI __m256 load8(const void *base, int fmt, size_t idx, __m256 sc) {
    if (fmt == POCKET_KV_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + idx)));
    if (fmt == POCKET_KV_Q8)
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                 _mm_loadl_epi64((const __m128i *)((const int8_t *)base + idx)))),
                             sc);
    return _mm256_loadu_ps((const float *)base + idx);
}

/* Scaled scores of heads [g0, g0 + GH) for the 16 keys of block kb, -inf for keys outside
 * [c, cend): s[g * PM_SPAN + 16 kb - base + 0..15]. */
static inline TGT AI void scores_block(const int GH, const pm_attn_args *A, int g0, int kb,
                                       int c, int cend, int base) {
    const int hd = A->hd;
    const size_t kbase = (size_t)kb * 16 * (size_t)hd;
    __m256 s[4][2];
    for (int g = 0; g < GH; g++) s[g][0] = s[g][1] = _mm256_setzero_ps();
    const int q8 = A->fmt == POCKET_KV_Q8;
    /* int8: the key block's scales, 16 per block of PM_KV_QBLOCK rows e */
    const uint16_t *ksb = q8 ? A->ks + kbase / PM_KV_QBLOCK : NULL;
    __m256 ks0 = _mm256_setzero_ps(), ks1 = ks0;
    for (int e = 0; e < hd; e++) {
        if (q8 && e % PM_KV_QBLOCK == 0) {
            const uint16_t *sb = ksb + 16 * (e / PM_KV_QBLOCK);
            ks0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)sb));
            ks1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sb + 8)));
        }
        const __m256 k0 = load8(A->K, A->fmt, kbase + (size_t)e * 16, ks0);
        const __m256 k1 = load8(A->K, A->fmt, kbase + (size_t)e * 16 + 8, ks1);
        for (int g = 0; g < GH; g++) {
            const __m256 q = _mm256_set1_ps(A->q[(size_t)(g0 + g) * hd + e]);
            s[g][0] = _mm256_fmadd_ps(q, k0, s[g][0]);
            s[g][1] = _mm256_fmadd_ps(q, k1, s[g][1]);
        }
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 vscale = _mm256_set1_ps(A->scale), ninf = _mm256_set1_ps(-INFINITY);
    for (int h = 0; h < 2; h++) {
        const __m256i pos = _mm256_add_epi32(lane, _mm256_set1_epi32(16 * kb + 8 * h));
        const __m256i ok = _mm256_andnot_si256(
            _mm256_cmpgt_epi32(_mm256_set1_epi32(c), pos),
            _mm256_cmpgt_epi32(_mm256_set1_epi32(cend), pos));
        for (int g = 0; g < GH; g++)
            _mm256_storeu_ps(A->s + (size_t)(g0 + g) * PM_SPAN + 16 * kb - base + 8 * h,
                             _mm256_blendv_ps(ninf, _mm256_mul_ps(s[g][h], vscale),
                                              _mm256_castsi256_ps(ok)));
    }
}

/* acc[g][col0 .. col0 + 16) of heads [g0, g0 + GH) += p[g][j] V[j] over the keys [c, cend). */
static inline TGT AI void values_block(const int GH, const pm_attn_args *A, int g0, int col0,
                                       int c, int cend, int base) {
    const int hd = A->hd;
    __m256 acc[4][2];
    for (int g = 0; g < GH; g++)
        for (int h = 0; h < 2; h++)
            acc[g][h] = _mm256_loadu_ps(A->acc + (size_t)(g0 + g) * hd + col0 + 8 * h);
    for (int j = c; j < cend; j++) {
        const size_t vb = (size_t)j * hd + (size_t)col0;
        /* int8: the scale of the block holding these 16 columns */
        const __m256 vs = A->fmt == POCKET_KV_Q8
                              ? _mm256_set1_ps(_cvtsh_ss(A->vs[vb / PM_KV_QBLOCK]))
                              : _mm256_setzero_ps();
        const __m256 v0 = load8(A->V, A->fmt, vb, vs), v1 = load8(A->V, A->fmt, vb + 8, vs);
        for (int g = 0; g < GH; g++) {
            const __m256 p = _mm256_set1_ps(A->s[(size_t)(g0 + g) * PM_SPAN + j - base]);
            acc[g][0] = _mm256_fmadd_ps(p, v0, acc[g][0]);
            acc[g][1] = _mm256_fmadd_ps(p, v1, acc[g][1]);
        }
    }
    for (int g = 0; g < GH; g++)
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(A->acc + (size_t)(g0 + g) * hd + col0 + 8 * h, acc[g][h]);
}

#define PM_BY_HEADS(GH, CALL1, CALL2, CALL3, CALL4)                                             \
    switch (GH) {                                                                               \
    case 1: CALL1; break;                                                                       \
    case 2: CALL2; break;                                                                       \
    case 3: CALL3; break;                                                                       \
    default: CALL4; break;                                                                      \
    }

static TGT void attn_avx2(const pm_attn_args *A) {
    const int G = A->G, hd = A->hd;
    if (hd % 16) {
        pm_attn_portable(A);
        return;
    }
    for (int c = A->a; c < A->b;) {
        const int cend0 = (c / PM_SPAN + 1) * PM_SPAN, cend = cend0 < A->b ? cend0 : A->b;
        const int kb0 = c / 16, kb1 = (cend - 1) / 16, base = kb0 * 16;
        for (int kb = kb0; kb <= kb1; kb++)
            for (int g0 = 0; g0 < G; g0 += 4) {
                const int gh = G - g0 < 4 ? G - g0 : 4;
                PM_BY_HEADS(gh, scores_block(1, A, g0, kb, c, cend, base),
                            scores_block(2, A, g0, kb, c, cend, base),
                            scores_block(3, A, g0, kb, c, cend, base),
                            scores_block(4, A, g0, kb, c, cend, base))
            }
        /* softmax pieces: s = e^(s - max) over the piece, the running maximum and sum */
        const int nlen = (kb1 - kb0 + 1) * 16;
        const __m256 ninf = _mm256_set1_ps(-INFINITY);
        for (int g = 0; g < G; g++) {
            float *sg = A->s + (size_t)g * PM_SPAN;
            __m256 mx = ninf;
            for (int j = 0; j < nlen; j += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + j));
            const float cm = pocket_hmax8(mx), old = A->m[g], nm = old > cm ? old : cm;
            const float corr = old == -INFINITY ? 0.0f : expf(old - nm);
            const __m256 vnm = _mm256_set1_ps(nm);
            __m256 sum = _mm256_setzero_ps();
            for (int j = 0; j < nlen; j += 8) {
                const __m256 sv = _mm256_loadu_ps(sg + j);
                const __m256 pv = _mm256_andnot_ps(_mm256_cmp_ps(sv, ninf, _CMP_EQ_OQ),
                                                   pocket_exp256(_mm256_sub_ps(sv, vnm)));
                _mm256_storeu_ps(sg + j, pv);
                sum = _mm256_add_ps(sum, pv);
            }
            A->l[g] = A->l[g] * corr + pocket_hsum8(sum);
            A->m[g] = nm;

            if (corr != 1.0f) {
                const __m256 vc = _mm256_set1_ps(corr);
                float *ag = A->acc + (size_t)g * hd;
                for (int e = 0; e < hd; e += 8)
                    _mm256_storeu_ps(ag + e, _mm256_mul_ps(_mm256_loadu_ps(ag + e), vc));
            }
        }
        for (int g0 = 0; g0 < G; g0 += 4) {
            const int gh = G - g0 < 4 ? G - g0 : 4;
            for (int col0 = 0; col0 < hd; col0 += 16)
                PM_BY_HEADS(gh, values_block(1, A, g0, col0, c, cend, base),
                            values_block(2, A, g0, col0, c, cend, base),
                            values_block(3, A, g0, col0, c, cend, base),
                            values_block(4, A, g0, col0, c, cend, base))
        }
        c = cend;
    }
}

/* gate = act(gate) * up: silu(x) = x / (1 + e^-x); gelu (tanh form) = x / (1 + e^-2u),
 * u = sqrt(2 / pi) (x + 0.044715 x^3); the exponential of -|.|, then the other side by
 * 1 - sigmoid. */
static inline TGT AI __m256 sigmoid256(__m256 z) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 az = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), z);
    const __m256 e = pocket_exp256(_mm256_sub_ps(_mm256_setzero_ps(), az)); /* e^-|z| */
    const __m256 pos = _mm256_div_ps(one, _mm256_add_ps(one, e));    /* sigmoid(|z|) */
    return _mm256_blendv_ps(pos, _mm256_sub_ps(one, pos), z);        /* z < 0: 1 - that */
}

static TGT void glu_avx2(float *gate, const float *up, size_t len, int gelu) {
    size_t k = 0;
    for (; k + 8 <= len; k += 8) {
        const __m256 x = _mm256_loadu_ps(gate + k);
        __m256 z = x;
        if (gelu) {
            const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
            z = _mm256_mul_ps(_mm256_set1_ps(2.0f * 0.7978845608028654f),
                              _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
        }
        _mm256_storeu_ps(gate + k,
                         _mm256_mul_ps(_mm256_mul_ps(x, sigmoid256(z)), _mm256_loadu_ps(up + k)));
    }
    if (k < len) pm_glu_portable(gate + k, up + k, len - k, gelu);
}

/* ---- activation digits ----------------------------------------------------------------- */

/* 4 x 8 int32 (values within int8) -> 32 int8 in order. */
static inline TGT AI __m256i pack_i8(__m256i a, __m256i b, __m256i c, __m256i d) {
    const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    return _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static inline TGT AI int32_t hsum8i(__m256i v) {
    __m128i m = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_add_epi32(m, _mm_shuffle_epi32(m, 0xB1));
    return _mm_cvtsi128_si32(m);
}

/* pm_quant_act_portable's operations per value, 8 at a time: the same bits (a NaN never wins
 * the maximum: vmaxps returns its second operand, the running maximum, for a NaN first). */
static TGT void quant_act_avx2(const float *x, int n, int cols, int digits, int8_t *q1,
                               int8_t *q2, float *dd, float *bsum, int32_t *corr) {
    const size_t nblk = (size_t)n * (size_t)cols / 32;
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    const __m256 sign = _mm256_set1_ps(-0.0f), c128 = _mm256_set1_ps(128.0f);
    const int RNE = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (size_t b = 0; b < nblk; b++) {
        const float *p = x + 32 * b;
        __m256 v[4], m = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(p + 8 * k);
            m = _mm256_max_ps(_mm256_andnot_ps(sign, v[k]), m);
        }
        const float amax = pocket_hmax8(m);
        float d = amax / 127.0f, id = 1.0f / d;
        if (!(amax >= POCKET_ACT_TINY)) d = 0.0f, id = 0.0f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i i1[4], i2[4];
        __m256i s1 = _mm256_setzero_si256(), s2 = _mm256_setzero_si256();
        for (int k = 0; k < 4; k++) {
            /* max(t, -127) returns -127 for a NaN t, as the portable comparison */
            const __m256 t = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[k], vid), lo), hi);
            const __m256 r = _mm256_round_ps(t, RNE);
            i1[k] = _mm256_cvtps_epi32(r);
            s1 = _mm256_add_epi32(s1, i1[k]);
            if (digits == 2) {
                i2[k] = _mm256_cvtps_epi32(
                    _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(t, r), c128), RNE));
                s2 = _mm256_add_epi32(s2, i2[k]);
            }
        }
        _mm256_storeu_si256((__m256i *)(q1 + 32 * b), pack_i8(i1[0], i1[1], i1[2], i1[3]));
        int32_t S = hsum8i(s1);
        if (digits == 2) {
            _mm256_storeu_si256((__m256i *)(q2 + 32 * b), pack_i8(i2[0], i2[1], i2[2], i2[3]));
            S = 128 * S + hsum8i(s2);
            dd[b] = d * (1.0f / 128.0f);
        } else {
            dd[b] = d;
        }
        bsum[b] = dd[b] * (float)S;
        corr[b] = 128 * S;
    }
}

/* ---- float32 weights (the float reference path, precision="float") -----------------------
 *
 * y[i * rows + r] = x[i] . w[r], bit-identical to pm_matmul_f32_portable: each dot product
 * keeps 8 lane sums (lane l adds x[c + l] * w[c + l] for c = 0, 8, 16, ..., a multiply then an
 * add), folds them as ((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7)) and adds the last
 * cols % 8 products one by one, as dot_f32 does. What changes is the order of the dot
 * products, never their arithmetic: 4 weight rows x 2 tokens at a time share their loads
 * (6 loads for 16 multiply-adds instead of 2 for 2), and the tokens are taken in blocks whose
 * activations stay in the core's L2 cache while every row of the range passes over them.
 * Before this the avx2 level ran the portable loop, one dot product at a time, and a float32
 * model's prefill was compute-bound on it. The avx512 level runs this product too. */

static inline TGT AI float fold8(__m256 acc, const float *x, const float *w, int c, int cols) {
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    float f[4];
    _mm_storeu_ps(f, t);
    float s = (f[0] + f[1]) + (f[2] + f[3]);
    for (; c < cols; c++) s += x[c] * w[c];
    return s;
}

/* The NR x NI dot products of rows w[0..NR) with tokens x[0..NI) (NR <= 4, NI <= 2; constants
 * where it is inlined, so that the sums live in registers). */
static inline TGT AI void f32_block(const int NR, const int NI, const float *x, int cols,
                                    const float *w, int rows, float *y) {
    __m256 acc[4][2];
#pragma GCC unroll 4
    for (int a = 0; a < NR; a++)
#pragma GCC unroll 2
        for (int b = 0; b < NI; b++) acc[a][b] = _mm256_setzero_ps();
    int c = 0;
    for (; c + 8 <= cols; c += 8) {
        __m256 xv[2];
#pragma GCC unroll 2
        for (int b = 0; b < NI; b++) xv[b] = _mm256_loadu_ps(x + (size_t)b * cols + c);
#pragma GCC unroll 4
        for (int a = 0; a < NR; a++) {
            const __m256 wv = _mm256_loadu_ps(w + (size_t)a * cols + c);
#pragma GCC unroll 2
            for (int b = 0; b < NI; b++)
                acc[a][b] = _mm256_add_ps(acc[a][b], _mm256_mul_ps(xv[b], wv));
        }
    }
#pragma GCC unroll 4
    for (int a = 0; a < NR; a++)
#pragma GCC unroll 2
        for (int b = 0; b < NI; b++)
            y[(size_t)b * rows + a] =
                fold8(acc[a][b], x + (size_t)b * cols, w + (size_t)a * cols, c, cols);
}

/* Rows w[0..NR) against tokens [i0, i1) of x, two at a time (NR a constant where inlined). */
static inline TGT AI void f32_rows(const int NR, const float *x, int i0, int i1, int cols,
                                   const float *wr, int rows, float *y) {
    int i = i0;
    for (; i + 2 <= i1; i += 2)
        f32_block(NR, 2, x + (size_t)i * cols, cols, wr, rows, y + (size_t)i * rows);
    if (i < i1) f32_block(NR, 1, x + (size_t)i * cols, cols, wr, rows, y + (size_t)i * rows);
}

TGT void pm_matmul_f32_avx2(const float *x, int n, int cols, const float *w, int rows, float *y,
                            int rb, int re) {
    /* tokens per block: their activations within ~192 KiB (an even count, 2 to 64) */
    int tb = (int)((192u * 1024u) / ((size_t)cols * sizeof(float)));
    tb = tb < 2 ? 2 : tb > 64 ? 64 : tb & ~1;
    for (int i0 = 0; i0 < n; i0 += tb) {
        const int i1 = n - i0 < tb ? n : i0 + tb;
        int r = rb;
        for (; r + 4 <= re; r += 4) f32_rows(4, x, i0, i1, cols, w + (size_t)r * cols, rows, y + r);
        for (; r < re; r++) f32_rows(1, x, i0, i1, cols, w + (size_t)r * cols, rows, y + r);
    }
}

/* ---- LoRA adapters (pm_ops.lora_down / lora_up) ----------------------------------------
 * Eight ranks (down) or eight output columns (up) per vector, float16 adapters converted with
 * F16C as they are loaded; every value is the portable operation's sum in its order (multiply,
 * then add, no fusing), so the bits are the portable ones. */

TGT AI static inline __m256 lora_ld8(const void *p, size_t off, const int f16) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + off)))
               : _mm256_loadu_ps((const float *)p + off);
}

TGT AI static inline float lora_ld1(const void *p, size_t off, const int f16) {
    return f16 ? pocket_f16_to_f32(((const uint16_t *)p)[off]) : ((const float *)p)[off];
}

/* t[q][k .. k + 8 V) = sum over the columns of x[q] A^T, for TB tokens q (x, t: the first
 * token's rows, cols and r floats apart); TB x V chains of sums, A's values loaded once. */
TGT AI static inline void lora_down_block(const int TB, const int V, const void *A, int r, int cols,
                                      int k, const float *x, float *t, const int f16) {
    __m256 s[4][2];
    for (int q = 0; q < TB; q++)
        for (int v = 0; v < V; v++) s[q][v] = _mm256_setzero_ps();
    for (int c = 0; c < cols; c++) {
        __m256 a[2];
        for (int v = 0; v < V; v++) a[v] = lora_ld8(A, (size_t)c * r + k + 8 * v, f16);
        for (int q = 0; q < TB; q++) {
            const __m256 xq = _mm256_set1_ps(x[(size_t)q * cols + c]);
            for (int v = 0; v < V; v++) s[q][v] = _mm256_add_ps(s[q][v], _mm256_mul_ps(xq, a[v]));
        }
    }
    for (int q = 0; q < TB; q++)
        for (int v = 0; v < V; v++) _mm256_storeu_ps(t + (size_t)q * r + k + 8 * v, s[q][v]);
}

TGT AI static inline void lora_down_tokens(const int TB, const pocket_weight *w, const float *x,
                                           float *t, const int f16) {
    const int r = w->lora_rank, cols = w->cols;
    int k = 0;
    for (; k + 16 <= r; k += 16) lora_down_block(TB, 2, w->lora_at, r, cols, k, x, t, f16);
    for (; k + 8 <= r; k += 8) lora_down_block(TB, 1, w->lora_at, r, cols, k, x, t, f16);
    for (; k < r; k++)
        for (int q = 0; q < TB; q++) {
            float acc = 0.0f;
            for (int c = 0; c < cols; c++)
                acc += x[(size_t)q * cols + c] * lora_ld1(w->lora_at, (size_t)c * r + k, f16);
            t[(size_t)q * r + k] = acc;
        }
}

TGT AI static inline void lora_down_body(const pocket_weight *w, const float *x, int i0, int i1,
                                         float *t, const int f16) {
    const int r = w->lora_rank, cols = w->cols;
    int i = i0;
    for (; i + 4 <= i1; i += 4)
        lora_down_tokens(4, w, x + (size_t)i * cols, t + (size_t)i * r, f16);
    for (; i < i1; i++) lora_down_tokens(1, w, x + (size_t)i * cols, t + (size_t)i * r, f16);
}

TGT void pm_lora_down_avx2(const pocket_weight *w, const float *x, int i0, int i1, float *t) {
    if (w->lora_f16)
        lora_down_body(w, x, i0, i1, t, 1);
    else
        lora_down_body(w, x, i0, i1, t, 0);
}

TGT AI static inline void lora_up_body(const pocket_weight *w, const float *t, int n, float *y,
                                       size_t ys, int c0, int c1, const int f16) {
    const int r = w->lora_rank;
    const size_t rows = (size_t)w->rows;
    const void *B = w->lora_bt;
    for (int i = 0; i < n; i++) {
        float *yi = y + (size_t)i * ys;
        const float *ti = t + (size_t)i * r;
        int o = c0;
        for (; o + 32 <= c1; o += 32) { /* four chains */
            __m256 s0 = _mm256_loadu_ps(yi + o), s1 = _mm256_loadu_ps(yi + o + 8);
            __m256 s2 = _mm256_loadu_ps(yi + o + 16), s3 = _mm256_loadu_ps(yi + o + 24);
            for (int k = 0; k < r; k++) {
                const __m256 tk = _mm256_set1_ps(ti[k]);
                const size_t off = (size_t)k * rows + (size_t)o;
                s0 = _mm256_add_ps(s0, _mm256_mul_ps(tk, lora_ld8(B, off, f16)));
                s1 = _mm256_add_ps(s1, _mm256_mul_ps(tk, lora_ld8(B, off + 8, f16)));
                s2 = _mm256_add_ps(s2, _mm256_mul_ps(tk, lora_ld8(B, off + 16, f16)));
                s3 = _mm256_add_ps(s3, _mm256_mul_ps(tk, lora_ld8(B, off + 24, f16)));
            }
            _mm256_storeu_ps(yi + o, s0);
            _mm256_storeu_ps(yi + o + 8, s1);
            _mm256_storeu_ps(yi + o + 16, s2);
            _mm256_storeu_ps(yi + o + 24, s3);
        }
        for (; o + 8 <= c1; o += 8) {
            __m256 s0 = _mm256_loadu_ps(yi + o);
            for (int k = 0; k < r; k++)
                s0 = _mm256_add_ps(s0, _mm256_mul_ps(_mm256_set1_ps(ti[k]),
                                                     lora_ld8(B, (size_t)k * rows + o, f16)));
            _mm256_storeu_ps(yi + o, s0);
        }
        for (; o < c1; o++) {
            float acc = yi[o];
            for (int k = 0; k < r; k++) acc += ti[k] * lora_ld1(B, (size_t)k * rows + o, f16);
            yi[o] = acc;
        }
    }
}

TGT void pm_lora_up_avx2(const pocket_weight *w, const float *t, int n, float *y, size_t ys,
                         int c0, int c1) {
    if (w->lora_f16)
        lora_up_body(w, t, n, y, ys, c0, c1, 1);
    else
        lora_up_body(w, t, n, y, ys, c0, c1, 0);
}

const pm_ops pm_ops_avx2 = PM_OPS_F32("avx2", attn_avx2, glu_avx2, quant_act_avx2,
                                      matmul_tiled_avx2, pm_matmul_f32_avx2, pm_lora_down_avx2,
                                      pm_lora_up_avx2, matmul_planes_avx2);
#if PM_HAVE_AVXVNNI
const pm_ops pm_ops_avxvnni = PM_OPS_F32("avx2+avxvnni", attn_avx2, glu_avx2, quant_act_avx2,
                                         matmul_tiled_avxvnni, pm_matmul_f32_avx2,
                                         pm_lora_down_avx2, pm_lora_up_avx2,
                                         matmul_planes_avxvnni);
#endif

#endif /* PM_HAVE_AVX2 */
