/* Internal helpers shared by the kernel sources (not part of the public API). */
#ifndef POCKET_INTERNAL_H
#define POCKET_INTERNAL_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pocket_kernels.h"

/* The SIMD kernels need GCC/Clang target attributes and x86-64 intrinsics. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(POCKET_NO_SIMD)
#define POCKET_X86_SIMD 1
#else
#define POCKET_X86_SIMD 0
#endif

/* The ARM64 neon level (dot-product kernels, see pocket_model_neon.c): GCC >= 8 compiles the
 * SDOT code with a target attribute; Clang only when the target already has the extension
 * (-march=...+dotprod), as its arm_neon.h before version 16 declares the dot-product intrinsics
 * only then. */
#if defined(__aarch64__) && !defined(POCKET_NO_SIMD) &&                                          \
    ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 8) ||                             \
     (defined(__clang__) && defined(__ARM_FEATURE_DOTPROD)))
#define POCKET_ARM_NEON 1
#else
#define POCKET_ARM_NEON 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define POCKET_INLINE static inline __attribute__((always_inline))
#define POCKET_LIKELY(x) __builtin_expect(!!(x), 1)
#else
#define POCKET_INLINE static inline
#define POCKET_LIKELY(x) (x)
#endif

/* Columns of a float32 weight tile (dequantized rows) in the batched float kernels. */
#define POCKET_KC 512

/* Activation blocks whose absolute maximum is below this quantize to zero (avoids 1/tiny). */
#define POCKET_ACT_TINY 1e-30f

/* float16 bits -> float32 (exact, subnormals, infinities and NaNs included). */
static inline float pocket_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    float f;
    if (exp == 0) {
        f = (float)man * (1.0f / 16777216.0f); /* man * 2^-24, exact */
        return sign ? -f : f;
    }
    if (exp == 31)
        bits = sign | 0x7f800000u | (man << 13);
    else
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Argument checks shared by all kernels. */
static inline int pocket_check_shape(int n, int cols, int rows, int group_size, int row_begin,
                                     int row_end) {
    if (n < 0 || cols <= 0 || rows <= 0) return POCKET_EINVAL;
    if (group_size != 32 && group_size != 64 && group_size != 128) return POCKET_EINVAL;
    if (cols % POCKET_QBLOCK != 0 || cols % group_size != 0) return POCKET_EINVAL;
    if (row_begin < 0 || row_end < row_begin || row_end > rows) return POCKET_EINVAL;
    return POCKET_OK;
}

static inline size_t pocket_round_up(size_t v, size_t m) { return (v + m - 1) / m * m; }

/* Round to nearest, ties to even, for |v| <= 2^22 (the activation digits: |v| <= 127): no libm
 * call. Both operations round in float32 (FLT_EVAL_METHOD 0 on x86-64 and ARM64). */
static inline float pocket_round_even_small(float v) {
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    return (v + magic) - magic;
}

/* Part `task` of `ntasks` of [0, total), cut at multiples of `unit`: [*b, *e). The parts depend
 * on total, unit and ntasks only (which thread runs one does not matter). */
static inline void pocket_split_range(long long total, int unit, int task, int ntasks, int *b,
                                      int *e) {
    const long long units = (total + unit - 1) / unit;
    const long long b0 = units * task / ntasks * unit, e0 = units * (task + 1) / ntasks * unit;
    *b = (int)(b0 < total ? b0 : total);
    *e = (int)(e0 < total ? e0 : total);
}

#if POCKET_X86_SIMD
extern const pocket_kernel_table pocket_table_avx2;
extern const pocket_kernel_table pocket_table_avx512;
#endif

#endif /* POCKET_INTERNAL_H */
