/* pocketlm native inference engine: the decoder forward pass (see pocket_model.h).
 *
 * Work of one block of tokens, per layer. Regions marked || run on the pool, split into
 * `nthreads` fixed parts (rows of the weights; attention units); steps marked | are per-token
 * and run split over the threads by tokens for blocks of PM_PAR_ROWS tokens or more, on the
 * calling thread otherwise (decode: a few microseconds per layer).
 *
 *   |  h = rmsnorm(x), quantized (q8) or summed per block (f32) for the tiled kernels
 *   || q|k|v products: one region over the concatenated rows of W_q, W_k, W_v
 *   |  biases, q/k norms, RoPE, k and v into the cache
 *   || attention: decode (one token) splits the keys of every KV head into aligned units of
 *      PM_SPAN positions (partial softmax sums, merged in a fixed order afterwards); a longer
 *      block splits (token, KV head) pairs
 *   |  (merge of the decode partials) the attention output prepared for W_o
 *   || W_o
 *   |  post-attention norm, residual, MLP norm, prepared for gate|up
 *   || gate|up products over the same rows, with act(gate) * up fused in
 *   |  prepared for W_down
 *   || W_down
 *   |  post-MLP norm, residual
 *
 * i.e. four fork-join points per layer in decode (plus one for the output head), eight with
 * the per-token steps of a long block. Longer inputs run in blocks of PM_BLOCK tokens (batched
 * products: the weights are streamed once per block).
 *
 * Quantized weights: at creation, the weights of the products that run on the tiled kernels
 * (every product on AVX-512; the int8-activation ones elsewhere) are repacked into 16-row
 * tiles (pm_tiled, pocket_model_ops.h), the same size as the original; the others use the
 * kernels of pocket_kernels.h on the caller's layout.
 */
#if !defined(_WIN32) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* posix_memalign */
#endif

#include <math.h>
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include "pocket_internal.h"
#include "pocket_model.h"
#include "pocket_model_ops.h"

#define PM_BLOCK 128     /* tokens per prefill block */
#define PM_ROW_UNIT 16   /* row splits between threads are multiples of this */
#define PM_MAX_THREADS 1024
#define PM_MAX_DIM (1 << 20)

struct pocket_model {
    pocket_model_config c;
    pocket_layer_weights *layers;
    pocket_weight embed, head;
    const float *final_norm;
    const pocket_kernel_table *kt;
    const pm_ops *ops;
    int act_q8;       /* POCKET_Q8_* classes with int8 activations */
    int one_digit;    /* POCKET_Q8_* classes with one int8 digit per activation (else two) */
    int tiled_f32;    /* float-activation products on the tiled weights too (AVX-512) */
    /* repacked weights of the int8-activation products: [layer * 7 + k] (k: q, k, v, o,
     * gate, up, down), then the head; data == NULL where not used */
    pm_tiled *tiled;
    int q_dim, kv_dim, group, half;
    int max_in; /* the widest input of a product: max(d_model, q_dim, d_ff) */
    /* RoPE: inv_freq per base (0: rope_theta, 1: rope_theta_local); cos/sin [pos][half] */
    double *inv_freq[2];
    float *rcos[2], *rsin[2];
    int rope_cap;
    int n_bases;
    /* scratch, sized for PM_BLOCK tokens */
    float *x, *h, *o, *q, *k, *v, *att, *gate, *up;
    /* prepared activations of the products (pm_act), two sets: a product's input and the
     * next product's, prepared while the first is still being read */
    int8_t *a1[2], *a2[2];
    float *add[2], *absum[2];
    int32_t *acorr[2];
    /* decode attention partials [unit][G][hd + 2]; per-task attention scratch */
    float *part;
    size_t part_units;
    float *tscr;
    int tscr_tasks;
    size_t tscr_stride;
};

struct pocket_kv {
    const pocket_model *model;
    int capacity, f16;
    size_t head_stride;  /* elements between KV heads: capacity (rounded up to 16) * head_dim */
    size_t layer_stride; /* elements between layers: n_kv_heads * head_stride */
    void *k, *v;
};

/* =========================================================================================
 * Portable operations
 * ========================================================================================= */

static float dot_f32(const float *a, const float *b, int len) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int c = 0;
    for (; c + 8 <= len; c += 8)
        for (int l = 0; l < 8; l++) acc[l] += a[c + l] * b[c + l];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; c < len; c++) s += a[c] * b[c];
    return s;
}

static void rmsnorm_portable(const float *x, const float *w, int n, int d, float eps,
                             float *out) {
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * d;
        float *oi = out + (size_t)i * d;
        float ms = dot_f32(xi, xi, d) / (float)d;
        float r = sqrtf(ms + eps);
        for (int c = 0; c < d; c++) oi[c] = xi[c] / r * w[c];
    }
}

static inline float kv_load(const void *base, int f16, size_t idx) {
    return f16 ? pocket_f16_to_f32(((const uint16_t *)base)[idx]) : ((const float *)base)[idx];
}

static void attn_portable(const pm_attn_args *A) {
    const int G = A->G, hd = A->hd;
    for (int c = A->a; c < A->b;) {
        const int cend0 = (c / PM_SPAN + 1) * PM_SPAN, cend = cend0 < A->b ? cend0 : A->b;
        const int len = cend - c;
        for (int j = 0; j < len; j++)
            for (int g = 0; g < G; g++) {
                const float *qg = A->q + (size_t)g * hd;
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                int e = 0;
                for (; e + 8 <= hd; e += 8)
                    for (int l = 0; l < 8; l++)
                        acc[l] += qg[e + l] * kv_load(A->K, A->f16, pm_k_index(c + j, e + l, hd));
                float sc = ((acc[0] + acc[4]) + (acc[1] + acc[5])) +
                           ((acc[2] + acc[6]) + (acc[3] + acc[7]));
                for (; e < hd; e++) sc += qg[e] * kv_load(A->K, A->f16, pm_k_index(c + j, e, hd));
                A->s[g * PM_SPAN + j] = sc * A->scale;
            }
        for (int g = 0; g < G; g++) {
            float *sg = A->s + g * PM_SPAN;
            float cm = sg[0];
            for (int j = 1; j < len; j++) cm = sg[j] > cm ? sg[j] : cm;
            const float old = A->m[g], nm = old > cm ? old : cm;
            const float corr = old == -INFINITY ? 0.0f : expf(old - nm);
            float sum = 0.0f;
            for (int j = 0; j < len; j++) {
                sg[j] = expf(sg[j] - nm);
                sum += sg[j];
            }
            A->l[g] = A->l[g] * corr + sum;
            A->m[g] = nm;
            if (corr != 1.0f)
                for (int e = 0; e < hd; e++) A->acc[(size_t)g * hd + e] *= corr;
        }
        for (int j = 0; j < len; j++) {
            const size_t vb = (size_t)(c + j) * hd;
            for (int g = 0; g < G; g++) {
                const float p = A->s[g * PM_SPAN + j];
                float *ag = A->acc + (size_t)g * hd;
                for (int e = 0; e < hd; e++) ag[e] += p * kv_load(A->V, A->f16, vb + e);
            }
        }
        c = cend;
    }
}

static void glu_portable(float *gate, const float *up, size_t len, int gelu) {
    if (gelu) {
        const float c = 0.7978845608028654f; /* sqrt(2 / pi) */
        for (size_t k = 0; k < len; k++) {
            const float x = gate[k];
            gate[k] = 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x))) * up[k];
        }
    } else {
        for (size_t k = 0; k < len; k++) {
            const float x = gate[k];
            gate[k] = x * (0.5f + 0.5f * tanhf(0.5f * x)) * up[k];
        }
    }
}

static void matmul_f32_portable(const float *x, int n, int cols, const float *w, int rows,
                                float *y, int rb, int re) {
    for (int r = rb; r < re; r++)
        for (int i = 0; i < n; i++)
            y[(size_t)i * rows + r] = dot_f32(x + (size_t)i * cols, w + (size_t)r * cols, cols);
}

/* float32 -> float16 bits, round to nearest even (NaN stays NaN, overflow -> inf). */
static uint16_t f32_to_f16_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520: rounds to inf */
    if (ax < 0x38800000u) {                                     /* float16 subnormal or zero */
        float af;
        memcpy(&af, &ax, sizeof af);
        const float t = af * 16777216.0f; /* units of 2^-24, exact, < 1024 */
        const float r = (t + 12582912.0f) - 12582912.0f; /* round to nearest even */
        return (uint16_t)(sign | (uint32_t)r);
    }
    const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u) - 0x38000000u;
    return (uint16_t)(sign | (r >> 13));
}

static void to_f16_portable(const float *x, uint16_t *out, size_t len) {
    for (size_t k = 0; k < len; k++) out[k] = f32_to_f16_bits(x[k]);
}

/* Round to nearest, ties to even, for |v| <= 2^22: no libm call. */
static inline float round_even_small(float v) {
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    return (v + magic) - magic;
}

void pm_quant_act_portable(const float *x, int n, int cols, int digits, int8_t *q1, int8_t *q2,
                           float *dd, float *bsum, int32_t *corr) {
    const size_t nblk = (size_t)n * (size_t)cols / 32;
    for (size_t b = 0; b < nblk; b++) {
        const float *p = x + 32 * b;
        float amax = 0.0f;
        for (int k = 0; k < 32; k++) {
            const float a = fabsf(p[k]);
            if (a > amax) amax = a; /* NaN never wins */
        }
        float d = amax / 127.0f, id = 1.0f / d;
        if (!(amax >= POCKET_ACT_TINY)) d = 0.0f, id = 0.0f;
        int32_t s1 = 0, s2 = 0;
        for (int k = 0; k < 32; k++) {
            float t = p[k] * id;
            t = t > -127.0f ? t : -127.0f; /* NaN -> -127 */
            t = t < 127.0f ? t : 127.0f;
            const float r1 = round_even_small(t);
            q1[32 * b + k] = (int8_t)r1;
            s1 += (int32_t)r1;
            if (digits == 2) {
                const float r2 = round_even_small((t - r1) * 128.0f);
                q2[32 * b + k] = (int8_t)r2;
                s2 += (int32_t)r2;
            }
        }
        const int32_t S = digits == 2 ? 128 * s1 + s2 : s1;
        dd[b] = digits == 2 ? d * (1.0f / 128.0f) : d;
        bsum[b] = dd[b] * (float)S;
        corr[b] = 128 * S;
    }
}

/* Weight value (u8 operand) of row lane `i`, column k of block b, in a tile record. */
static inline int tiled_value(const pm_tiled *w, const uint8_t *rec, int b, int k, int i) {
    const uint8_t *blk = rec + (size_t)b * w->block_bytes;
    if (w->bits == 4) {
        const int m = k / 8, j = k % 8;
        const uint8_t byte = blk[64 * m + 4 * i + (j & 3)];
        return j < 4 ? (byte & 15) : (byte >> 4);
    }
    return blk[64 * (k / 4) + 4 * i + (k & 3)];
}

void pm_block_sums_portable(const float *x, int n, int cols, float *bsum) {
    const size_t nblk = (size_t)n * (size_t)cols / 32;
    for (size_t b = 0; b < nblk; b++) {
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int k = 0; k < 32; k += 8)
            for (int l = 0; l < 8; l++) acc[l] += x[32 * b + k + l];
        bsum[b] = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    }
}

/* Float activations on tiled weights: per group (x_g . q_g) * scale + sum(x_g) * min (INT4),
 * or (x_g . (q_g + 128)) * scale - 128 * sum(x_g) * scale (INT8 stored offset). */
static void tiled_f32_portable(const pm_tiled *w, const pm_act *a, float *y, size_t ystride,
                               int tb, int te) {
    const int nb = w->nb, gpb = w->gpb, ng = w->ng;
    for (int t = tb; t < te; t++) {
        const uint8_t *rec = w->data + (size_t)t * w->tile_bytes;
        const uint16_t *sc = (const uint16_t *)(rec + w->scale_off);
        const uint16_t *mn = sc + (size_t)ng * 16;
        const int r0 = 16 * t, nr = w->rows - r0 < 16 ? w->rows - r0 : 16;
        for (int i = 0; i < a->n; i++) {
            const float *x = a->x + (size_t)i * a->cols, *bs = a->bsum + (size_t)i * nb;
            for (int rr = 0; rr < nr; rr++) {
                float acc = 0.0f;
                for (int g = 0; g < ng; g++) {
                    const float s = pocket_f16_to_f32(sc[16 * g + rr]);
                    float d = 0.0f, xs = 0.0f;
                    for (int j = 0; j < gpb; j++) {
                        const int b = g * gpb + j;
                        for (int k = 0; k < 32; k++)
                            d += (float)tiled_value(w, rec, b, k, rr) * x[32 * b + k];
                        xs += bs[b];
                    }
                    acc += d * s;
                    if (w->bits == 4)
                        acc += pocket_f16_to_f32(mn[16 * g + rr]) * xs;
                    else
                        acc -= 128.0f * xs * s;
                }
                y[(size_t)i * ystride + r0 + rr] = acc;
            }
        }
    }
}

void pm_matmul_tiled_portable(const pm_tiled *w, const pm_act *a, float *y, size_t ystride,
                              int tb, int te) {
    if (a->digits == 0) {
        tiled_f32_portable(w, a, y, ystride, tb, te);
        return;
    }
    const int nb = w->nb, gpb = w->gpb, ng = w->ng;
    for (int t = tb; t < te; t++) {
        const uint8_t *rec = w->data + (size_t)t * w->tile_bytes;
        const uint16_t *sc = (const uint16_t *)(rec + w->scale_off);
        const uint16_t *mn = sc + (size_t)ng * 16;
        const int r0 = 16 * t, nr = w->rows - r0 < 16 ? w->rows - r0 : 16;
        for (int i = 0; i < a->n; i++) {
            const int8_t *x1 = a->q1 + (size_t)i * a->cols, *x2 = a->q2 + (size_t)i * a->cols;
            const float *dd = a->dd + (size_t)i * nb, *bs = a->bsum + (size_t)i * nb;
            const int32_t *corr = a->corr + (size_t)i * nb;
            for (int rr = 0; rr < nr; rr++) {
                float acc = 0.0f, macc = 0.0f;
                for (int g = 0; g < ng; g++) {
                    const float s = pocket_f16_to_f32(sc[16 * g + rr]);
                    float xs = 0.0f;
                    for (int j = 0; j < gpb; j++) {
                        const int b = g * gpb + j;
                        int32_t i1 = 0, i2 = 0;
                        for (int k = 0; k < 32; k++) {
                            const int v = tiled_value(w, rec, b, k, rr);
                            i1 += v * x1[32 * b + k];
                            if (a->digits == 2) i2 += v * x2[32 * b + k];
                        }
                        int32_t T = a->digits == 2 ? 128 * i1 + i2 : i1;
                        if (w->bits == 8) T -= corr[b];
                        acc += (float)T * (s * dd[b]);
                        xs += bs[b];
                    }
                    if (w->bits == 4) macc += pocket_f16_to_f32(mn[16 * g + rr]) * xs;
                }
                y[(size_t)i * ystride + r0 + rr] = acc + macc;
            }
        }
    }
}

const pm_ops pm_ops_portable = {
    "portable",          rmsnorm_portable,      attn_portable,           glu_portable,
    matmul_f32_portable, to_f16_portable,       pm_quant_act_portable,   pm_matmul_tiled_portable,
    pm_block_sums_portable,
};

/* =========================================================================================
 * Repacking of quantized weights into 16-row tiles (pm_tiled)
 * ========================================================================================= */

static void *zalloc(size_t count, size_t size);

static void tiled_free(pm_tiled *t) {
    free(t->data);
    memset(t, 0, sizeof *t);
}

/* Hand the whole pages inside [p, p + n) back to the kernel. Only for read-only file mappings
 * (config.release_source): a page touched again is read back from the file. */
static void release_range(const void *p, size_t n) {
#if defined(__linux__) && defined(MADV_DONTNEED)
    long page = sysconf(_SC_PAGESIZE);
    if (!p || !n || page <= 0) return;
    uintptr_t a = (uintptr_t)p, ps = (uintptr_t)page;
    uintptr_t lo = (a + ps - 1) / ps * ps, hi = (a + n) / ps * ps;
    if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
#else
    (void)p;
    (void)n;
#endif
}

/* Release the source pages of rows [r0, r1) of a quantized weight. */
/* Hand back the pages that hold [p, p + n), whole pages around it included: only for a
 * read-only file mapping, where a dropped page is read back from the page cache when next
 * touched. */
static void release_around(const void *p, size_t n) {
#if defined(__linux__) && defined(MADV_DONTNEED)
    long page = sysconf(_SC_PAGESIZE);
    if (!p || !n || page <= 0) return;
    uintptr_t a = (uintptr_t)p, ps = (uintptr_t)page;
    uintptr_t lo = a / ps * ps, hi = (a + n + ps - 1) / ps * ps;
    (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
#else
    (void)p;
    (void)n;
#endif
}

static void release_rows(const pocket_weight *w, size_t r0, size_t r1) {
    if (w->type != POCKET_WT_Q4 && w->type != POCKET_WT_Q8) return;
    const size_t cols = (size_t)w->cols, ng = cols / (size_t)w->group_size;
    const size_t row_bytes = w->type == POCKET_WT_Q4 ? cols / 2 : cols;
    const size_t n = r1 - r0;
    release_range((const uint8_t *)w->data + r0 * row_bytes, n * row_bytes);
    release_range(w->scales + r0 * ng, n * ng * sizeof(uint16_t));
    if (w->type == POCKET_WT_Q4) release_range(w->mins + r0 * ng, n * ng * sizeof(uint16_t));
}

static void release_weight(const pocket_weight *w) { release_rows(w, 0, (size_t)w->rows); }

/* The embedding rows are read from the file mapping a few at a time, in no order: tell the
 * kernel not to read ahead around each one (its usual 128 KB readahead per fault made a
 * 512-token prompt pull ~70 MB of Gemma's embedding into memory for 0.3 MB of rows). */
static void advise_random_rows(const pocket_weight *w) {
#if defined(__linux__) && defined(MADV_RANDOM)
    if (w->type != POCKET_WT_Q4 && w->type != POCKET_WT_Q8) return;
    const size_t rows = (size_t)w->rows, cols = (size_t)w->cols, ng = cols / (size_t)w->group_size;
    const size_t row_bytes = w->type == POCKET_WT_Q4 ? cols / 2 : cols;
    const void *ranges[3] = {w->data, w->scales, w->type == POCKET_WT_Q4 ? w->mins : NULL};
    const size_t sizes[3] = {rows * row_bytes, rows * ng * sizeof(uint16_t),
                             rows * ng * sizeof(uint16_t)};
    long page = sysconf(_SC_PAGESIZE);
    if (page <= 0) return;
    for (int k = 0; k < 3; k++) {
        if (!ranges[k]) continue;
        uintptr_t a = (uintptr_t)ranges[k], ps = (uintptr_t)page;
        uintptr_t lo = (a + ps - 1) / ps * ps, hi = (a + sizes[k]) / ps * ps;
        if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_RANDOM);
    }
#else
    (void)w;
#endif
}

/* Tiles repacked between releases of their source rows: the source of a large matrix (a 262k
 * x 640 embedding used as the head) never sits in memory whole beside its copy. */
#define PM_RELEASE_TILES 256

/* Repack `w` into 16-row tiles; with `release`, the source pages (a read-only file mapping)
 * are handed back as the repacking goes. */
static int tiled_build(const pocket_weight *w, pm_tiled *t, int release) {
    memset(t, 0, sizeof *t);
    if (w->type != POCKET_WT_Q4 && w->type != POCKET_WT_Q8) return POCKET_EINVAL;
    const int q4 = w->type == POCKET_WT_Q4;
    t->bits = q4 ? 4 : 8;
    t->rows = w->rows;
    t->cols = w->cols;
    t->group_size = w->group_size;
    t->ntiles = (w->rows + 15) / 16;
    t->nb = w->cols / 32;
    t->ng = w->cols / w->group_size;
    t->gpb = w->group_size / 32;
    t->block_bytes = q4 ? 256 : 512;
    t->scale_off = (size_t)t->nb * t->block_bytes;
    t->tile_bytes = pocket_round_up(t->scale_off + (size_t)t->ng * 32 * (q4 ? 2 : 1), 64);
    t->data = (uint8_t *)zalloc((size_t)t->ntiles * t->tile_bytes, 1);
    if (!t->data) return POCKET_ENOMEM;
    const size_t C = (size_t)w->cols, ng = (size_t)t->ng;
    for (int tl = 0; tl < t->ntiles; tl++) {
        uint8_t *rec = t->data + (size_t)tl * t->tile_bytes;
        uint16_t *sc = (uint16_t *)(rec + t->scale_off), *mn = sc + ng * 16;
        for (int i = 0; i < 16; i++) {
            const size_t r = (size_t)tl * 16 + (size_t)i;
            if (r >= (size_t)w->rows) {
                if (!q4) /* zero weights are stored as 128 */
                    for (int b = 0; b < t->nb; b++)
                        for (int k = 0; k < 32; k++)
                            rec[(size_t)b * 512 + 64 * (k / 4) + 4 * i + (k & 3)] = 128;
                continue;
            }
            for (size_t g = 0; g < ng; g++) {
                sc[16 * g + i] = w->scales[r * ng + g];
                if (q4) mn[16 * g + i] = w->mins[r * ng + g];
            }
            if (q4) {
                /* source block b: byte k (k < 16) holds column k (low nibble) and 16 + k (high);
                 * target vector m, lane i, byte j: column 8m + j (low), 8m + 4 + j (high) */
                const uint8_t *src = (const uint8_t *)w->data + r * (C / 2);
                for (int b = 0; b < t->nb; b++, src += 16) {
                    uint8_t *blk = rec + (size_t)b * 256 + 4 * i;
                    for (int j = 0; j < 4; j++) {
                        blk[0 + j] = (uint8_t)((src[j] & 15) | (src[4 + j] << 4));
                        blk[64 + j] = (uint8_t)((src[8 + j] & 15) | (src[12 + j] << 4));
                        blk[128 + j] = (uint8_t)((src[j] >> 4) | (src[4 + j] & 0xF0));
                        blk[192 + j] = (uint8_t)((src[8 + j] >> 4) | (src[12 + j] & 0xF0));
                    }
                }
            } else {
                const int8_t *src = (const int8_t *)w->data + r * C;
                for (int b = 0; b < t->nb; b++, src += 32) {
                    uint8_t *blk = rec + (size_t)b * 512 + 4 * i;
                    for (int k = 0; k < 32; k++)
                        blk[64 * (k / 4) + (k & 3)] = (uint8_t)(src[k] + 128);
                }
            }
        }
        if (release && (tl + 1) % PM_RELEASE_TILES == 0)
            release_rows(w, (size_t)(tl + 1 - PM_RELEASE_TILES) * 16, (size_t)(tl + 1) * 16);
    }
    if (release) release_weight(w); /* the pages that straddled chunk ends, and the tail */
    return POCKET_OK;
}

/* =========================================================================================
 * Creation
 * ========================================================================================= */

static int weight_ok(const pocket_weight *w, int rows, int cols, int allow_f32) {
    if (!w || w->rows != rows || w->cols != cols || !w->data) return 0;
    if (w->type == POCKET_WT_F32) return allow_f32;
    if (w->type != POCKET_WT_Q4 && w->type != POCKET_WT_Q8) return 0;
    if (w->group_size != 32 && w->group_size != 64 && w->group_size != 128) return 0;
    if (cols % 32 || cols % w->group_size || !w->scales) return 0;
    if (w->type == POCKET_WT_Q4 && !w->mins) return 0;
    return 1;
}

static void *zalloc(size_t count, size_t size) {
    if (count == 0) count = 1;
    if (count > ((size_t)-1) / 64 / size) return NULL;
    void *p = NULL;
    size_t bytes = pocket_round_up(count * size, 64);
#if defined(_WIN32)
    p = malloc(bytes); /* the engine needs no alignment, it only helps */
    if (!p) return NULL;
#else
    if (posix_memalign(&p, 64, bytes) != 0) return NULL;
#endif
    memset(p, 0, bytes);
    return p;
}

void pocket_model_destroy(pocket_model *m) {
    if (!m) return;
    free(m->layers);
    for (int b = 0; b < 2; b++) {
        free(m->inv_freq[b]);
        free(m->rcos[b]);
        free(m->rsin[b]);
    }
    free(m->x);
    free(m->h);
    free(m->o);
    free(m->q);
    free(m->k);
    free(m->v);
    free(m->att);
    free(m->gate);
    free(m->up);
    for (int k = 0; k < 2; k++) {
        free(m->a1[k]);
        free(m->a2[k]);
        free(m->add[k]);
        free(m->absum[k]);
        free(m->acorr[k]);
    }
    if (m->tiled)
        for (int k = 0; k < 7 * m->c.n_layers + 1; k++) tiled_free(&m->tiled[k]);
    free(m->tiled);
    free(m->part);
    free(m->tscr);
    free(m);
}

int pocket_model_create(const pocket_model_config *cfg, const pocket_layer_weights *layers,
                        const pocket_weight *embed, const pocket_weight *head,
                        const float *final_norm, const pocket_kernel_table *kernels, int act_q8,
                        pocket_model **out) {
    if (!out) return POCKET_EINVAL;
    *out = NULL;
    if (!cfg || !layers || !embed || !head || !final_norm || !kernels) return POCKET_EINVAL;
    const pocket_model_config c = *cfg;
    if (c.vocab_size <= 0 || c.d_model <= 0 || c.n_layers <= 0 || c.n_heads <= 0 ||
        c.n_kv_heads <= 0 || c.head_dim <= 0 || c.d_ff <= 0 || c.max_positions <= 0)
        return POCKET_EINVAL;
    if (c.vocab_size > (1 << 24) || c.d_model > PM_MAX_DIM || c.n_layers > 4096 ||
        c.n_heads > 4096 || c.head_dim > 4096 || c.d_ff > PM_MAX_DIM ||
        (long long)c.n_heads * c.head_dim > PM_MAX_DIM || c.max_positions > (1 << 24))
        return POCKET_EINVAL;
    if (c.n_heads % c.n_kv_heads || c.head_dim % 2 || c.sliding_window < 0) return POCKET_EINVAL;
    if (!(c.norm_eps >= 0.0f) || !isfinite(c.embed_scale) || !isfinite(c.attn_scale) ||
        !(c.rope_theta > 0.0) || !(c.rope_theta_local >= 0.0) || !isfinite(c.rope_theta) ||
        !isfinite(c.rope_theta_local))
        return POCKET_EINVAL;
    if (act_q8 < 0 || act_q8 >= 1 << (2 * POCKET_Q8_ONE_DIGIT_SHIFT)) return POCKET_EINVAL;

    const int d = c.d_model, qd = c.n_heads * c.head_dim, kvd = c.n_kv_heads * c.head_dim;
    const int ff = c.d_ff;
    if (!weight_ok(embed, c.vocab_size, d, 1) || !weight_ok(head, c.vocab_size, d, 1))
        return POCKET_EINVAL;
    int any_sliding = 0;
    for (int l = 0; l < c.n_layers; l++) {
        const pocket_layer_weights *L = &layers[l];
        if (!L->attn_norm || !L->mlp_norm) return POCKET_EINVAL;
        if (c.qkv_bias && (!L->q_bias || !L->k_bias || !L->v_bias)) return POCKET_EINVAL;
        if (c.qk_norm && (!L->q_norm || !L->k_norm)) return POCKET_EINVAL;
        if (c.sandwich_norms && (!L->post_attn_norm || !L->post_mlp_norm)) return POCKET_EINVAL;
        if (!weight_ok(&L->wq, qd, d, 1) || !weight_ok(&L->wk, kvd, d, 1) ||
            !weight_ok(&L->wv, kvd, d, 1) || !weight_ok(&L->wo, d, qd, 1) ||
            !weight_ok(&L->wgate, ff, d, 1) || !weight_ok(&L->wup, ff, d, 1) ||
            !weight_ok(&L->wdown, d, ff, 1))
            return POCKET_EINVAL;
        if (L->sliding != 0 && L->sliding != 1) return POCKET_EINVAL;
        if (L->sliding && c.sliding_window <= 0) return POCKET_EINVAL;
        any_sliding |= L->sliding;
    }

    pocket_model *m = (pocket_model *)calloc(1, sizeof *m);
    if (!m) return POCKET_ENOMEM;
    m->c = c;
    m->embed = *embed;
    m->head = *head;
    m->final_norm = final_norm;
    m->kt = kernels;
    m->act_q8 = act_q8 & POCKET_Q8_ALL;
    m->one_digit = (act_q8 >> POCKET_Q8_ONE_DIGIT_SHIFT) & POCKET_Q8_ALL;
    m->ops = &pm_ops_portable;
#if PM_HAVE_AVX512
    if (kernels->level >= POCKET_LEVEL_AVX512) {
        m->ops = &pm_ops_avx512;
        m->tiled_f32 = 1;
    }
#endif
    m->q_dim = qd;
    m->kv_dim = kvd;
    m->group = c.n_heads / c.n_kv_heads;
    m->half = c.head_dim / 2;
    m->max_in = d > qd ? d : qd;
    if (ff > m->max_in) m->max_in = ff;
    m->n_bases = any_sliding && c.rope_theta_local > 0.0 ? 2 : 1;

    m->layers = (pocket_layer_weights *)malloc((size_t)c.n_layers * sizeof *m->layers);
    if (!m->layers) goto nomem;
    memcpy(m->layers, layers, (size_t)c.n_layers * sizeof *m->layers);

    for (int b = 0; b < m->n_bases; b++) {
        const double theta = b == 0 ? c.rope_theta : c.rope_theta_local;
        m->inv_freq[b] = (double *)malloc((size_t)m->half * sizeof(double));
        if (!m->inv_freq[b]) goto nomem;
        for (int i = 0; i < m->half; i++)
            m->inv_freq[b][i] = pow(theta, -(double)(2 * i) / (double)c.head_dim);
    }

    const size_t B = PM_BLOCK;
    if (!(m->x = (float *)zalloc(B * d, sizeof(float))) ||
        !(m->h = (float *)zalloc(B * d, sizeof(float))) ||
        !(m->o = (float *)zalloc(B * d, sizeof(float))) ||
        !(m->q = (float *)zalloc(B * qd, sizeof(float))) ||
        !(m->k = (float *)zalloc(B * kvd, sizeof(float))) ||
        !(m->v = (float *)zalloc(B * kvd, sizeof(float))) ||
        !(m->att = (float *)zalloc(B * qd, sizeof(float))) ||
        !(m->gate = (float *)zalloc(B * ff, sizeof(float))) ||
        !(m->up = (float *)zalloc(B * ff, sizeof(float))))
        goto nomem;
    for (int k = 0; k < 2; k++)
        if (!(m->a1[k] = (int8_t *)zalloc(B * m->max_in, 1)) ||
            !(m->a2[k] = (int8_t *)zalloc(B * m->max_in, 1)) ||
            !(m->add[k] = (float *)zalloc(B * (m->max_in / 32 + 1), sizeof(float))) ||
            !(m->absum[k] = (float *)zalloc(B * (m->max_in / 32 + 1), sizeof(float))) ||
            !(m->acorr[k] = (int32_t *)zalloc(B * (m->max_in / 32 + 1), sizeof(int32_t))))
            goto nomem;
    m->tiled = (pm_tiled *)calloc((size_t)7 * c.n_layers + 1, sizeof(pm_tiled));
    if (!m->tiled) goto nomem;
    for (int l = 0; l < c.n_layers; l++) {
        const pocket_layer_weights *L = &m->layers[l];
        const pocket_weight *ws[7] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->wgate, &L->wup, &L->wdown};
        const int cls[7] = {POCKET_Q8_QKV, POCKET_Q8_QKV, POCKET_Q8_QKV, POCKET_Q8_WO,
                            POCKET_Q8_GATE_UP, POCKET_Q8_GATE_UP, POCKET_Q8_DOWN};
        for (int k = 0; k < 7; k++)
            if ((m->tiled_f32 || (m->act_q8 & cls[k])) && ws[k]->type != POCKET_WT_F32) {
                int rc = tiled_build(ws[k], &m->tiled[7 * l + k], c.release_source);
                if (rc) {
                    pocket_model_destroy(m);
                    return rc;
                }
            }
    }
    if ((m->tiled_f32 || (m->act_q8 & POCKET_Q8_HEAD)) && m->head.type != POCKET_WT_F32) {
        int rc = tiled_build(&m->head, &m->tiled[7 * c.n_layers], c.release_source);
        if (rc) {
            pocket_model_destroy(m);
            return rc;
        }
    }
    if (c.release_source) advise_random_rows(&m->embed);
    *out = m;
    return POCKET_OK;
nomem:
    pocket_model_destroy(m);
    return POCKET_ENOMEM;
}

/* RoPE tables for positions < need (grown by doubling, capped at max_positions). */
static int ensure_rope(pocket_model *m, int need) {
    if (need <= m->rope_cap) return POCKET_OK;
    long long cap = m->rope_cap ? 2LL * m->rope_cap : 256;
    if (cap < need) cap = need;
    if (cap > m->c.max_positions) cap = m->c.max_positions;
    if (cap < need) return POCKET_EINVAL;
    const size_t H = (size_t)m->half;
    for (int b = 0; b < m->n_bases; b++) {
        float *nc = (float *)realloc(m->rcos[b], (size_t)cap * H * sizeof(float));
        if (!nc) return POCKET_ENOMEM;
        m->rcos[b] = nc;
        float *ns = (float *)realloc(m->rsin[b], (size_t)cap * H * sizeof(float));
        if (!ns) return POCKET_ENOMEM;
        m->rsin[b] = ns;
        for (long long p = m->rope_cap; p < cap; p++)
            for (size_t i = 0; i < H; i++) {
                const double a = (double)p * m->inv_freq[b][i];
                nc[p * H + i] = (float)cos(a);
                ns[p * H + i] = (float)sin(a);
            }
    }
    m->rope_cap = (int)cap;
    return POCKET_OK;
}

/* Per-task attention scratch for `tasks` tasks and decode partials for `units` units. */
static int ensure_attn_scratch(pocket_model *m, int tasks, size_t units) {
    const size_t G = (size_t)m->group, hd = (size_t)m->c.head_dim;
    if (tasks > m->tscr_tasks) {
        const size_t stride = pocket_round_up(G * PM_SPAN + G * (hd + 2), 16);
        float *t = (float *)zalloc((size_t)tasks * stride, sizeof(float));
        if (!t) return POCKET_ENOMEM;
        free(m->tscr);
        m->tscr = t;
        m->tscr_tasks = tasks;
        m->tscr_stride = stride;
    }
    if (units > m->part_units) {
        float *p = (float *)zalloc(units * G * (hd + 2), sizeof(float));
        if (!p) return POCKET_ENOMEM;
        free(m->part);
        m->part = p;
        m->part_units = units;
    }
    return POCKET_OK;
}

/* =========================================================================================
 * KV cache
 * ========================================================================================= */

int pocket_kv_create(const pocket_model *m, int capacity, int kv_f16, pocket_kv **out) {
    if (!out) return POCKET_EINVAL;
    *out = NULL;
    if (!m || capacity <= 0 || capacity > m->c.max_positions || (kv_f16 != 0 && kv_f16 != 1))
        return POCKET_EINVAL;
    pocket_kv *kv = (pocket_kv *)calloc(1, sizeof *kv);
    if (!kv) return POCKET_ENOMEM;
    kv->model = m;
    kv->capacity = capacity;
    kv->f16 = kv_f16;
    kv->head_stride = pocket_round_up((size_t)capacity, 16) * (size_t)m->c.head_dim;
    kv->layer_stride = (size_t)m->c.n_kv_heads * kv->head_stride;
    const size_t total = kv->layer_stride * (size_t)m->c.n_layers;
    const size_t es = kv_f16 ? 2 : 4;
    kv->k = zalloc(total, es);
    kv->v = zalloc(total, es);
    if (!kv->k || !kv->v) {
        pocket_kv_destroy(kv);
        return POCKET_ENOMEM;
    }
    *out = kv;
    return POCKET_OK;
}

void pocket_kv_destroy(pocket_kv *kv) {
    if (!kv) return;
    free(kv->k);
    free(kv->v);
    free(kv);
}

int pocket_kv_capacity(const pocket_kv *kv) { return kv ? kv->capacity : 0; }

size_t pocket_kv_nbytes(const pocket_kv *kv) {
    if (!kv) return 0;
    return 2 * kv->layer_stride * (size_t)kv->model->c.n_layers * (kv->f16 ? 2 : 4);
}

/* =========================================================================================
 * Parallel regions
 * ========================================================================================= */

enum { PM_JOB_CONCAT, PM_JOB_GLU, PM_JOB_ATTN_DECODE, PM_JOB_ATTN_BLOCK, PM_JOB_ROWS };

/* Blocks of at least this many tokens run their per-token steps (norms, activation
 * quantization, RoPE, residuals) split over the threads; smaller ones on the caller. */
#define PM_PAR_ROWS 16

/* Per-token steps of a layer: fn(r, i0, i1) processes tokens [i0, i1) of the block. */
struct pm_rows;
typedef void (*pm_rows_fn)(const struct pm_rows *r, int i0, int i1);
typedef struct pm_rows {
    pocket_model *m;
    pocket_kv *kv;
    int layer, pos0;
    const pm_act *act; /* activations to prepare (quantize / sum), or NULL */
    pm_rows_fn fn;
} pm_rows;



typedef struct pm_job {
    pocket_model *m;
    int kind, n;
    /* products */
    int nmat, total;
    const pocket_weight *w[3];
    const pm_tiled *t[3]; /* repacked weights (int8 activations) or NULL */
    float *y[3];
    const float *x;
    pm_act act; /* the int8 activations, when quantized */
    int quantized;
    /* attention */
    const pocket_kv *kv;
    int layer, pos0, lo, hi, nspans, units;
    const void *K, *V; /* the layer's cache */
    const pm_rows *rows; /* PM_JOB_ROWS */
    const pm_act *post;  /* PM_JOB_GLU: the output prepared for W_down by each task, or NULL */
    int status;
} pm_job;

static void split_range(long long total, int unit, int task, int ntasks, int *b, int *e) {
    long long units = (total + unit - 1) / unit;
    long long b0 = units * task / ntasks * unit, e0 = units * (task + 1) / ntasks * unit;
    *b = (int)(b0 < total ? b0 : total);
    *e = (int)(e0 < total ? e0 : total);
}

/* Prepare columns [c0, c1) (whole blocks of 32) of token i of a planned input. */
static void prepare_cols(const pocket_model *m, const pm_act *a, int i, int c0, int c1) {
    const size_t C = (size_t)a->cols, nb = C / 32, off = (size_t)i * C + (size_t)c0;
    const size_t boff = (size_t)i * nb + (size_t)c0 / 32;
    if (a->digits)
        m->ops->quant_act(a->x + off, 1, c1 - c0, a->digits, (int8_t *)a->q1 + off,
                          (int8_t *)a->q2 + off, (float *)a->dd + boff, (float *)a->bsum + boff,
                          (int32_t *)a->corr + boff);
    else
        m->ops->block_sums(a->x + off, 1, c1 - c0, (float *)a->bsum + boff);
}

static void job_fail(pm_job *j, int rc) {
    if (rc) __atomic_store_n(&j->status, rc, __ATOMIC_RELAXED);
}

/* y[:, rb:re] = x W[rb:re]^T for one weight. */
static int product_rows(const pocket_model *m, const pocket_weight *w, const pm_tiled *t,
                        const pm_job *j, float *y, int rb, int re) {
    if (re <= rb) return POCKET_OK;
    if (t && j->quantized) { /* rb is a multiple of 16; re too, or the last row */
        m->ops->matmul_tiled(t, &j->act, y, (size_t)w->rows, rb / 16, (re + 15) / 16);
        return POCKET_OK;
    }
    switch (w->type) {
    case POCKET_WT_Q4:
        return m->kt->matmul_q4_f32(j->x, j->n, w->cols, (const uint8_t *)w->data, w->scales,
                                    w->mins, w->rows, w->group_size, y, rb, re);
    case POCKET_WT_Q8:
        return m->kt->matmul_q8_f32(j->x, j->n, w->cols, (const int8_t *)w->data, w->scales,
                                    w->rows, w->group_size, y, rb, re);
    case POCKET_WT_F32:
        m->ops->matmul_f32(j->x, j->n, w->cols, (const float *)w->data, w->rows, y, rb, re);
        return POCKET_OK;
    default: return POCKET_EINVAL;
    }
}

static void attn_unit_init(float *m, float *l, float *acc, int G, int hd) {
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(acc, 0, (size_t)G * hd * sizeof(float));
}

static void pm_task(void *ctx, int task, int ntasks) {
    pm_job *j = (pm_job *)ctx;
    pocket_model *m = j->m;
    int b, e, rc = POCKET_OK;
    switch (j->kind) {
    case PM_JOB_CONCAT: {
        split_range(j->total, PM_ROW_UNIT, task, ntasks, &b, &e);
        int off = 0; /* matrices start at multiples of 16 of the split space */
        for (int k = 0; k < j->nmat && rc == POCKET_OK; k++) {
            const int rows = j->w[k]->rows;
            const int rb = (b > off ? b : off) - off, re = (e < off + rows ? e : off + rows) - off;
            if (re > rb) rc = product_rows(m, j->w[k], j->t[k], j, j->y[k], rb, re);
            off += (rows + PM_ROW_UNIT - 1) / PM_ROW_UNIT * PM_ROW_UNIT;
        }
        break;
    }
    case PM_JOB_GLU: {
        /* with j->post, whole blocks of 32 columns per task: each prepares its own */
        split_range(j->total, j->post ? 32 : PM_ROW_UNIT, task, ntasks, &b, &e);
        if (e <= b) break;
        rc = product_rows(m, j->w[0], j->t[0], j, j->y[0], b, e);
        if (rc == POCKET_OK) rc = product_rows(m, j->w[1], j->t[1], j, j->y[1], b, e);
        if (rc == POCKET_OK)
            for (int i = 0; i < j->n; i++)
                m->ops->glu(j->y[0] + (size_t)i * j->total + b, j->y[1] + (size_t)i * j->total + b,
                            (size_t)(e - b), m->c.act_gelu);
        if (rc == POCKET_OK && j->post)
            for (int i = 0; i < j->n; i++) prepare_cols(m, j->post, i, b, e);
        break;
    }
    case PM_JOB_ATTN_DECODE: {
        /* units u = kvh * nspans + s: keys [lo + s * SPAN, ...) of KV head kvh */
        const int G = m->group, hd = m->c.head_dim;
        split_range(j->units, 1, task, ntasks, &b, &e);
        float *scr = m->tscr + (size_t)task * m->tscr_stride;
        for (int u = b; u < e; u++) {
            const int kvh = u / j->nspans, s = u % j->nspans;
            float *p = m->part + (size_t)u * G * (hd + 2);
            float *pm = p, *pl = p + G, *pacc = p + 2 * G;
            attn_unit_init(pm, pl, pacc, G, hd);
            pm_attn_args A;
            A.q = m->q + (size_t)kvh * G * hd;
            A.G = G;
            A.hd = hd;
            A.scale = m->c.attn_scale;
            A.f16 = j->kv->f16;
            const size_t off = (size_t)kvh * j->kv->head_stride * (A.f16 ? 2 : 4);
            A.K = (const char *)j->K + off;
            A.V = (const char *)j->V + off;
            const int s0 = (j->lo / PM_SPAN + s) * PM_SPAN; /* aligned span */
            A.a = s0 > j->lo ? s0 : j->lo;
            A.b = s0 + PM_SPAN < j->hi ? s0 + PM_SPAN : j->hi;
            A.s = scr;
            A.m = pm;
            A.l = pl;
            A.acc = pacc;
            m->ops->attn(&A);
        }
        break;
    }
    case PM_JOB_ATTN_BLOCK: {
        /* units u = i * n_kv + kvh, dealt round-robin (later tokens have more keys) */
        const int G = m->group, hd = m->c.head_dim, nkv = m->c.n_kv_heads;
        float *scr = m->tscr + (size_t)task * m->tscr_stride;
        float *pm = scr + (size_t)G * PM_SPAN, *pl = pm + G, *pacc = pl + G;
        const int win = m->layers[j->layer].sliding ? m->c.sliding_window : 0;
        for (int u = task; u < j->units; u += ntasks) {
            const int i = u / nkv, kvh = u % nkv, pos = j->pos0 + i;
            attn_unit_init(pm, pl, pacc, G, hd);
            pm_attn_args A;
            A.q = m->q + (size_t)i * m->q_dim + (size_t)kvh * G * hd;
            A.G = G;
            A.hd = hd;
            A.scale = m->c.attn_scale;
            A.f16 = j->kv->f16;
            const size_t off = (size_t)kvh * j->kv->head_stride * (A.f16 ? 2 : 4);
            A.K = (const char *)j->K + off;
            A.V = (const char *)j->V + off;
            A.a = win && pos - win + 1 > 0 ? pos - win + 1 : 0;
            A.b = pos + 1;
            A.s = scr;
            A.m = pm;
            A.l = pl;
            A.acc = pacc;
            m->ops->attn(&A);
            float *out = m->att + (size_t)i * m->q_dim + (size_t)kvh * G * hd;
            for (int g = 0; g < G; g++) {
                const float l = pl[g];
                for (int c = 0; c < hd; c++) out[(size_t)g * hd + c] = pacc[(size_t)g * hd + c] / l;
            }
        }
        break;
    }
    case PM_JOB_ROWS:
        split_range(j->n, 1, task, ntasks, &b, &e);
        if (e > b) j->rows->fn(j->rows, b, e);
        break;
    default: rc = POCKET_EINVAL;
    }
    job_fail(j, rc);
}

static int run_job(pm_job *j, pocket_pool *pool, int ntasks) {
    j->status = POCKET_OK;
    if (ntasks < 1) ntasks = 1;
    pocket_pool_run(pool, ntasks, pm_task, j);
    return j->status;
}

/* Tasks for a row split: nthreads, fewer if there are fewer row units. */
static int row_tasks(int total, int nthreads) {
    int units = (total + PM_ROW_UNIT - 1) / PM_ROW_UNIT;
    return units < nthreads ? units : nthreads;
}

/* How the products of class `cls` over the weights tiled[0..nmat) take their input x [n, cols]:
 * fills *act (digits 1-2: int8 digits; 0: float with block sums) and returns 1 when the tiled
 * kernels run them, 0 when the original-layout kernels do (act unused). */
static int plan_act(const pocket_model *m, int cls, const pm_tiled *tiled, int nmat,
                    const float *x, int n, int cols, int slot, pm_act *act) {
    memset(act, 0, sizeof *act);
    if (!tiled) return 0;
    int any = 0;
    for (int k = 0; k < nmat; k++) any |= tiled[k].data != NULL;
    const int q8 = (m->act_q8 & cls) != 0;
    if (!any || (!q8 && !m->tiled_f32)) return 0;
    act->n = n;
    act->cols = cols;
    act->x = x;
    act->digits = q8 ? ((m->one_digit & cls) ? 1 : 2) : 0;
    act->q1 = m->a1[slot];
    act->q2 = m->a2[slot];
    act->dd = m->add[slot];
    act->bsum = m->absum[slot];
    act->corr = m->acorr[slot];
    return 1;
}

/* Quantize (or sum per block) tokens [i0, i1) of a planned input. */
static void prepare_act(const pocket_model *m, const pm_act *a, int i0, int i1) {
    if (!a || a->n == 0 || i1 <= i0) return;
    const size_t C = (size_t)a->cols, nb = C / 32;
    if (a->digits)
        m->ops->quant_act(a->x + i0 * C, i1 - i0, a->cols, a->digits, (int8_t *)a->q1 + i0 * C,
                          (int8_t *)a->q2 + i0 * C, (float *)a->dd + i0 * nb,
                          (float *)a->bsum + i0 * nb, (int32_t *)a->corr + i0 * nb);
    else
        m->ops->block_sums(a->x + i0 * C, i1 - i0, a->cols, (float *)a->bsum + i0 * nb);
}

/* A product region over `nmat` weights sharing the input x [n, cols] (their rows
 * concatenated; kind PM_JOB_GLU: gate and up over the same rows). tiled: the repacked forms of
 * the nmat weights; act: the input as planned by plan_act and prepared (or NULL: the
 * original-layout kernels on x). */
static int run_products(pocket_model *m, pocket_pool *pool, int nthreads, int kind, int nmat,
                        const pocket_weight *w0, const pocket_weight *w1,
                        const pocket_weight *w2, const pm_tiled *tiled, const pm_act *act,
                        float *y0, float *y1, float *y2, const float *x, int n,
                        const pm_act *post) {
    pm_job j;
    memset(&j, 0, sizeof j);
    j.post = post;
    j.m = m;
    j.kind = kind;
    j.n = n;
    j.nmat = nmat;
    j.w[0] = w0;
    j.w[1] = w1;
    j.w[2] = w2;
    j.y[0] = y0;
    j.y[1] = y1;
    j.y[2] = y2;
    j.x = x;
    if (act && act->n) {
        for (int k = 0; k < nmat; k++) j.t[k] = tiled[k].data ? &tiled[k] : NULL;
        j.quantized = 1;
        j.act = *act;
    }
    if (kind == PM_JOB_GLU) {
        j.total = w0->rows;
    } else {
        j.total = 0;
        for (int k = 0; k < nmat; k++)
            j.total += (j.w[k]->rows + PM_ROW_UNIT - 1) / PM_ROW_UNIT * PM_ROW_UNIT;
    }
    int tasks = row_tasks(j.total, nthreads);
    if (post) {
        const int units = (j.total + 31) / 32;
        tasks = units < nthreads ? units : nthreads;
    }
    return run_job(&j, pool, tasks);
}

/* Run r->fn over the block's n tokens: split over the threads for long blocks. */
static int run_rows(pocket_model *m, pocket_pool *pool, int nthreads, int n, const pm_rows *r) {
    if (n < PM_PAR_ROWS || nthreads < 2) {
        r->fn(r, 0, n);
        return POCKET_OK;
    }
    pm_job j;
    memset(&j, 0, sizeof j);
    j.m = m;
    j.kind = PM_JOB_ROWS;
    j.n = n;
    j.rows = r;
    return run_job(&j, pool, nthreads);
}

/* =========================================================================================
 * Serial steps
 * ========================================================================================= */

/* Row r of a tiled matrix as floats: the same values (and float operations) as dequantizing
 * the source row. */
static void tiled_row(const pm_tiled *w, size_t r, float *x) {
    const uint8_t *rec = w->data + (r / 16) * w->tile_bytes;
    const uint16_t *sc = (const uint16_t *)(rec + w->scale_off), *mn = sc + (size_t)w->ng * 16;
    const int i = (int)(r % 16), per_group = w->group_size;
    for (int b = 0; b < w->nb; b++)
        for (int k = 0; k < 32; k++) {
            const int c = 32 * b + k, g = c / per_group;
            const int q = tiled_value(w, rec, b, k, i);
            x[c] = w->bits == 4 ? (float)q * pocket_f16_to_f32(sc[16 * g + i]) +
                                      pocket_f16_to_f32(mn[16 * g + i])
                                : (float)(q - 128) * pocket_f16_to_f32(sc[16 * g + i]);
        }
}

static void embed_rows(const pocket_model *m, const int32_t *ids, int n, float *x) {
    const pocket_weight *w = &m->embed;
    const size_t d = (size_t)m->c.d_model, gs = (size_t)w->group_size;
    const size_t ng = w->type == POCKET_WT_F32 ? 0 : d / gs;
    /* a tied embedding is read from the head's tiles: its source pages stay released */
    const pm_tiled *head = &m->tiled[7 * m->c.n_layers];
    const int from_head = head->data && w->data == m->head.data;
    for (int i = 0; i < n; i++) {
        const size_t r = (size_t)ids[i];
        float *xi = x + (size_t)i * d;
        if (from_head) {
            tiled_row(head, r, xi);
        } else if (w->type == POCKET_WT_F32) {
            memcpy(xi, (const float *)w->data + r * d, d * sizeof(float));
        } else if (w->type == POCKET_WT_Q8) {
            const int8_t *q = (const int8_t *)w->data + r * d;
            const uint16_t *s = w->scales + r * ng;
            for (size_t c = 0; c < d; c++) xi[c] = (float)q[c] * pocket_f16_to_f32(s[c / gs]);
        } else {
            const uint8_t *q = (const uint8_t *)w->data + r * (d / 2);
            const uint16_t *s = w->scales + r * ng, *mn = w->mins + r * ng;
            for (size_t b = 0; b < d / 32; b++)
                for (size_t k = 0; k < 16; k++) {
                    const size_t c0 = 32 * b + k, c1 = c0 + 16;
                    const uint8_t byte = q[16 * b + k];
                    xi[c0] = (float)(byte & 15) * pocket_f16_to_f32(s[c0 / gs]) +
                             pocket_f16_to_f32(mn[c0 / gs]);
                    xi[c1] = (float)(byte >> 4) * pocket_f16_to_f32(s[c1 / gs]) +
                             pocket_f16_to_f32(mn[c1 / gs]);
                }
        }
        if (m->c.embed_scale != 1.0f)
            for (size_t c = 0; c < d; c++) xi[c] *= m->c.embed_scale;
        if (!from_head && m->c.release_source && w->type != POCKET_WT_F32) {
            /* a separate embedding stays in the file: drop the pages a lookup mapped (the
             * kernel maps whole large folios, ~1 MB a row), so lookups never add up */
            release_around((const uint8_t *)w->data + r * (w->type == POCKET_WT_Q8 ? d : d / 2),
                           w->type == POCKET_WT_Q8 ? d : d / 2);
            release_around(w->scales + r * ng, ng * sizeof(uint16_t));
            if (w->type == POCKET_WT_Q4) release_around(w->mins + r * ng, ng * sizeof(uint16_t));
        }
    }
}

static void rope_heads(float *x, int heads, int hd, const float *cs, const float *sn) {
    const int half = hd / 2;
    for (int h = 0; h < heads; h++) {
        float *p = x + (size_t)h * hd;
        for (int i = 0; i < half; i++) {
            const float x1 = p[i], x2 = p[i + half];
            p[i] = x1 * cs[i] - x2 * sn[i];
            p[i + half] = x2 * cs[i] + x1 * sn[i];
        }
    }
}

/* Biases, q/k norms, RoPE for the block's q and k; k and v into the cache. */
static void post_qkv(pocket_model *m, pocket_kv *kv, int layer, int i0, int i1, int pos0) {
    const pocket_layer_weights *L = &m->layers[layer];
    const int hd = m->c.head_dim, nh = m->c.n_heads, nkv = m->c.n_kv_heads;
    const int qd = m->q_dim, kvd = m->kv_dim;
    const int base = L->sliding && m->n_bases > 1 ? 1 : 0;
    const size_t H = (size_t)m->half;
    for (int i = i0; i < i1; i++) {
        float *q = m->q + (size_t)i * qd, *k = m->k + (size_t)i * kvd, *v = m->v + (size_t)i * kvd;
        if (m->c.qkv_bias) {
            for (int c = 0; c < qd; c++) q[c] += L->q_bias[c];
            for (int c = 0; c < kvd; c++) k[c] += L->k_bias[c];
            for (int c = 0; c < kvd; c++) v[c] += L->v_bias[c];
        }
        if (m->c.qk_norm) {
            m->ops->rmsnorm(q, L->q_norm, nh, hd, m->c.norm_eps, q);
            m->ops->rmsnorm(k, L->k_norm, nkv, hd, m->c.norm_eps, k);
        }
        const size_t pos = (size_t)(pos0 + i);
        const float *cs = m->rcos[base] + pos * H, *sn = m->rsin[base] + pos * H;
        rope_heads(q, nh, hd, cs, sn);
        rope_heads(k, nkv, hd, cs, sn);
        for (int h = 0; h < nkv; h++) {
            const size_t head = (size_t)layer * kv->layer_stride + (size_t)h * kv->head_stride;
            const size_t vdst = head + pos * (size_t)hd;
            const size_t kdst = head + pm_k_index((int)pos, 0, hd); /* then stride 16 */
            const float *kh = k + (size_t)h * hd;
            if (kv->f16) {
                uint16_t tmp[4096];
                m->ops->to_f16(kh, tmp, (size_t)hd);
                for (int e = 0; e < hd; e++) ((uint16_t *)kv->k)[kdst + (size_t)e * 16] = tmp[e];
                m->ops->to_f16(v + (size_t)h * hd, (uint16_t *)kv->v + vdst, (size_t)hd);
            } else {
                for (int e = 0; e < hd; e++) ((float *)kv->k)[kdst + (size_t)e * 16] = kh[e];
                memcpy((float *)kv->v + vdst, v + (size_t)h * hd, (size_t)hd * sizeof(float));
            }
        }
    }
}

/* Merge the decode partials of every query head into m->att (one token). */
static void merge_partials(pocket_model *m, int nspans) {
    const int G = m->group, hd = m->c.head_dim;
    for (int h = 0; h < m->c.n_heads; h++) {
        const int kvh = h / G, g = h % G;
        float M = -INFINITY;
        for (int s = 0; s < nspans; s++) {
            const float *p = m->part + (size_t)(kvh * nspans + s) * G * (hd + 2);
            if (p[g] > M) M = p[g];
        }
        float *out = m->att + (size_t)h * hd;
        if (nspans == 1) {
            const float *p = m->part + (size_t)kvh * G * (hd + 2);
            const float l = p[G + g];
            for (int c = 0; c < hd; c++) out[c] = p[2 * G + (size_t)g * hd + c] / l;
            continue;
        }
        float L = 0.0f;
        for (int c = 0; c < hd; c++) out[c] = 0.0f;
        for (int s = 0; s < nspans; s++) {
            const float *p = m->part + (size_t)(kvh * nspans + s) * G * (hd + 2);
            const float f = expf(p[g] - M);
            L += f * p[G + g];
            const float *acc = p + 2 * G + (size_t)g * hd;
            for (int c = 0; c < hd; c++) out[c] += f * acc[c];
        }
        for (int c = 0; c < hd; c++) out[c] /= L;
    }
}

static void add_rows(float *x, const float *o, size_t len) {
    for (size_t k = 0; k < len; k++) x[k] += o[k];
}

/* =========================================================================================
 * Forward
 * ========================================================================================= */

/* Per-token steps of a layer (pm_rows_fn). */
static void step_pre_attn(const pm_rows *r, int i0, int i1) { /* h = norm(x); prepare h */
    pocket_model *m = r->m;
    const int d = m->c.d_model;
    m->ops->rmsnorm(m->x + (size_t)i0 * d, m->layers[r->layer].attn_norm, i1 - i0, d,
                    m->c.norm_eps, m->h + (size_t)i0 * d);
    prepare_act(m, r->act, i0, i1);
}

static void step_post_qkv(const pm_rows *r, int i0, int i1) {
    post_qkv(r->m, r->kv, r->layer, i0, i1, r->pos0);
}

static void step_post_attn(const pm_rows *r, int i0, int i1) { /* x += [norm](o); h = norm(x) */
    pocket_model *m = r->m;
    const pocket_layer_weights *L = &m->layers[r->layer];
    const int d = m->c.d_model;
    const size_t off = (size_t)i0 * d, len = (size_t)(i1 - i0) * d;
    if (m->c.sandwich_norms)
        m->ops->rmsnorm(m->o + off, L->post_attn_norm, i1 - i0, d, m->c.norm_eps, m->o + off);
    add_rows(m->x + off, m->o + off, len);
    m->ops->rmsnorm(m->x + off, L->mlp_norm, i1 - i0, d, m->c.norm_eps, m->h + off);
    prepare_act(m, r->act, i0, i1);
}

static void step_prepare(const pm_rows *r, int i0, int i1) { prepare_act(r->m, r->act, i0, i1); }

static void step_post_mlp(const pm_rows *r, int i0, int i1) { /* x += [norm](o) */
    pocket_model *m = r->m;
    const int d = m->c.d_model;
    const size_t off = (size_t)i0 * d, len = (size_t)(i1 - i0) * d;
    if (m->c.sandwich_norms)
        m->ops->rmsnorm(m->o + off, m->layers[r->layer].post_mlp_norm, i1 - i0, d,
                        m->c.norm_eps, m->o + off);
    add_rows(m->x + off, m->o + off, len);
}

static int layer_forward(pocket_model *m, pocket_kv *kv, int l, int n, int pos0,
                         pocket_pool *pool, int nthreads) {
    const pocket_layer_weights *L = &m->layers[l];
    const int d = m->c.d_model, qd = m->q_dim, ff = m->c.d_ff;
    const pm_tiled *T = m->tiled + (size_t)7 * l;
    pm_rows r = {m, kv, l, pos0, NULL, NULL};
    pm_act act;
    int rc;

    /* attention */
    const int tq = plan_act(m, POCKET_Q8_QKV, T, 3, m->h, n, d, 0, &act);
    r.act = tq ? &act : NULL;
    r.fn = step_pre_attn;
    if ((rc = run_rows(m, pool, nthreads, n, &r))) return rc;
    rc = run_products(m, pool, nthreads, PM_JOB_CONCAT, 3, &L->wq, &L->wk, &L->wv, T, r.act,
                      m->q, m->k, m->v, m->h, n, NULL);
    if (rc) return rc;
    r.act = NULL;
    r.fn = step_post_qkv;
    if ((rc = run_rows(m, pool, nthreads, n, &r))) return rc;

    pm_job j;
    memset(&j, 0, sizeof j);
    j.m = m;
    j.kv = kv;
    j.layer = l;
    j.pos0 = pos0;
    j.n = n;
    const size_t es = kv->f16 ? 2 : 4;
    j.K = (const char *)kv->k + (size_t)l * kv->layer_stride * es;
    j.V = (const char *)kv->v + (size_t)l * kv->layer_stride * es;
    const int nkv = m->c.n_kv_heads;
    if (n == 1) {
        const int win = L->sliding ? m->c.sliding_window : 0;
        j.kind = PM_JOB_ATTN_DECODE;
        j.hi = pos0 + 1;
        j.lo = win && pos0 - win + 1 > 0 ? pos0 - win + 1 : 0;
        j.nspans = (j.hi - 1) / PM_SPAN - j.lo / PM_SPAN + 1;
        j.units = nkv * j.nspans;
        int tasks = j.units < nthreads ? j.units : nthreads;
        if ((rc = ensure_attn_scratch(m, tasks, (size_t)j.units))) return rc;
        if ((rc = run_job(&j, pool, tasks))) return rc;
        merge_partials(m, j.nspans);
    } else {
        j.kind = PM_JOB_ATTN_BLOCK;
        j.units = n * nkv;
        int tasks = j.units < nthreads ? j.units : nthreads;
        if ((rc = ensure_attn_scratch(m, tasks, 0))) return rc;
        if ((rc = run_job(&j, pool, tasks))) return rc;
    }
    const int to = plan_act(m, POCKET_Q8_WO, T + 3, 1, m->att, n, qd, 0, &act);
    r.act = to ? &act : NULL;
    r.fn = step_prepare;
    if (r.act && (rc = run_rows(m, pool, nthreads, n, &r))) return rc;
    rc = run_products(m, pool, nthreads, PM_JOB_CONCAT, 1, &L->wo, NULL, NULL, T + 3, r.act,
                      m->o, NULL, NULL, m->att, n, NULL);
    if (rc) return rc;

    /* MLP */
    const int tg = plan_act(m, POCKET_Q8_GATE_UP, T + 4, 2, m->h, n, d, 0, &act);
    r.act = tg ? &act : NULL;
    r.fn = step_post_attn;
    if ((rc = run_rows(m, pool, nthreads, n, &r))) return rc;
    pm_act act_dn; /* the GLU tasks prepare their own columns of W_down's input */
    const int tdn = plan_act(m, POCKET_Q8_DOWN, T + 6, 1, m->gate, n, ff, 1, &act_dn);
    rc = run_products(m, pool, nthreads, PM_JOB_GLU, 2, &L->wgate, &L->wup, NULL, T + 4, r.act,
                      m->gate, m->up, NULL, m->h, n, tdn ? &act_dn : NULL);
    if (rc) return rc;
    rc = run_products(m, pool, nthreads, PM_JOB_CONCAT, 1, &L->wdown, NULL, NULL, T + 6,
                      tdn ? &act_dn : NULL, m->o, NULL, NULL, m->gate, n, NULL);
    if (rc) return rc;
    r.act = NULL;
    r.fn = step_post_mlp;
    return run_rows(m, pool, nthreads, n, &r);
}

int pocket_model_forward(pocket_model *m, pocket_kv *kv, const int32_t *ids, int n,
                         int start_pos, float *logits, int all_logits, pocket_pool *pool,
                         int nthreads) {
    if (!m || !kv || !ids || !logits || kv->model != m) return POCKET_EINVAL;
    if (n <= 0 || start_pos < 0 || (long long)start_pos + n > kv->capacity) return POCKET_EINVAL;
    if (nthreads < 1 || nthreads > PM_MAX_THREADS || (all_logits != 0 && all_logits != 1))
        return POCKET_EINVAL;
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= m->c.vocab_size) return POCKET_EINVAL;
    if (pool && pocket_pool_size(pool) < nthreads) nthreads = pocket_pool_size(pool);
    if (!pool) nthreads = 1;
    int rc = ensure_rope(m, start_pos + n);
    if (rc) return rc;
    const int d = m->c.d_model;
    const size_t V = (size_t)m->c.vocab_size;
    for (int b0 = 0; b0 < n; b0 += PM_BLOCK) {
        const int nb = n - b0 < PM_BLOCK ? n - b0 : PM_BLOCK;
        const int pos0 = start_pos + b0;
        embed_rows(m, ids + b0, nb, m->x);
        for (int l = 0; l < m->c.n_layers; l++) {
            rc = layer_forward(m, kv, l, nb, pos0, pool, nthreads);
            if (rc) return rc;
        }
        int rows0 = 0, nrows = nb; /* rows of the block whose logits are wanted */
        float *y = logits + (size_t)b0 * V;
        if (!all_logits) {
            if (b0 + nb < n) continue;
            rows0 = nb - 1;
            nrows = 1;
            y = logits;
        }
        m->ops->rmsnorm(m->x + (size_t)rows0 * d, m->final_norm, nrows, d, m->c.norm_eps, m->h);
        const pm_tiled *th = m->tiled + (size_t)7 * m->c.n_layers;
        pm_act act;
        const int use = plan_act(m, POCKET_Q8_HEAD, th, 1, m->h, nrows, d, 0, &act);
        if (use) prepare_act(m, &act, 0, nrows);
        rc = run_products(m, pool, nthreads, PM_JOB_CONCAT, 1, &m->head, NULL, NULL, th,
                          use ? &act : NULL, y, NULL, NULL, m->h, nrows, NULL);
        if (rc) return rc;
    }
    return POCKET_OK;
}
