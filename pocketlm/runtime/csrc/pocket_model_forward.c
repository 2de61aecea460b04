/* pocketlm native inference engine: the decoder forward pass (pocket_model_forward(), see
 * pocket_model.h).
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
 * products: the weights are streamed once per block). When only the last token's logits are
 * asked for, the last layer stops after the keys and values for all rows but that token (for
 * every row of the blocks before it): layer_forward's out0.
 *
 * The products run on the repacked weights (pm_tiled, pocket_model_tiles.c) where the model has
 * them, on the kernels of pocket_kernels.h otherwise; the other operations through the model's
 * pm_ops (pocket_model_ops.c, pocket_model_x86.c).
 */
#include <math.h>

#include "pocket_internal.h"
#include "pocket_model.h"
#include "pocket_model_internal.h"

#define PM_ROW_UNIT 16 /* row splits between threads are multiples of this */
#define PM_MAX_THREADS 1024

/* =========================================================================================
 * Parallel regions
 * ========================================================================================= */

enum {
    PM_JOB_CONCAT,
    PM_JOB_GLU,
    PM_JOB_ATTN_DECODE,
    PM_JOB_ATTN_BLOCK,
    PM_JOB_AMX_KV,
    PM_JOB_AMX_ATTN,
    PM_JOB_ROWS,
    PM_JOB_HEAD_PLANES
};

/* Blocks of at least this many tokens run their per-token steps (norms, activation
 * quantization, RoPE, residuals) split over the threads; smaller ones on the caller. */
#define PM_PAR_ROWS 16

/* Where the rows of a block go: one sequence (row i at position pos0 + i of kv), or a batch
 * of sequences (row i at position pos[i] of kvs[i], all distinct caches). */
typedef struct pm_seq {
    pocket_kv *kv;
    int pos0;
    pocket_kv *const *kvs;
    const int32_t *pos;
} pm_seq;

static inline pocket_kv *seq_kv(const pm_seq *s, int i) { return s->kvs ? s->kvs[i] : s->kv; }
static inline int seq_pos(const pm_seq *s, int i) { return s->pos ? s->pos[i] : s->pos0 + i; }

/* Whether a block of n tokens runs its products on the tile unit. */
static inline int pm_amx_path(const pocket_model *m, int n) {
    return PM_HAVE_AMX && m->amx_call && n >= PM_AMX_MIN_TOKENS;
}

/* Per-token steps of a layer: fn(r, i0, i1) processes tokens [i0, i1) of the block. */
struct pm_rows;
typedef void (*pm_rows_fn)(const struct pm_rows *r, int i0, int i1);
typedef struct pm_rows {
    pocket_model *m;
    const pm_seq *seq;
    int layer;
    const pm_act *act; /* activations to prepare (quantize / sum), or NULL */
    pm_rows_fn fn;
    const pocket_weight *lora[3]; /* step_lora: the weights whose adapters take lora_x */
    const float *lora_x;
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
    /* decode attention, rows [0, n): keys [lo[i], hi[i]) of row i, its units (KV head x
     * span) from ustart[i] to ustart[i + 1] */
    const int *lo_i, *hi_i, *ustart;
    const pm_seq *seq;   /* block */
    int layer, lo, hi, nspans, units;
    int end, last;     /* amx attention: keys < end exist; the last chunk of keys */
    const pm_rows *rows; /* PM_JOB_ROWS */
    const pm_act *post;  /* PM_JOB_GLU: the output prepared for W_down by each task, or NULL */
    const uint8_t *screened; /* PM_JOB_HEAD_PLANES: rows left to screen_rows (NULL: none) */
    int estimate;            /* PM_JOB_HEAD_PLANES: the high plane's estimates, every row */
    int status;
} pm_job;

/* Prepare columns [c0, c1) (whole blocks of 32) of token i of a planned input. */
static void prepare_cols(const pocket_model *m, const pm_act *a, int i, int c0, int c1) {
    const size_t C = (size_t)a->cols, nb = C / 32, off = (size_t)i * C + (size_t)c0;
    const size_t boff = (size_t)i * nb + (size_t)c0 / 32;
#if PM_HAVE_AMX
    if (a->xb) {
        pm_amx_act(a->x, a->cols, i, i + 1, c0, c1, a->xb, a->xl);
        return;
    }
#endif
    if (a->digits)
        m->ops->quant_act(a->x + off, 1, c1 - c0, a->digits, (int8_t *)a->q1 + off,
                          (int8_t *)a->q2 + off, (float *)a->dd + boff, (float *)a->bsum + boff,
                          (int32_t *)a->corr + boff);
    else
        m->ops->block_sums(a->x + off, 1, c1 - c0, (float *)a->bsum + boff);
}

/* LoRA adapters (pocket_weight.lora_*). Every token is computed alike, whatever the block
 * and however its columns are split over the threads, so that a row of a batch or of a
 * verification computes what a one-token decode computes. */

/* x A^T [n, slot k]: the adapter's inner values of the k-th weight of a product region */
static inline float *lora_slot(const pocket_model *m, int k) {
    return m->lora_t + (size_t)k * PM_BLOCK * (size_t)m->lora_rank;
}

/* A screened head (pocket_model.head_lo) over tile tl for the n rows of a prepared input, the
 * INT8 head's values: scr [n, 16]. */
static void head_planes_tile(pocket_model *m, const pm_act *act, int tl, float *scr) {
    pm_tiled h1 = m->tiled[7 * m->c.n_layers], l1 = m->head_lo;
    h1.data += (size_t)tl * h1.tile_bytes;
    l1.data += (size_t)tl * l1.tile_bytes;
    h1.rows = l1.rows = pm_tile_rows(&l1, tl);
    h1.ntiles = l1.ntiles = 1;
    m->ops->matmul_planes(&h1, &l1, act, scr, 16, 0, 1);
}

static void job_fail(pm_job *j, int rc) {
    if (rc) __atomic_store_n(&j->status, rc, __ATOMIC_RELAXED);
}

/* y[:, rb:re] = x W[rb:re]^T for one weight (task: the caller's task index). */
static int product_rows(const pocket_model *m, const pocket_weight *w, const pm_tiled *t,
                        const pm_job *j, float *y, int rb, int re, int task) {
    if (re <= rb) return POCKET_OK;
    if (t && j->quantized) { /* rb is a multiple of 16; re too, or the last row */
#if PM_HAVE_AMX
        if (j->act.xb) {
            pm_amx_matmul(t, j->act.xb, j->act.xl, j->act.n, y, (size_t)w->rows, rb / 16,
                          (re + 15) / 16, m->awbuf + (size_t)task * m->awbuf_stride,
                          j->act.one_term);
            return POCKET_OK;
        }
#endif
        m->ops->matmul_tiled(t, &j->act, y, (size_t)w->rows, rb / 16, (re + 15) / 16);
        return POCKET_OK;
    }
    /* The avx2 kernel table's float-activation products take one token and several tokens
     * by different routes (a dot product per row, or tiles over dequantized blocks), whose sums
     * round differently: there, one token at a time, so that a row's result never depends on
     * how many rows its block has (last-logits-only prefill, batched decode and speculative
     * verification compute what a one-token decode computes). That costs the avx2 level's
     * float-activation prefill its weight reuse; its default int8 activations take the tiled
     * products above, row-independent as they are. The scalar and neon tables compute every
     * token alike already, and keep their blocks. */
    const int step = m->kt->level == POCKET_LEVEL_AVX2 ? 1 : j->n;
    const size_t cols = (size_t)w->cols, ys = (size_t)w->rows;
    switch (w->type) {
    case POCKET_WT_Q4:
    case POCKET_WT_Q8:
        for (int i = 0; i < j->n; i += step) {
            const int n = j->n - i < step ? j->n - i : step;
            const float *x = j->x + (size_t)i * cols;
            float *yi = y + (size_t)i * ys;
            const int rc = w->type == POCKET_WT_Q4
                ? m->kt->matmul_q4_f32(x, n, w->cols, (const uint8_t *)w->data, w->scales,
                                       w->mins, w->rows, w->group_size, yi, rb, re)
                : m->kt->matmul_q8_f32(x, n, w->cols, (const int8_t *)w->data, w->scales,
                                       w->rows, w->group_size, yi, rb, re);
            if (rc) return rc;
        }
        return POCKET_OK;
    case POCKET_WT_F32:
        m->ops->matmul_f32(j->x, j->n, w->cols, (const float *)w->data, w->rows, y, rb, re);
        return POCKET_OK;
    default: return POCKET_EINVAL;
    }
}

/* The G query heads q of KV head kvh over the keys [a, b) of layer l of kv, from the start:
 * running maximum pm, sum pl and weighted values pacc (G, G, G * head_dim); s: the scratch of
 * pm_attn_args. */
static void attend(const pocket_model *m, const pocket_kv *kv, int l, int kvh, const float *q,
                   int a, int b, float *s, float *pm, float *pl, float *pacc) {
    const int G = m->group, hd = m->c.head_dim;
    for (int g = 0; g < G; g++) {
        pm[g] = -INFINITY;
        pl[g] = 0.0f;
    }
    memset(pacc, 0, (size_t)G * hd * sizeof(float));
    pm_attn_args A;
    A.q = q;
    A.G = G;
    A.hd = hd;
    A.scale = m->c.attn_scale;
    pm_kv_head(kv, l, kvh, &A);
    A.a = a;
    A.b = b;
    A.s = s;
    A.m = pm;
    A.l = pl;
    A.acc = pacc;
    m->ops->attn(&A);
}

static void pm_task(void *ctx, int task, int ntasks) {
    pm_job *j = (pm_job *)ctx;
    pocket_model *m = j->m;
    int b, e, rc = POCKET_OK;
    switch (j->kind) {
    case PM_JOB_CONCAT: {
        pocket_split_range(j->total, PM_ROW_UNIT, task, ntasks, &b, &e);
        int off = 0; /* matrices start at multiples of 16 of the split space */
        for (int k = 0; k < j->nmat && rc == POCKET_OK; k++) {
            const int rows = j->w[k]->rows;
            const int rb = (b > off ? b : off) - off, re = (e < off + rows ? e : off + rows) - off;
            if (re > rb) rc = product_rows(m, j->w[k], j->t[k], j, j->y[k], rb, re, task);
            if (re > rb && rc == POCKET_OK && j->w[k]->lora_rank)
                m->ops->lora_up(j->w[k], lora_slot(m, k), j->n, j->y[k], (size_t)rows, rb, re);
            off += (rows + PM_ROW_UNIT - 1) / PM_ROW_UNIT * PM_ROW_UNIT;
        }
        break;
    }
    case PM_JOB_GLU: {
        /* with j->post, whole blocks of 32 columns per task: each prepares its own */
        pocket_split_range(j->total, j->post ? 32 : PM_ROW_UNIT, task, ntasks, &b, &e);
        if (e <= b) break;
        rc = product_rows(m, j->w[0], j->t[0], j, j->y[0], b, e, task);
        if (rc == POCKET_OK) rc = product_rows(m, j->w[1], j->t[1], j, j->y[1], b, e, task);
        for (int k = 0; k < 2 && rc == POCKET_OK; k++)
            if (j->w[k]->lora_rank)
                m->ops->lora_up(j->w[k], lora_slot(m, k), j->n, j->y[k], (size_t)j->total, b, e);
        if (rc == POCKET_OK)
            for (int i = 0; i < j->n; i++)
                m->ops->glu(j->y[0] + (size_t)i * j->total + b, j->y[1] + (size_t)i * j->total + b,
                            (size_t)(e - b), m->c.act_gelu);
        if (rc == POCKET_OK && j->post)
            for (int i = 0; i < j->n; i++) prepare_cols(m, j->post, i, b, e);
        break;
    }
    case PM_JOB_ATTN_DECODE: {
        /* units u = ustart[i] + kvh * nspans_i + s: keys [lo + s * SPAN, ...) of KV head kvh
         * of row i, each row as a one-token decode splits it (aligned spans) */
        const int G = m->group, hd = m->c.head_dim;
        pocket_split_range(j->units, 1, task, ntasks, &b, &e);
        float *scr = m->tscr + (size_t)task * m->tscr_stride;
        int i = 0;
        for (int u = b; u < e; u++) {
            while (u >= j->ustart[i + 1]) i++;
            const int lo = j->lo_i[i], hi = j->hi_i[i];
            const int nspans = (hi - 1) / PM_SPAN - lo / PM_SPAN + 1;
            const int kvh = (u - j->ustart[i]) / nspans, s = (u - j->ustart[i]) % nspans;
            float *p = m->part + (size_t)u * G * (hd + 2);
            float *pm = p, *pl = p + G, *pacc = p + 2 * G;
            const int s0 = (lo / PM_SPAN + s) * PM_SPAN; /* aligned span */
            attend(m, seq_kv(j->seq, i), j->layer, kvh,
                   m->q + (size_t)i * m->q_dim + (size_t)kvh * G * hd, s0 > lo ? s0 : lo,
                   s0 + PM_SPAN < hi ? s0 + PM_SPAN : hi, scr, pm, pl, pacc);
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
            const int i = u / nkv, kvh = u % nkv, pos = seq_pos(j->seq, i);
            const pocket_kv *kv = seq_kv(j->seq, i);
            attend(m, kv, j->layer, kvh, m->q + (size_t)i * m->q_dim + (size_t)kvh * G * hd,
                   win && pos - win + 1 > 0 ? pos - win + 1 : 0, pos + 1, scr, pm, pl, pacc);
            float *out = m->att + (size_t)i * m->q_dim + (size_t)kvh * G * hd;
            for (int g = 0; g < G; g++) {
                const float l = pl[g];
                for (int c = 0; c < hd; c++) out[(size_t)g * hd + c] = pacc[(size_t)g * hd + c] / l;
            }
        }
        break;
    }
#if PM_HAVE_AMX
    case PM_JOB_AMX_KV: {
        /* units u = kvh * chunks + c: 32 keys from j->lo of KV head kvh */
        const int hd = m->c.head_dim, nc = (j->hi - j->lo) / 32;
        const size_t buf = (size_t)PM_AMX_KCHUNK * hd;
        pocket_split_range(j->units, 1, task, ntasks, &b, &e);
        for (int u = b; u < e;) {
            const int kvh = u / nc, c0 = u % nc, c1 = e - u < nc - c0 ? c0 + (e - u) : nc;
            uint16_t *kh = m->akv + (size_t)kvh * 4 * buf;
            pm_attn_args H;
            pm_kv_head(j->seq->kv, j->layer, kvh, &H);
            pm_amx_attn_kv(H.K, H.V, H.ks, H.vs, H.fmt, hd, j->lo, j->end, c0, c1, kh, kh + buf,
                           kh + 2 * buf, kh + 3 * buf);
            u += c1 - c0;
        }
        break;
    }
    case PM_JOB_AMX_ATTN: {
        /* units u = tile * n_heads + h: 16 query rows of head h, dealt round-robin */
        const int hd = m->c.head_dim, nh = m->c.n_heads, qd = m->q_dim;
        const size_t buf = (size_t)PM_AMX_KCHUNK * hd;
        for (int u = task; u < j->units; u += ntasks) {
            const int tile = u / nh, h = u % nh, i0 = 16 * tile;
            const uint16_t *kh = m->akv + (size_t)(h / m->group) * 4 * buf;
            pm_amx_attn_args A;
            A.q = m->q + (size_t)i0 * qd + (size_t)h * hd;
            A.qstride = (size_t)qd;
            A.nq = j->n - i0 < 16 ? j->n - i0 : 16;
            A.hd = hd;
            A.pos0 = j->seq->pos0 + i0;
            A.win = m->layers[j->layer].sliding ? m->c.sliding_window : 0;
            A.scale = m->c.attn_scale;
            A.kh = kh;
            A.kl = kh + buf;
            A.vh = kh + 2 * buf;
            A.vl = kh + 3 * buf;
            A.k0 = j->lo;
            A.nk = j->hi - j->lo;
            A.m = m->aml + (size_t)h * PM_BLOCK + i0;
            A.l = A.m + (size_t)nh * PM_BLOCK;
            A.acc = m->att + (size_t)i0 * qd + (size_t)h * hd;
            A.astride = (size_t)qd;
            A.last = j->last;
            A.scratch = m->ascr + (size_t)task * PM_AMX_ATTN_SCRATCH(hd);
            pm_amx_attn(&A);
        }
        break;
    }
#endif
    case PM_JOB_ROWS:
        pocket_split_range(j->n, 1, task, ntasks, &b, &e);
        if (e > b) j->rows->fn(j->rows, b, e);
        break;
    case PM_JOB_HEAD_PLANES: {
        /* over tiles [b, e): the high plane's estimates of every row (estimate), else the INT8
         * head's values for the rows not screened */
        const pm_tiled *hi = &m->tiled[7 * m->c.n_layers];
        const size_t V = (size_t)m->head_lo.rows;
        pocket_split_range(m->head_lo.ntiles, 1, task, ntasks, &b, &e);
        if (e <= b) break;
        if (j->estimate || !j->screened) { /* every row: the estimate, or the INT8 values */
            m->ops->matmul_planes(hi, j->estimate ? NULL : &m->head_lo, &j->act, j->y[0], V, b, e);
            break;
        }
        float scr[PM_BLOCK * 16];
        for (int tl = b; tl < e; tl++) {
            const int nr = pm_tile_rows(&m->head_lo, tl);
            head_planes_tile(m, &j->act, tl, scr);
            for (int i = 0; i < j->n; i++)
                if (!j->screened[i])
                    memcpy(j->y[0] + (size_t)i * V + 16 * (size_t)tl, scr + i * 16,
                           sizeof(float) * (size_t)nr);
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

/* How the products of class `cls` over the weights tiled[0..nmat) take their input x [n, cols]:
 * fills *act (digits 1-2: int8 digits; 0: float with block sums) and returns 1 when the tiled
 * kernels run them, 0 when the original-layout kernels do (act unused). amx: on the tile unit
 * (pm_amx_path). */
static int plan_act(const pocket_model *m, int cls, const pm_tiled *tiled, int nmat,
                    const float *x, int n, int cols, int slot, int amx, pm_act *act) {
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
    if (amx) {
        act->xb = m->axb[slot];
        act->xl = m->axb[slot] + (size_t)PM_BLOCK * (size_t)m->max_in;
        act->one_term = (m->amx_one_term & cls) != 0;
    }
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
#if PM_HAVE_AMX
    if (a->xb) {
        pm_amx_act(a->x, a->cols, i0, i1, 0, a->cols, a->xb, a->xl);
        return;
    }
#endif
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
    pm_job j = {.m = m, .kind = kind, .n = n, .nmat = nmat, .w = {w0, w1, w2}, .y = {y0, y1, y2},
                .x = x, .post = post};
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
    if (j.quantized && j.act.xb) {
        const int rc = pm_ensure_amx_scratch(m, tasks);
        if (rc) return rc;
    }
    return run_job(&j, pool, tasks);
}

/* Run r->fn over the block's n tokens: split over the threads for long blocks. */
static int run_rows(pocket_model *m, pocket_pool *pool, int nthreads, int n, const pm_rows *r) {
    if (n < PM_PAR_ROWS || nthreads < 2) {
        r->fn(r, 0, n);
        return POCKET_OK;
    }
    pm_job j = {.m = m, .kind = PM_JOB_ROWS, .n = n, .rows = r};
    return run_job(&j, pool, nthreads);
}

/* =========================================================================================
 * Serial steps
 * ========================================================================================= */

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
        if (from_head && m->head_screen) {
            pm_tiled_row_planes(head, &m->head_lo, r, xi);
        } else if (from_head) {
            pm_tiled_row(head, r, xi);
        } else if (w->type == POCKET_WT_F32) {
            memcpy(xi, (const float *)w->data + r * d, d * sizeof(float));
        } else if (w->type == POCKET_WT_Q8) {
            const int8_t *q = (const int8_t *)w->data + r * d;
            const uint16_t *s = w->scales + r * ng;
            for (size_t c = 0; c < d; c++) xi[c] = (float)q[c] * pocket_f16_to_f32(s[c / gs]);
        } else { /* INT4, INT5: blocks of 32 columns, [high bits (INT5)] nibbles */
            const int q5 = w->type == POCKET_WT_Q5;
            const uint8_t *q = (const uint8_t *)w->data + r * pm_row_bytes(w);
            const uint16_t *s = w->scales + r * ng, *mn = w->mins + r * ng;
            for (size_t b = 0; b < d / 32; b++, q += q5 ? 20 : 16) {
                const uint32_t qh = q5 ? (uint32_t)q[0] | (uint32_t)q[1] << 8 |
                                             (uint32_t)q[2] << 16 | (uint32_t)q[3] << 24
                                       : 0;
                const uint8_t *nib = q + (q5 ? 4 : 0);
                for (size_t k = 0; k < 16; k++) {
                    const size_t c0 = 32 * b + k, c1 = c0 + 16;
                    const unsigned v0 = (nib[k] & 15u) | ((qh >> k) & 1u) << 4;
                    const unsigned v1 = (nib[k] >> 4) | ((qh >> (k + 16)) & 1u) << 4;
                    xi[c0] = (float)v0 * pocket_f16_to_f32(s[c0 / gs]) +
                             pocket_f16_to_f32(mn[c0 / gs]);
                    xi[c1] = (float)v1 * pocket_f16_to_f32(s[c1 / gs]) +
                             pocket_f16_to_f32(mn[c1 / gs]);
                }
            }
        }
        if (m->c.embed_scale != 1.0f)
            for (size_t c = 0; c < d; c++) xi[c] *= m->c.embed_scale;
        if (!from_head && m->c.release_lookups && w->type != POCKET_WT_F32) {
            /* a separate embedding stays in the file: drop the pages a lookup mapped (the
             * kernel maps whole large folios, ~1 MB a row), so lookups never add up */
            const size_t rb = pm_row_bytes(w);
            pm_release_around((const uint8_t *)w->data + r * rb, rb);
            pm_release_around(w->scales + r * ng, ng * sizeof(uint16_t));
            if (w->type != POCKET_WT_Q8 && !w->mins_in_memory)
                pm_release_around(w->mins + r * ng, ng * sizeof(uint16_t));
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

/* x [PM_KV_QBLOCK] -> int8 q[i * stride] = round(x[i] / d) (to nearest even, within +-127),
 * d = float16(max |x| / 127); returns d's float16 bits (0 for all zeros; NaN when x holds a
 * NaN or an infinity, which the logits then show). */
static uint16_t kv_quant(const pocket_model *m, const float *x, int8_t *q, size_t stride) {
    float amax = 0.0f, bad = 0.0f;
    for (int i = 0; i < PM_KV_QBLOCK; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
        bad += x[i] * 0.0f; /* NaN for a NaN or an infinity */
    }
    const float d0 = bad == 0.0f ? amax / 127.0f : NAN;
    uint16_t dh;
    m->ops->to_f16(&d0, &dh, 1);
    const float d = pocket_f16_to_f32(dh);
    for (int i = 0; i < PM_KV_QBLOCK; i++) {
        const float r = d > 0.0f ? nearbyintf(x[i] / d) : 0.0f; /* d NaN: 0 */
        q[(size_t)i * stride] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
    }
    return dh;
}

/* Biases, q/k norms, RoPE for the block's q and k; k and v into the cache. */
static void post_qkv(pocket_model *m, const pm_seq *seq, int layer, int i0, int i1) {
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
        pocket_kv *kv = seq_kv(seq, i);
        const size_t pos = (size_t)seq_pos(seq, i);
        const float *cs = m->rcos[base] + pos * H, *sn = m->rsin[base] + pos * H;
        rope_heads(q, nh, hd, cs, sn);
        rope_heads(k, nkv, hd, cs, sn);
        for (int h = 0; h < nkv; h++) {
            const size_t head = (size_t)layer * kv->layer_stride + (size_t)h * kv->head_stride;
            const size_t vdst = head + pos * (size_t)hd;
            const size_t kdst = head + pm_k_index((int)pos, 0, hd); /* then stride 16 */
            const float *kh = k + (size_t)h * hd;
            if (kv->fmt == POCKET_KV_Q8) {
                pm_attn_args A;
                pm_kv_head(kv, layer, h, &A);
                const int nb = hd / PM_KV_QBLOCK, B = PM_KV_QBLOCK;
                if (L->k_smooth) { /* the key's channels evened out, its queries scaled back */
                    const float *sm = L->k_smooth + (size_t)h * hd;
                    float *kw = (float *)kh, *qg = q + (size_t)h * m->group * hd;
                    for (int e = 0; e < hd; e++) kw[e] /= sm[e];
                    for (int g = 0; g < m->group; g++)
                        for (int e = 0; e < hd; e++) qg[(size_t)g * hd + e] *= sm[e];
                }
                for (int b = 0; b < nb; b++) {
                    ((uint16_t *)A.ks)[pm_k_index((int)pos, b, nb)] =
                        kv_quant(m, kh + B * b, (int8_t *)kv->k + kdst + (size_t)16 * B * b, 16);
                    ((uint16_t *)A.vs)[pos * nb + b] = kv_quant(
                        m, v + (size_t)h * hd + B * b, (int8_t *)kv->v + vdst + B * b, 1);
                }
            } else if (kv->fmt == POCKET_KV_F16) {
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

/* Merge the decode partials of every query head of row `row` (its units from u0) into that
 * row of m->att. */
static void merge_partials(pocket_model *m, int nspans, int row, int u0) {
    const int G = m->group, hd = m->c.head_dim;
    const float *part = m->part + (size_t)u0 * G * (hd + 2);
    for (int h = 0; h < m->c.n_heads; h++) {
        const int kvh = h / G, g = h % G;
        float M = -INFINITY;
        for (int s = 0; s < nspans; s++) {
            const float *p = part + (size_t)(kvh * nspans + s) * G * (hd + 2);
            if (p[g] > M) M = p[g];
        }
        float *out = m->att + (size_t)row * m->q_dim + (size_t)h * hd;
        if (nspans == 1) {
            const float *p = part + (size_t)kvh * G * (hd + 2);
            const float l = p[G + g];
            for (int c = 0; c < hd; c++) out[c] = p[2 * G + (size_t)g * hd + c] / l;
            continue;
        }
        float L = 0.0f;
        for (int c = 0; c < hd; c++) out[c] = 0.0f;
        for (int s = 0; s < nspans; s++) {
            const float *p = part + (size_t)(kvh * nspans + s) * G * (hd + 2);
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

static void step_lora(const pm_rows *r, int i0, int i1) { /* x A^T of each adapter */
    for (int k = 0; k < 3; k++)
        if (r->lora[k]) r->m->ops->lora_down(r->lora[k], r->lora_x, i0, i1, lora_slot(r->m, k));
}

/* Before a product region over w0..w2 (NULL: absent) on x [n, cols]: the inner values x A^T of
 * the adapters among them, into their slots (nothing when none has one). */
static int lora_prepare(pocket_model *m, pocket_pool *pool, int nthreads, int n, const float *x,
                        const pocket_weight *w0, const pocket_weight *w1,
                        const pocket_weight *w2) {
    if (!m->lora_rank) return POCKET_OK;
    const pocket_weight *ws[3] = {w0, w1, w2};
    pm_rows r = {.m = m, .fn = step_lora, .lora_x = x};
    int any = 0;
    for (int k = 0; k < 3; k++) {
        r.lora[k] = ws[k] && ws[k]->lora_rank ? ws[k] : NULL;
        any |= r.lora[k] != NULL;
    }
    /* on the caller for short blocks (decode): a parallel region costs more than it saves */
    return any ? run_rows(m, pool, nthreads, n, &r) : POCKET_OK;
}

/* Per-token steps of a layer (pm_rows_fn). */
static void step_pre_attn(const pm_rows *r, int i0, int i1) { /* h = norm(x); prepare h */
    pocket_model *m = r->m;
    const int d = m->c.d_model;
    m->ops->rmsnorm(m->x + (size_t)i0 * d, m->layers[r->layer].attn_norm, i1 - i0, d,
                    m->c.norm_eps, m->h + (size_t)i0 * d);
    prepare_act(m, r->act, i0, i1);
}

static void step_post_qkv(const pm_rows *r, int i0, int i1) {
    post_qkv(r->m, r->seq, r->layer, i0, i1);
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

/* Attention of a prefill block on the tile unit (pm_amx_attn): the keys the block sees in
 * chunks of PM_AMX_KCHUNK, each converted once (one parallel region) and then attended to by
 * every 16 query rows of every head (a second one). */
static int attn_amx(pm_job *jp, int block_pos0, pocket_pool *pool, int nthreads) {
    pm_job j = *jp; /* m, seq, layer, n and kv set by layer_forward */
    pocket_model *m = j.m;
    const pm_seq *seq = j.seq;
    const int l = j.layer, n = j.n;
    const int win = m->layers[l].sliding ? m->c.sliding_window : 0;
    const int nh = m->c.n_heads, ntiles = (n + 15) / 16;
    /* the key chunks start at the multiple of PM_AMX_KCHUNK at or before the window of the
     * block's first token (block_pos0), also when only its last rows are attended
     * (layer_forward's out0): every row sees the same chunks of keys, at the same positions
     * wherever a prompt is cut into calls and blocks (each chunk is a step of the online
     * softmax, so its bounds set the rounding) */
    const int end = seq->pos0 + n,
              first = win && block_pos0 - win + 1 > 0
                          ? (block_pos0 - win + 1) / PM_AMX_KCHUNK * PM_AMX_KCHUNK
                          : 0;
    const int tasks = nthreads < ntiles * nh ? nthreads : ntiles * nh;
    int rc = pm_ensure_amx_attn(m, tasks);
    if (rc) return rc;
    for (int h = 0; h < nh; h++)
        for (int i = 0; i < n; i++) {
            m->aml[(size_t)h * PM_BLOCK + i] = -INFINITY;
            m->aml[(size_t)(nh + h) * PM_BLOCK + i] = 0.0f;
        }
    j.end = end;
    for (int k0 = first & ~31; k0 < end; k0 += PM_AMX_KCHUNK) {
        const int k1 = k0 + PM_AMX_KCHUNK < end ? k0 + PM_AMX_KCHUNK : (end + 31) & ~31;
        j.lo = k0;
        j.hi = k1;
        j.last = k0 + PM_AMX_KCHUNK >= end;
        j.kind = PM_JOB_AMX_KV;
        j.units = m->c.n_kv_heads * ((k1 - k0) / 32);
        if ((rc = run_job(&j, pool, j.units < nthreads ? j.units : nthreads))) return rc;
        j.kind = PM_JOB_AMX_ATTN;
        j.units = ntiles * nh;
        if ((rc = run_job(&j, pool, tasks))) return rc;
    }
    return POCKET_OK;
}

/* Layer l over the block's n tokens (its input and output in m->x). Rows [0, out0) are needed
 * no further than their keys and values (the last layer of a prefill that returns the logits
 * of its last token): after the keys and values of all n rows are stored, attention and the
 * MLP run on rows [out0, n) alone, moved to the front of m->x, on the paths the whole block
 * takes (tile unit or not, block attention rather than one token's), so their numbers are those
 * of the whole block. out0 = n: no rows go on. */
static int layer_forward(pocket_model *m, const pm_seq *seq, int l, int n, int out0,
                         pocket_pool *pool, int nthreads) {
    const pocket_layer_weights *L = &m->layers[l];
    const int d = m->c.d_model, qd = m->q_dim, ff = m->c.d_ff;
    const pm_tiled *T = m->tiled + (size_t)7 * l;
    const int amx = pm_amx_path(m, n), one = n == 1 && !seq->kvs, block_pos0 = seq->pos0;
    pm_rows r = {m, seq, l, NULL, NULL};
    pm_act act;
    int rc;

    /* attention */
    const int tq = plan_act(m, POCKET_Q8_QKV, T, 3, m->h, n, d, 0, amx, &act);
    r.act = tq ? &act : NULL;
    r.fn = step_pre_attn;
    if ((rc = run_rows(m, pool, nthreads, n, &r))) return rc;
    if ((rc = lora_prepare(m, pool, nthreads, n, m->h, &L->wq, &L->wk, &L->wv))) return rc;
    rc = run_products(m, pool, nthreads, PM_JOB_CONCAT, 3, &L->wq, &L->wk, &L->wv, T, r.act,
                      m->q, m->k, m->v, m->h, n, NULL);
    if (rc) return rc;
    r.act = NULL;
    r.fn = step_post_qkv;
    if ((rc = run_rows(m, pool, nthreads, n, &r))) return rc;

    pm_seq rest;
    if (out0 > 0 && !seq->kvs) {
        if (out0 >= n) return POCKET_OK;
        n -= out0;
        memmove(m->x, m->x + (size_t)out0 * d, (size_t)n * d * sizeof(float));
        memmove(m->q, m->q + (size_t)out0 * qd, (size_t)n * qd * sizeof(float));
        rest = *seq;
        rest.pos0 += out0;
        seq = &rest;
        r.seq = seq;
    }

    pm_job j = {.m = m, .n = n, .seq = seq, .layer = l};
    const int nkv = m->c.n_kv_heads;
    if (one || m->verify_call || seq->kvs) {
        /* one token, verification rows, a batch of sequences: each row's keys split into
         * aligned spans over the threads and merged in order, as a one-token decode does, so
         * that every row computes exactly what that one-token decode computes */
        int lo[PM_BLOCK], hi[PM_BLOCK], ustart[PM_BLOCK + 1];
        const int win = L->sliding ? m->c.sliding_window : 0;
        ustart[0] = 0;
        for (int i = 0; i < n; i++) {
            const int pos = seq_pos(seq, i);
            hi[i] = pos + 1;
            lo[i] = win && pos - win + 1 > 0 ? pos - win + 1 : 0;
            ustart[i + 1] = ustart[i] + nkv * ((hi[i] - 1) / PM_SPAN - lo[i] / PM_SPAN + 1);
        }
        j.kind = PM_JOB_ATTN_DECODE;
        j.lo_i = lo;
        j.hi_i = hi;
        j.ustart = ustart;
        j.units = ustart[n];
        int tasks = j.units < nthreads ? j.units : nthreads;
        if ((rc = pm_ensure_attn_scratch(m, tasks, (size_t)j.units))) return rc;
        if ((rc = run_job(&j, pool, tasks))) return rc;
        for (int i = 0; i < n; i++)
            merge_partials(m, (ustart[i + 1] - ustart[i]) / nkv, i, ustart[i]);
    } else if (amx && !seq->kvs && m->c.head_dim % 32 == 0) {
        if ((rc = attn_amx(&j, block_pos0, pool, nthreads))) return rc;
    } else {
        j.kind = PM_JOB_ATTN_BLOCK;
        j.units = n * nkv;
        int tasks = j.units < nthreads ? j.units : nthreads;
        if ((rc = pm_ensure_attn_scratch(m, tasks, 0))) return rc;
        if ((rc = run_job(&j, pool, tasks))) return rc;
    }
    const int to = plan_act(m, POCKET_Q8_WO, T + 3, 1, m->att, n, qd, 0, amx, &act);
    r.act = to ? &act : NULL;
    r.fn = step_prepare;
    if (r.act && (rc = run_rows(m, pool, nthreads, n, &r))) return rc;
    if ((rc = lora_prepare(m, pool, nthreads, n, m->att, &L->wo, NULL, NULL))) return rc;
    rc = run_products(m, pool, nthreads, PM_JOB_CONCAT, 1, &L->wo, NULL, NULL, T + 3, r.act,
                      m->o, NULL, NULL, m->att, n, NULL);
    if (rc) return rc;

    /* MLP */
    const int tg = plan_act(m, POCKET_Q8_GATE_UP, T + 4, 2, m->h, n, d, 0, amx, &act);
    r.act = tg ? &act : NULL;
    r.fn = step_post_attn;
    if ((rc = run_rows(m, pool, nthreads, n, &r))) return rc;
    pm_act act_dn; /* the GLU tasks prepare their own columns of W_down's input */
    const int tdn = plan_act(m, POCKET_Q8_DOWN, T + 6, 1, m->gate, n, ff, 1, amx, &act_dn);
    if ((rc = lora_prepare(m, pool, nthreads, n, m->h, &L->wgate, &L->wup, NULL))) return rc;
    rc = run_products(m, pool, nthreads, PM_JOB_GLU, 2, &L->wgate, &L->wup, NULL, T + 4, r.act,
                      m->gate, m->up, NULL, m->h, n, tdn ? &act_dn : NULL);
    if (rc) return rc;
    if ((rc = lora_prepare(m, pool, nthreads, n, m->gate, &L->wdown, NULL, NULL))) return rc;
    rc = run_products(m, pool, nthreads, PM_JOB_CONCAT, 1, &L->wdown, NULL, NULL, T + 6,
                      tdn ? &act_dn : NULL, m->o, NULL, NULL, m->gate, n, NULL);
    if (rc) return rc;
    r.act = NULL;
    r.fn = step_post_mlp;
    return run_rows(m, pool, nthreads, n, &r);
}

/* The K tiles (16 rows each) of y [V] with the largest maxima, in tiles[]; returns how many
 * (fewer when the vocabulary has fewer tiles). They hold the K largest logits, and more. NaN
 * logits never count. */
static int screen_tiles(const float *y, int V, int K, int *tiles, float *val) {
    const int nt = (V + 15) / 16;
    int n = 0, lo = 0; /* the best so far in tiles/val; lo: the position of the smallest */
    for (int tl = 0; tl < nt; tl++) {
        const float *yt = y + 16 * (size_t)tl;
        const int nr = V - 16 * tl < 16 ? V - 16 * tl : 16;
        float v = -INFINITY;
        for (int r = 0; r < nr; r++) v = yt[r] > v ? yt[r] : v;
        if (n < K) {
            tiles[n] = tl;
            val[n] = v;
            if (v < val[lo]) lo = n;
            n++;
            continue;
        }
        if (!(v > val[lo])) continue;
        tiles[lo] = tl;
        val[lo] = v;
        for (int k = 0; k < K; k++)
            if (val[k] < val[lo]) lo = k;
    }
    return n;
}

/* A screened head's second pass over nrows rows of logits y [nrows, V] (the high plane's
 * estimates): each screened row gets the INT8 head's values on its own K best tiles, computed
 * for that row alone, so that a row's result never depends on the others in its block. */
static int screen_rows(pocket_model *m, const pm_act *act, float *y, int nrows,
                       const uint8_t *screened) {
    const int K = m->head_screen, V = m->head_lo.rows, nb = act->cols / 32;
    int tiles[PM_SCREEN_MAX];
    float val[PM_SCREEN_MAX], scr[16];
    for (int i = 0; i < nrows; i++) {
        if (!screened[i]) continue;
        float *yi = y + (size_t)i * V;
        const int nt = screen_tiles(yi, V, K, tiles, val);
        pm_act one = *act; /* row i alone */
        one.n = 1;
        one.x = act->x + (size_t)i * act->cols;
        one.q1 = act->q1 + (size_t)i * act->cols;
        one.q2 = act->q2 + (size_t)i * act->cols;
        one.dd = act->dd + (size_t)i * nb;
        one.bsum = act->bsum + (size_t)i * nb;
        one.corr = act->corr + (size_t)i * nb;
        for (int t = 0; t < nt; t++) {
            head_planes_tile(m, &one, tiles[t], scr);
            memcpy(yi + 16 * (size_t)tiles[t], scr,
                   sizeof(float) * (size_t)pm_tile_rows(&m->head_lo, tiles[t]));
        }
    }
    return POCKET_OK;
}

/* Room for the head patch's logits of nrows rows (m->patch_y [nrows][patch.rows]). */
static int patch_room(pocket_model *m, int nrows) {
    if (nrows <= m->patch_cap) return POCKET_OK;
    float *py = (float *)pm_zalloc((size_t)nrows * (size_t)m->patch.rows, sizeof(float));
    if (!py) return POCKET_ENOMEM;
    free(m->patch_y);
    m->patch_y = py;
    m->patch_cap = nrows;
    return POCKET_OK;
}

/* The head patch's logits of nrows rows (m->patch_y) written over theirs in y [nrows, vocab],
 * by the patch's ids. */
static void patch_scatter(const pocket_model *m, int nrows, float *y) {
    const size_t K = (size_t)m->patch.rows, V = (size_t)m->c.vocab_size;
    for (int i = 0; i < nrows; i++) {
        const float *pi = m->patch_y + (size_t)i * K;
        float *yi = y + (size_t)i * V;
        for (size_t k = 0; k < K; k++) yi[m->patch_ids[k]] = pi[k];
    }
}

/* Output head over rows [rows0, rows0 + nrows) of the block: y [nrows, vocab]. screened:
 * per row, whether a screened head may leave estimates outside its K best tiles (NULL:
 * every logit the head's). A screened head's rows that want every logit get the INT8 head's
 * values bit for bit (pm_ops.matmul_planes); its products never take the AMX path. */
static int head_rows(pocket_model *m, int rows0, int nrows, float *y, pocket_pool *pool,
                     int nthreads, const uint8_t *screened) {
    const int d = m->c.d_model;
    m->ops->rmsnorm(m->x + (size_t)rows0 * d, m->final_norm, nrows, d, m->c.norm_eps, m->h);
    const pm_tiled *th = m->tiled + (size_t)7 * m->c.n_layers; /* the head, then the patch */
    const int np = m->patch.rows > 0;
    pm_act act;
    const int use = plan_act(m, POCKET_Q8_HEAD, th, 1 + np, m->h, nrows, d, 0,
                             !m->head_screen && pm_amx_path(m, nrows), &act);
    if (use) prepare_act(m, &act, 0, nrows);
    int nscreen = 0;
    for (int i = 0; m->head_screen && use && screened && i < nrows; i++)
        nscreen += screened[i] != 0;
    if (!m->head_screen || !use) {
        /* a head patch (never beside a screened head: pocket_model_create) is one more matrix
         * of the same product region, its rows computed as the head's are, then scattered */
        int rc = np ? patch_room(m, nrows) : POCKET_OK;
        if (rc == POCKET_OK)
            rc = run_products(m, pool, nthreads, PM_JOB_CONCAT, 1 + np, &m->head,
                              np ? &m->patch : NULL, NULL, th, use ? &act : NULL, y,
                              np ? m->patch_y : NULL, NULL, m->h, nrows, NULL);
        if (rc == POCKET_OK && np) patch_scatter(m, nrows, y);
        return rc;
    }
    const int tasks = m->head_lo.ntiles < nthreads ? m->head_lo.ntiles : nthreads;
    for (int pass = nscreen ? 0 : 1; pass < (nscreen < nrows ? 2 : 1); pass++) {
        /* pass 0: the estimates (screened rows); pass 1: the INT8 values (the other rows) */
        pm_job j = {.m = m, .kind = PM_JOB_HEAD_PLANES, .n = nrows, .y = {y, NULL, NULL}};
        j.quantized = 1;
        j.act = act;
        j.estimate = pass == 0;
        j.screened = pass == 1 && nscreen ? screened : NULL;
        const int rc = run_job(&j, pool, tasks);
        if (rc) return rc;
    }
    return nscreen ? screen_rows(m, &act, y, nrows, screened) : POCKET_OK;
}

void pocket_model_set_screen(pocket_model *m, const uint8_t *rows) {
    if (m) m->screen_rows = rows;
}

static int check_threads(pocket_pool *pool, int *nthreads) {
    if (*nthreads < 1 || *nthreads > PM_MAX_THREADS) return POCKET_EINVAL;
    if (pool && pocket_pool_size(pool) < *nthreads) *nthreads = pocket_pool_size(pool);
    if (!pool) *nthreads = 1;
    return POCKET_OK;
}

int pocket_model_forward(pocket_model *m, pocket_kv *kv, const int32_t *ids, int n,
                         int start_pos, float *logits, int all_logits, pocket_pool *pool,
                         int nthreads) {
    const uint8_t *screened = m ? m->screen_rows : NULL;
    if (m) m->screen_rows = NULL;
    if (!m || !kv || !ids || !logits || kv->model != m) return POCKET_EINVAL;
    if (n <= 0 || start_pos < 0 || (long long)start_pos + n > kv->capacity) return POCKET_EINVAL;
    if (check_threads(pool, &nthreads) || (all_logits != 0 && all_logits != 1))
        return POCKET_EINVAL;
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= m->c.vocab_size) return POCKET_EINVAL;
    int rc = pm_ensure_rope(m, start_pos + n);
    if (rc) return rc;
    m->amx_call = m->amx;
    m->verify_call = 0;
    const size_t V = (size_t)m->c.vocab_size;
    for (int b0 = 0, nb; b0 < n; b0 += nb) {
        nb = n - b0 < PM_BLOCK ? n - b0 : PM_BLOCK;
        /* on the tile unit no block is left with fewer than PM_AMX_MIN_TOKENS rows (they
         * would take the int8 products): a call's rows then round alike wherever the call
         * is cut, as long as each call holds that many */
        const int rest = n - b0 - nb;
        if (pm_amx_path(m, n) && rest > 0 && rest < PM_AMX_MIN_TOKENS)
            nb -= PM_AMX_MIN_TOKENS - rest;
        const pm_seq seq = {kv, start_pos + b0, NULL, NULL};
        embed_rows(m, ids + b0, nb, m->x);
        /* without all_logits the last layer goes on with the block's last row (the last
         * block) or none (the others): out0 */
        const int last = m->c.n_layers - 1, out0 = all_logits ? 0 : b0 + nb == n ? nb - 1 : nb;
        for (int l = 0; l < m->c.n_layers; l++) {
            rc = layer_forward(m, &seq, l, nb, l == last ? out0 : 0, pool, nthreads);
            if (rc) return rc;
        }
        if (all_logits)
            rc = head_rows(m, 0, nb, logits + (size_t)b0 * V, pool, nthreads, NULL);
        else if (b0 + nb == n) /* the last row, now at the front */
            rc = head_rows(m, 0, 1, logits, pool, nthreads, screened);
        if (rc) return rc;
    }
    return POCKET_OK;
}

/* Rows of several sequences, each as a one-token decode at its position computes it (see
 * pocket_model_forward_batch and pocket_model_verify_batch); `repeats`: a cache may have
 * several rows, at increasing positions (verification), else one each (a decode step). */
static int decode_rows(pocket_model *m, pocket_kv *const *kvs, const int32_t *ids,
                       const int32_t *pos, int n, float *logits, pocket_pool *pool, int nthreads,
                       int repeats) {
    const uint8_t *screened = m ? m->screen_rows : NULL;
    if (m) m->screen_rows = NULL;
    if (!m || !kvs || !ids || !pos || !logits || n <= 0) return POCKET_EINVAL;
    if (check_threads(pool, &nthreads)) return POCKET_EINVAL;
    int need = 0;
    for (int i = 0; i < n; i++) {
        const pocket_kv *kv = kvs[i];
        if (!kv || kv->model != m || ids[i] < 0 || ids[i] >= m->c.vocab_size || pos[i] < 0 ||
            pos[i] >= kv->capacity)
            return POCKET_EINVAL;
        for (int k = 0; k < i; k++)
            if (kvs[k] == kv && (!repeats || pos[k] >= pos[i])) return POCKET_EINVAL;
        if (pos[i] + 1 > need) need = pos[i] + 1;
    }
    int rc = pm_ensure_rope(m, need);
    if (rc) return rc;
    m->amx_call = 0; /* the int8 products of one-token decode, whatever the batch size */
    m->verify_call = repeats;
    const size_t V = (size_t)m->c.vocab_size;
    for (int b0 = 0; b0 < n && rc == POCKET_OK; b0 += PM_BLOCK) {
        const int nb = n - b0 < PM_BLOCK ? n - b0 : PM_BLOCK;
        const pm_seq seq = {NULL, 0, kvs + b0, pos + b0};
        embed_rows(m, ids + b0, nb, m->x);
        for (int l = 0; l < m->c.n_layers && rc == POCKET_OK; l++)
            rc = layer_forward(m, &seq, l, nb, 0, pool, nthreads);
        if (rc == POCKET_OK)
            rc = head_rows(m, 0, nb, logits + (size_t)b0 * V, pool, nthreads,
                           screened ? screened + b0 : NULL);
    }
    m->verify_call = 0;
    return rc;
}

int pocket_model_forward_batch(pocket_model *m, pocket_kv *const *kvs, const int32_t *ids,
                               const int32_t *pos, int n, float *logits, pocket_pool *pool,
                               int nthreads) {
    return decode_rows(m, kvs, ids, pos, n, logits, pool, nthreads, 0);
}

int pocket_model_verify_batch(pocket_model *m, pocket_kv *const *kvs, const int32_t *ids,
                              const int32_t *pos, int n, float *logits, pocket_pool *pool,
                              int nthreads) {
    return decode_rows(m, kvs, ids, pos, n, logits, pool, nthreads, 1);
}

int pocket_model_verify(pocket_model *m, pocket_kv *kv, const int32_t *ids, int n,
                        int start_pos, float *logits, pocket_pool *pool, int nthreads) {
    if (!m || !kv || !ids || !logits || kv->model != m) return POCKET_EINVAL;
    if (n <= 0 || n > PM_BLOCK || start_pos < 0 || (long long)start_pos + n > kv->capacity)
        return POCKET_EINVAL;
    pocket_kv *kvs[PM_BLOCK];
    int32_t pos[PM_BLOCK];
    for (int i = 0; i < n; i++) {
        kvs[i] = kv;
        pos[i] = start_pos + i;
    }
    return pocket_model_verify_batch(m, kvs, ids, pos, n, logits, pool, nthreads);
}

int pocket_kv_copy(pocket_kv *dst, const pocket_kv *src, int n) {
    if (!dst || !src || dst == src || dst->model != src->model || dst->fmt != src->fmt || n < 0 ||
        n > src->capacity || n > dst->capacity)
        return POCKET_EINVAL;
    if (n == 0) return POCKET_OK;
    const pocket_model *m = src->model;
    const size_t es = pm_kv_es(src->fmt), hd = (size_t)m->c.head_dim;
    /* keys: whole blocks of 16 positions (the tail of the last block is never read) */
    const size_t kbytes = pocket_round_up((size_t)n, 16) * hd * es, vbytes = (size_t)n * hd * es;
    for (int l = 0; l < m->c.n_layers; l++)
        for (int h = 0; h < m->c.n_kv_heads; h++) {
            pm_attn_args S, D;
            pm_kv_head(src, l, h, &S);
            pm_kv_head(dst, l, h, &D);
            memcpy((void *)D.K, S.K, kbytes);
            memcpy((void *)D.V, S.V, vbytes);
            if (S.ks) { /* float16 scales, laid out as the keys and values */
                memcpy((uint16_t *)D.ks, S.ks, kbytes / PM_KV_QBLOCK * 2);
                memcpy((uint16_t *)D.vs, S.vs, vbytes / PM_KV_QBLOCK * 2);
            }
        }
    return POCKET_OK;
}
