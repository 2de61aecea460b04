/* AVX-512 operations of the inference engine (see pocket_model_ops.h): norms, attention,
 * activations, and the products on tiled weights (int8 digits with VNNI, or float32). Every
 * function carries its own target attribute: this file is compiled without -mavx* flags, and
 * the engine only selects these where the avx512 kernel level is supported (AVX-512
 * F/BW/DQ/VL + VNNI, F16C, FMA; checked at run time).
 *
 * The float32-weight product is the avx2 level's (pm_matmul_f32_avx2: the portable product's
 * bits, register-blocked), so that the float reference path computes the same products on
 * every x86 level. Differences to the other portable versions are float rounding only: sums in
 * 16 lanes, exp from a
 * degree-6 polynomial (within ~2 ulp of expf), silu / GELU written with exp:
 *   silu(x) = x / (1 + e^-x),  gelu_tanh(x) = x / (1 + e^(-2u)), u = sqrt(2/pi)(x + 0.044715x^3)
 * (the same functions as x * (0.5 + 0.5 tanh(x/2)) and 0.5x(1 + tanh(u))).
 */
#include <math.h>

#include "pocket_internal.h"
#include "pocket_model_ops.h"

#if PM_HAVE_AVX512

#include "pocket_model_x86.h"

#define TGT __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")))

#define AI __attribute__((always_inline))
#define PM_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC) /* round to nearest even */

static inline TGT AI __mmask16 tail_mask(int left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

/* 16 values of a KV head's V from element idx = pos * hd + c (format fmt: POCKET_KV_*; int8 times
 * its block's scale vs[idx / 16]) as float32 */
static inline TGT AI __m512 load_kv(const void *base, const uint16_t *vs, int fmt, size_t idx,
                                    __mmask16 mk) {
    if (fmt == POCKET_KV_F16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, (const uint16_t *)base + idx));
    if (fmt == POCKET_KV_Q8)
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                 _mm_maskz_loadu_epi8(mk, (const int8_t *)base + idx))),
                             _mm512_set1_ps(_cvtsh_ss(vs[idx / PM_KV_QBLOCK])));
    return _mm512_maskz_loadu_ps(mk, (const float *)base + idx);
}

static TGT void rmsnorm_avx512(const float *x, const float *w, int n, int d, float eps,
                               float *out) {
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * d;
        float *oi = out + (size_t)i * d;
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < d; c += 16) {
            const __m512 v = _mm512_maskz_loadu_ps(tail_mask(d - c), xi + c);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        const float ms = _mm512_reduce_add_ps(acc) / (float)d;
        const __m512 r = _mm512_set1_ps(sqrtf(ms + eps));
        for (int c = 0; c < d; c += 16) {
            const __mmask16 mk = tail_mask(d - c);
            const __m512 v = _mm512_maskz_loadu_ps(mk, xi + c);
            _mm512_mask_storeu_ps(oi + c, mk,
                                  _mm512_mul_ps(_mm512_div_ps(v, r), _mm512_maskz_loadu_ps(mk, w + c)));
        }
    }
}

/* 16 positions of K^T row e (see pm_k_index) of one K block, as float32 (int8: times the
 * positions' scales of e's block, ksblk the block's scales) */
static inline TGT AI __m512 load_k16(const void *kblk, const uint16_t *ksblk, int fmt, int e) {
    if (fmt == POCKET_KV_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)kblk + 16 * e)));
    if (fmt == POCKET_KV_Q8)
        return _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(
                (const int8_t *)kblk + 16 * e)))),
            _mm512_cvtph_ps(
                _mm256_loadu_si256((const __m256i *)(ksblk + 16 * (e / PM_KV_QBLOCK)))));
    return _mm512_loadu_ps((const float *)kblk + 16 * e);
}

/* Scores of GH (<= 4) query heads against the 16 positions of one K block: out[g] lane j =
 * q_g . k_j (two partial sums over even / odd e, for independent FMA chains). */
static inline TGT AI void scores_block(const int GH, const float *q, int hd, const void *kblk,
                                       const uint16_t *ksblk, int fmt, __m512 out[4]) {
    __m512 a0[4], a1[4];
    for (int g = 0; g < GH; g++) a0[g] = a1[g] = _mm512_setzero_ps();
    for (int e = 0; e < hd; e += 2) {
        const __m512 k0 = load_k16(kblk, ksblk, fmt, e), k1 = load_k16(kblk, ksblk, fmt, e + 1);
        for (int g = 0; g < GH; g++) {
            a0[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[(size_t)g * hd + e]), k0, a0[g]);
            a1[g] = _mm512_fmadd_ps(_mm512_set1_ps(q[(size_t)g * hd + e + 1]), k1, a1[g]);
        }
    }
    for (int g = 0; g < GH; g++) out[g] = _mm512_add_ps(a0[g], a1[g]);
}

/* acc[g][c] = acc[g][c] * corr[g] + sum_j p[g][j] * V[pos0 + j][c], j < len, for G heads and
 * the 16 * NV columns c from col0 (acc rows and V rows hd apart), accumulators in registers
 * (G * NV <= 16): each value vector is loaded once for the G heads. */
static inline TGT AI void values_regs(const int G, const int NV, const float *p, size_t pstride,
                                      const void *V, const uint16_t *vs, int fmt, int pos0, int len,
                                      const float *corr, float *acc, int hd, int col0) {
    __m512 av[4][8];
    for (int g = 0; g < G; g++) {
        const __m512 c = _mm512_set1_ps(corr[g]);
        for (int t = 0; t < NV; t++)
            av[g][t] = _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)g * hd + col0 + 16 * t), c);
    }
    for (int j = 0; j < len; j++) {
        const size_t vb = (size_t)(pos0 + j) * hd + col0;
        __m512 v[8];
        for (int t = 0; t < NV; t++) v[t] = load_kv(V, vs, fmt, vb + 16 * t, (__mmask16)0xFFFF);
        for (int g = 0; g < G; g++) {
            const __m512 pg = _mm512_set1_ps(p[(size_t)g * pstride + j]);
            for (int t = 0; t < NV; t++) av[g][t] = _mm512_fmadd_ps(pg, v[t], av[g][t]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int t = 0; t < NV; t++) _mm512_storeu_ps(acc + (size_t)g * hd + col0 + 16 * t, av[g][t]);
}

/* The same for any G and head_dim, head by head (accumulators of one head in registers). */
static TGT void values_any(int G, int hd, const float *p, size_t pstride, const void *V,
                           const uint16_t *vs, int fmt,
                           int pos0, int len, const float *corr, float *acc) {
    const int nv = (hd + 15) / 16;
    for (int g = 0; g < G; g++) {
        float *ag = acc + (size_t)g * hd;
        for (int t0 = 0; t0 < nv; t0 += 8) {
            const int tn = nv - t0 < 8 ? nv - t0 : 8;
            __m512 av[8];
            const __m512 c = _mm512_set1_ps(corr[g]);
            for (int t = 0; t < tn; t++)
                av[t] = _mm512_mul_ps(
                    _mm512_maskz_loadu_ps(tail_mask(hd - 16 * (t0 + t)), ag + 16 * (t0 + t)), c);
            for (int j = 0; j < len; j++) {
                const __m512 pg = _mm512_set1_ps(p[(size_t)g * pstride + j]);
                const size_t vb = (size_t)(pos0 + j) * hd;
                for (int t = 0; t < tn; t++) {
                    const int col = 16 * (t0 + t);
                    av[t] = _mm512_fmadd_ps(pg, load_kv(V, vs, fmt, vb + col, tail_mask(hd - col)),
                                            av[t]);
                }
            }
            for (int t = 0; t < tn; t++)
                _mm512_mask_storeu_ps(ag + 16 * (t0 + t), tail_mask(hd - 16 * (t0 + t)), av[t]);
        }
    }
}

static TGT void attn_avx512(const pm_attn_args *A) {
    const int G = A->G, hd = A->hd, fmt = A->fmt;
    const void *V = A->V;
    const uint16_t *vs = A->vs;
    const size_t kblock = (size_t)16 * hd; /* elements per K block */
    const size_t es = pm_kv_es(fmt);
    const __m512 vscale = _mm512_set1_ps(A->scale), ninf = _mm512_set1_ps(-INFINITY);
    float corr[64];
    if (G > 64) {
        pm_ops_portable.attn(A);
        return;
    }
    for (int c = A->a; c < A->b;) {
        const int cend0 = (c / PM_SPAN + 1) * PM_SPAN, cend = cend0 < A->b ? cend0 : A->b;
        const int kb0 = c / 16, kb1 = (cend - 1) / 16, base = kb0 * 16;
        /* scores into s[g][pos - base], -inf outside [c, cend) */
        for (int kb = kb0; kb <= kb1; kb++) {
            const int p0 = kb * 16;
            const int lo = c > p0 ? c - p0 : 0, hi = cend < p0 + 16 ? cend - p0 : 16;
            const __mmask16 valid = (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
            const char *kblk = (const char *)A->K + (size_t)kb * kblock * es;
            const uint16_t *ksblk = A->ks ? A->ks + (size_t)kb * kblock / PM_KV_QBLOCK : NULL;
            for (int g0 = 0; g0 < G; g0 += 4) {
                const int gh = G - g0 < 4 ? G - g0 : 4;
                __m512 sc[4];
                const float *q = A->q + (size_t)g0 * hd;
                switch (gh) {
                case 1: scores_block(1, q, hd, kblk, ksblk, fmt, sc); break;
                case 2: scores_block(2, q, hd, kblk, ksblk, fmt, sc); break;
                case 3: scores_block(3, q, hd, kblk, ksblk, fmt, sc); break;
                default: scores_block(4, q, hd, kblk, ksblk, fmt, sc); break;
                }
                for (int g = 0; g < gh; g++)
                    _mm512_storeu_ps(A->s + (size_t)(g0 + g) * PM_SPAN + (p0 - base),
                                     _mm512_mask_mul_ps(ninf, valid, sc[g], vscale));
            }
        }
        /* softmax pieces */
        const int nlen = (kb1 - kb0 + 1) * 16;
        for (int g = 0; g < G; g++)
            corr[g] = pm_softmax_piece(A->s + (size_t)g * PM_SPAN, nlen, A->m + g, A->l + g);
        /* weighted values of positions [c, cend) */
        const float *p = A->s + (c - base);
        const int len = cend - c;
        if (hd % 64) {
            values_any(G, hd, p, PM_SPAN, V, vs, fmt, c, len, corr, A->acc);
        } else {
            /* heads in groups of <= 4, columns in blocks of 128 (<= 2 heads) or 64 */
            for (int g0 = 0; g0 < G; g0 += 4) {
                const int gh = G - g0 < 4 ? G - g0 : 4, wide = gh <= 2 && hd % 128 == 0;
                const float *pg = p + (size_t)g0 * PM_SPAN, *cg = corr + g0;
                float *ag = A->acc + (size_t)g0 * hd;
                for (int col0 = 0; col0 < hd; col0 += wide ? 128 : 64) {
                    switch (wide ? 10 + gh : gh) {
                    case 1: values_regs(1, 4, pg, PM_SPAN, V, vs, fmt, c, len, cg, ag, hd, col0); break;
                    case 2: values_regs(2, 4, pg, PM_SPAN, V, vs, fmt, c, len, cg, ag, hd, col0); break;
                    case 3: values_regs(3, 4, pg, PM_SPAN, V, vs, fmt, c, len, cg, ag, hd, col0); break;
                    case 4: values_regs(4, 4, pg, PM_SPAN, V, vs, fmt, c, len, cg, ag, hd, col0); break;
                    case 11: values_regs(1, 8, pg, PM_SPAN, V, vs, fmt, c, len, cg, ag, hd, col0); break;
                    default: values_regs(2, 8, pg, PM_SPAN, V, vs, fmt, c, len, cg, ag, hd, col0); break;
                    }
                }
            }
        }
        c = cend;
    }
}

static TGT void glu_avx512(float *gate, const float *up, size_t len, int gelu) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (size_t k = 0; k < len; k += 16) {
        const __mmask16 mk = len - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - k)) - 1u);
        const __m512 x = _mm512_maskz_loadu_ps(mk, gate + k);
        __m512 t;
        if (gelu) {
            const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
            const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                           _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
            t = _mm512_mul_ps(u, _mm512_set1_ps(-2.0f));
        } else {
            t = _mm512_sub_ps(_mm512_setzero_ps(), x);
        }
        const __m512 a = _mm512_div_ps(x, _mm512_add_ps(one, pocket_exp512(t)));
        _mm512_mask_storeu_ps(gate + k, mk, _mm512_mul_ps(a, _mm512_maskz_loadu_ps(mk, up + k)));
    }
}

static TGT void to_f16_avx512(const float *x, uint16_t *out, size_t len) {
    for (size_t k = 0; k < len; k += 16) {
        const __mmask16 mk = len - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - k)) - 1u);
        const __m256i h = _mm512_cvtps_ph(_mm512_maskz_loadu_ps(mk, x + k),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_mask_storeu_epi16(out + k, mk, h);
    }
}

/* ---- int8-digit activations ------------------------------------------------------------ */

#define TGTV __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

/* Bit-identical to pm_quant_act_portable (same operations, in the same order per value). */
static TGTV void quant_act_avx512(const float *x, int n, int cols, int digits, int8_t *q1,
                                  int8_t *q2, float *dd, float *bsum, int32_t *corr) {
    const size_t nblk = (size_t)n * (size_t)cols / 32;
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (size_t b = 0; b < nblk; b++) {
        const float *p = x + 32 * b;
        const __m512 v0 = _mm512_loadu_ps(p), v1 = _mm512_loadu_ps(p + 16);
        const __m512 m = _mm512_max_ps(_mm512_andnot_ps(sign, v1), _mm512_andnot_ps(sign, v0));
        const float amax = _mm512_reduce_max_ps(m);
        float d = amax / 127.0f, id = 1.0f / d;
        if (!(amax >= POCKET_ACT_TINY)) d = 0.0f, id = 0.0f;
        const __m512 vid = _mm512_set1_ps(id);
        __m512 t0 = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v0, vid), lo), hi);
        __m512 t1 = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v1, vid), lo), hi);
        const __m512 r0 = _mm512_roundscale_ps(t0, PM_RNE), r1 = _mm512_roundscale_ps(t1, PM_RNE);
        const __m512i i0 = _mm512_cvtps_epi32(r0), i1 = _mm512_cvtps_epi32(r1);
        _mm_storeu_si128((__m128i *)(q1 + 32 * b), _mm512_cvtepi32_epi8(i0));
        _mm_storeu_si128((__m128i *)(q1 + 32 * b + 16), _mm512_cvtepi32_epi8(i1));
        int32_t S = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
        if (digits == 2) {
            const __m512 c = _mm512_set1_ps(128.0f);
            const __m512 e0 = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(t0, r0), c), PM_RNE);
            const __m512 e1 = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_sub_ps(t1, r1), c), PM_RNE);
            const __m512i j0 = _mm512_cvtps_epi32(e0), j1 = _mm512_cvtps_epi32(e1);
            _mm_storeu_si128((__m128i *)(q2 + 32 * b), _mm512_cvtepi32_epi8(j0));
            _mm_storeu_si128((__m128i *)(q2 + 32 * b + 16), _mm512_cvtepi32_epi8(j1));
            S = 128 * S + _mm512_reduce_add_epi32(_mm512_add_epi32(j0, j1));
            dd[b] = d * (1.0f / 128.0f);
        } else {
            dd[b] = d;
        }
        bsum[b] = dd[b] * (float)S;
        corr[b] = 128 * S;
    }
}

/* The loops over the T tokens of a tile, unrolled so that their accumulators stay in registers. */
#define PM_UNROLL_T _Pragma("GCC unroll 4")

/* One tile of 16 rows for T tokens (i0 .. i0 + T - 1). BITS: INT4 (u8 nibbles), INT5 (nibbles
 * and high-bit masks) or INT8 (q + 128) weights, or the planes of an INT8 matrix (w the high
 * plane, w2 the low one: PM_BITS_ESTIMATE, PM_BITS_PLANES); DIG: activation digits. Integer
 * block sums are exact; each block is rescaled by scale[row] * dd[token] into float32
 * accumulators (lane = row); INT4 / INT5 (and estimate) minimums are added per group. The
 * planes recombined give INT8's integer sums and float steps, bit for bit. */
static inline TGTV AI void tiled_tile(const int BITS, const int DIG, const int T,
                                      const pm_tiled *w, const pm_tiled *w2, const pm_act *a,
                                      int i0, float *y, size_t ystride, int tile, int prefetch,
                                      const uint16_t *steps) {
    const int EST = BITS == PM_BITS_ESTIMATE, PL = BITS == PM_BITS_PLANES;
    const int NIB = BITS != 8;       /* operand pairs of nibble vectors */
    const int MINS = NIB && !PL;     /* minimums per group */
    const int OFF = BITS == 8 || PL; /* the +128 offset of INT8 codes (corr) */
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
    const int8_t *x1[4], *x2[4];
    const float *dd[4], *bs[4];
    const int32_t *cr[4];
    PM_UNROLL_T
    for (int t = 0; t < T; t++) {
        x1[t] = a->q1 + (size_t)(i0 + t) * a->cols;
        x2[t] = a->q2 + (size_t)(i0 + t) * a->cols;
        dd[t] = a->dd + (size_t)(i0 + t) * nb;
        bs[t] = a->bsum + (size_t)(i0 + t) * nb;
        cr[t] = a->corr + (size_t)(i0 + t) * nb;
    }
    if (prefetch)
        for (size_t o = w->scale_off; o < w->tile_bytes; o += 64)
            PM_PREFETCH(rec + o);
    __m512 acc[4];
    PM_UNROLL_T
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int g = 0; g < ng; g++) {
        const __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 16 * g)));
        const __m512 s = EST ? _mm512_mul_ps(s1, _mm512_set1_ps(PM_EST_SCALE(a))) : s1;
        for (int jb = 0; jb < gpb; jb++) {
            const int b = g * gpb + jb;
            const uint8_t *blk = rec + (size_t)b * BB;
            const uint8_t *blk2 = PL ? rec2 + (size_t)b * BB : NULL;
            if (prefetch)
                for (size_t o = 0; o < BB; o += 64) {
                    PM_PREFETCH(blk + o);
                    if (PL) PM_PREFETCH(blk2 + o);
                }
            __m512i i1[4], i2[4]; /* exact integer sums of the block: digit 1, digit 2 */
            PM_UNROLL_T
            for (int t = 0; t < T; t++) {
                i1[t] = _mm512_setzero_si512();
                i2[t] = _mm512_setzero_si512();
            }
            if (NIB) {
                for (int mm = 0; mm < 4; mm++) {
                    __m512i lo, hi;
                    if (PL) { /* 16 hi + lo of columns 8 mm + j and 8 mm + 4 + j */
                        const __m512i m4 = _mm512_set1_epi8(0x0F);
                        const __m512i h4 = _mm512_set1_epi8((char)0xF0);
                        const __m512i Vh = _mm512_load_si512((const void *)(blk + 64 * mm));
                        const __m512i Vl = _mm512_load_si512((const void *)(blk2 + 64 * mm));
                        lo = _mm512_or_si512(_mm512_and_si512(_mm512_slli_epi16(Vh, 4), h4),
                                             _mm512_and_si512(Vl, m4));
                        hi = _mm512_or_si512(_mm512_and_si512(Vh, h4),
                                             _mm512_and_si512(_mm512_srli_epi16(Vl, 4), m4));
                    } else {
                        pm_nibble_pair(EST ? 4 : BITS, blk, mm, &lo, &hi);
                    }
                    PM_UNROLL_T
                    for (int t = 0; t < T; t++) {
                        const int8_t *p1 = x1[t] + 32 * b + 8 * mm;
                        int32_t wa, wb;
                        memcpy(&wa, p1, 4);
                        memcpy(&wb, p1 + 4, 4);
                        i1[t] = _mm512_dpbusd_epi32(i1[t], lo, _mm512_set1_epi32(wa));
                        i1[t] = _mm512_dpbusd_epi32(i1[t], hi, _mm512_set1_epi32(wb));
                        if (DIG == 2) {
                            const int8_t *p2 = x2[t] + 32 * b + 8 * mm;
                            memcpy(&wa, p2, 4);
                            memcpy(&wb, p2 + 4, 4);
                            i2[t] = _mm512_dpbusd_epi32(i2[t], lo, _mm512_set1_epi32(wa));
                            i2[t] = _mm512_dpbusd_epi32(i2[t], hi, _mm512_set1_epi32(wb));
                        }
                    }
                }
            } else {
                for (int k = 0; k < 8; k++) {
                    const __m512i V = _mm512_load_si512((const void *)(blk + 64 * k));
                    PM_UNROLL_T
                    for (int t = 0; t < T; t++) {
                        int32_t wa;
                        memcpy(&wa, x1[t] + 32 * b + 4 * k, 4);
                        i1[t] = _mm512_dpbusd_epi32(i1[t], V, _mm512_set1_epi32(wa));
                        if (DIG == 2) {
                            memcpy(&wa, x2[t] + 32 * b + 4 * k, 4);
                            i2[t] = _mm512_dpbusd_epi32(i2[t], V, _mm512_set1_epi32(wa));
                        }
                    }
                }
            }
            PM_UNROLL_T
            for (int t = 0; t < T; t++) {
                __m512i tot = i1[t];
                if (DIG == 2) tot = _mm512_add_epi32(_mm512_slli_epi32(tot, 7), i2[t]);
                if (OFF) tot = _mm512_sub_epi32(tot, _mm512_set1_epi32(cr[t][b]));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tot),
                                         _mm512_mul_ps(s, _mm512_set1_ps(dd[t][b])), acc[t]);
            }
        }
        if (MINS) {
            const __m512 mv =
                EST ? _mm512_mul_ps(s1, _mm512_set1_ps(-120.5f))
                : zp ? _mm512_mul_ps(s1, _mm512_set1_ps(zp)) /* implicit: exact, as stored */
                     : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + 16 * g)));
            PM_UNROLL_T
            for (int t = 0; t < T; t++) {
                float xs = bs[t][g * gpb];
                for (int jb = 1; jb < gpb; jb++) xs += bs[t][g * gpb + jb];
                acc[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs), acc[t]);
            }
        }
    }
    const int r0 = 16 * tile, nr = pm_tile_rows(w, tile);
    const __mmask16 mk = tail_mask(nr);
    PM_UNROLL_T
    for (int t = 0; t < T; t++)
        _mm512_mask_storeu_ps(y + (size_t)(i0 + t) * ystride + r0, mk, acc[t]);
}

/* The float16 scales and minimums of coded tile record rec (pm_tiled_steps, bit for bit: the
 * code times the row's step in float32, rounded to nearest even once). */
static inline TGTV void coded_steps_avx512(const pm_tiled *w, const uint8_t *rec, uint16_t *out) {
    const pm_coded c = pm_coded_parts(w, rec);
    __m512 d = _mm512_setzero_ps(), dm = d;
    for (size_t g = 0; g < c.ng; g++) {
        if (g % c.gps == 0) { /* the next run's steps */
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(c.st + 32 * (g / c.gps))));
            dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(c.st + 32 * (g / c.gps) + 16)));
        }
        const __m512 s = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c.sc + 16 * g)))),
            d);
        const __m512 m = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c.mc + 16 * g)))),
            dm);
        _mm256_storeu_si256((__m256i *)(out + 16 * g), _mm512_cvtps_ph(s, PM_RNE));
        _mm256_storeu_si256((__m256i *)(out + 16 * (c.ng + g)), _mm512_cvtps_ph(m, PM_RNE));
    }
}

static inline TGTV AI void tiled_range(const int BITS, const int DIG, const pm_tiled *w,
                                       const pm_tiled *w2, const pm_act *a, float *y,
                                       size_t ystride, int tb, int te) {
    uint16_t buf[2 * 16 * PM_CODED_MAX_GROUPS] __attribute__((aligned(64)));
    const int coded = BITS == 4 && w->coded;
    for (int tile = tb; tile < te; tile++) {
        const uint16_t *st = NULL;
        if (coded) {
            coded_steps_avx512(w, w->data + (size_t)tile * w->tile_bytes, buf);
            st = buf;
        }
        int i0 = 0;
        for (; i0 + 4 <= a->n; i0 += 4)
            tiled_tile(BITS, DIG, 4, w, w2, a, i0, y, ystride, tile, i0 == 0, st);
        switch (a->n - i0) {
        case 1: tiled_tile(BITS, DIG, 1, w, w2, a, i0, y, ystride, tile, i0 == 0, st); break;
        case 2: tiled_tile(BITS, DIG, 2, w, w2, a, i0, y, ystride, tile, i0 == 0, st); break;
        case 3: tiled_tile(BITS, DIG, 3, w, w2, a, i0, y, ystride, tile, i0 == 0, st); break;
        default: break;
        }
    }
}

static TGTV void matmul_planes_avx512(const pm_tiled *hi, const pm_tiled *lo, const pm_act *a,
                                      float *y, size_t ystride, int tb, int te) {
    PM_PLANES_DISPATCH(tiled_range, hi, lo, a, y, ystride, tb, te);
}

/* ---- float activations on tiled weights -------------------------------------------------- */

/* One tile of 16 rows for T tokens, float32 activations. INT4: a weight nibble becomes a float
 * through a 16-entry table (vpermps uses the low 4 bits of each lane, so a shift of the packed
 * lanes selects the nibble); INT5: the nibble pair completed with its high bits (pm_nibble_pair)
 * through a 32-entry table (vpermt2ps, 5 index bits); INT8 (q + 128): byte -> int32 -> float. Per group and token,
 * d = x_g . q_g accumulates in SPL independent partial sums (FMA latency; the same SPL for
 * every token count, so that results do not depend on how tokens are batched), then
 * acc += d * scale + sum(x_g) * min  (INT8: - 128 * sum(x_g) * scale). */
static inline TGTV AI void tiledf_tile(const int BITS, const int T, const int SPL,
                                       const pm_tiled *w, const pm_act *a, int i0, float *y,
                                       size_t ystride, int tile, int prefetch,
                                       const uint16_t *steps) {
    const int Q4 = BITS != 8; /* nibbles and minimums */
    const size_t BB = PM_BLOCK_BYTES(BITS);
    const uint16_t *sc, *mn;
    const uint8_t *rec = pm_tile_record(w, tile, &sc, &mn);
    if (steps) { /* a coded tile's steps, decoded */
        sc = steps;
        mn = steps + (size_t)w->ng * 16;
    }
    const int ng = w->ng, gpb = w->gpb, nb = w->nb;
    const float zp = -(float)w->zero_point; /* implicit minimums: -zero_point * scale */
    const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 lut16 = _mm512_add_ps(lut, _mm512_set1_ps(16.0f));
    const __m512i ff = _mm512_set1_epi32(0xFF);
    const float *x[8], *bs[8];
    for (int t = 0; t < T; t++) {
        x[t] = a->x + (size_t)(i0 + t) * a->cols;
        bs[t] = a->bsum + (size_t)(i0 + t) * nb;
    }
    if (prefetch)
        for (size_t o = w->scale_off; o < w->tile_bytes; o += 64) PM_PREFETCH(rec + o);
    __m512 acc[8];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    for (int g = 0; g < ng; g++) {
        __m512 d[8][4];
        for (int t = 0; t < T; t++)
            for (int q = 0; q < SPL; q++) d[t][q] = _mm512_setzero_ps();
        for (int jb = 0; jb < gpb; jb++) {
            const int b = g * gpb + jb;
            const uint8_t *blk = rec + (size_t)b * BB;
            if (prefetch)
                for (size_t o = 0; o < BB; o += 64) PM_PREFETCH(blk + o);
            if (BITS == 5) {
                for (int mm = 0; mm < 4; mm++) {
                    __m512i lo, hi;
                    pm_nibble_pair(5, blk, mm, &lo, &hi);
                    for (int j = 0; j < 4; j++) {
                        const __m512 wl = _mm512_permutex2var_ps(
                            lut, j ? _mm512_srli_epi32(lo, 8 * j) : lo, lut16);
                        const __m512 wh = _mm512_permutex2var_ps(
                            lut, j ? _mm512_srli_epi32(hi, 8 * j) : hi, lut16);
                        const int c = 32 * b + 8 * mm + j;
                        for (int t = 0; t < T; t++) {
                            const int q0 = (2 * j) % SPL, q1 = (2 * j + 1) % SPL;
                            d[t][q0] = _mm512_fmadd_ps(wl, _mm512_set1_ps(x[t][c]), d[t][q0]);
                            d[t][q1] = _mm512_fmadd_ps(wh, _mm512_set1_ps(x[t][c + 4]), d[t][q1]);
                        }
                    }
                }
            } else if (Q4) {
                for (int mm = 0; mm < 4; mm++) {
                    const __m512i V = _mm512_load_si512((const void *)(blk + 64 * mm));
                    for (int j = 0; j < 4; j++) {
                        const __m512 wl = _mm512_permutexvar_ps(j ? _mm512_srli_epi32(V, 8 * j) : V, lut);
                        const __m512 wh = _mm512_permutexvar_ps(_mm512_srli_epi32(V, 8 * j + 4), lut);
                        const int c = 32 * b + 8 * mm + j;
                        for (int t = 0; t < T; t++) {
                            const int q0 = (2 * j) % SPL, q1 = (2 * j + 1) % SPL;
                            d[t][q0] = _mm512_fmadd_ps(wl, _mm512_set1_ps(x[t][c]), d[t][q0]);
                            d[t][q1] = _mm512_fmadd_ps(wh, _mm512_set1_ps(x[t][c + 4]), d[t][q1]);
                        }
                    }
                }
            } else {
                for (int k = 0; k < 8; k++) {
                    const __m512i V = _mm512_load_si512((const void *)(blk + 64 * k));
                    for (int j = 0; j < 4; j++) {
                        const __m512i bj = j == 3 ? _mm512_srli_epi32(V, 24)
                                                  : _mm512_and_si512(j ? _mm512_srli_epi32(V, 8 * j) : V, ff);
                        const __m512 wv = _mm512_cvtepi32_ps(bj);
                        const int c = 32 * b + 4 * k + j, q = j % SPL;
                        for (int t = 0; t < T; t++)
                            d[t][q] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[t][c]), d[t][q]);
                    }
                }
            }
        }
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 16 * g)));
        const __m512 mv =
            !Q4  ? s
            : zp ? _mm512_mul_ps(s, _mm512_set1_ps(zp)) /* implicit minimums: exact */
                 : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + 16 * g)));
        for (int t = 0; t < T; t++) {
            __m512 dt = d[t][0];
            for (int q = 1; q < SPL; q++) dt = _mm512_add_ps(dt, d[t][q]);
            float xs = bs[t][g * gpb];
            for (int jb = 1; jb < gpb; jb++) xs += bs[t][g * gpb + jb];
            acc[t] = _mm512_fmadd_ps(dt, s, acc[t]);
            acc[t] = _mm512_fmadd_ps(mv, _mm512_set1_ps(Q4 ? xs : -128.0f * xs), acc[t]);
        }
    }
    const int r0 = 16 * tile, nr = pm_tile_rows(w, tile);
    const __mmask16 mk = tail_mask(nr);
    for (int t = 0; t < T; t++)
        _mm512_mask_storeu_ps(y + (size_t)(i0 + t) * ystride + r0, mk, acc[t]);
}

static inline TGTV AI void tiledf_range(const int BITS, const pm_tiled *w, const pm_act *a,
                                        float *y, size_t ystride, int tb, int te) {
    uint16_t buf[2 * 16 * PM_CODED_MAX_GROUPS] __attribute__((aligned(64)));
    const int coded = BITS == 4 && w->coded;
    for (int tile = tb; tile < te; tile++) {
        const uint16_t *st = NULL;
        if (coded) {
            coded_steps_avx512(w, w->data + (size_t)tile * w->tile_bytes, buf);
            st = buf;
        }
        int i0 = 0;
        /* the same operations for a (row, token) whatever the token count: SPL = 2 always */
        for (; i0 + 8 <= a->n; i0 += 8)
            tiledf_tile(BITS, 8, 2, w, a, i0, y, ystride, tile, i0 == 0, st);
        if (a->n - i0 >= 4) {
            tiledf_tile(BITS, 4, 2, w, a, i0, y, ystride, tile, i0 == 0, st);
            i0 += 4;
        }
        switch (a->n - i0) {
        case 1: tiledf_tile(BITS, 1, 2, w, a, i0, y, ystride, tile, i0 == 0, st); break;
        case 2: tiledf_tile(BITS, 2, 2, w, a, i0, y, ystride, tile, i0 == 0, st); break;
        case 3: tiledf_tile(BITS, 3, 2, w, a, i0, y, ystride, tile, i0 == 0, st); break;
        default: break;
        }
    }
}

static TGTV void block_sums_avx512(const float *x, int n, int cols, float *bsum) {
    const size_t nblk = (size_t)n * (size_t)cols / 32;
    for (size_t b = 0; b < nblk; b++)
        bsum[b] = _mm512_reduce_add_ps(
            _mm512_add_ps(_mm512_loadu_ps(x + 32 * b), _mm512_loadu_ps(x + 32 * b + 16)));
}

static TGTV void matmul_tiled_avx512(const pm_tiled *w, const pm_act *a, float *y,
                                     size_t ystride, int tb, int te) {
    if (a->digits == 0) {
        if (w->bits == 4)
            tiledf_range(4, w, a, y, ystride, tb, te);
        else if (w->bits == 5)
            tiledf_range(5, w, a, y, ystride, tb, te);
        else
            tiledf_range(8, w, a, y, ystride, tb, te);
        return;
    }
    if (w->bits == 4) {
        if (a->digits == 2)
            tiled_range(4, 2, w, NULL, a, y, ystride, tb, te);
        else
            tiled_range(4, 1, w, NULL, a, y, ystride, tb, te);
    } else if (w->bits == 5) {
        if (a->digits == 2)
            tiled_range(5, 2, w, NULL, a, y, ystride, tb, te);
        else
            tiled_range(5, 1, w, NULL, a, y, ystride, tb, te);
    } else {
        if (a->digits == 2)
            tiled_range(8, 2, w, NULL, a, y, ystride, tb, te);
        else
            tiled_range(8, 1, w, NULL, a, y, ystride, tb, te);
    }
}

const pm_ops pm_ops_avx512 = {
    "avx512",          rmsnorm_avx512,        attn_avx512,             glu_avx512,
    pm_matmul_f32_avx2, to_f16_avx512,        quant_act_avx512,        matmul_tiled_avx512,
    block_sums_avx512, pm_lora_down_avx2,    pm_lora_up_avx2,       matmul_planes_avx512,
};

#endif /* PM_HAVE_AVX512 */

typedef int pocket_model_x86_unit_not_empty;
