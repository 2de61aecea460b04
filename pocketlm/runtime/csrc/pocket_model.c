/* pocketlm native inference engine: the decoder forward pass (see pocket_model.h).
 *
 * Work of one block of tokens, per layer (regions marked || run on the pool, split into
 * `nthreads` fixed parts; the rest runs on the calling thread and is small):
 *
 *      rmsnorm (+ int8 quantization of the activations under act_q8)
 *   || q|k|v products: one region over the concatenated rows of W_q, W_k, W_v
 *      biases, q/k norms, RoPE, k and v into the cache
 *   || attention: decode (one token) splits the keys of every KV head into units of PM_SPAN
 *      positions (partial softmax sums, merged in a fixed order afterwards); a longer block
 *      splits (token, KV head) pairs
 *      (merge of the decode partials; quantization)
 *   || W_o
 *      post-attention norm, residual, MLP norm (+ quantization)
 *   || gate|up products over the same rows, with act(gate) * up fused in
 *      (quantization)
 *   || W_down
 *      post-MLP norm, residual
 *
 * i.e. four fork-join points per layer, plus one for the output head. Longer inputs run in
 * blocks of PM_BLOCK tokens (batched products: the weights are streamed once per block).
 */
#if !defined(_WIN32) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* posix_memalign */
#endif

#include <math.h>

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
    int act_q8;
    int q_dim, kv_dim, group, half;
    int max_in; /* the widest input of a product: max(d_model, q_dim, d_ff) */
    /* RoPE: inv_freq per base (0: rope_theta, 1: rope_theta_local); cos/sin [pos][half] */
    double *inv_freq[2];
    float *rcos[2], *rsin[2];
    int rope_cap;
    int n_bases;
    /* scratch, sized for PM_BLOCK tokens */
    float *x, *h, *o, *q, *k, *v, *att, *gate, *up;
    int8_t *qx;
    float *dx, *sx;
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
    size_t head_stride;  /* elements between KV heads: capacity * head_dim */
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
    for (int c = A->a; c < A->b; c += PM_SPAN) {
        const int len = A->b - c < PM_SPAN ? A->b - c : PM_SPAN;
        for (int j = 0; j < len; j++) {
            const size_t kb = (size_t)(c + j) * hd;
            for (int g = 0; g < G; g++) {
                const float *qg = A->q + (size_t)g * hd;
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                int e = 0;
                for (; e + 8 <= hd; e += 8)
                    for (int l = 0; l < 8; l++) acc[l] += qg[e + l] * kv_load(A->K, A->f16, kb + e + l);
                float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) +
                          ((acc[2] + acc[6]) + (acc[3] + acc[7]));
                for (; e < hd; e++) s += qg[e] * kv_load(A->K, A->f16, kb + e);
                A->s[g * PM_SPAN + j] = s * A->scale;
            }
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

const pm_ops pm_ops_portable = {
    "portable", rmsnorm_portable, attn_portable, glu_portable, matmul_f32_portable,
    to_f16_portable,
};

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
    free(m->qx);
    free(m->dx);
    free(m->sx);
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
    if (act_q8 < 0 || act_q8 > POCKET_Q8_ALL) return POCKET_EINVAL;

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
    m->act_q8 = act_q8;
    m->ops = &pm_ops_portable;
#if PM_HAVE_AVX512
    if (kernels->level >= POCKET_LEVEL_AVX512) m->ops = &pm_ops_avx512;
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
        !(m->up = (float *)zalloc(B * ff, sizeof(float))) ||
        !(m->qx = (int8_t *)zalloc(B * m->max_in, 1)) ||
        !(m->dx = (float *)zalloc(B * (m->max_in / 32 + 1), sizeof(float))) ||
        !(m->sx = (float *)zalloc(B * (m->max_in / 32 + 1), sizeof(float))))
        goto nomem;
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
    kv->head_stride = (size_t)capacity * (size_t)m->c.head_dim;
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

enum { PM_JOB_CONCAT, PM_JOB_GLU, PM_JOB_ATTN_DECODE, PM_JOB_ATTN_BLOCK };

typedef struct pm_job {
    pocket_model *m;
    int kind, n;
    /* products */
    int nmat, total;
    const pocket_weight *w[3];
    float *y[3];
    const float *x;
    const int8_t *qx;
    const float *dx, *sx;
    /* attention */
    const pocket_kv *kv;
    int layer, pos0, lo, hi, nspans, units;
    const void *K, *V; /* the layer's cache */
    int status;
} pm_job;

static void split_range(long long total, int unit, int task, int ntasks, int *b, int *e) {
    long long units = (total + unit - 1) / unit;
    long long b0 = units * task / ntasks * unit, e0 = units * (task + 1) / ntasks * unit;
    *b = (int)(b0 < total ? b0 : total);
    *e = (int)(e0 < total ? e0 : total);
}

static void job_fail(pm_job *j, int rc) {
    if (rc) __atomic_store_n(&j->status, rc, __ATOMIC_RELAXED);
}

/* y[:, rb:re] = x W[rb:re]^T for one weight. */
static int product_rows(const pocket_model *m, const pocket_weight *w, const pm_job *j, float *y,
                        int rb, int re) {
    if (re <= rb) return POCKET_OK;
    const int use_q8 = j->qx != NULL;
    switch (w->type) {
    case POCKET_WT_Q4:
        if (use_q8)
            return m->kt->matmul_q4_q8(j->qx, j->dx, j->sx, j->n, w->cols,
                                       (const uint8_t *)w->data, w->scales, w->mins, w->rows,
                                       w->group_size, y, rb, re);
        return m->kt->matmul_q4_f32(j->x, j->n, w->cols, (const uint8_t *)w->data, w->scales,
                                    w->mins, w->rows, w->group_size, y, rb, re);
    case POCKET_WT_Q8:
        if (use_q8)
            return m->kt->matmul_q8_q8(j->qx, j->dx, j->n, w->cols, (const int8_t *)w->data,
                                       w->scales, w->rows, w->group_size, y, rb, re);
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
        int off = 0;
        for (int k = 0; k < j->nmat && rc == POCKET_OK; k++) {
            const int rows = j->w[k]->rows;
            const int rb = (b > off ? b : off) - off, re = (e < off + rows ? e : off + rows) - off;
            if (re > rb) rc = product_rows(m, j->w[k], j, j->y[k], rb, re);
            off += rows;
        }
        break;
    }
    case PM_JOB_GLU: {
        split_range(j->total, PM_ROW_UNIT, task, ntasks, &b, &e);
        if (e <= b) break;
        rc = product_rows(m, j->w[0], j, j->y[0], b, e);
        if (rc == POCKET_OK) rc = product_rows(m, j->w[1], j, j->y[1], b, e);
        if (rc == POCKET_OK)
            for (int i = 0; i < j->n; i++)
                m->ops->glu(j->y[0] + (size_t)i * j->total + b, j->y[1] + (size_t)i * j->total + b,
                            (size_t)(e - b), m->c.act_gelu);
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
            A.a = j->lo + s * PM_SPAN;
            A.b = A.a + PM_SPAN < j->hi ? A.a + PM_SPAN : j->hi;
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

/* A product region over `nmat` weights sharing input x [n, cols] (concatenated rows). */
static int run_products(pocket_model *m, pocket_pool *pool, int nthreads, int kind, int nmat,
                        const pocket_weight *w0, const pocket_weight *w1,
                        const pocket_weight *w2, float *y0, float *y1, float *y2,
                        const float *x, int n, int quantized) {
    pm_job j;
    memset(&j, 0, sizeof j);
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
    if (quantized) {
        j.qx = m->qx;
        j.dx = m->dx;
        j.sx = m->sx;
    }
    if (kind == PM_JOB_GLU) {
        j.total = w0->rows;
    } else {
        j.total = 0;
        for (int k = 0; k < nmat; k++) j.total += j.w[k]->rows;
    }
    return run_job(&j, pool, row_tasks(j.total, nthreads));
}

/* Quantize x [n, cols] into m->qx/dx/sx when int8 activations are in use and some weight of
 * the coming product is quantized. Returns 1 if quantized, 0 if not, < 0 on error. */
static int maybe_quantize(pocket_model *m, int cls, const float *x, int n, int cols,
                          const pocket_weight *w0, const pocket_weight *w1,
                          const pocket_weight *w2) {
    if (!(m->act_q8 & cls)) return 0;
    int any = 0;
    const pocket_weight *ws[3] = {w0, w1, w2};
    for (int k = 0; k < 3; k++)
        if (ws[k] && ws[k]->type != POCKET_WT_F32) any = 1;
    if (!any) return 0;
    int rc = m->kt->quantize_act_q8(x, n, cols, m->qx, m->dx, m->sx);
    return rc ? rc : 1;
}

/* =========================================================================================
 * Serial steps
 * ========================================================================================= */

static void embed_rows(const pocket_model *m, const int32_t *ids, int n, float *x) {
    const pocket_weight *w = &m->embed;
    const size_t d = (size_t)m->c.d_model, gs = (size_t)w->group_size;
    const size_t ng = w->type == POCKET_WT_F32 ? 0 : d / gs;
    for (int i = 0; i < n; i++) {
        const size_t r = (size_t)ids[i];
        float *xi = x + (size_t)i * d;
        if (w->type == POCKET_WT_F32) {
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
static void post_qkv(pocket_model *m, pocket_kv *kv, int layer, int n, int pos0) {
    const pocket_layer_weights *L = &m->layers[layer];
    const int hd = m->c.head_dim, nh = m->c.n_heads, nkv = m->c.n_kv_heads;
    const int qd = m->q_dim, kvd = m->kv_dim;
    const int base = L->sliding && m->n_bases > 1 ? 1 : 0;
    const size_t H = (size_t)m->half;
    for (int i = 0; i < n; i++) {
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
            const size_t dst = (size_t)layer * kv->layer_stride + (size_t)h * kv->head_stride +
                               pos * (size_t)hd;
            if (kv->f16) {
                m->ops->to_f16(k + (size_t)h * hd, (uint16_t *)kv->k + dst, (size_t)hd);
                m->ops->to_f16(v + (size_t)h * hd, (uint16_t *)kv->v + dst, (size_t)hd);
            } else {
                memcpy((float *)kv->k + dst, k + (size_t)h * hd, (size_t)hd * sizeof(float));
                memcpy((float *)kv->v + dst, v + (size_t)h * hd, (size_t)hd * sizeof(float));
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

static int layer_forward(pocket_model *m, pocket_kv *kv, int l, int n, int pos0,
                         pocket_pool *pool, int nthreads) {
    const pocket_layer_weights *L = &m->layers[l];
    const int d = m->c.d_model, qd = m->q_dim, ff = m->c.d_ff, hd = m->c.head_dim;
    const float eps = m->c.norm_eps;
    int rc, qz;

    /* attention */
    m->ops->rmsnorm(m->x, L->attn_norm, n, d, eps, m->h);
    qz = maybe_quantize(m, POCKET_Q8_QKV, m->h, n, d, &L->wq, &L->wk, &L->wv);
    if (qz < 0) return qz;
    rc = run_products(m, pool, nthreads, PM_JOB_CONCAT, 3, &L->wq, &L->wk, &L->wv, m->q, m->k,
                      m->v, m->h, n, qz);
    if (rc) return rc;
    post_qkv(m, kv, l, n, pos0);

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
        j.nspans = (j.hi - j.lo + PM_SPAN - 1) / PM_SPAN;
        j.units = nkv * j.nspans;
        int tasks = j.units < nthreads ? j.units : nthreads;
        rc = ensure_attn_scratch(m, tasks, (size_t)j.units);
        if (rc) return rc;
        rc = run_job(&j, pool, tasks);
        if (rc) return rc;
        merge_partials(m, j.nspans);
    } else {
        j.kind = PM_JOB_ATTN_BLOCK;
        j.units = n * nkv;
        int tasks = j.units < nthreads ? j.units : nthreads;
        rc = ensure_attn_scratch(m, tasks, 0);
        if (rc) return rc;
        rc = run_job(&j, pool, tasks);
        if (rc) return rc;
    }
    (void)hd;
    qz = maybe_quantize(m, POCKET_Q8_WO, m->att, n, qd, &L->wo, NULL, NULL);
    if (qz < 0) return qz;
    rc = run_products(m, pool, nthreads, PM_JOB_CONCAT, 1, &L->wo, NULL, NULL, m->o, NULL, NULL,
                      m->att, n, qz);
    if (rc) return rc;
    if (m->c.sandwich_norms) m->ops->rmsnorm(m->o, L->post_attn_norm, n, d, eps, m->o);
    add_rows(m->x, m->o, (size_t)n * d);

    /* MLP */
    m->ops->rmsnorm(m->x, L->mlp_norm, n, d, eps, m->h);
    qz = maybe_quantize(m, POCKET_Q8_GATE_UP, m->h, n, d, &L->wgate, &L->wup, NULL);
    if (qz < 0) return qz;
    rc = run_products(m, pool, nthreads, PM_JOB_GLU, 2, &L->wgate, &L->wup, NULL, m->gate, m->up,
                      NULL, m->h, n, qz);
    if (rc) return rc;
    qz = maybe_quantize(m, POCKET_Q8_DOWN, m->gate, n, ff, &L->wdown, NULL, NULL);
    if (qz < 0) return qz;
    rc = run_products(m, pool, nthreads, PM_JOB_CONCAT, 1, &L->wdown, NULL, NULL, m->o, NULL,
                      NULL, m->gate, n, qz);
    if (rc) return rc;
    if (m->c.sandwich_norms) m->ops->rmsnorm(m->o, L->post_mlp_norm, n, d, eps, m->o);
    add_rows(m->x, m->o, (size_t)n * d);
    return POCKET_OK;
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
        int qz = maybe_quantize(m, POCKET_Q8_HEAD, m->h, nrows, d, &m->head, NULL, NULL);
        if (qz < 0) return qz;
        rc = run_products(m, pool, nthreads, PM_JOB_CONCAT, 1, &m->head, NULL, NULL, y, NULL,
                          NULL, m->h, nrows, qz);
        if (rc) return rc;
    }
    return POCKET_OK;
}
