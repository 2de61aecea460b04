/* Internal: the state of the inference engine (pocket_model.h) shared by its sources. Not part
 * of the public API.
 *
 *   pocket_model.c          creation and destruction, configuration checks, the lazily grown
 *                           buffers (RoPE tables, attention scratch), the KV cache
 *   pocket_model_tiles.c    quantized weights repacked into 16-row tiles (pm_tiled), release of
 *                           the source pages of a read-only file mapping
 *   pocket_model_ops.c      the portable operations (pm_ops_portable, pocket_model_ops.h)
 *   pocket_model_x86.c      the AVX-512 operations (pm_ops_avx512)
 *   pocket_model_forward.c  parallel regions, per-token steps and pocket_model_forward()
 */
#ifndef POCKET_MODEL_INTERNAL_H
#define POCKET_MODEL_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "pocket_model.h"
#include "pocket_model_ops.h"

#define PM_BLOCK 128 /* tokens per prefill block: the scratch buffers hold this many */
#define PM_SCREEN_MAX 256 /* the largest config.head_screen */
/* entries of pocket_model.tiled: 7 per layer, the head, the head patch */
#define PM_NTILED(n_layers) (7 * (n_layers) + 2)

struct pocket_model {
    pocket_model_config c;
    pocket_layer_weights *layers;
    pocket_weight embed, head;
    const float *final_norm;
    /* the head patch (pocket_head_patch): patch.rows == 0 for none; its tiles are
     * tiled[7 * n_layers + 1]; patch_y: its logits [patch_cap rows][patch.rows], grown on
     * demand */
    pocket_weight patch;
    const int32_t *patch_ids;
    float *patch_y;
    int patch_cap;
    /* the norm weights and biases, copied out of the caller's memory: a few KB each, read every
     * token, and in a file mapping every touch would map the file's large folio around them */
    float *vecs;
    const pocket_kernel_table *kt;
    const pm_ops *ops;
    int act_q8;       /* POCKET_Q8_* classes with int8 activations */
    int amx_one_term; /* POCKET_Q8_* classes whose AMX products take one bfloat16 weight term */
    int one_digit;    /* POCKET_Q8_* classes with one int8 digit per activation (else two) */
    int tiled_f32;    /* float-activation products on the tiled weights too (AVX-512, INT5) */
    int amx;          /* products of PM_AMX_MIN_TOKENS or more tokens on AMX-BF16 */
    int amx_call;     /* amx in this call: prefill (pocket_model_forward) only, so that a
                       * batched decode row never depends on how many others share its batch */
    int verify_call;  /* this call verifies drafted tokens: every row of the block computes
                       * what a one-token decode at its position computes (pocket_model_verify) */
    /* repacked weights of the int8-activation products: [layer * 7 + k] (k: q, k, v, o,
     * gate, up, down), then the head, then the head patch (PM_NTILED entries); data == NULL
     * where not used */
    pm_tiled *tiled;
    /* config.head_screen > 0 and an INT8 tiled head: tiled[7 * n_layers] is its high plane
     * (INT4 nibbles of q + 128 >> 4, then the matrix's float16 scales s, no minimums), head_lo
     * its low plane (the nibbles of q + 128 & 15 only): the INT8 tiles' bytes, read by
     * pm_ops.matmul_planes and pm_tiled_row_planes only; else zeroed */
    pm_tiled head_lo;
    int head_screen;
    const uint8_t *screen_rows; /* pocket_model_set_screen: the next call's screened rows */
    int q_dim, kv_dim, group, half;
    int max_in; /* the widest input of a product: max(d_model, q_dim, d_ff) */
    /* RoPE: inv_freq per base (0: rope_theta, 1: rope_theta_local); cos/sin [pos][half] */
    double *inv_freq[2];
    float *rcos[2], *rsin[2];
    int rope_cap;
    int n_bases;
    /* scratch, sized for PM_BLOCK tokens */
    float *x, *h, *o, *q, *k, *v, *att, *gate, *up;
    /* LoRA adapters: the largest rank (0: none) and x A^T of the (up to 3) weights of one
     * product region [3][PM_BLOCK * lora_rank] */
    int lora_rank;
    float *lora_t;
    /* prepared activations of the products (pm_act), two sets: a product's input and the
     * next product's, prepared while the first is still being read */
    int8_t *a1[2], *a2[2];
    float *add[2], *absum[2];
    int32_t *acorr[2];
    uint16_t *axb[2]; /* amx: the activations in bfloat16, hi then lo [2, PM_BLOCK, max_in] */
    uint16_t *awbuf;  /* amx: per task, two weight tiles widened to bfloat16 */
    int awbuf_tasks;
    size_t awbuf_stride;
    uint16_t *akv;    /* amx attention: keys and values of a chunk [n_kv_heads][4][KCHUNK * hd] */
    float *aml;       /* amx attention: running max and sum [2][n_heads][PM_BLOCK] */
    uint8_t *ascr;    /* amx attention: per-task scratch */
    int ascr_tasks;
    /* decode attention partials [unit][G][hd + 2]; per-task attention scratch */
    float *part;
    size_t part_units;
    float *tscr;
    int tscr_tasks;
    size_t tscr_stride;
};

struct pocket_kv {
    const pocket_model *model;
    int capacity, fmt;   /* fmt: POCKET_KV_* */
    size_t head_stride;  /* elements between KV heads: capacity (rounded up to 16) * head_dim */
    size_t layer_stride; /* elements between layers: n_kv_heads * head_stride */
    void *k, *v;
    /* POCKET_KV_Q8: the float16 scales of keys and values [layer][kv head][head_stride /
     * PM_KV_QBLOCK] (layout in pocket_model_ops.h); NULL otherwise */
    uint16_t *ks, *vs;
};

/* Keys, values (and int8 scales) of KV head h of layer l of kv, as attention arguments. */
static inline void pm_kv_head(const pocket_kv *kv, int l, int h, pm_attn_args *A) {
    const size_t es = pm_kv_es(kv->fmt);
    const size_t off = (size_t)l * kv->layer_stride + (size_t)h * kv->head_stride;
    A->fmt = kv->fmt;
    A->K = (const char *)kv->k + off * es;
    A->V = (const char *)kv->v + off * es;
    A->ks = A->vs = NULL;
    if (kv->ks) { /* int8 scales: one per PM_KV_QBLOCK values */
        const size_t so = ((size_t)l * kv->model->c.n_kv_heads + (size_t)h) *
                          (kv->head_stride / PM_KV_QBLOCK);
        A->ks = kv->ks + so;
        A->vs = kv->vs + so;
    }
}

/* ---- pocket_model.c ---------------------------------------------------------------------- */

/* count * size zeroed bytes, 64-byte aligned (count 0 allocates one element); NULL on failure.
 * Freed with free(). */
void *pm_zalloc(size_t count, size_t size);

/* RoPE tables for positions < need (grown by doubling, capped at max_positions). */
int pm_ensure_rope(pocket_model *m, int need);

/* Per-task attention scratch for `tasks` tasks and decode partials for `units` units. */
int pm_ensure_attn_scratch(pocket_model *m, int tasks, size_t units);

/* amx: per-task weight buffers for `tasks` tasks. */
int pm_ensure_amx_scratch(pocket_model *m, int tasks);
/* amx attention: the chunk buffers and per-task scratch for `tasks` tasks. */
int pm_ensure_amx_attn(pocket_model *m, int tasks);

/* ---- pocket_model_amx.c ------------------------------------------------------------------ */

#define PM_AMX_MIN_TOKENS POCKET_AMX_MIN_TOKENS /* fewer tokens: the int8 products (one tile of 16 would be idle) */
#if PM_HAVE_AMX
/* Ask the OS for the tile state (once per process): 1 when AMX-BF16 can be used. */
int pm_amx_enable(void);
/* float32 x -> two bfloat16 terms hi = bf16(x), lo = bf16(x - hi), len values. */
void pm_amx_to_bf16(const float *x, uint16_t *hi, uint16_t *lo, size_t len);
/* Tokens [i0, i1), columns [c0, c1) (multiples of 32) of x [n, cols] as two bfloat16 terms in
 * the A-tile layout of pm_amx_matmul: value (i, c) at
 * ((i / 16) * (cols / 32) + c / 32) * 512 + (i % 16) * 32 + c % 32 of hi and lo. */
void pm_amx_act(const float *x, int cols, int i0, int i1, int c0, int c1, uint16_t *hi,
                uint16_t *lo);
/* y[i * ystride + r] = (hi[i] + lo[i]) . W~[r] for the rows of tiles [tb, te), tokens i < n:
 * xb, xl the activation terms by pm_amx_act, ceil16(n) tokens (rows past n are read, their
 * results dropped); W~ = W_hi + W_lo, or W_hi alone with one_term (W_hi = bf16(W));
 * wbuf: 8 * (cols / 32) * 512 bfloat16 of scratch (four weight tiles widened), 64-byte
 * aligned. */
void pm_amx_matmul(const pm_tiled *w, const uint16_t *xb, const uint16_t *xl, int n, float *y,
                   size_t ystride, int tb, int te, uint16_t *wbuf, int one_term);
#endif

/* Prefill attention on the tile unit (one sequence, head_dim a multiple of 32): keys in chunks
 * of PM_AMX_KCHUNK, each converted once for all query rows (pm_amx_attn_kv), then 16 query rows
 * of one head at a time (pm_amx_attn). */
#define PM_AMX_KCHUNK 512
/* bytes of pm_amx_attn scratch for head_dim hd */
#define PM_AMX_ATTN_SCRATCH(hd) ((size_t)128 * (size_t)(hd) + (size_t)128 * PM_AMX_KCHUNK)
typedef struct pm_amx_attn_args {
    const float *q; /* query row i of the head at q + i * qstride, i < nq <= 16 */
    size_t qstride;
    int nq, hd, pos0, win; /* row i is at position pos0 + i; win: sliding window or 0 */
    float scale;
    /* keys [k0, k0 + nk) (k0, nk multiples of 32) of the head's KV head, by pm_amx_attn_kv */
    const uint16_t *kh, *kl, *vh, *vl;
    int k0, nk;
    float *m, *l;   /* running maximum and sum of row i (start: -inf, 0) */
    float *acc;     /* running weighted values of row i at acc + i * astride */
    size_t astride;
    int last;       /* the last chunk: acc is divided by l */
    void *scratch;  /* PM_AMX_ATTN_SCRATCH(hd) bytes, 64-byte aligned */
} pm_amx_attn_args;
#if PM_HAVE_AMX
/* K and V of one KV head's cache (pocket_model_ops.h layout and formats; ks, vs the int8
 * scales), key chunks
 * [c0, c1) of 32 from key k0, in B-tile form with two bfloat16 terms (keys >= end: zero):
 *   kh[(kb * hd/32 + c) * 512 + 32 r + 2 j + t] = K[k0 + 16 kb + j][32 c + 2 r + t]
 *   vh[(kc * hd/16 + c) * 512 + 32 r + 2 j + t] = V[k0 + 32 kc + 2 r + t][16 c + j]
 * (kl, vl the remainders), each buffer PM_AMX_KCHUNK * hd values. */
void pm_amx_attn_kv(const void *K, const void *V, const uint16_t *ks, const uint16_t *vs, int fmt,
                    int hd, int k0, int end, int c0, int c1, uint16_t *kh, uint16_t *kl,
                    uint16_t *vh, uint16_t *vl);
/* One chunk of keys for 16 query rows of one head: causal (row i sees keys <= pos0 + i, and
 * > pos0 + i - win with a window), scores (q . k) * scale. */
void pm_amx_attn(const pm_amx_attn_args *a);
#endif

/* ---- pocket_model_tiles.c ---------------------------------------------------------------- */

/* Bytes of one row of a quantized weight's data (INT4, INT5, INT8). */
static inline size_t pm_row_bytes(const pocket_weight *w) {
    const size_t cols = (size_t)w->cols;
    return w->type == POCKET_WT_Q4 ? cols / 2 : w->type == POCKET_WT_Q5 ? cols / 32 * 20 : cols;
}

/* Lay out and allocate the 16-row tiles of `w` (INT4, INT5 or INT8) in `t` (zeroed memory);
 * with `lo` (INT8 only), its two nibble planes instead (see pocket_model.head_lo): `t` the high
 * plane and the scales, `lo` the low plane. `coded`: an INT4 group-32 weight with coded steps
 * (pocket_weight.scale_codes) keeps them coded (pm_tiled.coded); `zero_point`: an INT4 / INT5
 * weight with implicit minimums (pocket_weight.zero_point, the same value) stores none
 * (pm_tiled.zero_point). */
int pm_tiled_alloc(const pocket_weight *w, pm_tiled *t, pm_tiled *lo, int huge, int coded,
                   int zero_point);

/* Repack tiles [tb, te) of `w` into `t` (and `lo`: the nibble planes of pm_tiled_alloc; else
 * NULL); ranges of one weight may be filled by different threads. With `release`, the source
 * pages of those rows (a read-only file mapping) are handed back as the repacking goes.
 * Returns 0, or 1 when `t` is compact and a group's codes (or zero point) do not give the
 * weight's float16 scale or minimum (then the tiles must not be used). */
int pm_tiled_fill(const pocket_weight *w, pm_tiled *t, pm_tiled *lo, int tb, int te,
                  int release);

/* Hand back every source page of `w` (a read-only file mapping), e.g. those that straddled
 * the ends of the ranges filled. */
void pm_tiled_release_source(const pocket_weight *w);

/* Row r of an INT8 matrix held as nibble planes (pm_tiled_alloc with lo), as floats: the same
 * values as pm_tiled_row of its INT8 tiles. */
void pm_tiled_row_planes(const pm_tiled *hi, const pm_tiled *lo, size_t r, float *x);

/* Free the tiles of `t` and zero it (a zeroed pm_tiled is fine). */
void pm_tiled_free(pm_tiled *t);

/* Row r of a tiled matrix as floats: the same values (and float operations) as dequantizing
 * the source row. */
void pm_tiled_row(const pm_tiled *w, size_t r, float *x);

/* Hand back the pages that hold [p, p + n), whole pages around it included (read-only file
 * mappings only). */
void pm_release_around(const void *p, size_t n);

/* Tell the kernel that the source rows of `w` (a file mapping) are read in no order. */
void pm_advise_random_rows(const pocket_weight *w);

#endif /* POCKET_MODEL_INTERNAL_H */
