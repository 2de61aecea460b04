/* AVX-512 operations of the inference engine (see pocket_model_ops.h). Every function carries
 * its own target attribute: this file is compiled without -mavx* flags, and the engine only
 * selects these after the kernel level check (AVX-512 F/BW/DQ/VL, F16C, FMA) at run time.
 *
 * Differences to the portable versions are float rounding only: sums in 16 lanes, exp from a
 * degree-6 polynomial (within ~2 ulp of expf), silu / GELU written with exp:
 *   silu(x) = x / (1 + e^-x),  gelu_tanh(x) = x / (1 + e^(-2u)), u = sqrt(2/pi)(x + 0.044715x^3)
 * (the same functions as x * (0.5 + 0.5 tanh(x/2)) and 0.5x(1 + tanh(u))).
 */
#include <math.h>

#include "pocket_internal.h"
#include "pocket_model_ops.h"

#if PM_HAVE_AVX512

#include <immintrin.h>

#define TGT __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")))
#define AI __attribute__((always_inline))

static inline TGT AI __mmask16 tail_mask(int left) {
    return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
}

/* e^x, x <= 0 or moderate; inputs below -104 give 0 (or the smallest subnormal). */
static inline TGT AI __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.5f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 r2 = _mm512_mul_ps(r, r);
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

static inline TGT AI __m512 load_kv(const void *base, int f16, size_t idx, __mmask16 mk) {
    if (f16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, (const uint16_t *)base + idx));
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

/* Attention for head_dim == 16 * NV (NV constant: registers) or any head_dim (NV == 0). */
static inline TGT AI void attn_body(const pm_attn_args *A, const int NV) {
    const int G = A->G, hd = A->hd, f16 = A->f16;
    const int nv = NV ? NV : (hd + 15) / 16;
    const __m512 vscale = _mm512_set1_ps(A->scale);
    for (int c = A->a; c < A->b; c += PM_SPAN) {
        const int len = A->b - c < PM_SPAN ? A->b - c : PM_SPAN;
        /* scores */
        for (int j = 0; j < len; j++) {
            const size_t kb = (size_t)(c + j) * hd;
            __m512 kv[16];
            for (int t = 0; t < nv; t++)
                kv[t] = load_kv(A->K, f16, kb + 16 * t, NV ? (__mmask16)0xFFFF : tail_mask(hd - 16 * t));
            for (int g = 0; g < G; g++) {
                const float *qg = A->q + (size_t)g * hd;
                __m512 acc = _mm512_setzero_ps();
                for (int t = 0; t < nv; t++) {
                    const __mmask16 mk = NV ? (__mmask16)0xFFFF : tail_mask(hd - 16 * t);
                    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, qg + 16 * t), kv[t], acc);
                }
                A->s[g * PM_SPAN + j] = _mm512_reduce_add_ps(acc) * A->scale;
            }
        }
        (void)vscale;
        /* softmax pieces */
        for (int g = 0; g < G; g++) {
            float *sg = A->s + g * PM_SPAN;
            __m512 mx = _mm512_set1_ps(-INFINITY);
            for (int j = 0; j < len; j += 16)
                mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY),
                                                            tail_mask(len - j), sg + j));
            const float cm = _mm512_reduce_max_ps(mx);
            const float old = A->m[g], nm = old > cm ? old : cm;
            const float corr = old == -INFINITY ? 0.0f : expf(old - nm);
            const __m512 vnm = _mm512_set1_ps(nm);
            __m512 sum = _mm512_setzero_ps();
            for (int j = 0; j < len; j += 16) {
                const __mmask16 mk = tail_mask(len - j);
                const __m512 p = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sg + j), vnm));
                _mm512_mask_storeu_ps(sg + j, mk, p);
                sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mk, p));
            }
            A->l[g] = A->l[g] * corr + _mm512_reduce_add_ps(sum);
            A->m[g] = nm;
            /* weighted values, accumulators in registers */
            float *ag = A->acc + (size_t)g * hd;
            __m512 av[16];
            const __m512 vc = _mm512_set1_ps(corr);
            for (int t = 0; t < nv; t++) {
                const __mmask16 mk = NV ? (__mmask16)0xFFFF : tail_mask(hd - 16 * t);
                av[t] = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, ag + 16 * t), vc);
            }
            for (int j = 0; j < len; j++) {
                const __m512 p = _mm512_set1_ps(sg[j]);
                const size_t vb = (size_t)(c + j) * hd;
                for (int t = 0; t < nv; t++)
                    av[t] = _mm512_fmadd_ps(
                        p, load_kv(A->V, f16, vb + 16 * t, NV ? (__mmask16)0xFFFF : tail_mask(hd - 16 * t)),
                        av[t]);
            }
            for (int t = 0; t < nv; t++) {
                const __mmask16 mk = NV ? (__mmask16)0xFFFF : tail_mask(hd - 16 * t);
                _mm512_mask_storeu_ps(ag + 16 * t, mk, av[t]);
            }
        }
    }
}

static TGT void attn_avx512(const pm_attn_args *A) {
    switch (A->hd) {
    case 64: attn_body(A, 4); break;
    case 128: attn_body(A, 8); break;
    case 256: attn_body(A, 16); break;
    default:
        if (A->hd <= 256)
            attn_body(A, 0);
        else
            pm_ops_portable.attn(A);
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
        const __m512 a = _mm512_div_ps(x, _mm512_add_ps(one, exp512(t)));
        _mm512_mask_storeu_ps(gate + k, mk, _mm512_mul_ps(a, _mm512_maskz_loadu_ps(mk, up + k)));
    }
}

static TGT void matmul_f32_avx512(const float *x, int n, int cols, const float *w, int rows,
                                  float *y, int rb, int re) {
    for (int r = rb; r < re; r++) {
        const float *wr = w + (size_t)r * cols;
        for (int i = 0; i < n; i++) {
            const float *xi = x + (size_t)i * cols;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            int c = 0;
            for (; c + 32 <= cols; c += 32) {
                a0 = _mm512_fmadd_ps(_mm512_loadu_ps(xi + c), _mm512_loadu_ps(wr + c), a0);
                a1 = _mm512_fmadd_ps(_mm512_loadu_ps(xi + c + 16), _mm512_loadu_ps(wr + c + 16), a1);
            }
            for (; c < cols; c += 16) {
                const __mmask16 mk = tail_mask(cols - c);
                a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk, xi + c),
                                     _mm512_maskz_loadu_ps(mk, wr + c), a0);
            }
            y[(size_t)i * rows + r] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
        }
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

const pm_ops pm_ops_avx512 = {
    "avx512", rmsnorm_avx512, attn_avx512, glu_avx512, matmul_f32_avx512, to_f16_avx512,
};

#endif /* PM_HAVE_AVX512 */

typedef int pocket_model_x86_unit_not_empty;
