/* pocketlm native inference engine: the whole decoder forward pass in C.
 *
 * One call of pocket_model_forward() runs a block of tokens through every layer and writes
 * the logits; it implements exactly pocketlm/runtime/model.py (the numpy reference):
 *
 *   x = embed[ids] * embed_scale
 *   per layer:  h = rmsnorm(x, attn_norm)
 *               q, k, v = h W_q^T (+b), h W_k^T (+b), h W_v^T (+b)
 *               [qk_norm] per-head rmsnorm of q and k
 *               rotate-half RoPE of q and k (the layer's theta), k and v into the KV cache
 *               causal GQA attention (sliding window on 'sliding' layers), softmax in float32
 *               o = att W_o^T; [sandwich] o = rmsnorm(o, post_attn_norm); x += o
 *               h = rmsnorm(x, mlp_norm); a = act(h W_gate^T) * (h W_up^T)
 *               d = a W_down^T; [sandwich] d = rmsnorm(d, post_mlp_norm); x += d
 *   logits = rmsnorm(x, norm) (lm_head or embed)^T  (only the last row unless all_logits)
 *
 * Plain C (no Python), no mutable global state, never exits. The model does not own the weight
 * memory (the caller keeps it alive, e.g. a mmap'd deploy file); it owns its scratch buffers
 * and RoPE tables. KV caches are separate objects (several may exist per model, e.g. one per
 * conversation), each tied to the model that created it.
 *
 * Threading: the caller passes a pocket_pool (or NULL) and a thread count; each parallel
 * region splits its work into nthreads fixed parts (rows of the concatenated q/k/v or gate/up
 * weights, attention units) that are independent of which thread runs them, so results do not
 * depend on the number of threads. A model is not reentrant: one forward at a time per model
 * (the CPython wrapper holds a lock).
 */
#ifndef POCKET_MODEL_H
#define POCKET_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "pocket_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Weight storage types. */
enum {
    POCKET_WT_NONE = 0, /* absent (optional tensors) */
    POCKET_WT_F32 = 1,  /* float32 [rows, cols] (or [cols] for vectors) */
    POCKET_WT_Q4 = 4,   /* INT4 layout of pocket_kernels.h */
    POCKET_WT_Q5 = 5,   /* INT5: uint8 [rows, cols / 32 * 20], per block of 32 columns a
                         * little-endian uint32 of high bits (bit k: column k) then the low
                         * nibbles as INT4 packs them (GGUF Q5_0's qh, qs); scales and mins as
                         * INT4, q in 0..31. Runs on the tiled kernels only. */
    POCKET_WT_Q8 = 8    /* INT8 layout of pocket_kernels.h */
};

/* A 2-D weight [rows, cols] (a linear layer or the embedding table). */
#define POCKET_MAX_LORA_RANK 256 /* the largest LoRA adapter rank a weight may carry */

typedef struct pocket_weight {
    int type; /* POCKET_WT_* */
    int rows, cols, group_size;
    const void *data;       /* float32 | uint8 packed INT4 / INT5 | int8 */
    const uint16_t *scales; /* float16 [rows, cols / group_size] (Q4, Q5, Q8) */
    const uint16_t *mins;   /* float16 [rows, cols / group_size] (Q4, Q5) */
    int mins_in_memory;     /* the mins were computed (implicit zero point), not mapped from the
                             * file: release_source never hands their pages back */
    /* Optional coded steps of an INT4 group-32 weight (the deploy format's "int4_c8", or a
     * GGUF Q4_K's 6-bit codes, "q4_k"): scale code uint8 [rows, cols / 32], minimum code int8
     * [rows, cols / 32] and float16 steps code_steps [rows, 2 * nsteps] (d, dmin of each run
     * of code_groups groups: nsteps = cols / 32 / code_groups; code_groups 0: one pair per
     * row), so that scales[r][g] = f16(scale_codes[r][g] * d) and mins[r][g] =
     * f16(min_codes[r][g] * dmin) with the d, dmin of g's run, each product in float32
     * rounded once (the repack checks every group against scales / mins and refuses the
     * model otherwise). With config.compact_tiles the tiles keep the codes: 4.5 bits per
     * weight read per token (plus the steps) instead of 5.0, the same results. All NULL:
     * none. */
    const uint8_t *scale_codes;
    const int8_t *min_codes;
    const uint16_t *code_steps;
    int code_groups;
    /* > 0: the minimums are implicit, mins[r][g] = f16(-zero_point * scales[r][g]) for every
     * group (the deploy format's zero point: INT4 8, INT5 16; the repack checks it), so that
     * with config.compact_tiles the tiles hold no minimums: 0.5 bits per weight fewer read per
     * token, the same results. 0: explicit minimums. */
    int zero_point;
    /* Optional low-rank adapter (LoRA) kept beside the weight: the product becomes
     * y = x W^T + (x A^T) B^T, the adapter's part in float32 (its scale folded into B), on every
     * path (prefill, decode, batched decode, verification), row by row alike. lora_rank 0: none
     * (layer products only; not the embedding or the head). lora_at: A transposed [cols, rank];
     * lora_bt: B transposed [rank, rows]; both float32, or float16 bits with lora_f16 = 1 (half
     * the bytes read per token; converted exactly to float32 as they are read, so the results
     * are those of the float32 values). Not copied: the caller keeps them alive. */
    int lora_rank, lora_f16;
    const void *lora_at, *lora_bt;
} pocket_weight;

typedef struct pocket_layer_weights {
    const float *attn_norm, *mlp_norm;                 /* [d_model] */
    const float *q_bias, *k_bias, *v_bias;             /* qkv_bias: [q_dim], [kv_dim], [kv_dim] */
    const float *q_norm, *k_norm;                      /* qk_norm: [head_dim] */
    const float *post_attn_norm, *post_mlp_norm;       /* sandwich_norms: [d_model] */
    pocket_weight wq, wk, wv, wo, wgate, wup, wdown;
    int sliding; /* 1: sliding-window layer (window and local RoPE base) */
    /* Optional [kv_dim], positive, equal on each RoPE pair (c, c + head_dim / 2) of a head:
     * before a key goes into an int8 (POCKET_KV_Q8) cache it is divided by these, and the
     * query heads reading it are multiplied by them, so that q . k is unchanged while the
     * keys' channels of large range (e.g. from a key bias) no longer set the quantization
     * step of the others. Not copied: the caller keeps it alive (NULL: none). */
    const float *k_smooth;
} pocket_layer_weights;

/* Optional head patch (pocketlm/head_patch.py): `weight` rows of the output head held a second
 * time in INT8 (POCKET_WT_Q8, [rows, d_model]), with their vocabulary ids (int32 [rows],
 * strictly increasing, each < vocab_size). After the head's product, logits[ids[k]] = x .
 * weight[k] on every path (prefill, decode, batched decode, verification), by the products
 * the head takes (tiled for int8 head activations, so that a row's logits never depend on
 * its batch). Not with a screened head (config.head_screen on an INT8 head). Not copied: the
 * caller keeps them alive. */
typedef struct pocket_head_patch {
    pocket_weight weight;
    const int32_t *ids;
} pocket_head_patch;

typedef struct pocket_model_config {
    int vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, d_ff;
    int qkv_bias, qk_norm, sandwich_norms;
    int act_gelu;       /* 0: silu, 1: tanh-approximated GELU */
    int sliding_window; /* tokens (the current one included); 0: none */
    float norm_eps, embed_scale, attn_scale;
    double rope_theta, rope_theta_local; /* local: base of sliding layers (0: rope_theta) */
    int max_positions;                   /* the largest KV cache capacity allowed */
    int release_source; /* 1: the weights (matrices and vectors) are a read-only file mapping:
                         * once a weight is repacked (a vector: copied), its source pages are
                         * handed back to the kernel (madvise), so load does not hold the file
                         * and the copy at once */
    int release_lookups; /* 1: the embedding is a read-only file mapping too: a lookup that
                          * reads it in place hands back the pages it touched */
    int amx;            /* 1: products over 16 or more tokens run on AMX-BF16 tiles, bfloat16
                         * weights and activations (pocket_model_amx.c); needs the avx512 level
                         * and a CPU (and OS) with AMX-BF16, else POCKET_EUNSUPPORTED */
    int amx_one_term;   /* with amx: the POCKET_Q8_* classes whose AMX products take the weights
                         * as one bfloat16 term, bf16(w): two products per block instead of
                         * three (x_hi w + x_lo w); the others take w as hi + lo, exact to ~16
                         * bits (pocket_model_amx.c). Ignored without amx. */
    int avxvnni;        /* the avx2 level's int8-activation products: 1 on AVX-VNNI where the
                         * build and the CPU have it, 0 on AVX2's multiply-add pairs (the same
                         * results; see pocket_model_avx2.c). Other levels ignore it. */
    int huge_pages;     /* 1: the tiled weights ask for transparent huge pages (Linux,
                         * MADV_HUGEPAGE); 0: the kernel's default pages. The same results. */
    int head_screen;    /* K > 0: an INT8 output head (tiled, int8 head activations, a level
                         * with pm_ops.matmul_planes) is held as two INT4 planes, the high and
                         * low nibbles of q + 128 (the same bytes). A logits row that a call
                         * marks screened (pocket_model_set_screen) reads the high plane for
                         * every row of the vocabulary (half the bytes), then the head's values
                         * for the K tiles of 16 rows with the largest estimates; its other
                         * logits stay estimates. Every other row gets the INT8 head's values
                         * bit for bit. 0: the INT8 head as it is. Range 0..256. */
    int compact_tiles;  /* 1: compact tiles (every level; not with amx, whose products read
                         * float16 steps): INT4 weights with coded steps (pocket_weight.
                         * scale_codes) keep the codes, INT4 / INT5 weights with implicit
                         * minimums (pocket_weight.zero_point) hold no minimums; fewer bytes
                         * per token, the same results. 0: every tile holds float16 scales
                         * and minimums. */
} pocket_model_config;

typedef struct pocket_model pocket_model;
typedef struct pocket_kv pocket_kv;

/* 1 when config.amx can be used here (built with AMX support, a CPU with AMX-BF16 and the
 * avx512 level, the OS grants the tile state: asked once per process), else 0. */
int pocket_model_amx_available(void);

/* Bytes of the model's repacked weights (its tiles; a screened head's two planes; a head
 * patch's tiles), and of
 * those the compact tiles take (coded steps or no minimums, config.compact_tiles): what the
 * products stream. */
size_t pocket_model_tile_bytes(const pocket_model *m, size_t *coded);

/* The engine's int8 activation digits (pm_act in pocket_model_ops.h) of x [n, cols] (cols a
 * positive multiple of 32), computed by the operations of kernel table `kernels` (the same
 * bits at every level): q1 (and q2 when digits == 2) [n, cols], dd and bsum [n, cols / 32].
 * Returns POCKET_OK or a negative status (bad arguments, out of memory). */
int pocket_model_act_digits(const pocket_kernel_table *kernels, const float *x, int n, int cols,
                            int digits, int8_t *q1, int8_t *q2, float *dd, float *bsum);

/* y [n, rows] = x [n, cols] . w [rows, cols]^T (float32 weights, the float reference path),
 * by the product of kernel table `kernels` that a model at that level runs (the same bits at
 * every level). Returns POCKET_OK or POCKET_EINVAL. */
int pocket_model_matmul_f32(const pocket_kernel_table *kernels, const float *x, int n, int cols,
                            const float *w, int rows, float *y);

/* y [n, rows] += (x [n, cols] A^T) B^T for the LoRA adapter w (w->lora_*, rank, float32 or
 * float16; w->rows, w->cols), by the operations a model at kernel table `kernels`' level runs
 * (the same bits at every level): x A^T for tokens [i, i + step) at a time, the second product
 * for output columns [c, c + step) at a time (step 0: all at once). Returns POCKET_OK or a
 * negative status. */
int pocket_model_lora(const pocket_kernel_table *kernels, const pocket_weight *w, const float *x,
                      int n, float *y, int step);

/* Product classes whose activations may be quantized to int8 (bits of act_q8). */
enum {
    POCKET_Q8_QKV = 1 << 0,
    POCKET_Q8_WO = 1 << 1,
    POCKET_Q8_GATE_UP = 1 << 2,
    POCKET_Q8_DOWN = 1 << 3,
    POCKET_Q8_HEAD = 1 << 4,
    POCKET_Q8_ALL = 31
    /* the same bits shifted by POCKET_Q8_ONE_DIGIT_SHIFT: those products carry one int8 digit
     * per activation instead of two (faster, coarser: see pm_act in pocket_model_ops.h) */
};

#define POCKET_Q8_ONE_DIGIT_SHIFT 5

/* With config.amx, a forward call of this many tokens or more runs its products on the tiles,
 * a shorter one on the int8 products: each row's numbers are the same wherever a prompt is
 * cut into calls of at least this many tokens. */
#define POCKET_AMX_MIN_TOKENS 16

/* Build a model over caller-owned weights (layers: n_layers entries, copied; head may equal
 * embed for tied embeddings; patch: a head patch, or NULL for none). kernels: a table from pocket_kernels(); act_q8: a set of
 * POCKET_Q8_* bits, the products whose activations are quantized to int8 (0: float
 * activations everywhere); the quantized weights of those products are repacked into a
 * layout for int8 dot products (pocket_model_ops.h), the same size as the original, by up to
 * nthreads threads of `pool` (NULL: the caller alone). Checks every scalar argument and every
 * pointer for presence; the sizes behind the pointers are the caller's responsibility.
 * Returns POCKET_OK and *out, or a negative status. */
int pocket_model_create(const pocket_model_config *config, const pocket_layer_weights *layers,
                        const pocket_weight *embed, const pocket_weight *head,
                        const float *final_norm, const pocket_head_patch *patch,
                        const pocket_kernel_table *kernels, int act_q8, pocket_pool *pool,
                        int nthreads, pocket_model **out);
void pocket_model_destroy(pocket_model *model);
/* The name of the operations the model runs on ("portable", "avx2", "avx2+avxvnni", "avx512"
 * or "neon": see pocket_model_ops.h), chosen from the kernel table's level (and, at the avx2
 * level, config.avxvnni); NULL for a NULL model. pocket_level_ops_name: the same choice for a
 * model created now with `kernels` and config.avxvnni = avxvnni. */
const char *pocket_model_ops_name(const pocket_model *model);
const char *pocket_level_ops_name(const pocket_kernel_table *kernels, int avxvnni);

/* KV cache formats. */
enum {
    POCKET_KV_F32 = 0, /* float32 keys and values */
    POCKET_KV_F16 = 1, /* float16: half the memory and the attention's memory traffic (at 512
                        * positions, smollm2-135m reads 13 MB of keys and values per token in
                        * float16, 26 MB in float32, next to 90 MB of weights); values rounded
                        * to float16 (relative error <= 2^-11) move the logits by ~5e-4 of
                        * their largest value relative to the float32 reference */
    POCKET_KV_Q8 = 2   /* int8, one float16 scale (absmax / 127; values rounded to nearest
                        * even) per 16 keys or values of a position and KV head (head_dim a
                        * multiple of 16): 1.125 bytes per value, 0.56 of float16; each value
                        * moves by at most half a step, ~1/254 of its block's largest */
};

/* A KV cache of `capacity` positions for `model` in format kv_format (POCKET_KV_*): per layer
 * and KV head, values [position][head_dim], keys transposed in blocks of 16 positions (see
 * pm_k_index in pocket_model_ops.h). */
int pocket_kv_create(const pocket_model *model, int capacity, int kv_format, pocket_kv **out);
void pocket_kv_destroy(pocket_kv *kv);
int pocket_kv_capacity(const pocket_kv *kv);
size_t pocket_kv_nbytes(const pocket_kv *kv);

/* Which logits of the next pocket_model_forward / _forward_batch / _verify_batch call a head
 * screen (config.head_screen) may leave as estimates: rows[i] != 0 for row i of that call's
 * logits (pocket_model_forward without all_logits: rows[0], its one row), NULL for none (every
 * logit the head's). Screened rows have the head's values on their K best tiles and
 * estimates elsewhere: for a caller that takes the largest logit only (greedy decoding
 * without penalties, biases or a grammar). The array is read by the next call only, which
 * then forgets it; a model without a screened head ignores it. */
void pocket_model_set_screen(pocket_model *model, const uint8_t *rows);

/* Run tokens ids[0..n) at positions start_pos.. of `kv` (positions before start_pos must have
 * been filled by earlier calls). logits: float32 [n, vocab] if all_logits, else [vocab] (the
 * last token). Checks ids (0 <= id < vocab), start_pos + n <= capacity, nthreads in 1..1024;
 * returns POCKET_OK or a negative status (nothing is written to kv on an argument error). */
int pocket_model_forward(pocket_model *model, pocket_kv *kv, const int32_t *ids, int n,
                         int start_pos, float *logits, int all_logits, pocket_pool *pool,
                         int nthreads);

/* One token for each of n sequences in one pass over the weights (continuous batching): row i
 * runs ids[i] at position pos[i] of kvs[i] (positions before pos[i] filled by earlier calls;
 * the n caches distinct, all of this model) and writes logits[i * vocab ..]. Each row computes
 * bit for bit what pocket_model_forward() of that one token computes (the same int8 products;
 * its keys split into the same aligned spans, merged in the same order), so it does not depend
 * on the other rows of the batch either: a server's answers do not change with its load, nor
 * with speculation (pocket_model_verify_batch). Checks every id, position and
 * cache; returns POCKET_OK or a negative status (nothing is written to any cache on an
 * argument error). */
int pocket_model_forward_batch(pocket_model *model, pocket_kv *const *kvs, const int32_t *ids,
                               const int32_t *pos, int n, float *logits, pocket_pool *pool,
                               int nthreads);

/* Verify drafted tokens: the forward of ids[0..n) (n <= 128) at positions start_pos.. of kv,
 * with the logits of every row in logits [n, vocab]. Each row computes, bit for bit, what a
 * one-token pocket_model_forward at its position computes after the rows before it (the same
 * int8 products, attention split into the same spans and merged in the same order), so
 * accepting a prefix of the drafts gives exactly the tokens plain decoding would; the keys and
 * values of all n rows are written, and a caller that accepts fewer simply treats the cache as
 * that much shorter (the rest is overwritten by the next forward). */
int pocket_model_verify(pocket_model *model, pocket_kv *kv, const int32_t *ids, int n,
                        int start_pos, float *logits, pocket_pool *pool, int nthreads);

/* Verification for several sequences in one pass: row i is ids[i] at position pos[i] of
 * kvs[i]; a sequence may have several rows (its drafts, at increasing positions, the keys below
 * each already in its cache or among its rows before it: rows run in blocks of 128, so a row
 * never sees a later block's keys). Each row computes what a one-token forward at its position
 * computes, after its sequence's rows before it. logits [n, vocab]. */
int pocket_model_verify_batch(pocket_model *model, pocket_kv *const *kvs, const int32_t *ids,
                              const int32_t *pos, int n, float *logits, pocket_pool *pool,
                              int nthreads);

/* Copy positions [0, n) of src into dst (same model and format; n within both capacities):
 * a shared prompt prefix computed once and reused by another sequence. */
int pocket_kv_copy(pocket_kv *dst, const pocket_kv *src, int n);

#ifdef __cplusplus
}
#endif

#endif /* POCKET_MODEL_H */
