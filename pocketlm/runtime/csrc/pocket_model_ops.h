/* Internal: the elementwise / attention operations of the engine (pocket_model_forward.c),
 * with a portable implementation (pocket_model_ops.c), an AVX-512 one (pocket_model_x86.c), an
 * AVX2 one (pocket_model_avx2.c) and an ARM64 NEON one (pocket_model_neon.c), chosen once per
 * model from the kernel level; the layouts they share (KV cache, tiled weights, prepared
 * activations). Not part of the public API. */
#ifndef POCKET_MODEL_OPS_H
#define POCKET_MODEL_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "pocket_internal.h" /* POCKET_X86_SIMD, POCKET_ARM_NEON */
#include "pocket_model.h"    /* POCKET_KV_* */

/* Keys per attention chunk: the online softmax rescales once per chunk, and decode splits the
 * keys of every KV head into units of this many positions. Chunks and units are aligned to
 * multiples of PM_SPAN absolute positions (a fixed rule, so results do not depend on the number
 * of threads). A multiple of 16. */
#define PM_SPAN 128

/* Element sizes of the KV cache formats (POCKET_KV_* in pocket_model.h). */
#define PM_KV_QBLOCK 16 /* int8 keys / values per scale */
static inline size_t pm_kv_es(int fmt) {
    return fmt == POCKET_KV_F32 ? 4 : fmt == POCKET_KV_F16 ? 2 : 1;
}

/* KV cache layout of one KV head (float32, float16 or int8 values):
 *   K: blocks of 16 positions, each [head_dim][16] (transposed: key e of positions 16k..16k+15
 *      is 16 consecutive values), i.e. element (pos, e) at (pos / 16) * 16 * hd + e * 16 + pos % 16
 *   V: [position][head_dim]
 * int8 (POCKET_KV_Q8, head_dim a multiple of 16): a float16 scale per block of PM_KV_QBLOCK of a
 * position's keys and one per block of its values (nb = hd / 16 blocks):
 *   key e of pos   = ks[pm_k_index(pos, e / 16, nb)] * K(pos, e)  (scales laid out as keys)
 *   value c of pos = vs[pos * nb + c / 16] * V(pos, c) */
static inline size_t pm_k_index(int pos, int e, int hd) {
    return (size_t)(pos / 16) * 16 * (size_t)hd + (size_t)e * 16 + (size_t)(pos % 16);
}

/* Online-softmax attention of G query heads (q: G rows of hd floats, consecutive) over the
 * keys [a, b) of one KV head (K, V: that head's cache in format fmt, layout above; ks, vs: its
 * int8 scales). m, l, acc (G, G, G * hd)
 * hold the running maximum, sum of exponentials and weighted sum of values; the caller
 * initializes them to -inf, 0, 0 and divides acc by l at the end. s: scratch of
 * G * PM_SPAN floats. Scores are (q . k) * scale, as in the reference. */
typedef struct pm_attn_args {
    const float *q;
    int G, hd;
    float scale;
    const void *K, *V;
    const uint16_t *ks, *vs; /* POCKET_KV_Q8 only: the head's float16 scales (layout above) */
    int fmt;              /* POCKET_KV_* */
    int a, b;
    float *s;
    float *m, *l, *acc;
} pm_attn_args;

/* Quantized weights repacked for the int8-activation products: tiles of 16 rows. Tile t holds
 * rows 16t .. 16t+15 (zero rows pad the last one) as one record:
 *
 *   [nb blocks of weights][ng x 16 float16 scales][ng x 16 float16 mins (INT4)]  (64-aligned)
 *
 * A block (32 columns) is 8 column chunks of 4; chunk k of row i is the 4 bytes at lane i of a
 * 64-byte vector (lane = 4 bytes), so that one u8 x s8 dot-product instruction with a broadcast
 * activation word computes 16 rows:
 *   INT4: 4 vectors per block; vector m, lane i, byte j: low nibble = column 8m + j,
 *         high nibble = column 8m + 4 + j (values 0..15);
 *   INT5: the 4 vectors of INT4 (the low 4 bits), then for each vector m two little-endian
 *         64-bit masks (bytes 256 + 16m ..): bit 4i + j of the first is bit 4 of column
 *         8m + j of lane i, of the second bit 4 of column 8m + 4 + j (values 0..31; a masked
 *         byte add of 16 completes a vector);
 *   INT8: 8 vectors per block; vector k, lane i, byte j = column 4k + j, stored as q + 128.
 * Scales (and mins) of group g are 16 float16 values, one per row of the tile.
 *
 * Coded INT4 tiles (pm_tiled.coded, group 32, pocket_weight.scale_codes) hold the steps as
 * their codes instead:
 *   [nb blocks][ng x 16 uint8 scale codes][ng x 16 int8 minimum codes]
 *   [nsteps x ([16 float16 d][16 float16 dmin])]  (64-aligned)
 * the steps of each run of code_groups groups (nsteps = ng / code_groups; one run a row for
 * int4_c8, one per 256 columns for GGUF Q4_K)
 * and a kernel that reads them first decodes a tile's scales and minimums into the float16
 * layout above (pm_tiled_steps: f16(code * d), the product in float32 rounded once),
 * so that its products are those of the float16 tiles bit for bit.
 *
 * Zero-point tiles (pm_tiled.zero_point > 0, a power of two: INT4 or INT5 weights with
 * implicit minimums, pocket_weight.zero_point) hold the scales but no minimums:
 *   [nb blocks][ng x 16 float16 scales]  (64-aligned)
 * and a kernel computes each minimum as -zero_point * scale in float32 where it uses it (exact,
 * and equal to the float16 minimum: the repack checks it). */
typedef struct pm_tiled {
    int bits; /* 4 | 5 | 8 */
    int rows, cols, group_size;
    int ntiles, nb, ng, gpb;
    size_t block_bytes; /* 256 | 320 | 512 */
    size_t tile_bytes;  /* bytes of one tile record */
    size_t scale_off;   /* offset of the scales in a record (mins follow: + ng * 32) */
    int coded;          /* 1: coded INT4 steps (above) */
    int code_groups;    /* coded: groups per pair of steps (ng: one pair a row) */
    int zero_point;     /* > 0: no minimums stored, each -zero_point * its scale (above) */
    uint8_t *data;
} pm_tiled;

/* The most groups of 32 columns a coded tile may have (its decoded steps go on the stack). */
#define PM_CODED_MAX_GROUPS 256

/* Whether tile records of w hold their steps compactly (coded, or without minimums). */
POCKET_INLINE int pm_tiled_compact(const pm_tiled *w) { return w->coded || w->zero_point > 0; }

/* The float16 scales and minimums of coded tile record `rec` of `w` (pm_tiled.coded) in the
 * layout of a float16 tile's: out [ng x 16 scales][ng x 16 mins] (pocket_model_tiles.c; the
 * SIMD levels have their own, the same bits). */
void pm_tiled_steps(const pm_tiled *w, const uint8_t *rec, uint16_t *out);

/* The coded steps of a tile record: its 16 rows' scale codes (uint8), minimum codes (int8)
 * and float16 steps (16 d then 16 dmin for each run of gps groups), ng groups a row. */
typedef struct pm_coded {
    const uint8_t *sc;
    const int8_t *mc;
    const uint16_t *st;
    size_t ng, gps;
} pm_coded;

POCKET_INLINE pm_coded pm_coded_parts(const pm_tiled *w, const uint8_t *rec) {
    pm_coded c;
    c.ng = (size_t)w->ng;
    c.gps = (size_t)w->code_groups;
    c.sc = rec + w->scale_off;
    c.mc = (const int8_t *)c.sc + c.ng * 16;
    c.st = (const uint16_t *)(c.sc + c.ng * 32);
    return c;
}

/* Bytes of a block of 32 columns in a tile record for BITS-bit weights (pm_tiled.block_bytes),
 * as a constant where BITS is one. */
#define PM_BLOCK_BYTES(BITS) ((BITS) == 8 ? 512 : (BITS) == 5 ? 320 : 256)

/* The record of tile t of w (its blocks of weights), its scales *sc and mins *mn (INT4, INT5:
 * after the scales). */
POCKET_INLINE const uint8_t *pm_tile_record(const pm_tiled *w, int t, const uint16_t **sc,
                                            const uint16_t **mn) {
    const uint8_t *rec = w->data + (size_t)t * w->tile_bytes;
    *sc = (const uint16_t *)(rec + w->scale_off);
    *mn = *sc + (size_t)w->ng * 16;
    return rec;
}

/* The rows of tile t of w, 16 t + 0 .. count: 16, fewer in a partial last tile. */
POCKET_INLINE int pm_tile_rows(const pm_tiled *w, int t) {
    return w->rows - 16 * t < 16 ? w->rows - 16 * t : 16;
}

/* Weight value (u8 operand) of row lane `i`, column k of block b, in a tile record. */
static inline int pm_tiled_value(const pm_tiled *w, const uint8_t *rec, int b, int k, int i) {
    const uint8_t *blk = rec + (size_t)b * w->block_bytes;
    if (w->bits != 8) {
        const int m = k / 8, j = k % 8;
        const uint8_t byte = blk[64 * m + 4 * i + (j & 3)];
        int v = j < 4 ? (byte & 15) : (byte >> 4);
        if (w->bits == 5) {
            const int bit = 4 * i + (j & 3); /* byte bit / 8 of mask (j >= 4) of vector m */
            v |= ((blk[256 + 16 * m + 8 * (j >= 4) + bit / 8] >> (bit % 8)) & 1) << 4;
        }
        return v;
    }
    return blk[64 * (k / 4) + 4 * i + (k & 3)];
}

/* Activations for the int8 products: per block of 32 columns, with d = absmax / 127,
 *   digits = 1:  x~ = d * q1,                    dd = d,       S = sum q1
 *   digits = 2:  x~ = (d / 128) * (128 q1 + q2), dd = d / 128, S = sum (128 q1 + q2)
 * q1 = round(x / d) in [-127, 127], q2 = round(128 (x / d - q1)) in [-64, 64]: two int8
 * "digits" carry ~15 bits of the block's range. bsum = dd * S (the block's sum of x~, for
 * the INT4 minimums) and corr = 128 * S (the exact offset of INT8 weights stored as q + 128). */
typedef struct pm_act {
    int n, cols, digits; /* digits 0: float activations x (bsum: sums of x per block) */
    uint16_t *xb, *xl;   /* non-NULL: the AMX-BF16 path, x = xb + xl in bfloat16 [n, cols] */
    int one_term;        /* AMX-BF16 path: the weights as one bfloat16 term (else two) */
    const float *x;      /* [n, cols] */
    const int8_t *q1, *q2; /* [n, cols] */
    const float *dd, *bsum; /* [n, cols / 32] */
    const int32_t *corr;    /* [n, cols / 32] */
} pm_act;

typedef struct pm_ops {
    const char *name;
    /* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w for rows r < n of length d (in place ok) */
    void (*rmsnorm)(const float *x, const float *w, int n, int d, float eps, float *out);
    void (*attn)(const pm_attn_args *a);
    /* gate[k] = act(gate[k]) * up[k], k < len; act: silu (gelu = 0) or tanh-GELU (gelu = 1) */
    void (*glu)(float *gate, const float *up, size_t len, int gelu);
    /* y[i * rows + r] = x[i] . w[r] for rows r in [rb, re), tokens i < n (float32 weights) */
    void (*matmul_f32)(const float *x, int n, int cols, const float *w, int rows, float *y,
                       int rb, int re);
    /* float32 -> float16 bits (round to nearest even), len values */
    void (*to_f16)(const float *x, uint16_t *out, size_t len);
    /* activations x [n, cols] -> the int8 digits and block terms of pm_act (q2 only when
     * digits == 2); identical results in every implementation */
    void (*quant_act)(const float *x, int n, int cols, int digits, int8_t *q1, int8_t *q2,
                      float *dd, float *bsum, int32_t *corr);
    /* y[i * ystride + r] = W[r] . x~[i] for the rows of tiles [tb, te), tokens i < a->n;
     * digits == 0: float activations a->x (W[r] . x with the reference's per-group
     * decomposition (x_g . q_g) * scale + sum(x_g) * min, in float32) */
    void (*matmul_tiled)(const pm_tiled *w, const pm_act *a, float *y, size_t ystride, int tb,
                         int te);
    /* sums of x over each block of 32 columns: bsum [n, cols / 32] */
    void (*block_sums)(const float *x, int n, int cols, float *bsum);
    /* LoRA adapters (pocket_weight.lora_*, float32 or float16): t[i] = x[i] A^T for tokens
     * [i0, i1) of x [n, w->cols] (t [n, rank]); y[i, c0:c1] += t[i] B^T[:, c0:c1] for the n
     * tokens (y's rows ys floats apart). Each value is one sum in a fixed order, products and
     * sums rounded apart (no fused multiply-add): t[i][k] = 0 + x[i][0] A^T[0][k] + ... in
     * column order, y[i][o] + t[i][0] B^T[0][o] + ... in rank order, so every implementation
     * gives the portable one's bits, whatever the tokens and columns it is given. */
    void (*lora_down)(const pocket_weight *w, const float *x, int i0, int i1, float *t);
    void (*lora_up)(const pocket_weight *w, const float *t, int n, float *y, size_t ys, int c0,
                    int c1);
    /* An INT8 matrix held as its two nibble planes (pocket_model.head_lo: hi = q + 128 >> 4
     * with the matrix's scales s after the blocks, lo = q + 128 & 15 without scales), tiles
     * [tb, te): with lo, matmul_tiled of the INT8 tiles they were split from, bit for bit;
     * lo NULL, the estimate from the high plane alone, an INT4 product of scale 16 s and
     * minimum -120.5 s (the low nibble's midpoint) on the first activation digit
     * (PM_EST_SCALE). int8 activations only (a->digits 1 or 2).
     * NULL where a level has none (then no head is split). */
    void (*matmul_planes)(const pm_tiled *hi, const pm_tiled *lo, const pm_act *a, float *y,
                          size_t ystride, int tb, int te);
} pm_ops;

/* BITS values of the SIMD tile kernels for an INT8 matrix held as its two nibble planes
 * (pm_ops.matmul_planes): the high plane alone (an estimate: INT4 arithmetic with scale 16 s
 * and minimum -120.5 s from the plane's scales s), or both recombined into the INT8 codes. */
#define PM_BITS_ESTIMATE 40
#define PM_BITS_PLANES 44
/* The estimate's products take the first activation digit alone (half the integer work of two
 * digits; its rounding, 1/254 of a block's largest value, is far below the missing low
 * nibble's): with two digits, dd = d / 128 is the second digit's step, so the scale 16 s
 * becomes 16 * 128 s (exact: powers of two). */
#define PM_EST_SCALE(a) ((a)->digits == 2 ? 2048.0f : 16.0f)
/* pm_ops.matmul_planes of a SIMD level from its tile loop RANGE(BITS, DIG, w, w2, a, y,
 * ystride, tb, te): the planes recombined (lo), else the estimate on the first digit. */
#define PM_PLANES_DISPATCH(RANGE, hi, lo, a, y, ystride, tb, te)                                \
    do {                                                                                        \
        if ((lo) && (a)->digits == 2)                                                           \
            RANGE(PM_BITS_PLANES, 2, hi, lo, a, y, ystride, tb, te);                            \
        else if (lo)                                                                            \
            RANGE(PM_BITS_PLANES, 1, hi, lo, a, y, ystride, tb, te);                            \
        else                                                                                    \
            RANGE(PM_BITS_ESTIMATE, 1, hi, NULL, a, y, ystride, tb, te);                        \
    } while (0)

/* An operations table named NAME (a string): the portable operations but for those the avx2
 * and neon levels replace (attention, GLU, activation quantization, the tiled products, the
 * LoRA adapters' products and, PM_OPS_F32, the float32-weight product). */
#define PM_OPS_F32(NAME, ATTN, GLU, QUANT_ACT, MATMUL_TILED, MATMUL_F32, LORA_DOWN, LORA_UP,     \
                   MATMUL_PLANES)                                                               \
    {                                                                                           \
        NAME, pm_rmsnorm_portable, ATTN, GLU, MATMUL_F32, pm_to_f16_portable, QUANT_ACT,        \
            MATMUL_TILED, pm_block_sums_portable, LORA_DOWN, LORA_UP, MATMUL_PLANES             \
    }
#define PM_OPS(NAME, ATTN, GLU, QUANT_ACT, MATMUL_TILED, LORA_DOWN, LORA_UP, MATMUL_PLANES)      \
    PM_OPS_F32(NAME, ATTN, GLU, QUANT_ACT, MATMUL_TILED, pm_matmul_f32_portable, LORA_DOWN,     \
               LORA_UP, MATMUL_PLANES)

/* The portable operations, also in the tables of the SIMD levels that do not replace them. */
void pm_rmsnorm_portable(const float *x, const float *w, int n, int d, float eps, float *out);
void pm_attn_portable(const pm_attn_args *a);
void pm_glu_portable(float *gate, const float *up, size_t len, int gelu);
void pm_matmul_f32_portable(const float *x, int n, int cols, const float *w, int rows, float *y,
                            int rb, int re);
void pm_to_f16_portable(const float *x, uint16_t *out, size_t len);
/* The LoRA operations with float16 adapters converted by `conv` (exact), in chunks. */
typedef void (*pm_from_f16_fn)(const uint16_t *h, float *out, size_t len);
void pm_from_f16_portable(const uint16_t *h, float *out, size_t len);
void pm_lora_down_conv(pm_from_f16_fn conv, const pocket_weight *w, const float *x, int i0,
                       int i1, float *t);
void pm_lora_up_conv(pm_from_f16_fn conv, const pocket_weight *w, const float *t, int n,
                     float *y, size_t ys, int c0, int c1);
void pm_lora_down_portable(const pocket_weight *w, const float *x, int i0, int i1, float *t);
void pm_lora_up_portable(const pocket_weight *w, const float *t, int n, float *y, size_t ys,
                         int c0, int c1);
/* Portable twins used by every implementation. */
void pm_quant_act_portable(const float *x, int n, int cols, int digits, int8_t *q1, int8_t *q2,
                           float *dd, float *bsum, int32_t *corr);
void pm_block_sums_portable(const float *x, int n, int cols, float *bsum);
void pm_matmul_tiled_portable(const pm_tiled *w, const pm_act *a, float *y, size_t ystride,
                              int tb, int te);
void pm_matmul_planes_portable(const pm_tiled *hi, const pm_tiled *lo, const pm_act *a,
                               float *y, size_t ystride, int tb, int te);

extern const pm_ops pm_ops_portable;
/* The x86-64 operations (pocket_model_x86.c: AVX-512; pocket_model_avx2.c: AVX2, and AVX-VNNI
 * where the compiler has its intrinsics, GCC 11, Clang 12) are compiled wherever the kernels'
 * SIMD levels are (POCKET_X86_SIMD: GCC / Clang target attributes); each is chosen only where
 * the CPU has its instructions (checked at run time). */
#define PM_HAVE_AVX512 POCKET_X86_SIMD
#define PM_HAVE_AVX2 POCKET_X86_SIMD
#if PM_HAVE_AVX512
extern const pm_ops pm_ops_avx512;
#endif
#if PM_HAVE_AVX2
extern const pm_ops pm_ops_avx2;
/* The float32-weight product of the avx2 and avx512 levels: pm_matmul_f32_portable's bits. */
void pm_matmul_f32_avx2(const float *x, int n, int cols, const float *w, int rows, float *y,
                        int rb, int re);
/* The LoRA operations of the avx2 and avx512 levels: the portable ones' bits. */
void pm_lora_down_avx2(const pocket_weight *w, const float *x, int i0, int i1, float *t);
void pm_lora_up_avx2(const pocket_weight *w, const float *t, int n, float *y, size_t ys, int c0,
                     int c1);
#endif
#if PM_HAVE_AVX2 && ((defined(__clang__) && __clang_major__ >= 12) ||                          \
                     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
extern const pm_ops pm_ops_avxvnni;
#define PM_HAVE_AVXVNNI 1
#else
#define PM_HAVE_AVXVNNI 0
#endif
/* AMX intrinsics: GCC 11, Clang 12 (pocket_model_amx.c) */
#if PM_HAVE_AVX512 && defined(__linux__) &&                                                     \
    ((defined(__clang__) && __clang_major__ >= 12) ||                                          \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define PM_HAVE_AMX 1
#else
#define PM_HAVE_AMX 0
#endif
/* SDOT products (pocket_model_neon.c): ARMv8.2-A +dotprod, checked at run time; compiled under
 * POCKET_ARM_NEON's condition (pocket_internal.h). */
#define PM_HAVE_NEON POCKET_ARM_NEON
#if PM_HAVE_NEON
extern const pm_ops pm_ops_neon;
#endif

#endif /* POCKET_MODEL_OPS_H */
