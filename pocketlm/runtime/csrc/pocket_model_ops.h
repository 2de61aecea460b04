/* Internal: the elementwise / attention operations of the engine (pocket_model.c), with a
 * portable implementation (pocket_model.c) and an AVX-512 one (pocket_model_x86.c), chosen
 * once per model from the kernel level. Not part of the public API. */
#ifndef POCKET_MODEL_OPS_H
#define POCKET_MODEL_OPS_H

#include <stddef.h>
#include <stdint.h>

/* Keys per attention chunk: the online softmax rescales once per chunk, and decode splits the
 * keys of each KV head into units of this many positions (a fixed size, so that results do not
 * depend on the number of threads). */
#define PM_SPAN 128

/* Online-softmax attention of G query heads (q: G rows of hd floats, consecutive) over the
 * keys [a, b) of one KV head (K, V: that head's rows, row stride hd elements, float32 or
 * float16 bits). m, l, acc (G, G, G * hd) hold the running maximum, sum of exponentials and
 * weighted sum of values; the caller initializes them to -inf, 0, 0 and divides acc by l at
 * the end. s: scratch of G * PM_SPAN floats. Scores are (q . k) * scale, as in the reference. */
typedef struct pm_attn_args {
    const float *q;
    int G, hd;
    float scale;
    const void *K, *V;
    int f16;
    int a, b;
    float *s;
    float *m, *l, *acc;
} pm_attn_args;

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
} pm_ops;

extern const pm_ops pm_ops_portable;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(POCKET_NO_SIMD)
extern const pm_ops pm_ops_avx512;
#define PM_HAVE_AVX512 1
#else
#define PM_HAVE_AVX512 0
#endif

#endif /* POCKET_MODEL_OPS_H */
