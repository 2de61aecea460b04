/* A standalone driver of the native engine (pocketlm/runtime/csrc, no Python): loads a model
 * dump, runs prefill, decode and batched decode at one kernel level (default: the portable
 * scalar kernels) and writes every logit. tests/test_arm_build.py builds it for the host and
 * for ARM64 (run under qemu) and compares the two with each other and with the numpy reference
 * runtime, and the ARM64 build's neon level with its scalar level.
 *
 * Usage: native_harness MODEL OUT ACT_Q8 KV SPLIT IDS_A IDS_B BATCH [LEVEL [SCREEN]]
 *   ACT_Q8   the engine's act_q8 mask: 0 (float activations) .. 1023 (31: int8 activations,
 *            two digits, everywhere)
 *   KV       the KV caches' format (POCKET_KV_*): 0 float32, 1 float16, 2 int8
 *   IDS_A    comma-separated token ids of sequence A; its first SPLIT ids (1 <= SPLIT <= len)
 *            run as one prefill with all logits, the others one decode step each
 *   IDS_B    comma-separated ids of sequence B, one prefill (all logits) in a second cache
 *   BATCH    two comma-separated ids: one pocket_model_forward_batch() call running the first
 *            at the next position of A's cache and the second at the next position of B's
 *   LEVEL    the kernel level by name (pocket_level_name: scalar, avx2, avx512, neon); default
 *            scalar. A level this build or CPU lacks is an error (exit status 1), never a
 *            silent fallback.
 *   SCREEN   head screening (pocket_model_config.head_screen): K tiles, default 0 (off); with
 *            K > 0 every decode step of A is screened (pocket_model_set_screen), and the first
 *            row of the batched step (the second is not), the prefills are not
 * Every forward uses a pocket_pool of 2 threads. Exit status 0 on success; 1 with a message on
 * stderr on any error (bad arguments or file, an engine status other than POCKET_OK).
 * On success it prints one line to stdout:
 *   "ok arch=<x86_64|aarch64|other> level=<name> ops=<name> ..."
 * level: the kernel table's level, ops: the engine's operations (pocket_model_ops_name:
 * portable, avx512 or neon).
 *
 * Model dump (all integers int32, all floats float64 or float32 as stated, little-endian):
 *   char[8]  "PLMDUMP1"
 *   int32    vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, d_ff
 *   int32    qkv_bias, qk_norm, sandwich_norms, act_gelu (0: silu, 1: tanh GELU),
 *            sliding_window (0: none), tie_embeddings, has_lm_head, max_positions
 *   float64  norm_eps, embed_scale, attn_scale (-1: 1 / sqrt(head_dim)), rope_theta,
 *            rope_theta_local (0: none, the global base)
 *   int32    sliding[n_layers] (0: global layer, 1: sliding-window layer)
 *   tensors, each: int32 name_len, name (name_len bytes, no terminator),
 *                  int32 kind, rows, cols, group_size, then the data:
 *     kind 1 (float32): float32 [rows, cols]; a vector has cols = 0 and is float32 [rows]
 *     kind 4 (INT4):    uint8 qweight [rows, cols / 2], float16 scales [rows, cols / gs],
 *                       float16 mins [rows, cols / gs]   (layout of pocket_kernels.h)
 *     kind 5 (INT5):    uint8 qweight [rows, cols / 32 * 20], then scales and mins as INT4
 *                       (layout: POCKET_WT_Q5 in pocket_model.h)
 *     kind 8 (INT8):    int8 qweight [rows, cols], float16 scales [rows, cols / gs]
 *     kind 14 (INT4 with coded steps, group 32): INT4's arrays, then uint8 scale codes
 *                       [rows, cols / 32], int8 minimum codes [rows, cols / 32], int32 groups
 *                       per step G (dividing cols / 32), float16 steps [rows, 2 * cols / 32 /
 *                       G] (pocket_weight.scale_codes, code_groups; config compact_tiles 1)
 *     kind 24, 25 (INT4, INT5 with implicit minimums): INT4's / INT5's arrays (the minimums
 *                       -zero_point * scales), then int32 zero_point (pocket_weight.zero_point)
 *     (group_size is 0 for float32)
 *   in this order (the names pocketlm.config.ModelConfig uses):
 *     embed.weight, lm_head.weight (only if has_lm_head), norm.weight, then per layer i:
 *     layers.i.attn_norm.weight, layers.i.mlp_norm.weight, layers.i.attn.w_q.weight,
 *     layers.i.attn.w_k.weight, layers.i.attn.w_v.weight, layers.i.attn.w_o.weight,
 *     layers.i.mlp.w_gate.weight, layers.i.mlp.w_up.weight, layers.i.mlp.w_down.weight,
 *     [qkv_bias] layers.i.attn.w_q.bias, layers.i.attn.w_k.bias, layers.i.attn.w_v.bias,
 *     [qk_norm] layers.i.attn.q_norm.weight, layers.i.attn.k_norm.weight,
 *     [sandwich_norms] layers.i.post_attn_norm.weight, layers.i.post_mlp_norm.weight
 *   optionally a head patch (pocket_head_patch): char[4] "PTCH", then the tensors
 *     head_patch.weight (kind 8, [K, d_model]) and head_patch.ids (kind 32: int32 [K], cols 0)
 *   char[4]  "END!"
 *
 * Output (little-endian): char[8] "PLMLOGIT", int32 rows, int32 vocab, float32 [rows, vocab]:
 * the rows of A (prefill rows, then one per decode step), the rows of B, the 2 batch rows.
 *
 * The model is filled exactly as the CPython wrapper (pocket_module_model.c) fills it.
 * Build: cc -std=c11 -ffp-contract=off -pthread -I pocketlm/runtime/csrc native_harness.c
 * <every engine source in that folder but pocket_module.c> -lm; add
 * -Wl,--wrap=tanhf -Wl,--wrap=expf to pin the engine's float libm calls ("pinned libm" below).
 */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pocket_kernels.h"
#include "pocket_model.h"

#define HARNESS_THREADS 2
#define MAX_IDS 4096

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("native_harness: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static const char *status_name(int rc) {
    switch (rc) {
    case POCKET_OK: return "POCKET_OK";
    case POCKET_EINVAL: return "POCKET_EINVAL";
    case POCKET_ENOMEM: return "POCKET_ENOMEM";
    case POCKET_EUNSUPPORTED: return "POCKET_EUNSUPPORTED";
    case POCKET_ECORRUPT: return "POCKET_ECORRUPT";
    default: return "unknown status";
    }
}

static void check(int rc, const char *what) {
    if (rc != POCKET_OK) die("%s failed: status %d (%s)", what, rc, status_name(rc));
}

/* ---- input -------------------------------------------------------------------------------- */

/* Every array read from the dump is a separate allocation (aligned for any type). */
static void **allocs;
static size_t nallocs, capallocs;

static void *keep(void *p) {
    if (nallocs == capallocs) {
        size_t nc = capallocs ? 2 * capallocs : 64;
        void **na = (void **)realloc(allocs, nc * sizeof *na);
        if (!na) die("out of memory");
        allocs = na;
        capallocs = nc;
    }
    allocs[nallocs++] = p;
    return p;
}

static void free_all(void) {
    for (size_t i = 0; i < nallocs; i++) free(allocs[i]);
    free(allocs);
    allocs = NULL;
    nallocs = capallocs = 0;
}

typedef struct {
    FILE *f;
    const char *path;
} reader;

static void rd_bytes(reader *r, void *out, size_t n, const char *what) {
    if (n && fread(out, 1, n, r->f) != n)
        die("%s: truncated or unreadable (reading %s)", r->path, what);
}

static int32_t rd_i32(reader *r, const char *what) {
    uint8_t b[4];
    rd_bytes(r, b, 4, what);
    return (int32_t)((uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 |
                     (uint32_t)b[3] << 24);
}

static double rd_f64(reader *r, const char *what) {
    uint8_t b[8];
    rd_bytes(r, b, 8, what);
    uint64_t u = 0;
    for (int i = 7; i >= 0; i--) u = u << 8 | b[i];
    double d;
    memcpy(&d, &u, sizeof d);
    return d;
}

/* n bytes of array data, in a new allocation (the host is little-endian: checked in main). */
static void *rd_array(reader *r, size_t n, const char *what) {
    void *p = keep(malloc(n ? n : 1));
    if (!p) die("out of memory (%zu bytes for %s)", n, what);
    rd_bytes(r, p, n, what);
    return p;
}

/* The next tensor's header: its name must be `name`. */
static void rd_tensor_head(reader *r, const char *name, int *kind, int *rows, int *cols,
                           int *gs) {
    int32_t len = rd_i32(r, name);
    char got[256];
    if (len <= 0 || len >= (int32_t)sizeof got)
        die("%s: bad tensor name length %d where '%s' was expected", r->path, (int)len, name);
    rd_bytes(r, got, (size_t)len, name);
    got[len] = 0;
    if (strcmp(got, name) != 0)
        die("%s: tensor '%s' found where '%s' was expected", r->path, got, name);
    *kind = rd_i32(r, name);
    *rows = rd_i32(r, name);
    *cols = rd_i32(r, name);
    *gs = rd_i32(r, name);
}

static const float *rd_vector(reader *r, const char *name, int len) {
    int kind, rows, cols, gs;
    rd_tensor_head(r, name, &kind, &rows, &cols, &gs);
    if (kind != POCKET_WT_F32 || rows != len || cols != 0 || gs != 0)
        die("tensor '%s': expected a float32 vector of %d values, got kind %d shape (%d, %d)",
            name, len, kind, rows, cols);
    return (const float *)rd_array(r, (size_t)len * sizeof(float), name);
}

#define KIND_Q4_CODED 14 /* the dump's kind of an INT4 weight with coded steps */
#define KIND_ZERO_POINT 20 /* + POCKET_WT_Q4 / Q5: the kind of one with implicit minimums */

static void rd_matrix(reader *r, const char *name, int rows, int cols, pocket_weight *w) {
    int kind, rr, cc, gs;
    memset(w, 0, sizeof *w);
    rd_tensor_head(r, name, &kind, &rr, &cc, &gs);
    if (rr != rows || cc != cols)
        die("tensor '%s': expected shape (%d, %d), got (%d, %d)", name, rows, cols, rr, cc);
    w->rows = rows;
    w->cols = cols;
    const size_t rc = (size_t)rows * (size_t)cols;
    if (kind == POCKET_WT_F32) {
        if (gs != 0) die("tensor '%s': float32 with group size %d", name, gs);
        w->type = POCKET_WT_F32;
        w->data = rd_array(r, rc * sizeof(float), name);
        return;
    }
    const int coded = kind == KIND_Q4_CODED;
    const int zp = kind == KIND_ZERO_POINT + POCKET_WT_Q4 || kind == KIND_ZERO_POINT + POCKET_WT_Q5;
    if (zp) kind -= KIND_ZERO_POINT;
    if (coded) {
        if (gs != 32) die("tensor '%s': coded steps need group size 32, got %d", name, gs);
        kind = POCKET_WT_Q4;
    }
    if (kind != POCKET_WT_Q4 && kind != POCKET_WT_Q5 && kind != POCKET_WT_Q8)
        die("tensor '%s': unknown kind %d", name, kind);
    if (gs != 32 && gs != 64 && gs != 128)
        die("tensor '%s': group_size must be 32, 64 or 128, got %d", name, gs);
    if (cols % 32 || cols % gs)
        die("tensor '%s': %d input columns are not a multiple of 32 and of the group size %d",
            name, cols, gs);
    const size_t ng = (size_t)rows * (size_t)(cols / gs);
    w->type = kind;
    w->group_size = gs;
    if (kind == POCKET_WT_Q4 || kind == POCKET_WT_Q5) {
        w->data = rd_array(r, kind == POCKET_WT_Q4 ? rc / 2 : rc / 32 * 20, name);
        w->scales = (const uint16_t *)rd_array(r, ng * sizeof(uint16_t), name);
        w->mins = (const uint16_t *)rd_array(r, ng * sizeof(uint16_t), name);
        if (coded) {
            w->scale_codes = (const uint8_t *)rd_array(r, ng, name);
            w->min_codes = (const int8_t *)rd_array(r, ng, name);
            w->code_groups = rd_i32(r, name);
            const int per_row = cols / 32;
            if (w->code_groups < 1 || per_row % w->code_groups)
                die("tensor '%s': %d groups per step do not divide %d", name, w->code_groups,
                    per_row);
            w->code_steps = (const uint16_t *)rd_array(
                r, (size_t)rows * 2 * (size_t)(per_row / w->code_groups) * sizeof(uint16_t), name);
        }
        if (zp) {
            w->zero_point = rd_i32(r, name);
            w->mins_in_memory = 1;
        }
    } else {
        w->data = rd_array(r, rc, name);
        w->scales = (const uint16_t *)rd_array(r, ng * sizeof(uint16_t), name);
    }
}

/* "1,2,3" -> ids (at most MAX_IDS); returns the count (>= 1). */
static int parse_ids(const char *s, int32_t *ids, const char *what) {
    int n = 0;
    const char *p = s;
    for (;;) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 0 || v > INT32_MAX) die("%s: bad token id list '%s'", what, s);
        if (n == MAX_IDS) die("%s: more than %d ids", what, MAX_IDS);
        ids[n++] = (int32_t)v;
        if (*end == 0) break;
        if (*end != ',') die("%s: bad token id list '%s'", what, s);
        p = end + 1;
    }
    return n;
}

static long parse_int(const char *s, long lo, long hi, const char *what) {
    char *end;
    long v = strtol(s, &end, 10);
    if (end == s || *end || v < lo || v > hi)
        die("%s must be an integer in %ld..%ld, got '%s'", what, lo, hi, s);
    return v;
}

/* ---- pinned libm (test-only) ---------------------------------------------------------------
 * Linked with -Wl,--wrap=tanhf -Wl,--wrap=expf, the engine's calls of tanhf and expf land here
 * instead of in the C library: the float functions evaluated through the double ones and
 * rounded to float, the same on every platform (to a double rounding). glibc's own tanhf
 * differs by up to 3 ulp between its x86-64 and AArch64 builds (glibc 2.36), which moves the
 * engine's logits by ~1e-7 of their largest value between the two; with these, the engine's own
 * arithmetic can be compared bit for bit across architectures. Unused in a plain link. */
float __wrap_tanhf(float x);
float __wrap_expf(float x);
float __wrap_tanhf(float x) { return (float)tanh((double)x); }
float __wrap_expf(float x) { return (float)exp((double)x); }

/* ---- output ------------------------------------------------------------------------------- */

static void wr_i32(FILE *f, int32_t v, const char *path) {
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    if (fwrite(b, 1, 4, f) != 4) die("%s: write failed", path);
}

/* ---- main --------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
    if (argc < 9 || argc > 11)
        die("usage: native_harness MODEL OUT ACT_Q8 KV_F16 SPLIT IDS_A IDS_B BATCH "
            "[LEVEL [SCREEN]] (see the top of tests/native_harness.c)");
    const int screen = argc == 11 ? (int)parse_int(argv[10], 0, 256, "SCREEN") : 0;
    int level = POCKET_LEVEL_SCALAR;
    if (argc >= 10) {
        level = -1;
        for (int l = 0; l < POCKET_LEVEL_COUNT; l++)
            if (strcmp(argv[9], pocket_level_name(l)) == 0) level = l;
        if (level < 0) die("LEVEL: unknown kernel level '%s'", argv[9]);
        if (!pocket_level_compiled(level)) die("LEVEL: '%s' is not compiled in", argv[9]);
        if (!pocket_level_supported(level))
            die("LEVEL: '%s' is not supported by this CPU", argv[9]);
    }
    {
        const uint16_t one = 1;
        uint8_t low;
        memcpy(&low, &one, 1);
        if (low != 1) die("this harness reads little-endian dumps on little-endian hosts only");
    }
    const char *model_path = argv[1], *out_path = argv[2];
    const int act_q8 = (int)parse_int(argv[3], 0, 1023, "ACT_Q8");
    const int kv_fmt = (int)parse_int(argv[4], 0, 2, "KV");
    static int32_t ids_a[MAX_IDS], ids_b[MAX_IDS], batch[MAX_IDS];
    const int na = parse_ids(argv[6], ids_a, "IDS_A");
    const int split = (int)parse_int(argv[5], 1, na, "SPLIT");
    const int nb = parse_ids(argv[7], ids_b, "IDS_B");
    if (parse_ids(argv[8], batch, "BATCH") != 2) die("BATCH must hold exactly two ids");

    /* -- the model dump, read as the CPython wrapper reads its config dict and weights -- */
    reader r = {fopen(model_path, "rb"), model_path};
    if (!r.f) die("cannot open %s", model_path);
    char magic[8];
    rd_bytes(&r, magic, 8, "magic");
    if (memcmp(magic, "PLMDUMP1", 8) != 0) die("%s: not a model dump (bad magic)", model_path);

    pocket_model_config c;
    memset(&c, 0, sizeof c);
    c.vocab_size = rd_i32(&r, "vocab_size");
    c.d_model = rd_i32(&r, "d_model");
    c.n_layers = rd_i32(&r, "n_layers");
    c.n_heads = rd_i32(&r, "n_heads");
    c.n_kv_heads = rd_i32(&r, "n_kv_heads");
    c.head_dim = rd_i32(&r, "head_dim");
    c.d_ff = rd_i32(&r, "d_ff");
    c.qkv_bias = rd_i32(&r, "qkv_bias");
    c.qk_norm = rd_i32(&r, "qk_norm");
    c.sandwich_norms = rd_i32(&r, "sandwich_norms");
    c.act_gelu = rd_i32(&r, "act_gelu");
    c.sliding_window = rd_i32(&r, "sliding_window");
    const int tie = rd_i32(&r, "tie_embeddings");
    const int has_head = rd_i32(&r, "has_lm_head");
    c.max_positions = rd_i32(&r, "max_positions");
    const double eps = rd_f64(&r, "norm_eps"), escale = rd_f64(&r, "embed_scale");
    const double ascale = rd_f64(&r, "attn_scale"), theta = rd_f64(&r, "rope_theta");
    const double theta_local = rd_f64(&r, "rope_theta_local");
    if (c.vocab_size < 1 || c.d_model < 1 || c.n_layers < 1 || c.n_layers > 4096 ||
        c.n_heads < 1 || c.n_kv_heads < 1 || c.head_dim < 2 || c.d_ff < 1 ||
        c.n_heads % c.n_kv_heads || c.head_dim % 2 || c.max_positions < 1)
        die("%s: inconsistent config", model_path);
    if (!isfinite(eps) || !isfinite(escale) || !isfinite(ascale) || !isfinite(theta) ||
        !isfinite(theta_local) || eps < 0 || theta <= 0 || theta_local < 0)
        die("%s: config: norm_eps, rope_theta must be positive and finite", model_path);
    if (!has_head && !tie) die("%s: untied embeddings need lm_head.weight", model_path);
    if (c.act_gelu != 0 && c.act_gelu != 1) die("%s: act_gelu must be 0 or 1", model_path);
    c.norm_eps = (float)eps;
    c.embed_scale = (float)escale;
    c.attn_scale = ascale == -1.0 ? (float)(1.0 / sqrt((double)c.head_dim)) : (float)ascale;
    c.rope_theta = theta;
    c.rope_theta_local = theta_local;
    c.release_source = 0;
    c.head_screen = screen;
    c.compact_tiles = 1; /* NativeModel's default (POCKET_COMPACT_TILES) */
    c.avxvnni = 1; /* NativeModel's default (the avx2 level only) */
    const int capacity = c.max_positions;
    if (na + 1 > capacity || nb + 1 > capacity)
        die("%d and %d tokens (+1 batch step) do not fit the capacity %d", na, nb, capacity);

    const int d = c.d_model, qd = c.n_heads * c.head_dim, kvd = c.n_kv_heads * c.head_dim;
    const int ff = c.d_ff, hd = c.head_dim;
    pocket_layer_weights *layers =
        (pocket_layer_weights *)keep(calloc((size_t)c.n_layers, sizeof *layers));
    if (!layers) die("out of memory");
    for (int l = 0; l < c.n_layers; l++) {
        layers[l].sliding = rd_i32(&r, "sliding");
        if (layers[l].sliding != 0 && layers[l].sliding != 1)
            die("%s: layer %d: bad sliding flag", model_path, l);
        if (layers[l].sliding && c.sliding_window <= 0)
            die("%s: sliding layers need a sliding_window", model_path);
    }
    pocket_weight embed, head;
    rd_matrix(&r, "embed.weight", c.vocab_size, d, &embed);
    if (has_head)
        rd_matrix(&r, "lm_head.weight", c.vocab_size, d, &head);
    else
        head = embed;
    const float *final_norm = rd_vector(&r, "norm.weight", d);
    char name[128];
    for (int l = 0; l < c.n_layers; l++) {
        pocket_layer_weights *L = &layers[l];
#define LNAME(suffix) (snprintf(name, sizeof name, "layers.%d." suffix, l), name)
        L->attn_norm = rd_vector(&r, LNAME("attn_norm.weight"), d);
        L->mlp_norm = rd_vector(&r, LNAME("mlp_norm.weight"), d);
        rd_matrix(&r, LNAME("attn.w_q.weight"), qd, d, &L->wq);
        rd_matrix(&r, LNAME("attn.w_k.weight"), kvd, d, &L->wk);
        rd_matrix(&r, LNAME("attn.w_v.weight"), kvd, d, &L->wv);
        rd_matrix(&r, LNAME("attn.w_o.weight"), d, qd, &L->wo);
        rd_matrix(&r, LNAME("mlp.w_gate.weight"), ff, d, &L->wgate);
        rd_matrix(&r, LNAME("mlp.w_up.weight"), ff, d, &L->wup);
        rd_matrix(&r, LNAME("mlp.w_down.weight"), d, ff, &L->wdown);
        if (c.qkv_bias) {
            L->q_bias = rd_vector(&r, LNAME("attn.w_q.bias"), qd);
            L->k_bias = rd_vector(&r, LNAME("attn.w_k.bias"), kvd);
            L->v_bias = rd_vector(&r, LNAME("attn.w_v.bias"), kvd);
        }
        if (c.qk_norm) {
            L->q_norm = rd_vector(&r, LNAME("attn.q_norm.weight"), hd);
            L->k_norm = rd_vector(&r, LNAME("attn.k_norm.weight"), hd);
        }
        if (c.sandwich_norms) {
            L->post_attn_norm = rd_vector(&r, LNAME("post_attn_norm.weight"), d);
            L->post_mlp_norm = rd_vector(&r, LNAME("post_mlp_norm.weight"), d);
        }
#undef LNAME
    }
    rd_bytes(&r, magic, 4, "end marker");
    pocket_head_patch patch;
    int has_patch = 0;
    if (memcmp(magic, "PTCH", 4) == 0) { /* the optional head patch */
        int kind, rows, cols, gs;
        rd_tensor_head(&r, "head_patch.weight", &kind, &rows, &cols, &gs);
        if (kind != POCKET_WT_Q8 || rows < 1 || rows > c.vocab_size || cols != d || gs != 32)
            die("tensor 'head_patch.weight': expected INT8 group 32 (K, %d)", d);
        memset(&patch, 0, sizeof patch);
        patch.weight.type = POCKET_WT_Q8;
        patch.weight.rows = rows;
        patch.weight.cols = d;
        patch.weight.group_size = 32;
        patch.weight.data = rd_array(&r, (size_t)rows * (size_t)d, "head_patch.weight");
        patch.weight.scales = (const uint16_t *)rd_array(
            &r, (size_t)rows * (size_t)(d / 32) * sizeof(uint16_t), "head_patch.weight");
        int krows, kcols;
        rd_tensor_head(&r, "head_patch.ids", &kind, &krows, &kcols, &gs);
        if (kind != 32 || krows != rows || kcols != 0)
            die("tensor 'head_patch.ids': expected int32 [%d]", rows);
        patch.ids = (const int32_t *)rd_array(&r, (size_t)rows * sizeof(int32_t),
                                              "head_patch.ids");
        has_patch = 1;
        rd_bytes(&r, magic, 4, "end marker");
    }
    if (memcmp(magic, "END!", 4) != 0)
        die("%s: bad end marker (tensor order or sizes differ)", model_path);
    if (fgetc(r.f) != EOF) die("%s: trailing bytes after the end marker", model_path);
    fclose(r.f);

    /* -- the engine, at the requested level -- */
    for (int i = 0; i < na; i++)
        if (ids_a[i] >= c.vocab_size) die("IDS_A: id %d is out of range", (int)ids_a[i]);
    for (int i = 0; i < nb; i++)
        if (ids_b[i] >= c.vocab_size) die("IDS_B: id %d is out of range", (int)ids_b[i]);
    if (batch[0] >= c.vocab_size || batch[1] >= c.vocab_size) die("BATCH: id out of range");

    const pocket_kernel_table *kt = pocket_kernels(level);
    if (!kt) die("pocket_kernels(%s) returned NULL", pocket_level_name(level));
    if (kt->level != level)
        die("pocket_kernels(%s) gave level %d", pocket_level_name(level), kt->level);
    pocket_pool *pool = pocket_pool_create(HARNESS_THREADS);
    if (!pool) die("pocket_pool_create(%d) failed", HARNESS_THREADS);
    pocket_model *model = NULL;
    check(pocket_model_create(&c, layers, &embed, &head, final_norm, has_patch ? &patch : NULL,
                              kt, act_q8, NULL, 1, &model),
          "pocket_model_create");
    pocket_kv *kva = NULL, *kvb = NULL;
    check(pocket_kv_create(model, capacity, kv_fmt, &kva), "pocket_kv_create (A)");
    check(pocket_kv_create(model, capacity, kv_fmt, &kvb), "pocket_kv_create (B)");

    const size_t V = (size_t)c.vocab_size;
    const int rows = na + nb + 2;
    float *logits = (float *)keep(malloc((size_t)rows * V * sizeof(float)));
    if (!logits) die("out of memory");
    float *row = logits;
    /* (a) prefill of A's first SPLIT ids, every logit row */
    check(pocket_model_forward(model, kva, ids_a, split, 0, row, 1, pool, HARNESS_THREADS),
          "pocket_model_forward (prefill A)");
    row += (size_t)split * V;
    /* (b) the rest of A, one decode step each (the last row only) */
    const uint8_t screened[2] = {1, 0};
    for (int i = split; i < na; i++) {
        if (screen) pocket_model_set_screen(model, screened);
        check(pocket_model_forward(model, kva, &ids_a[i], 1, i, row, 0, pool, HARNESS_THREADS),
              "pocket_model_forward (decode A)");
        row += V;
    }
    /* B in a second cache */
    check(pocket_model_forward(model, kvb, ids_b, nb, 0, row, 1, pool, HARNESS_THREADS),
          "pocket_model_forward (prefill B)");
    row += (size_t)nb * V;
    /* (c) one batched step over both caches */
    pocket_kv *kvs[2] = {kva, kvb};
    const int32_t pos[2] = {na, nb};
    if (screen) pocket_model_set_screen(model, screened);
    check(pocket_model_forward_batch(model, kvs, batch, pos, 2, row, pool, HARNESS_THREADS),
          "pocket_model_forward_batch");
    row += 2 * V;

    for (size_t i = 0; i < (size_t)rows * V; i++)
        if (!isfinite(logits[i])) die("logit %zu (row %zu) is not finite", i, i / V);

    FILE *out = fopen(out_path, "wb");
    if (!out) die("cannot create %s", out_path);
    if (fwrite("PLMLOGIT", 1, 8, out) != 8) die("%s: write failed", out_path);
    wr_i32(out, rows, out_path);
    wr_i32(out, (int32_t)V, out_path);
    if (fwrite(logits, sizeof(float), (size_t)rows * V, out) != (size_t)rows * V)
        die("%s: write failed", out_path);
    if (fclose(out) != 0) die("%s: write failed", out_path);

    const unsigned feat = pocket_cpu_features();
    const char *arch = (feat & POCKET_CPU_AARCH64) ? "aarch64"
                       : (feat & POCKET_CPU_X86_64) ? "x86_64"
                                                    : "other";
    printf("ok arch=%s level=%s ops=%s act_q8=%d kv_fmt=%d rows=%d vocab=%d kv_bytes=%zu\n",
           arch, pocket_level_name(kt->level), pocket_model_ops_name(model), act_q8, kv_fmt,
           rows, (int)V, pocket_kv_nbytes(kva));

    pocket_kv_destroy(kva);
    pocket_kv_destroy(kvb);
    pocket_model_destroy(model);
    pocket_pool_destroy(pool);
    free_all();
    return 0;
}
