/* pocketlm native inference engine (pocket_model.h): creation and destruction of a model,
 * the checks of its configuration and weights, the buffers it grows on demand (RoPE tables,
 * attention scratch), and the KV cache.
 *
 * The engine is split by concept (pocket_model_internal.h lists the files): the forward pass
 * is in pocket_model_forward.c, the repacked weights in pocket_model_tiles.c, the operations in
 * pocket_model_ops.c (portable) and pocket_model_x86.c (AVX-512).
 */
#if !defined(_WIN32) && !defined(_GNU_SOURCE)
#define _GNU_SOURCE /* posix_memalign */
#endif

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pocket_internal.h"
#include "pocket_model.h"
#include "pocket_model_internal.h"

#define PM_MAX_DIM (1 << 20)

/* =========================================================================================
 * Creation
 * ========================================================================================= */

static int weight_ok(const pocket_weight *w, int rows, int cols, int allow_f32) {
    if (!w || w->rows != rows || w->cols != cols || !w->data) return 0;
    if (w->type == POCKET_WT_F32) return allow_f32;
    if (w->type != POCKET_WT_Q4 && w->type != POCKET_WT_Q5 && w->type != POCKET_WT_Q8) return 0;
    if (w->group_size != 32 && w->group_size != 64 && w->group_size != 128) return 0;
    if (cols % 32 || cols % w->group_size || !w->scales) return 0;
    if (w->type != POCKET_WT_Q8 && !w->mins) return 0;
    /* coded steps: all three arrays, of an INT4 group-32 weight only */
    const int ncodes = !!w->scale_codes + !!w->min_codes + !!w->code_steps;
    if (ncodes && (ncodes != 3 || w->type != POCKET_WT_Q4 || w->group_size != 32 ||
                   w->code_groups < 0 || (w->code_groups && (cols / 32) % w->code_groups)))
        return 0;
    if (w->zero_point < 0 || w->zero_point > 255 ||
        (w->zero_point && (w->type == POCKET_WT_Q8 || ncodes)))
        return 0;
    return 1;
}

void *pm_zalloc(size_t count, size_t size) {
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
    free(m->vecs);
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
    free(m->lora_t);
    for (int k = 0; k < 2; k++) {
        free(m->a1[k]);
        free(m->a2[k]);
        free(m->add[k]);
        free(m->absum[k]);
        free(m->acorr[k]);
        free(m->axb[k]);
    }
    free(m->awbuf);
    free(m->akv);
    free(m->aml);
    free(m->ascr);
    if (m->tiled)
        for (int k = 0; k < PM_NTILED(m->c.n_layers); k++) pm_tiled_free(&m->tiled[k]);
    free(m->tiled);
    free(m->patch_y);
    pm_tiled_free(&m->head_lo);
    free(m->part);
    free(m->tscr);
    free(m);
}

/* Copy every layer's norm weights and biases and the final norm into m->vecs and point the
 * model at the copies; with release_source, the source pages around them are handed back. */
static int copy_vectors(pocket_model *m) {
    const pocket_model_config *c = &m->c;
    const size_t d = (size_t)c->d_model, qd = (size_t)m->q_dim, kvd = (size_t)m->kv_dim;
    const size_t hd = (size_t)c->head_dim;
    size_t total = d;
    for (int l = 0; l < c->n_layers; l++) {
        const pocket_layer_weights *L = &m->layers[l];
        total += 2 * d + (L->q_bias ? qd : 0) + (L->k_bias ? kvd : 0) + (L->v_bias ? kvd : 0) +
                 (L->q_norm ? hd : 0) + (L->k_norm ? hd : 0) + (L->post_attn_norm ? d : 0) +
                 (L->post_mlp_norm ? d : 0);
    }
    if (!(m->vecs = (float *)malloc(total * sizeof(float)))) return POCKET_ENOMEM;
    float *dst = m->vecs;
#define PM_COPY_VEC(ptr, len)                                                                   \
    do {                                                                                        \
        if (ptr) {                                                                              \
            memcpy(dst, ptr, (len) * sizeof(float));                                            \
            if (c->release_source) pm_release_around(ptr, (len) * sizeof(float));               \
            ptr = dst;                                                                          \
            dst += (len);                                                                       \
        }                                                                                       \
    } while (0)
    for (int l = 0; l < c->n_layers; l++) {
        pocket_layer_weights *L = &m->layers[l];
        PM_COPY_VEC(L->attn_norm, d);
        PM_COPY_VEC(L->mlp_norm, d);
        PM_COPY_VEC(L->q_bias, qd);
        PM_COPY_VEC(L->k_bias, kvd);
        PM_COPY_VEC(L->v_bias, kvd);
        PM_COPY_VEC(L->q_norm, hd);
        PM_COPY_VEC(L->k_norm, hd);
        PM_COPY_VEC(L->post_attn_norm, d);
        PM_COPY_VEC(L->post_mlp_norm, d);
    }
    PM_COPY_VEC(m->final_norm, d);
#undef PM_COPY_VEC
    return POCKET_OK;
}

/* ---- the repacked weights --------------------------------------------------------------- */

#define PM_TILE_TASKS 64 /* threads that repack at most */

/* A range of tiles of one weight, repacked by one task. */
typedef struct tile_piece {
    size_t bytes;
    int k, tb, te, owner;
} tile_piece;

typedef struct tile_jobs {
    pocket_model *m;
    const pocket_weight **w; /* w[k]: the source of m->tiled[k], or NULL (not repacked) */
    tile_piece *pieces;
    int npieces;
    int bad[PM_TILE_TASKS]; /* per task: a coded weight whose codes did not give its steps */
} tile_jobs;

static int larger_first(const void *a, const void *b) {
    const tile_piece *x = (const tile_piece *)a, *y = (const tile_piece *)b;
    if (x->bytes != y->bytes) return x->bytes < y->bytes ? 1 : -1;
    return x->k != y->k ? x->k - y->k : x->tb - y->tb;
}

/* The low plane of tiled weight k when it is held as nibble planes (a screened head), else
 * NULL. */
static pm_tiled *pm_planes_of(pocket_model *m, int k) {
    return m->head_screen && k == 7 * m->c.n_layers ? &m->head_lo : NULL;
}

/* Whether tiled weight k may be held compactly (config compact_tiles): every level's products
 * read compact tiles, the tile unit's (amx) read float16 steps, and a screened head's planes
 * are INT8 (no minimums). Groups up to PM_CODED_MAX_GROUPS (a kernel's stack buffer). */
static int compact_ok(pocket_model *m, const pocket_weight *w, int k) {
    return m->c.compact_tiles && !m->amx && !pm_planes_of(m, k) &&
           w->cols / w->group_size <= PM_CODED_MAX_GROUPS;
}

/* Whether weight w keeps its coded steps (an INT4 group-32 weight with codes). */
static int coded_tiles(pocket_model *m, const pocket_weight *w, int k) {
    return compact_ok(m, w, k) && w->scale_codes && w->type == POCKET_WT_Q4 &&
           w->group_size == 32;
}

/* The zero point of weight w's tiles: its implicit minimums' (INT4, INT5, no codes), else 0
 * (minimums stored). A power of two (the format's 8 and 16), so that -zero_point * scale is
 * exact in float32 and the kernels compute it where they use it (the repack checks it equals
 * each float16 minimum). */
static int zero_point_tiles(pocket_model *m, const pocket_weight *w, int k) {
    const int zp = w->zero_point;
    return compact_ok(m, w, k) && zp > 0 && !(zp & (zp - 1)) && !w->scale_codes &&
                   (w->type == POCKET_WT_Q4 || w->type == POCKET_WT_Q5)
               ? zp
               : 0;
}

static void tiles_task(void *ctx, int task, int ntasks) {
    tile_jobs *J = (tile_jobs *)ctx;
    (void)ntasks;
    for (int i = 0; i < J->npieces; i++) {
        const tile_piece *p = &J->pieces[i];
        if (p->owner == task)
            J->bad[task] |= pm_tiled_fill(J->w[p->k], &J->m->tiled[p->k], pm_planes_of(J->m, p->k),
                                          p->tb, p->te, J->m->c.release_source);
    }
}

/* Repack the weights of the int8-activation products (and, on AVX-512, of the float ones)
 * into m->tiled with up to nthreads tasks: a weight larger than half a task's share is cut
 * into one tile range per task; the largest pieces go first, each to the task with the fewest
 * bytes so far. */
static int build_tiles(pocket_model *m, pocket_pool *pool, int nthreads) {
    const int L = m->c.n_layers, n = PM_NTILED(L);
    int ntasks = pool ? nthreads : 1;
    if (pool && ntasks > pocket_pool_size(pool)) ntasks = pocket_pool_size(pool);
    if (ntasks > PM_TILE_TASKS) ntasks = PM_TILE_TASKS;
    tile_jobs J;
    memset(&J, 0, sizeof J);
    J.m = m;
    J.w = (const pocket_weight **)calloc((size_t)n, sizeof *J.w);
    J.pieces = (tile_piece *)calloc((size_t)n * (size_t)ntasks, sizeof *J.pieces);
    int rc = J.w && J.pieces ? POCKET_OK : POCKET_ENOMEM;
    const int cls[7] = {POCKET_Q8_QKV, POCKET_Q8_QKV, POCKET_Q8_QKV, POCKET_Q8_WO,
                        POCKET_Q8_GATE_UP, POCKET_Q8_GATE_UP, POCKET_Q8_DOWN};
    for (int l = 0; l < L && !rc; l++) {
        const pocket_layer_weights *Lw = &m->layers[l];
        const pocket_weight *ws[7] = {&Lw->wq, &Lw->wk, &Lw->wv, &Lw->wo, &Lw->wgate, &Lw->wup,
                                      &Lw->wdown};
        for (int k = 0; k < 7; k++)
            if ((m->tiled_f32 || (m->act_q8 & cls[k])) && ws[k]->type != POCKET_WT_F32)
                J.w[7 * l + k] = ws[k];
    }
    if (!rc && (m->tiled_f32 || (m->act_q8 & POCKET_Q8_HEAD)) && m->head.type != POCKET_WT_F32)
        J.w[7 * L] = &m->head;
    /* the patch takes the head's products: tiled where the head's would be */
    if (!rc && m->patch.rows && (m->tiled_f32 || (m->act_q8 & POCKET_Q8_HEAD)))
        J.w[7 * L + 1] = &m->patch;
    size_t total = 0;
    for (int k = 0; k < n && !rc; k++)
        if (J.w[k] && !(rc = pm_tiled_alloc(J.w[k], &m->tiled[k], pm_planes_of(m, k),
                                            m->c.huge_pages, coded_tiles(m, J.w[k], k),
                                            zero_point_tiles(m, J.w[k], k))))
            total += (size_t)m->tiled[k].ntiles * m->tiled[k].tile_bytes;
    for (int k = 0; k < n && !rc; k++) {
        if (!J.w[k]) continue;
        const pm_tiled *t = &m->tiled[k];
        const size_t bytes = (size_t)t->ntiles * t->tile_bytes;
        const int parts = bytes > total / ntasks / 2 && t->ntiles >= ntasks ? ntasks : 1;
        for (int p = 0; p < parts; p++) {
            tile_piece *pc = &J.pieces[J.npieces++];
            pc->k = k;
            pc->tb = (int)((long long)t->ntiles * p / parts);
            pc->te = (int)((long long)t->ntiles * (p + 1) / parts);
            pc->bytes = (size_t)(pc->te - pc->tb) * t->tile_bytes;
        }
    }
    if (!rc) {
        qsort(J.pieces, (size_t)J.npieces, sizeof *J.pieces, larger_first);
        size_t load[PM_TILE_TASKS] = {0};
        for (int i = 0; i < J.npieces; i++) {
            int t = 0;
            for (int u = 1; u < ntasks; u++)
                if (load[u] < load[t]) t = u;
            J.pieces[i].owner = t;
            load[t] += J.pieces[i].bytes;
        }
        if (ntasks > 1)
            pocket_pool_run(pool, ntasks, tiles_task, &J);
        else
            tiles_task(&J, 0, 1);
        if (m->c.release_source)
            for (int k = 0; k < n; k++)
                if (J.w[k]) pm_tiled_release_source(J.w[k]);
        for (int t = 0; t < ntasks; t++)
            if (J.bad[t]) rc = POCKET_ECORRUPT;
    }
    free(J.w);
    free(J.pieces);
    return rc;
}

size_t pocket_model_tile_bytes(const pocket_model *m, size_t *coded) {
    size_t total = 0, in_coded = 0; /* in compact tiles (coded, or zero point) */
    for (int k = 0; m && k < PM_NTILED(m->c.n_layers); k++) {
        const size_t b = (size_t)m->tiled[k].ntiles * m->tiled[k].tile_bytes;
        total += b;
        if (pm_tiled_compact(&m->tiled[k])) in_coded += b;
    }
    if (m) total += (size_t)m->head_lo.ntiles * m->head_lo.tile_bytes;
    if (coded) *coded = in_coded;
    return total;
}

int pocket_model_amx_available(void) {
#if PM_HAVE_AMX
    return pm_amx_enable();
#else
    return 0;
#endif
}

/* The operations of a kernel table's level: at the avx2 level, the AVX-VNNI products where
 * avxvnni is 1 and the build and the CPU have them (else the AVX2 pairs, the same results). */
static const pm_ops *level_ops(const pocket_kernel_table *kernels, int avxvnni) {
#if PM_HAVE_AVX512
    if (kernels->level == POCKET_LEVEL_AVX512) return &pm_ops_avx512;
#endif
#if PM_HAVE_AVX2
    if (kernels->level == POCKET_LEVEL_AVX2) {
#if PM_HAVE_AVXVNNI
        if (avxvnni && (pocket_cpu_features() & POCKET_CPU_AVXVNNI)) return &pm_ops_avxvnni;
#endif
        return &pm_ops_avx2;
    }
#endif
#if PM_HAVE_NEON
    if (kernels->level == POCKET_LEVEL_NEON) return &pm_ops_neon;
#endif
    (void)avxvnni;
    return &pm_ops_portable;
}

const char *pocket_level_ops_name(const pocket_kernel_table *kernels, int avxvnni) {
    return kernels ? level_ops(kernels, avxvnni)->name : NULL;
}

int pocket_model_act_digits(const pocket_kernel_table *kernels, const float *x, int n, int cols,
                            int digits, int8_t *q1, int8_t *q2, float *dd, float *bsum) {
    if (!kernels || !x || !q1 || !dd || !bsum || (digits == 2 && !q2)) return POCKET_EINVAL;
    if (n < 0 || cols <= 0 || cols % 32 || (digits != 1 && digits != 2)) return POCKET_EINVAL;
    const size_t nblk = (size_t)n * (size_t)cols / 32;
    int32_t *corr = (int32_t *)malloc((nblk ? nblk : 1) * sizeof *corr);
    if (!corr) return POCKET_ENOMEM;
    /* the same bits at every level, and for both avx2 products */
    level_ops(kernels, 1)->quant_act(x, n, cols, digits, q1, q2, dd, bsum, corr);
    free(corr);
    return POCKET_OK;
}

int pocket_model_matmul_f32(const pocket_kernel_table *kernels, const float *x, int n, int cols,
                            const float *w, int rows, float *y) {
    if (!kernels || !x || !w || !y || n < 0 || cols <= 0 || rows < 0) return POCKET_EINVAL;
    level_ops(kernels, 1)->matmul_f32(x, n, cols, w, rows, y, 0, rows);
    return POCKET_OK;
}

int pocket_model_lora(const pocket_kernel_table *kernels, const pocket_weight *w, const float *x,
                      int n, float *y, int step) {
    if (!kernels || !w || !x || !y || n < 0 || step < 0 || w->rows < 0 || w->cols <= 0 ||
        w->lora_rank < 1 || w->lora_rank > POCKET_MAX_LORA_RANK || !w->lora_at ||
        !w->lora_bt || (w->lora_f16 != 0 && w->lora_f16 != 1))
        return POCKET_EINVAL;
    const pm_ops *ops = level_ops(kernels, 1);
    float *t = (float *)malloc(((size_t)n * (size_t)w->lora_rank + 1) * sizeof *t);
    if (!t) return POCKET_ENOMEM;
    const int ts = step ? step : n, cs = step ? step : w->rows;
    for (int i = 0; i < n; i += ts) ops->lora_down(w, x, i, n - i < ts ? n : i + ts, t);
    for (int c = 0; c < w->rows; c += cs)
        ops->lora_up(w, t, n, y, (size_t)w->rows, c, w->rows - c < cs ? w->rows : c + cs);
    free(t);
    return POCKET_OK;
}

int pocket_model_create(const pocket_model_config *cfg, const pocket_layer_weights *layers,
                        const pocket_weight *embed, const pocket_weight *head,
                        const float *final_norm, const pocket_head_patch *patch,
                        const pocket_kernel_table *kernels, int act_q8, pocket_pool *pool,
                        int nthreads, pocket_model **out) {
    if (!out) return POCKET_EINVAL;
    *out = NULL;
    if (!cfg || !layers || !embed || !head || !final_norm || !kernels) return POCKET_EINVAL;
    if (nthreads < 1 || nthreads > 1024) return POCKET_EINVAL;
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
    if (c.amx != 0 && c.amx != 1) return POCKET_EINVAL;
    if (c.avxvnni != 0 && c.avxvnni != 1) return POCKET_EINVAL;
    if (c.head_screen < 0 || c.head_screen > PM_SCREEN_MAX) return POCKET_EINVAL;
    if (c.compact_tiles != 0 && c.compact_tiles != 1) return POCKET_EINVAL;
    if (c.amx_one_term & ~POCKET_Q8_ALL) return POCKET_EINVAL;
#if PM_HAVE_AMX
    if (c.amx && (kernels->level != POCKET_LEVEL_AVX512 || !pm_amx_enable()))
        return POCKET_EUNSUPPORTED;
#else
    if (c.amx) return POCKET_EUNSUPPORTED;
#endif

    const int d = c.d_model, qd = c.n_heads * c.head_dim, kvd = c.n_kv_heads * c.head_dim;
    const int ff = c.d_ff;
    if (!weight_ok(embed, c.vocab_size, d, 1) || !weight_ok(head, c.vocab_size, d, 1))
        return POCKET_EINVAL;
    if (patch) { /* INT8, d_model columns, ids strictly increasing within the vocabulary */
        const pocket_weight *pw = &patch->weight;
        if (pw->type != POCKET_WT_Q8 || pw->rows <= 0 || pw->rows > c.vocab_size ||
            !weight_ok(pw, pw->rows, d, 1) || pw->lora_rank || !patch->ids)
            return POCKET_EINVAL;
        for (int k = 0; k < pw->rows; k++)
            if (patch->ids[k] < 0 || patch->ids[k] >= c.vocab_size ||
                (k > 0 && patch->ids[k] <= patch->ids[k - 1]))
                return POCKET_EINVAL;
    }
    int any_sliding = 0, lora_rank = 0;
    for (int l = 0; l < c.n_layers; l++) {
        const pocket_layer_weights *L = &layers[l];
        if (embed->lora_rank || head->lora_rank) return POCKET_EINVAL;
        if (!L->attn_norm || !L->mlp_norm) return POCKET_EINVAL;
        if (c.qkv_bias && (!L->q_bias || !L->k_bias || !L->v_bias)) return POCKET_EINVAL;
        if (c.qk_norm && (!L->q_norm || !L->k_norm)) return POCKET_EINVAL;
        if (c.sandwich_norms && (!L->post_attn_norm || !L->post_mlp_norm)) return POCKET_EINVAL;
        if (!weight_ok(&L->wq, qd, d, 1) || !weight_ok(&L->wk, kvd, d, 1) ||
            !weight_ok(&L->wv, kvd, d, 1) || !weight_ok(&L->wo, d, qd, 1) ||
            !weight_ok(&L->wgate, ff, d, 1) || !weight_ok(&L->wup, ff, d, 1) ||
            !weight_ok(&L->wdown, d, ff, 1))
            return POCKET_EINVAL;
        const pocket_weight *lw[7] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->wgate, &L->wup,
                                      &L->wdown};
        for (int k = 0; k < 7; k++) {
            const pocket_weight *w = lw[k];
            if (w->lora_rank < 0 || w->lora_rank > POCKET_MAX_LORA_RANK ||
                (w->lora_f16 != 0 && w->lora_f16 != 1) ||
                (w->lora_rank && (!w->lora_at || !w->lora_bt)))
                return POCKET_EINVAL;
            if (w->lora_rank > lora_rank) lora_rank = w->lora_rank;
        }
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
    if (patch) {
        m->patch = patch->weight;
        m->patch_ids = patch->ids;
    }
    m->kt = kernels;
    m->act_q8 = act_q8 & POCKET_Q8_ALL;
    m->one_digit = (act_q8 >> POCKET_Q8_ONE_DIGIT_SHIFT) & POCKET_Q8_ALL;
    m->ops = level_ops(kernels, c.avxvnni);
#if PM_HAVE_AVX512
    if (kernels->level == POCKET_LEVEL_AVX512) m->tiled_f32 = 1;
#endif
    /* avx2 and neon: int8-activation products only (float activations keep the kernel
     * table's products) */
    /* INT5 weights exist only as tiles: with any of them, every product runs on the tiles */
    if (embed->type == POCKET_WT_Q5 || head->type == POCKET_WT_Q5) m->tiled_f32 = 1;
    for (int l = 0; l < c.n_layers; l++) {
        const pocket_layer_weights *L = &layers[l];
        const pocket_weight *ws[7] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->wgate, &L->wup,
                                      &L->wdown};
        for (int k = 0; k < 7; k++)
            if (ws[k]->type == POCKET_WT_Q5) m->tiled_f32 = 1;
    }
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
    if (!(m->x = (float *)pm_zalloc(B * d, sizeof(float))) ||
        !(m->h = (float *)pm_zalloc(B * d, sizeof(float))) ||
        !(m->o = (float *)pm_zalloc(B * d, sizeof(float))) ||
        !(m->q = (float *)pm_zalloc(B * qd, sizeof(float))) ||
        !(m->k = (float *)pm_zalloc(B * kvd, sizeof(float))) ||
        !(m->v = (float *)pm_zalloc(B * kvd, sizeof(float))) ||
        !(m->att = (float *)pm_zalloc(B * qd, sizeof(float))) ||
        !(m->gate = (float *)pm_zalloc(B * ff, sizeof(float))) ||
        !(m->up = (float *)pm_zalloc(B * ff, sizeof(float))))
        goto nomem;
    m->lora_rank = lora_rank;
    if (lora_rank && !(m->lora_t = (float *)pm_zalloc((size_t)3 * B * lora_rank, sizeof(float))))
        goto nomem;
    for (int k = 0; k < 2; k++)
        if (!(m->a1[k] = (int8_t *)pm_zalloc(B * m->max_in, 1)) ||
            !(m->a2[k] = (int8_t *)pm_zalloc(B * m->max_in, 1)) ||
            !(m->add[k] = (float *)pm_zalloc(B * (m->max_in / 32 + 1), sizeof(float))) ||
            !(m->absum[k] = (float *)pm_zalloc(B * (m->max_in / 32 + 1), sizeof(float))) ||
            !(m->acorr[k] = (int32_t *)pm_zalloc(B * (m->max_in / 32 + 1), sizeof(int32_t))) ||
            (c.amx && !(m->axb[k] = (uint16_t *)pm_zalloc(2 * B * m->max_in, sizeof(uint16_t)))))
            goto nomem;
    m->amx = c.amx;
    m->amx_one_term = c.amx ? c.amx_one_term : 0;
    m->tiled = (pm_tiled *)calloc((size_t)PM_NTILED(c.n_layers), sizeof(pm_tiled));
    if (!m->tiled) goto nomem;
    /* a screened head: an INT8 head, tiled for int8 activations, on a level with the plane
     * products; build_tiles then repacks it into its nibble planes */
    if (c.head_screen > 0 && head->type == POCKET_WT_Q8 && m->ops->matmul_planes &&
        (m->act_q8 & POCKET_Q8_HEAD))
        m->head_screen = c.head_screen;
    if (m->head_screen && m->patch.rows) { /* a screened head leaves estimates: no patch */
        pocket_model_destroy(m);
        return POCKET_EINVAL;
    }
    {
        int rc = build_tiles(m, pool, nthreads);
        if (rc) {
            pocket_model_destroy(m);
            return rc;
        }
    }
    if (copy_vectors(m)) goto nomem;
    if (c.release_lookups) pm_advise_random_rows(&m->embed);
    *out = m;
    return POCKET_OK;
nomem:
    pocket_model_destroy(m);
    return POCKET_ENOMEM;
}

/* =========================================================================================
 * Buffers grown on demand
 * ========================================================================================= */

/* RoPE tables for positions < need (grown by doubling, capped at max_positions). */
int pm_ensure_rope(pocket_model *m, int need) {
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
int pm_ensure_attn_scratch(pocket_model *m, int tasks, size_t units) {
    const size_t G = (size_t)m->group, hd = (size_t)m->c.head_dim;
    if (tasks > m->tscr_tasks) {
        const size_t stride = pocket_round_up(G * PM_SPAN + G * (hd + 2), 16);
        float *t = (float *)pm_zalloc((size_t)tasks * stride, sizeof(float));
        if (!t) return POCKET_ENOMEM;
        free(m->tscr);
        m->tscr = t;
        m->tscr_tasks = tasks;
        m->tscr_stride = stride;
    }
    if (units > m->part_units) {
        float *p = (float *)pm_zalloc(units * G * (hd + 2), sizeof(float));
        if (!p) return POCKET_ENOMEM;
        free(m->part);
        m->part = p;
        m->part_units = units;
    }
    return POCKET_OK;
}

int pm_ensure_amx_scratch(pocket_model *m, int tasks) {
    if (!m->amx || tasks <= m->awbuf_tasks) return POCKET_OK;
    const size_t stride = (size_t)8 * (size_t)(m->max_in / 32 + 1) * 512; /* bfloat16 */
    uint16_t *b = (uint16_t *)pm_zalloc((size_t)tasks * stride, sizeof(uint16_t));
    if (!b) return POCKET_ENOMEM;
    free(m->awbuf);
    m->awbuf = b;
    m->awbuf_tasks = tasks;
    m->awbuf_stride = stride;
    return POCKET_OK;
}

int pm_ensure_amx_attn(pocket_model *m, int tasks) {
    if (!m->amx) return POCKET_EINVAL;
    const size_t hd = (size_t)m->c.head_dim;
    if (!m->akv) {
        m->akv = (uint16_t *)pm_zalloc((size_t)m->c.n_kv_heads * 4 * PM_AMX_KCHUNK * hd,
                                       sizeof(uint16_t));
        m->aml = (float *)pm_zalloc((size_t)2 * m->c.n_heads * PM_BLOCK, sizeof(float));
        if (!m->akv || !m->aml) return POCKET_ENOMEM;
    }
    if (tasks > m->ascr_tasks) {
        uint8_t *b = (uint8_t *)pm_zalloc((size_t)tasks * PM_AMX_ATTN_SCRATCH(hd), 1);
        if (!b) return POCKET_ENOMEM;
        free(m->ascr);
        m->ascr = b;
        m->ascr_tasks = tasks;
    }
    return POCKET_OK;
}

/* =========================================================================================
 * KV cache
 * ========================================================================================= */


int pocket_kv_create(const pocket_model *m, int capacity, int kv_format, pocket_kv **out) {
    if (!out) return POCKET_EINVAL;
    *out = NULL;
    if (!m || capacity <= 0 || capacity > m->c.max_positions ||
        (kv_format != POCKET_KV_F32 && kv_format != POCKET_KV_F16 && kv_format != POCKET_KV_Q8))
        return POCKET_EINVAL;
    if (kv_format == POCKET_KV_Q8 && m->c.head_dim % PM_KV_QBLOCK) return POCKET_EUNSUPPORTED;
    pocket_kv *kv = (pocket_kv *)calloc(1, sizeof *kv);
    if (!kv) return POCKET_ENOMEM;
    kv->model = m;
    kv->capacity = capacity;
    kv->fmt = kv_format;
    kv->head_stride = pocket_round_up((size_t)capacity, 16) * (size_t)m->c.head_dim;
    kv->layer_stride = (size_t)m->c.n_kv_heads * kv->head_stride;
    const size_t total = kv->layer_stride * (size_t)m->c.n_layers;
    const size_t es = pm_kv_es(kv_format);
    kv->k = pm_zalloc(total, es);
    kv->v = pm_zalloc(total, es);
    int ok = kv->k && kv->v;
    if (ok && kv_format == POCKET_KV_Q8) {
        const size_t ns = total / PM_KV_QBLOCK;
        kv->ks = (uint16_t *)pm_zalloc(ns, sizeof(uint16_t));
        kv->vs = (uint16_t *)pm_zalloc(ns, sizeof(uint16_t));
        ok = kv->ks && kv->vs;
    }
    if (!ok) {
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
    free(kv->ks);
    free(kv->vs);
    free(kv);
}

int pocket_kv_capacity(const pocket_kv *kv) { return kv ? kv->capacity : 0; }

const char *pocket_model_ops_name(const pocket_model *model) {
    return model ? model->ops->name : NULL;
}

size_t pocket_kv_nbytes(const pocket_kv *kv) {
    if (!kv) return 0;
    const size_t layers = (size_t)kv->model->c.n_layers;
    size_t n = 2 * kv->layer_stride * layers * pm_kv_es(kv->fmt);
    if (kv->fmt == POCKET_KV_Q8) n += 2 * kv->layer_stride * layers / PM_KV_QBLOCK * 2;
    return n;
}
