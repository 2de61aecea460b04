/* x86-64 SIMD levels of the kernels: pocket_simd.inc compiled twice, for AVX2 + FMA + F16C and
 * for AVX-512 (F/BW/DQ/VL + VNNI). Each function carries its own target attribute, so this file
 * is compiled without -mavx* flags and the library runs on any x86-64; pocket_kernels.c only
 * hands out a level after checking the CPU at run time. */
#include "pocket_internal.h"

#if POCKET_X86_SIMD

#include <immintrin.h>

#include "pocket_simd.h"

/* ---- AVX2 + FMA + F16C -------------------------------------------------------------------- */
#define TGT __attribute__((target("avx2,fma,f16c")))
#define SFX(name) name##_avx2
#define LEVEL POCKET_LEVEL_AVX2
#define LEVEL_NAME "avx2"
#define VF __m256
#define VLEN 8
#define vf_zero() _mm256_setzero_ps()
#define vf_loadu(p) _mm256_loadu_ps(p)
#define vf_storeu(p, v) _mm256_storeu_ps((p), (v))
#define vf_set1(s) _mm256_set1_ps(s)
#define vf_add(a, b) _mm256_add_ps((a), (b))
#define vf_mul(a, b) _mm256_mul_ps((a), (b))
#define vf_fma(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define vf_hsum(v) pocket_hsum8(v)
/* bytes 0..7 -> columns 0..7 (low nibbles) and 16..23 (high); bytes 8..15 -> 8..15, 24..31 */
#define UNPACK_Q4F(p, q)                                                                        \
    do {                                                                                        \
        const __m256i a_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p)));         \
        const __m256i b_ = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)((p) + 8)));   \
        const __m256i f_ = _mm256_set1_epi32(15);                                               \
        (q)[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a_, f_));                                  \
        (q)[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b_, f_));                                  \
        (q)[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a_, 4));                                  \
        (q)[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b_, 4));                                  \
    } while (0)
#define UNPACK_Q8F(p, q)                                                                        \
    do {                                                                                        \
        for (int u_ = 0; u_ < 4; u_++)                                                          \
            (q)[u_] = _mm256_cvtepi32_ps(                                                       \
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((p) + 8 * u_))));        \
    } while (0)
#define DOT_U8S8(w, x) _mm256_madd_epi16(_mm256_maddubs_epi16((w), (x)), _mm256_set1_epi16(1))
#define MR_N1 1
#define MR_F 3
#define NT_F 4
#define MR_Q 2
#define NT_Q 4
#define MR_Q1 4

#include "pocket_simd.inc"

#undef TGT
#undef SFX
#undef LEVEL
#undef LEVEL_NAME
#undef VF
#undef VLEN
#undef vf_zero
#undef vf_loadu
#undef vf_storeu
#undef vf_set1
#undef vf_add
#undef vf_mul
#undef vf_fma
#undef vf_hsum
#undef UNPACK_Q4F
#undef UNPACK_Q8F
#undef DOT_U8S8
#undef MR_N1
#undef MR_F
#undef NT_F
#undef MR_Q
#undef NT_Q
#undef MR_Q1

/* ---- AVX-512 F/BW/DQ/VL + VNNI ------------------------------------------------------------ */
#define TGT __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#define SFX(name) name##_avx512
#define LEVEL POCKET_LEVEL_AVX512
#define LEVEL_NAME "avx512"
#define VF __m512
#define VLEN 16
#define vf_zero() _mm512_setzero_ps()
#define vf_loadu(p) _mm512_loadu_ps(p)
#define vf_storeu(p, v) _mm512_storeu_ps((p), (v))
#define vf_set1(s) _mm512_set1_ps(s)
#define vf_add(a, b) _mm512_add_ps((a), (b))
#define vf_mul(a, b) _mm512_mul_ps((a), (b))
#define vf_fma(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define vf_hsum(v) _mm512_reduce_add_ps(v)
/* byte k -> column k (low nibble) and 16 + k (high nibble) */
#define UNPACK_Q4F(p, q)                                                                        \
    do {                                                                                        \
        const __m512i a_ = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p)));         \
        (q)[0] = _mm512_cvtepi32_ps(_mm512_and_si512(a_, _mm512_set1_epi32(15)));               \
        (q)[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(a_, 4));                                  \
    } while (0)
#define UNPACK_Q8F(p, q)                                                                        \
    do {                                                                                        \
        (q)[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p)))); \
        (q)[1] = _mm512_cvtepi32_ps(                                                            \
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((p) + 16))));                \
    } while (0)
#define DOT_U8S8(w, x) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (w), (x))
#define MR_N1 4
#define MR_F 4
#define NT_F 4
#define MR_Q 4
#define NT_Q 4
#define MR_Q1 4
#define Q8_ZMM 1

#include "pocket_simd.inc"

#endif /* POCKET_X86_SIMD */

/* ISO C forbids an empty translation unit. */
typedef int pocket_x86_unit_not_empty;
