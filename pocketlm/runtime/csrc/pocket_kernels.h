/* pocketlm native kernels: quantized matrix products on raw pointers.
 *
 * Plain C (no Python), no mutable global state, never exits. Every function validates its scalar
 * arguments and returns POCKET_OK or a negative error code; array contents and sizes behind the
 * pointers are the caller's responsibility (the CPython wrapper checks them).
 *
 * Weight layouts (see pocketlm/quant.py):
 *   INT4: qweight uint8 [rows, cols/2]; columns in blocks of 32, block b of a row is bytes
 *         16b..16b+15, byte k holds column 32b+k (low nibble) and 32b+16+k (high nibble);
 *         scales, mins float16 [rows, cols/group_size]; w = q * scale + min, q in 0..15.
 *   INT8: qweight int8 [rows, cols]; scales float16 [rows, cols/group_size]; w = q * scale.
 *   group_size is 32, 64 or 128; cols is a multiple of 32 and of group_size.
 *
 * Products: y[i, r] = sum_c x[i, c] * W[r, c]; x float32 [n, cols], y float32 [n, rows] (row
 * stride `rows`). The per-range kernels compute the rows [row_begin, row_end) only, so callers
 * may split rows between threads; results of a row never depend on how rows are split.
 *
 * Int8-activation products ("q8" path): activations are first quantized per block of 32 columns
 * (symmetric, absmax / 127) to qx int8 [n, cols], dx float [n, cols/32] (the block scales) and
 * sx float [n, cols/32] (dx * sum of the block's qx, used by the INT4 minimum term); then
 *   y = sum_b dot(q_w, q_x)_b * scale_w * dx_b + sum_g min_w,g * sum_{b in g} sx_b,
 * which is exactly W . x~ with x~ = dx * qx (up to float32 rounding of the sums).
 */
#ifndef POCKET_KERNELS_H
#define POCKET_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
    POCKET_OK = 0,
    POCKET_EINVAL = -1,      /* an argument is out of range or inconsistent */
    POCKET_ENOMEM = -2,      /* a workspace allocation failed */
    POCKET_EUNSUPPORTED = -3, /* the requested kernel level is not available on this CPU/build */
    POCKET_ECORRUPT = -4      /* weights that contradict themselves (coded scales that do not
                                 give the stored steps): a damaged file */
};

/* Kernel levels, lowest to highest within one architecture (x86-64: scalar < avx2 < avx512;
 * ARM64: scalar < neon). */
enum {
    POCKET_LEVEL_AUTO = -1,  /* the highest level this CPU supports */
    POCKET_LEVEL_SCALAR = 0, /* portable C (auto-vectorized by the compiler where it can) */
    POCKET_LEVEL_AVX2 = 1,   /* x86-64 AVX2 + FMA + F16C */
    POCKET_LEVEL_AVX512 = 2, /* x86-64 AVX-512 F/BW/DQ/VL + VNNI */
    POCKET_LEVEL_NEON = 3,   /* ARM64 NEON + dot product (ARMv8.2-A +dotprod, HWCAP_ASIMDDP):
                                the engine's tiled int8 products; the per-call kernels of the
                                table are the scalar ones */
    POCKET_LEVEL_COUNT = 4
};

/* CPU feature bits reported by pocket_cpu_features(). */
enum {
    POCKET_CPU_X86_64 = 1u << 0,
    POCKET_CPU_AARCH64 = 1u << 1,
    POCKET_CPU_AVX2 = 1u << 2,
    POCKET_CPU_FMA = 1u << 3,
    POCKET_CPU_F16C = 1u << 4,
    POCKET_CPU_AVX512F = 1u << 5,
    POCKET_CPU_AVX512BW = 1u << 6,
    POCKET_CPU_AVX512DQ = 1u << 7,
    POCKET_CPU_AVX512VL = 1u << 8,
    POCKET_CPU_AVX512VNNI = 1u << 9,
    POCKET_CPU_AVXVNNI = 1u << 10,
    POCKET_CPU_AMX_INT8 = 1u << 11,
    POCKET_CPU_AMX_BF16 = 1u << 12,
    POCKET_CPU_NEON = 1u << 13,
    POCKET_CPU_ASIMD_DOT = 1u << 14
};

#define POCKET_QBLOCK 32 /* activation quantization block and INT4 packing block */

unsigned pocket_cpu_features(void);
/* 1 if `level` is compiled in and supported by this CPU (and its OS), else 0. */
int pocket_level_supported(int level);
int pocket_best_level(void);
const char *pocket_level_name(int level); /* "scalar", "avx2", "avx512", "neon" or NULL */
/* 1 if the build contains code for `level` (whatever this CPU supports). */
int pocket_level_compiled(int level);

/* ---- per-range kernels ------------------------------------------------------------------ */

typedef int (*pocket_mm_q4_f32_fn)(const float *x, int n, int cols, const uint8_t *qw,
                                   const uint16_t *scales_f16, const uint16_t *mins_f16,
                                   int rows, int group_size, float *y, int row_begin,
                                   int row_end);
typedef int (*pocket_mm_q8_f32_fn)(const float *x, int n, int cols, const int8_t *qw,
                                   const uint16_t *scales_f16, int rows, int group_size,
                                   float *y, int row_begin, int row_end);
typedef int (*pocket_quant_act_fn)(const float *x, int n, int cols, int8_t *qx, float *dx,
                                   float *sx);
typedef int (*pocket_mm_q4_q8_fn)(const int8_t *qx, const float *dx, const float *sx, int n,
                                  int cols, const uint8_t *qw, const uint16_t *scales_f16,
                                  const uint16_t *mins_f16, int rows, int group_size, float *y,
                                  int row_begin, int row_end);
typedef int (*pocket_mm_q8_q8_fn)(const int8_t *qx, const float *dx, int n, int cols,
                                  const int8_t *qw, const uint16_t *scales_f16, int rows,
                                  int group_size, float *y, int row_begin, int row_end);

typedef struct pocket_kernel_table {
    int level;
    const char *name;
    pocket_mm_q4_f32_fn matmul_q4_f32;
    pocket_mm_q8_f32_fn matmul_q8_f32;
    pocket_quant_act_fn quantize_act_q8;
    pocket_mm_q4_q8_fn matmul_q4_q8;
    pocket_mm_q8_q8_fn matmul_q8_q8;
} pocket_kernel_table;

/* The kernels of one level (POCKET_LEVEL_AUTO: the best one), or NULL if unsupported. */
const pocket_kernel_table *pocket_kernels(int level);

/* ---- thread pool ------------------------------------------------------------------------ */

/* A fixed set of worker threads. pocket_pool_run(pool, ntasks, fn, ctx) calls fn(ctx, t, ntasks)
 * once for each t in [0, ntasks) and returns when all have finished. The caller takes part;
 * tasks are claimed by whichever thread is free, so a worker that the OS is slow to schedule
 * delays nothing (callers give each task fixed contents, so results do not depend on which
 * thread runs it). Concurrent pocket_pool_run calls on one pool are serialized. In a forked
 * child, or where threads are unavailable, tasks run one after another on the caller. */
typedef struct pocket_pool pocket_pool;
typedef void (*pocket_task_fn)(void *ctx, int task, int ntasks);

pocket_pool *pocket_pool_create(int nthreads); /* nthreads counts the caller; NULL on failure */
void pocket_pool_destroy(pocket_pool *pool);
int pocket_pool_size(const pocket_pool *pool);
void pocket_pool_run(pocket_pool *pool, int ntasks, pocket_task_fn fn, void *ctx);

/* ---- whole products, split over threads --------------------------------------------------
 * kernels: a table from pocket_kernels() (looked up once: no CPU check per call). pool may be
 * NULL (single-threaded); nthreads caps the number of tasks (and the pool size). act_q8 = 0:
 * float activations; 1: int8 activations (x is quantized internally). */
int pocket_linear_q4_k(const pocket_kernel_table *kernels, pocket_pool *pool, int nthreads,
                       int act_q8, const float *x, int n, int cols, const uint8_t *qw,
                       const uint16_t *scales_f16, const uint16_t *mins_f16, int rows,
                       int group_size, float *y);
int pocket_linear_q8_k(const pocket_kernel_table *kernels, pocket_pool *pool, int nthreads,
                       int act_q8, const float *x, int n, int cols, const int8_t *qw,
                       const uint16_t *scales_f16, int rows, int group_size, float *y);

#ifdef __cplusplus
}
#endif

#endif /* POCKET_KERNELS_H */
