/* AMX-BF16 products of the inference engine for prefill (pocket_model_config.amx).
 *
 * A product over a block of n >= PM_AMX_MIN_TOKENS tokens, Y[n, rows] = X[n, K] W[rows, K]^T,
 * runs on the tile unit with both operands as two bfloat16 terms, hi = bf16(v) and
 * lo = bf16(v - hi) (~16 significant bits together):
 *   Y = X_hi W_hi + X_lo W_hi + X_hi W_lo    (X_lo W_lo is below float32 rounding)
 * summed in float32 tiles (TDPBF16PS: C[16 tokens, 16 rows] += A . B). X's terms are the A
 * tiles (16 tokens x 32 features, row-major, as prepare_act writes them); W is widened from its
 * 16-row tiles (INT4, INT5 or INT8, pocket_model_ops.h: q * scale + min in float32) four tiles
 * at a time into a per-thread buffer in the B-tile layout (row r of a 32-feature block: for each
 * of the 16 weight rows, the features 2r and 2r + 1).
 *
 * Accuracy, smollm2-135m and gemma3-270m, 256 tokens of english and chinese text, against the
 * float-activation reference: top-1 agreement 100 %, KL ~3e-7 to 5e-7 (the two-digit int8
 * products: 100 %, 4e-7 to 1e-6). One term per operand was measured too: bfloat16 weights
 * alone cost gemma3-270m 1.5-2 % of top-1 agreement, bfloat16 activations smollm2-135m up to
 * 2 %; hence the three products.
 *
 * Work is split by weight tiles (16 rows), like the other products, so results do not depend
 * on the number of threads. Linux needs the process to ask for the tile state once
 * (arch_prctl ARCH_REQ_XCOMP_PERM); each thread loads the tile configuration before its
 * first tile instruction.
 */
#if !defined(_WIN32) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* syscall */
#endif

#include "pocket_internal.h"
#include "pocket_model_internal.h"

#if PM_HAVE_AMX

#include "pocket_model_x86.h"

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

static __thread int tiles_ready;

static TGTA void tiles_configure(void) {
    if (tiles_ready) return;
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
    tiles_ready = 1;
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

/* Tile `tile` of w widened into B-tile blocks of two bfloat16 terms: hi[b * 512 + 32 r + 2 i + j]
 * = bf16(W[16 tile + i][32 b + 2 r + j]), lo the same for W - hi. */
static TGTA void widen_tile(const pm_tiled *w, int tile, uint16_t *hi, uint16_t *lo) {
    const uint8_t *rec = w->data + (size_t)tile * w->tile_bytes;
    /* cvtne2ps gives [even column x 16 rows, odd column x 16 rows]: interleave to row pairs */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                           24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                           1, 16, 0);
    for (int b = 0; b < w->nb; b++) {
        __m512 wv[32];
        block_weights(w, rec, b, wv);
        uint16_t *oh = hi + (size_t)b * 512, *ol = lo + (size_t)b * 512;
        for (int r = 0; r < 16; r++) {
            const __m512 e = wv[2 * r], d = wv[2 * r + 1];
            const __m512i two = (__m512i)_mm512_cvtne2ps_pbh(d, e);
            _mm512_store_si512((void *)(oh + 32 * r), _mm512_permutexvar_epi16(pairs, two));
            /* the bfloat16 terms back in float32 (low half: e, high half: d), remainders */
            const __m512 eh = bf16_float(_mm512_castsi512_si256(two));
            const __m512 dh = bf16_float(_mm512_extracti64x4_epi64(two, 1));
            const __m512i tl =
                (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(d, dh), _mm512_sub_ps(e, eh));
            _mm512_store_si512((void *)(ol + 32 * r), _mm512_permutexvar_epi16(pairs, tl));
        }
    }
}

/* C tile (16 tokens x 16 rows, float) -> y rows [t0, t0 + nt) x columns [r0, r0 + nr). */
static inline TGTA void store_rows(const float *c, float *y, size_t ystride, int t0, int nt,
                                   int r0, int nr) {
    const __mmask16 mk = (__mmask16)(nr >= 16 ? 0xFFFFu : (1u << nr) - 1u);
    for (int t = 0; t < nt; t++)
        _mm512_mask_storeu_ps(y + (size_t)(t0 + t) * ystride + r0, mk, _mm512_loadu_ps(c + 16 * t));
}

void TGTA pm_amx_matmul(const pm_tiled *w, const uint16_t *xb, const uint16_t *xl, int n,
                        float *y, size_t ystride, int tb, int te, uint16_t *wbuf) {
    tiles_configure();
    const int K = w->cols, nb = w->nb, ntt = (n + 15) / 16;
    const size_t xs = (size_t)K * sizeof(uint16_t); /* stride of the activation rows */
    const size_t wt = (size_t)nb * 512;             /* bfloat16 of one widened tile */
    float c[4][256] __attribute__((aligned(64)));
    for (int tile = tb; tile < te; tile += PM_AMX_TILES) {
        /* up to 4 weight tiles at a time; a missing one repeats the last (results dropped) */
        const int nw = te - tile < PM_AMX_TILES ? te - tile : PM_AMX_TILES;
        const uint16_t *bh[PM_AMX_TILES], *bl[PM_AMX_TILES];
        for (int k = 0; k < PM_AMX_TILES; k++) {
            uint16_t *h = wbuf + (size_t)(2 * k) * wt, *l = h + wt;
            if (k < nw) widen_tile(w, tile + k, h, l);
            bh[k] = k < nw ? h : bh[nw - 1];
            bl[k] = k < nw ? l : bl[nw - 1];
        }
        for (int tt = 0; tt < ntt; tt++) {
            const size_t o = (size_t)16 * tt * K;
            const uint16_t *a = xb + o, *l = xl + o;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            /* C_k += x_hi w_hi + x_lo w_hi + x_hi w_lo (x_lo w_lo is below float32 rounding) */
            for (int b = 0; b < nb; b++) {
                const size_t ob = (size_t)512 * b;
                _tile_loadd(4, a + 32 * b, xs);
                _tile_loadd(5, l + 32 * b, xs);
                /* tile numbers are immediates: one expansion per accumulator */
#define PM_AMX_THREE(k)                                                                          \
    do {                                                                                        \
        _tile_loadd(6, bh[k] + ob, 64);                                                         \
        _tile_loadd(7, bl[k] + ob, 64);                                                         \
        _tile_dpbf16ps(k, 4, 6);                                                                \
        _tile_dpbf16ps(k, 5, 6);                                                                \
        _tile_dpbf16ps(k, 4, 7);                                                                \
    } while (0)
                PM_AMX_THREE(0);
                PM_AMX_THREE(1);
                PM_AMX_THREE(2);
                PM_AMX_THREE(3);
#undef PM_AMX_THREE
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
}

#endif /* PM_HAVE_AMX */

typedef int pocket_model_amx_unit_not_empty;
