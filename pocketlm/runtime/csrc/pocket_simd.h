/* Internal: the x86-64 vector helpers shared by the kernels' SIMD levels (pocket_simd.inc,
 * compiled by pocket_x86.c) and the engine's operations (pocket_model_avx2.c,
 * pocket_model_x86.c, pocket_model_amx.c), and the prefetch distances of their weight streams.
 * Include only where POCKET_X86_SIMD holds (pocket_internal.h). Not part of the public API.
 *
 * Each helper carries the target attribute of the instructions it uses: GCC and Clang inline a
 * function into a caller only when the caller's target includes the function's, so these must
 * stay subsets of every caller's ("avx2,fma,f16c" and the AVX-512 sets), and then the AVX2 and
 * the AVX-512 code inline one and the same text. */
#ifndef POCKET_SIMD_H
#define POCKET_SIMD_H

#include <immintrin.h>

/* ---- prefetch distances ----------------------------------------------------------------------
 * Bytes ahead of the weight stream that decode prefetches. Two on purpose, each tuned with its
 * own kernels and cache level (a prefetch changes no result, only the speed):
 *   POCKET_PREFETCH_DIST  the kernels of the kernel table (n == 1, pocket_simd.inc), into L1
 *                         (_MM_HINT_T0), a few rows of the original layout ahead;
 *   PM_PREFETCH_DIST      the engine's products on tiled weights (pocket_model_x86.c,
 *                         pocket_model_avx2.c), into L2 (PM_PREFETCH_HINT). Measured on Zen 4
 *                         (2 vCPUs): one thread streams ~20 GB/s with an L2 prefetch 12-16 KB
 *                         ahead, ~10 GB/s with an L1 prefetch (T0, whose few miss buffers fill
 *                         up), ~8-9 GB/s with none; with two threads decoding, 16 KB gave 5-15 %
 *                         more tokens/s than 8-12 KB or 24 KB, and NTA 25 % fewer than T1. */
#ifndef POCKET_PREFETCH_DIST
#define POCKET_PREFETCH_DIST 12288
#endif
#ifndef PM_PREFETCH_DIST
#define PM_PREFETCH_DIST 16384
#endif
#ifndef PM_PREFETCH_HINT
#define PM_PREFETCH_HINT _MM_HINT_T1
#endif
/* Prefetch the tiled weights PM_PREFETCH_DIST bytes after p. */
#define PM_PREFETCH(p) _mm_prefetch((const char *)(p) + PM_PREFETCH_DIST, PM_PREFETCH_HINT)

/* ---- horizontal sums and maxima ------------------------------------------------------------ */

/* Sum of the 8 lanes, ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)). */
static inline __attribute__((always_inline, target("avx"))) float pocket_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Maximum of the 8 lanes, paired as pocket_hsum8 pairs them (vmaxps: the second operand where
 * one of the two is NaN). */
static inline __attribute__((always_inline, target("avx"))) float pocket_hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* ---- the exponential -------------------------------------------------------------------------
 * e^x = 2^n e^r with n = round(x log2(e)) and r = x - n ln(2) (ln(2) in two parts, the first
 * with few bits so that n * ln2_hi is exact), e^r ~ 1 + r + r^2 p(r), p of degree 5 (Cephes'
 * expf; within ~2 ulp of expf). One text for both widths: VT the vector type, PS the intrinsics'
 * prefix (_mm256, _mm512), ROUND(v) rounds to nearest even. Sets n and y = e^r; the caller
 * clamps x before and scales y by 2^n after. */
#define POCKET_EXP_REDUCED(VT, PS, ROUND, x, n, y)                                              \
    do {                                                                                        \
        (n) = ROUND(PS##_mul_ps((x), PS##_set1_ps(1.44269504088896341f)));                      \
        VT r_ = PS##_fnmadd_ps((n), PS##_set1_ps(0.693359375f), (x));                           \
        r_ = PS##_fnmadd_ps((n), PS##_set1_ps(-2.12194440e-4f), r_);                            \
        VT p_ = PS##_set1_ps(1.9875691500e-4f);                                                 \
        p_ = PS##_fmadd_ps(p_, r_, PS##_set1_ps(1.3981999507e-3f));                             \
        p_ = PS##_fmadd_ps(p_, r_, PS##_set1_ps(8.3334519073e-3f));                             \
        p_ = PS##_fmadd_ps(p_, r_, PS##_set1_ps(4.1665795894e-2f));                             \
        p_ = PS##_fmadd_ps(p_, r_, PS##_set1_ps(1.6666665459e-1f));                             \
        p_ = PS##_fmadd_ps(p_, r_, PS##_set1_ps(5.0000001201e-1f));                             \
        (y) = PS##_add_ps(PS##_fmadd_ps(p_, PS##_mul_ps(r_, r_), r_), PS##_set1_ps(1.0f));      \
    } while (0)

#define POCKET_ROUND256(v) _mm256_round_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define POCKET_ROUND512(v) _mm512_roundscale_ps((v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* e^x, 8 lanes, for x <= 88; inputs below -87 give 0 (2^n built in the exponent bits). */
static inline __attribute__((always_inline, target("avx2,fma"))) __m256 pocket_exp256(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
    __m256 n, y;
    POCKET_EXP_REDUCED(__m256, _mm256, POCKET_ROUND256, x, n, y);
    const __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

/* e^x, 16 lanes, x <= 0 or moderate; inputs below -104 give 0 (or the smallest subnormal):
 * 2^n by vscalefps. */
static inline __attribute__((always_inline, target("avx512f"))) __m512 pocket_exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.5f));
    __m512 n, y;
    POCKET_EXP_REDUCED(__m512, _mm512, POCKET_ROUND512, x, n, y);
    return _mm512_scalef_ps(y, n);
}

#endif /* POCKET_SIMD_H */
