/* AMX-BF16 products and attention of the engine's prefill (pocket_model_config.amx).
 *
 * A product over a block of n >= PM_AMX_MIN_TOKENS tokens, Y[n, rows] = X[n, K] W[rows, K]^T,
 * runs on the tile unit with both operands as two bfloat16 terms, hi = bf16(v) and
 * lo = bf16(v - hi) (~16 significant bits together):
 *   Y = X_hi W_hi + X_lo W_hi + X_hi W_lo    (X_lo W_lo is below float32 rounding)
 * or, for the product classes in pocket_model_config.amx_one_term, with the weights as one
 * term (bf16(W), a relative error of at most 2^-9 per weight, ~1/100 of the INT4 rounding):
 *   Y = X_hi W_hi + X_lo W_hi                (two products instead of three)
 * summed in float32 tiles (TDPBF16PS: C[16 tokens, 16 rows] += A . B). X's terms are the A
 * tiles (16 tokens x 32 features, each tile's 1 KB in a row, as pm_amx_act writes them); W is
 * widened from its 16-row tiles (INT4, INT5 or INT8, pocket_model_ops.h: q * scale + min in
 * float32) four tiles at a time into a per-thread buffer in the B-tile layout (row r of a
 * 32-feature block: for each of the 16 weight rows, the features 2r and 2r + 1), block-major.
 * Tile loads cost about as much as the products: contiguous tiles made the loop 4-28 % faster
 * than row-major activations (benchmarks/amx_tile_loads.c).
 *
 * Accuracy, smollm2-135m and gemma3-270m, 256 tokens of english and chinese text, against the
 * float-activation reference: top-1 agreement 100 %, KL ~3e-7 to 5e-7 (the two-digit int8
 * products: 100 %, 4e-7 to 1e-6). One term per operand was measured too: bfloat16 weights
 * everywhere cost gemma3-270m 1-2 % of top-1 agreement, bfloat16 activations smollm2-135m up
 * to 2 %. One weight term for q/k/v, W_o and W_down only (the engine's default, half the
 * weights) keeps >= 99.6 % on all three registry models (docs/engine.md).
 *
 * Prefill attention (pm_amx_attn_kv, pm_amx_attn) uses the three products for Q K^T and
 * P V, see below.
 *
 * Work is split by weight tiles (16 rows), like the other products, and attention by 16 query
 * rows of one head, so results do not depend on the number of threads. Linux needs the
 * process to ask for the tile state once (arch_prctl ARCH_REQ_XCOMP_PERM); each thread loads
 * the tile configuration before its first tile instruction.
 */
#if !defined(_WIN32) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* syscall */
#endif

#include "pocket_internal.h"
#include "pocket_model_internal.h"

#if PM_HAVE_AMX

#include "pocket_model_x86.h"

#include <math.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

#define TGTA                                                                                    \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,"        \
                          "avx512bf16,amx-tile,amx-bf16")))

/* 0: not asked yet, 1: granted, -1: refused (by the kernel or the CPU). */
static int amx_state;

int pm_amx_enable(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (s) return s > 0;
    const unsigned f = pocket_cpu_features();
    int ok = (f & POCKET_CPU_AMX_BF16) && pocket_level_supported(POCKET_LEVEL_AVX512);
#if defined(__linux__)
    if (ok) ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    ok = 0;
#endif
    __atomic_store_n(&amx_state, ok ? 1 : -1, __ATOMIC_RELEASE);
    return ok;
}

#define PM_AMX_TILES 4 /* weight tiles per pass: 4 accumulators of 16 tokens */

/* The tile configuration: tiles 0-3 accumulators (16 x 16 float), 4-5 activations (16 tokens x
 * 32 bf16), 6-7 weights (16 feature pairs x 16 rows x 2 bf16): every tile 16 rows x 64 bytes. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Loaded at the start of every product and attention call, never remembered between calls:
 * another library in the same thread (PyTorch's oneDNN, in a process that trains and then
 * generates) loads its own configuration or releases the tiles between two of our calls, and a
 * tile instruction after a release faults (SIGILL). Each call releases the tiles when it is
 * done, so that the thread's context switches do not carry 8 KB of tile state. */
static TGTA void tiles_configure(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* 16 bfloat16 values back in float32 (exact: the upper halves of the lanes). */
static inline TGTA __m512 bf16_float(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* float32 x -> bfloat16 hi = bf16(x), lo = bf16(x - hi) (round to nearest even, as
 * vcvtneps2bf16). */
static inline TGTA void split_bf16(__m512 v, uint16_t *hi, uint16_t *lo, __mmask16 mk) {
    const __m256bh h = _mm512_cvtneps_pbh(v);
    const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, bf16_float((__m256i)h)));
    _mm256_mask_storeu_epi16(hi, mk, (__m256i)h);
    _mm256_mask_storeu_epi16(lo, mk, (__m256i)l);
}

void TGTA pm_amx_to_bf16(const float *x, uint16_t *hi, uint16_t *lo, size_t len) {
    size_t k = 0;
    for (; k + 16 <= len; k += 16) split_bf16(_mm512_loadu_ps(x + k), hi + k, lo + k, 0xFFFF);
    if (k < len) {
        const __mmask16 mk = (__mmask16)((1u << (len - k)) - 1u);
        split_bf16(_mm512_maskz_loadu_ps(mk, x + k), hi + k, lo + k, mk);
    }
}

/* The 32 columns of block b of a tile record as float32 weights, 16 rows each: w[c] lane i is
 * W[16 tile + i][32 b + c]. */
static inline TGTA void block_weights(const pm_tiled *w, const uint8_t *rec, int b, __m512 *wv) {
    const uint8_t *blk = rec + (size_t)b * w->block_bytes;
    const uint16_t *sc = (const uint16_t *)(rec + w->scale_off);
    const int g = b / w->gpb;
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 16 * g)));
    const __m512i ff = _mm512_set1_epi32(0xFF);
    if (w->bits == 8) {
        const __m512 mv = _mm512_mul_ps(s, _mm512_set1_ps(-128.0f));
        for (int k = 0; k < 8; k++) {
            const __m512i V = _mm512_load_si512((const void *)(blk + 64 * k));
            for (int j = 0; j < 4; j++) {
                const __m512i q = _mm512_and_si512(_mm512_srli_epi32(V, 8 * j), ff);
                wv[4 * k + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s, mv);
            }
        }
        return;
    }
    const uint16_t *mn = sc + (size_t)w->ng * 16;
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + 16 * g)));
    for (int mm = 0; mm < 4; mm++) {
        __m512i lo, hi;
        pm_nibble_pair(w->bits, blk, mm, &lo, &hi);
        for (int j = 0; j < 4; j++) {
            const __m512i ql = _mm512_and_si512(_mm512_srli_epi32(lo, 8 * j), ff);
            const __m512i qh = _mm512_and_si512(_mm512_srli_epi32(hi, 8 * j), ff);
            wv[8 * mm + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ql), s, mv);
            wv[8 * mm + 4 + j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(qh), s, mv);
        }
    }
}

/* Two float32 vectors (lane i: the values of features 2r and 2r + 1 for column i) as one row of
 * a B tile in two bfloat16 terms: hi[2 i + j] = bf16(v_j[i]), lo the same for v_j - hi (lo
 * NULL: hi alone). */
static inline TGTA void store_pair_row(__m512 e, __m512 d, uint16_t *hi, uint16_t *lo) {
    /* cvtne2ps gives [e x 16, d x 16]: interleave to column pairs */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                           1, 16, 0);
    const __m512i two = (__m512i)_mm512_cvtne2ps_pbh(d, e);
    _mm512_store_si512((void *)hi, _mm512_permutexvar_epi16(pairs, two));
    if (!lo) return;
    /* the bfloat16 terms back in float32 (low half: e, high half: d), remainders */
    const __m512 eh = bf16_float(_mm512_castsi512_si256(two));
    const __m512 dh = bf16_float(_mm512_extracti64x4_epi64(two, 1));
    const __m512i tl = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(d, dh), _mm512_sub_ps(e, eh));
    _mm512_store_si512((void *)lo, _mm512_permutexvar_epi16(pairs, tl));
}

/* Tile `tile` of w widened into B-tile blocks of two bfloat16 terms, block b at b * stride:
 * hi[b * stride + 32 r + 2 i + j] = bf16(W[16 tile + i][32 b + 2 r + j]), lo the same for
 * W - hi (lo NULL: hi alone). */
static TGTA void widen_tile(const pm_tiled *w, int tile, uint16_t *hi, uint16_t *lo,
                           size_t stride) {
    const uint8_t *rec = w->data + (size_t)tile * w->tile_bytes;
    for (int b = 0; b < w->nb; b++) {
        __m512 wv[32];
        block_weights(w, rec, b, wv);
        for (int r = 0; r < 16; r++)
            store_pair_row(wv[2 * r], wv[2 * r + 1], hi + (size_t)b * stride + 32 * r,
                           lo ? lo + (size_t)b * stride + 32 * r : NULL);
    }
}

/* Accumulator tile k += A_hi B_hi + A_lo B_hi + A_hi B_lo: the A terms in tiles 4 (hi) and 5
 * (lo), the B terms loaded from h and l (64-byte rows); PM_AMX_TWO: k += A_hi B + A_lo B. Tile
 * numbers are immediates, hence macros with one expansion per accumulator. */
#define PM_AMX_THREE(k, h, l)                                                                    \
    do {                                                                                        \
        _tile_loadd(6, h, 64);                                                                  \
        _tile_loadd(7, l, 64);                                                                  \
        _tile_dpbf16ps(k, 4, 6);                                                                \
        _tile_dpbf16ps(k, 5, 6);                                                                \
        _tile_dpbf16ps(k, 4, 7);                                                                \
    } while (0)

#define PM_AMX_TWO(k, h)                                                                        \
    do {                                                                                        \
        _tile_loadd(6, h, 64);                                                                  \
        _tile_dpbf16ps(k, 4, 6);                                                                \
        _tile_dpbf16ps(k, 5, 6);                                                                \
    } while (0)

static inline TGTA void zero_accumulators(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* C tile (16 tokens x 16 rows, float) -> y rows [t0, t0 + nt) x columns [r0, r0 + nr). */
static inline TGTA void store_rows(const float *c, float *y, size_t ystride, int t0, int nt,
                                   int r0, int nr) {
    const __mmask16 mk = (__mmask16)(nr >= 16 ? 0xFFFFu : (1u << nr) - 1u);
    for (int t = 0; t < nt; t++)
        _mm512_mask_storeu_ps(y + (size_t)(t0 + t) * ystride + r0, mk, _mm512_loadu_ps(c + 16 * t));
}

void TGTA pm_amx_act(const float *x, int cols, int i0, int i1, int c0, int c1, uint16_t *hi,
                     uint16_t *lo) {
    const size_t nb = (size_t)cols / 32;
    for (int i = i0; i < i1; i++)
        for (int c = c0; c < c1; c += 16) {
            const size_t o = ((size_t)(i / 16) * nb + (size_t)c / 32) * 512 +
                             (size_t)(i % 16) * 32 + (size_t)(c % 32);
            split_bf16(_mm512_loadu_ps(x + (size_t)i * (size_t)cols + c), hi + o, lo + o, 0xFFFF);
        }
}

void TGTA pm_amx_matmul(const pm_tiled *w, const uint16_t *xb, const uint16_t *xl, int n,
                        float *y, size_t ystride, int tb, int te, uint16_t *wbuf, int one_term) {
    tiles_configure();
    const int nb = w->nb, ntt = (n + 15) / 16;
    /* the widened weights, block-major: block b of tile k at (4 b + k) * ts, hi then lo (ts =
     * 1024; one term: hi alone, ts = 512), so that one step of the loop below reads 8 (4) KB
     * in a row */
    const size_t ts = one_term ? 512 : 1024, bs = (size_t)PM_AMX_TILES * ts;
    float c[4][256] __attribute__((aligned(64)));
    for (int tile = tb; tile < te; tile += PM_AMX_TILES) {
        /* up to 4 weight tiles at a time; a missing one repeats the last (results dropped) */
        const int nw = te - tile < PM_AMX_TILES ? te - tile : PM_AMX_TILES;
        size_t ko[PM_AMX_TILES];
        for (int k = 0; k < PM_AMX_TILES; k++) {
            if (k < nw)
                widen_tile(w, tile + k, wbuf + ts * k, one_term ? NULL : wbuf + ts * k + 512, bs);
            ko[k] = ts * (size_t)(k < nw ? k : nw - 1);
        }
        for (int tt = 0; tt < ntt; tt++) {
            const size_t o = (size_t)tt * nb * 512;
            const uint16_t *a = xb + o, *l = xl + o;
            zero_accumulators();
            /* C_k += x_hi w_hi + x_lo w_hi (one term: w = w_hi) */
            if (one_term)
                for (int b = 0; b < nb; b++) {
                    const uint16_t *q = wbuf + (size_t)b * bs;
                    _tile_loadd(4, a + 512 * b, 64);
                    _tile_loadd(5, l + 512 * b, 64);
                    PM_AMX_TWO(0, q + ko[0]);
                    PM_AMX_TWO(1, q + ko[1]);
                    PM_AMX_TWO(2, q + ko[2]);
                    PM_AMX_TWO(3, q + ko[3]);
                }
            /* C_k += x_hi w_hi + x_lo w_hi + x_hi w_lo (x_lo w_lo is below float32 rounding) */
            else
                for (int b = 0; b < nb; b++) {
                    const uint16_t *q = wbuf + (size_t)b * bs;
                    _tile_loadd(4, a + 512 * b, 64);
                    _tile_loadd(5, l + 512 * b, 64);
                    PM_AMX_THREE(0, q + ko[0], q + ko[0] + 512);
                    PM_AMX_THREE(1, q + ko[1], q + ko[1] + 512);
                    PM_AMX_THREE(2, q + ko[2], q + ko[2] + 512);
                    PM_AMX_THREE(3, q + ko[3], q + ko[3] + 512);
                }
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
            _tile_stored(2, c[2], 64);
            _tile_stored(3, c[3], 64);
            const int nt = n - 16 * tt < 16 ? n - 16 * tt : 16;
            for (int k = 0; k < nw; k++) {
                const int r0 = 16 * (tile + k), nr = w->rows - r0 < 16 ? w->rows - r0 : 16;
                store_rows(c[k], y, ystride, 16 * tt, nt, r0, nr);
            }
        }
    }
    _tile_release();
}


/* ---- attention over a prefill block ----------------------------------------------------------
 *
 * Scores S = Q K^T and values P V on the tile unit, both products in the three bfloat16 terms of
 * the weight products above (Q, P: hi + lo of float32; K, V: hi + lo of their float16 or float32
 * cache values, exact for float16), float32 softmax between them (the pieces of attn_avx512:
 * the same exponential, a running maximum and sum per query row over chunks of keys). */

/* 16 cache values from element idx (format fmt: POCKET_KV_*, int8 unscaled) as float32 */
static inline TGTA __m512 load16(const void *base, int fmt, size_t idx) {
    if (fmt == POCKET_KV_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + idx)));
    if (fmt == POCKET_KV_Q8)
        return _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)base + idx))));
    return _mm512_loadu_ps((const float *)base + idx);
}

void TGTA pm_amx_attn_kv(const void *K, const void *V, const uint16_t *ks, const uint16_t *vs,
                         int fmt, int hd, int k0, int end, int c0, int c1, uint16_t *kh,
                         uint16_t *kl, uint16_t *vh, uint16_t *vl) {
    const int ndc = hd / 32, ndt = hd / 16, q8 = fmt == POCKET_KV_Q8;
    const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
    for (int kc = c0; kc < c1; kc++) {
        for (int half = 0; half < 2; half++) { /* K: the two blocks of 16 keys */
            const int kb = 2 * kc + half, p0 = k0 + 16 * kb, left = end - p0;
            const __mmask16 mk =
                (__mmask16)(left >= 16 ? 0xFFFFu : left > 0 ? (1u << left) - 1u : 0u);
            const size_t base = pm_k_index(p0, 0, hd);
            for (int c = 0; c < ndc; c++) {
                /* int8 keys: the 16 positions' scales of scale blocks 2c, 2c + 1 (rows e of
                 * block c below and from 16; the products are exact in float32, the two
                 * bfloat16 terms keep ~16 bits of them) */
                __m512 sc[2] = {one, one};
                for (int t = 0; q8 && mk && t < 2; t++)
                    sc[t] = _mm512_cvtph_ps(
                        _mm256_maskz_loadu_epi16(mk, ks + pm_k_index(p0, 2 * c + t, ndt)));
                for (int r = 0; r < 16; r++) {
                    const size_t e = (size_t)(32 * c + 2 * r);
                    const __m512 s = sc[r / 8];
                    const __m512 ev =
                        mk ? _mm512_maskz_mul_ps(mk, load16(K, fmt, base + 16 * e), s) : zero;
                    const __m512 dv =
                        mk ? _mm512_maskz_mul_ps(mk, load16(K, fmt, base + 16 * (e + 1)), s) : zero;
                    const size_t o = ((size_t)kb * ndc + c) * 512 + 32 * r;
                    store_pair_row(ev, dv, kh + o, kl + o);
                }
            }
        }
        for (int r = 0; r < 16; r++) { /* V: keys in pairs, 16 columns per tile */
            const int p = k0 + 32 * kc + 2 * r;
            for (int c = 0; c < ndt; c++) { /* int8: the scales of block c */
                const size_t ie = (size_t)p * hd + 16 * c, id = ie + (size_t)hd;
                const __m512 se = q8 && p < end ? _mm512_set1_ps(_cvtsh_ss(vs[ie / 16])) : one;
                const __m512 sd = q8 && p + 1 < end ? _mm512_set1_ps(_cvtsh_ss(vs[id / 16])) : one;
                const __m512 ev = p < end ? _mm512_mul_ps(load16(V, fmt, ie), se) : zero;
                const __m512 dv = p + 1 < end ? _mm512_mul_ps(load16(V, fmt, id), sd) : zero;
                const size_t o = ((size_t)kc * ndt + c) * 512 + 32 * r;
                store_pair_row(ev, dv, vh + o, vl + o);
            }
        }
    }
}

void TGTA pm_amx_attn(const pm_amx_attn_args *A) {
    tiles_configure();
    const int hd = A->hd, ndc = hd / 32, ndt = hd / 16, nq = A->nq;
    const size_t KC = PM_AMX_KCHUNK;
    uint16_t *qh = (uint16_t *)A->scratch, *ql = qh + 16 * hd;
    float *s = (float *)(ql + 16 * hd);
    uint16_t *ph = (uint16_t *)(s + 16 * KC), *pl = ph + 16 * KC;
    float *o = (float *)(pl + 16 * KC);
    float corr[16];

    /* the keys of this chunk any row attends to: [ks, ke), ks a multiple of 32 from k0 */
    const int first = A->win && A->pos0 - A->win + 1 > 0 ? A->pos0 - A->win + 1 : 0;
    int ks = first > A->k0 ? first : A->k0;
    ks = A->k0 + ((ks - A->k0) & ~31);
    const int last = A->pos0 + nq; /* past the last row's own key */
    const int ke = last < A->k0 + A->nk ? last : A->k0 + A->nk;
    if (ke > ks) {
        const int len = (ke - ks + 31) & ~31;
        for (int i = 0; i < 16; i++) {
            if (i < nq) {
                pm_amx_to_bf16(A->q + (size_t)i * A->qstride, qh + (size_t)i * hd,
                               ql + (size_t)i * hd, (size_t)hd);
            } else {
                memset(qh + (size_t)i * hd, 0, (size_t)hd * sizeof(uint16_t));
                memset(ql + (size_t)i * hd, 0, (size_t)hd * sizeof(uint16_t));
            }
        }
        /* S[i][key - ks] = q_i . k, four blocks of 16 keys at a time */
        const int nkb = len / 16, kb0 = (ks - A->k0) / 16;
        const size_t qs = (size_t)hd * sizeof(uint16_t);
        for (int b = 0; b < nkb; b += 4) {
            const int nb = nkb - b < 4 ? nkb - b : 4;
            const uint16_t *bh[4], *bl[4];
            for (int k = 0; k < 4; k++) {
                const size_t off = (size_t)(kb0 + b + (k < nb ? k : nb - 1)) * ndc * 512;
                bh[k] = A->kh + off;
                bl[k] = A->kl + off;
            }
            zero_accumulators();
            for (int c = 0; c < ndc; c++) {
                _tile_loadd(4, qh + 32 * c, qs);
                _tile_loadd(5, ql + 32 * c, qs);
                const size_t oc = (size_t)512 * c;
                PM_AMX_THREE(0, bh[0] + oc, bl[0] + oc);
                PM_AMX_THREE(1, bh[1] + oc, bl[1] + oc);
                PM_AMX_THREE(2, bh[2] + oc, bl[2] + oc);
                PM_AMX_THREE(3, bh[3] + oc, bl[3] + oc);
            }
            _tile_stored(0, s + 16 * b, KC * sizeof(float));
            if (nb > 1) _tile_stored(1, s + 16 * (b + 1), KC * sizeof(float));
            if (nb > 2) _tile_stored(2, s + 16 * (b + 2), KC * sizeof(float));
            if (nb > 3) _tile_stored(3, s + 16 * (b + 3), KC * sizeof(float));
        }
        /* softmax pieces, row by row: P = exp(S * scale - max) over the row's keys, 0 elsewhere */
        const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512 ninf = _mm512_set1_ps(-INFINITY), vscale = _mm512_set1_ps(A->scale);
        for (int i = 0; i < 16; i++) {
            float *si = s + (size_t)i * KC;
            int a = 0, e = 0; /* the row's keys in [a, e) */
            if (i < nq) {
                const int p = A->pos0 + i;
                a = A->win && p - A->win + 1 > ks ? p - A->win + 1 : ks;
                e = p + 1 < ke ? p + 1 : ke;
            }
            const __m512i va = _mm512_set1_epi32(a - ks), ve = _mm512_set1_epi32(e - ks);
            for (int j = 0; j < len; j += 16) {
                const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(j));
                const __mmask16 ok =
                    _mm512_cmpge_epi32_mask(key, va) & _mm512_cmplt_epi32_mask(key, ve);
                const __m512 v = _mm512_mask_mul_ps(ninf, ok, _mm512_loadu_ps(si + j), vscale);
                _mm512_storeu_ps(si + j, v);
            }
            /* a row without keys so far gets corr 0 and P = 0: its accumulator becomes 0 */
            corr[i] = pm_softmax_piece(si, len, A->m + i, A->l + i);
            pm_amx_to_bf16(si, ph + (size_t)i * KC, pl + (size_t)i * KC, (size_t)len);
        }
        /* O = P V, four tiles of 16 columns at a time */
        const int nkc = len / 32, kc0 = (ks - A->k0) / 32;
        const size_t ps = KC * sizeof(uint16_t);
        for (int t = 0; t < ndt; t += 4) {
            const int nt = ndt - t < 4 ? ndt - t : 4;
            size_t off[4];
            for (int k = 0; k < 4; k++) off[k] = (size_t)(t + (k < nt ? k : nt - 1)) * 512;
            zero_accumulators();
            for (int c = 0; c < nkc; c++) {
                const size_t vo = (size_t)(kc0 + c) * ndt * 512;
                _tile_loadd(4, ph + 32 * c, ps);
                _tile_loadd(5, pl + 32 * c, ps);
                PM_AMX_THREE(0, A->vh + vo + off[0], A->vl + vo + off[0]);
                PM_AMX_THREE(1, A->vh + vo + off[1], A->vl + vo + off[1]);
                PM_AMX_THREE(2, A->vh + vo + off[2], A->vl + vo + off[2]);
                PM_AMX_THREE(3, A->vh + vo + off[3], A->vl + vo + off[3]);
            }
            const size_t os = (size_t)hd * sizeof(float);
            _tile_stored(0, o + 16 * t, os);
            if (nt > 1) _tile_stored(1, o + 16 * (t + 1), os);
            if (nt > 2) _tile_stored(2, o + 16 * (t + 2), os);
            if (nt > 3) _tile_stored(3, o + 16 * (t + 3), os);
        }
        for (int i = 0; i < nq; i++) {
            float *acc = A->acc + (size_t)i * A->astride;
            const float *oi = o + (size_t)i * hd;
            const __m512 c = _mm512_set1_ps(corr[i]);
            for (int k = 0; k < hd; k += 16) {
                const __m512 ov = _mm512_loadu_ps(oi + k);
                const __m512 prev = _mm512_loadu_ps(acc + k);
                _mm512_storeu_ps(acc + k, corr[i] == 0.0f ? ov : _mm512_fmadd_ps(prev, c, ov));
            }
        }
    }
    if (A->last)
        for (int i = 0; i < nq; i++) {
            float *acc = A->acc + (size_t)i * A->astride;
            const __m512 r = _mm512_set1_ps(A->l[i]);
            for (int k = 0; k < hd; k += 16)
                _mm512_storeu_ps(acc + k, _mm512_div_ps(_mm512_loadu_ps(acc + k), r));
        }
    _tile_release();
}

#endif /* PM_HAVE_AMX */

typedef int pocket_model_amx_unit_not_empty;
