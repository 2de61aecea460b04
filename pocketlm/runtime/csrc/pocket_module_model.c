/* pocketlm._native: NativeModel and NativeKV, the CPython wrapper of the inference engine
 * (pocket_model.h). Uses pocket_module.c's ThreadPool and argument checks
 * (pocket_module_internal.h); the module's initialization adds these types.
 *
 * NativeModel(config, weights, capacity, act_q8=0, level=-1, threads=1, pool=None, avxvnni=1)
 *   config:  dict of pocketlm.config.ModelConfig fields (to_dict()).
 *   weights: dict name -> float32 numpy array (norms, biases, float weights), or a tuple
 *            ("int4", qweight uint8 [rows, cols/2], scales f16, mins f16, group_size
 *            [, mins_in_memory[, codes]]) with mins_in_memory a bool, or the zero point (an
 *            int) of minimums that are -zero_point * scales (pocket_weight.zero_point; INT5
 *            too), and codes None or (scale codes uint8 [rows, cols/32],
 *            min codes int8 [rows, cols/32], steps f16 [rows, 2 * nsteps][, groups per
 *            step]) for group 32 (pocket_weight.scale_codes, code_groups: nsteps = cols / 32
 *            / groups per step, default one pair a row; scales and mins must be the codes'
 *            products),
 *            ("int5", qweight uint8 [rows, cols/32*20], scales f16, mins f16, group_size) or
 *            ("int8", qweight int8 [rows, cols], scales f16, group_size).
 *            Optional "head_patch.weight" ("int8" group 32, [K, d_model]) with "head_patch.ids"
 *            (int32 [K], strictly increasing, < vocab_size): the head patch
 *            (pocket_head_patch; not with a screened INT8 head).
 *            Optional "layers.N.attn.k_smooth": float32 [kv_dim], the int8 KV cache's key
 *            smoothing (pocket_layer_weights.k_smooth). With config "lora_rank" R > 0,
 *            optional LoRA adapters of the layer weights: "<weight>.lora_at" float32
 *            [cols, R] and "<weight>.lora_bt" float32 [R, rows] (float16 both with config
 *            "lora_f16" 1; pocket_weight.lora_*), where
 *            <weight> is "layers.N.attn.w_q" (w_k, w_v, w_o) or "layers.N.mlp.w_gate" (w_up,
 *            w_down).
 *   capacity: the largest KV cache capacity (positions) the model will be asked for.
 *   act_q8: the products whose activations are quantized to int8 (Q8_* bits; 0: none).
 *   threads, pool: the threads that repack the weights.
 *   avxvnni: the avx2 level's int8 products; 1: on AVX-VNNI where the CPU has it, 0: on AVX2's
 *            multiply-add pairs (the same results).
 *   config "huge_pages" true: the repacked weights ask for transparent huge pages
 *            (pocket_model_config.huge_pages; the same results).
 *   config "compact_tiles" true: weights with codes keep them in their tiles, and weights
 *            with a zero point keep no minimums (pocket_model_config.compact_tiles; the same
 *            results).
 *   config "head_screen" K (0..256): an INT8 head screened through its high nibbles, its K
 *            best tiles of 16 rows refined (pocket_model_config.head_screen; 0: the INT8
 *            head). forward(screen=True), forward_batch / verify_batch(screen=bytes, one per
 *            row): the rows whose caller takes the largest logit only.
 * Every array is checked (dtype, C order, shape against the config) before its pointer is
 * stored; the model holds a buffer view of each, so the memory behind (e.g. a mmap'd deploy
 * file) stays alive and unresized for the model's lifetime.
 *
 * NativeKV(model, capacity, format="f32"): a KV cache for that model ("f32", "f16" or "q8").
 * model.forward(kv, ids, start_pos, logits, all_logits=False, threads=1, pool=None)
 *   ids int32 [n]; logits float32 [n, vocab] (all_logits) or [vocab]; runs without the GIL,
 *   one forward at a time per model (a lock). Bad arguments raise TypeError / ValueError.
 * model.forward_batch(kvs, ids, pos, logits, threads=1, pool=None)
 *   one token per sequence (continuous batching): ids, pos int32 [n]; kvs n distinct NativeKV;
 *   logits float32 [n, vocab].
 * model.verify_batch(kvs, ids, pos, logits, threads=1, pool=None)
 *   drafted tokens of one or more sequences (a KV cache may repeat, at increasing positions):
 *   logits float32 [n, vocab], each row what a one-token forward at its position computes.
 * model.kv_copy(dst, src, n): positions [0, n) of src into dst (a shared prompt prefix).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <math.h>
#include <string.h>

#include "pocket_kernels.h"
#include "pocket_model.h"
#include "pocket_module_internal.h"
#include "pythread.h"

#ifndef _WIN32
#include <unistd.h>
static long this_process(void) { return (long)getpid(); }
#else
static long this_process(void) { return 0; }
#endif

#define MODEL_API 1

typedef struct {
    PyObject_HEAD pocket_model *model;
    PyThread_type_lock lock;
    long lock_pid; /* the process the lock belongs to (model_lock) */
    Py_buffer *views;
    Py_ssize_t nviews, capviews;
    int vocab, n_layers, max_positions;
    int act_q8, level;
} ModelObject;

/* The model's lock, for a call about to take it (the GIL held). A process forked while
 * another thread was in a forward inherits the lock held by a thread it does not have: its
 * first call would wait forever. A child takes a lock of its own (the parent's stays as it
 * was: freeing a held lock is undefined); the model's scratch is rewritten by every call. */
static PyThread_type_lock model_lock(ModelObject *self) {
    const long pid = this_process();
    if (self->lock_pid != pid) {
        PyThread_type_lock fresh = PyThread_allocate_lock();
        if (fresh) {
            self->lock = fresh;
            self->lock_pid = pid;
        }
    }
    return self->lock;
}

typedef struct {
    PyObject_HEAD ModelObject *owner;
    pocket_kv *kv;
    int capacity, fmt; /* POCKET_KV_* */
} KVObject;

static PyTypeObject ModelType;
static PyTypeObject KVType;

/* ---- config ----------------------------------------------------------------------------- */

static PyObject *cfg_item(PyObject *cfg, const char *key, int required) {
    PyObject *v = PyDict_GetItemString(cfg, key); /* borrowed */
    if (!v && required) PyErr_Format(PyExc_ValueError, "config lacks field '%s'", key);
    return v;
}

static int cfg_int(PyObject *cfg, const char *key, long lo, long hi, int *out) {
    PyObject *v = cfg_item(cfg, key, 1);
    if (!v) return -1;
    if (!PyLong_Check(v) || PyBool_Check(v)) {
        PyErr_Format(PyExc_TypeError, "config field '%s' must be an int", key);
        return -1;
    }
    long x = PyLong_AsLong(v);
    if (x == -1 && PyErr_Occurred()) return -1;
    if (x < lo || x > hi) {
        PyErr_Format(PyExc_ValueError, "config field '%s' = %ld is out of range %ld..%ld", key,
                     x, lo, hi);
        return -1;
    }
    *out = (int)x;
    return 0;
}

static int cfg_bool(PyObject *cfg, const char *key, int *out) {
    PyObject *v = cfg_item(cfg, key, 1);
    if (!v) return -1;
    int t = PyObject_IsTrue(v);
    if (t < 0) return -1;
    *out = t;
    return 0;
}

/* A float field; None gives `dflt` when none_ok. */
static int cfg_float(PyObject *cfg, const char *key, int none_ok, double dflt, double *out) {
    PyObject *v = cfg_item(cfg, key, !none_ok);
    if (!v || v == Py_None) {
        if (!none_ok) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "config field '%s' must be a number", key);
            return -1;
        }
        *out = dflt;
        return 0;
    }
    double x = PyFloat_AsDouble(v);
    if (x == -1.0 && PyErr_Occurred()) return -1;
    if (!isfinite(x)) {
        PyErr_Format(PyExc_ValueError, "config field '%s' must be finite", key);
        return -1;
    }
    *out = x;
    return 0;
}

/* ---- weights ---------------------------------------------------------------------------- */

static int model_keep(ModelObject *self, PyObject *obj, const char *name, char code,
                      int ndim, Py_ssize_t d0, Py_ssize_t d1, const void **ptr) {
    if (self->nviews == self->capviews) {
        Py_ssize_t nc = self->capviews ? 2 * self->capviews : 64;
        Py_buffer *nv = (Py_buffer *)PyMem_Realloc(self->views, (size_t)nc * sizeof(Py_buffer));
        if (!nv) {
            PyErr_NoMemory();
            return -1;
        }
        self->views = nv;
        self->capviews = nc;
    }
    Py_buffer *v = &self->views[self->nviews];
    if (obj == NULL || !PyObject_CheckBuffer(obj) ||
        PyObject_GetBuffer(obj, v, PyBUF_RECORDS_RO) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "weight '%s' must be a %s numpy array, got %s", name,
                     dtype_name(code), obj ? Py_TYPE(obj)->tp_name : "nothing");
        return -1;
    }
    if (!has_dtype(v, code)) {
        PyErr_Format(PyExc_TypeError, "weight '%s' must have dtype %s, got buffer format '%s'",
                     name, dtype_name(code), v->format ? v->format : "B");
        PyBuffer_Release(v);
        return -1;
    }
    if (v->ndim != ndim || !PyBuffer_IsContiguous(v, 'C') || v->shape[0] != d0 ||
        (ndim == 2 && v->shape[1] != d1)) {
        if (ndim == 1)
            PyErr_Format(PyExc_ValueError,
                         "weight '%s' must be a C-contiguous array of shape (%zd,)", name, d0);
        else
            PyErr_Format(PyExc_ValueError,
                         "weight '%s' must be a C-contiguous array of shape (%zd, %zd)", name, d0,
                         d1);
        PyBuffer_Release(v);
        return -1;
    }
    *ptr = v->buf;
    self->nviews++;
    return 0;
}

/* weights[name] (borrowed), or NULL with a ValueError if the tensor is missing. */
static PyObject *weight_item(PyObject *weights, const char *name) {
    PyObject *obj = PyDict_GetItemString(weights, name);
    if (!obj) PyErr_Format(PyExc_ValueError, "weights lack tensor '%s'", name);
    return obj;
}

static int model_vector(ModelObject *self, PyObject *weights, const char *name, int len,
                        const float **out) {
    PyObject *obj = weight_item(weights, name);
    if (!obj) return -1;
    return model_keep(self, obj, name, 'f', 1, len, 0, (const void **)out);
}

static int model_matrix(ModelObject *self, PyObject *weights, const char *name, int rows,
                        int cols, pocket_weight *w) {
    memset(w, 0, sizeof *w);
    PyObject *obj = weight_item(weights, name);
    if (!obj) return -1;
    w->rows = rows;
    w->cols = cols;
    if (!PyTuple_Check(obj)) {
        w->type = POCKET_WT_F32;
        return model_keep(self, obj, name, 'f', 2, rows, cols, &w->data);
    }
    Py_ssize_t len = PyTuple_GET_SIZE(obj);
    PyObject *kind = len > 0 ? PyTuple_GET_ITEM(obj, 0) : NULL;
    int is4 = kind && PyUnicode_Check(kind) && PyUnicode_CompareWithASCIIString(kind, "int4") == 0;
    int is5 = kind && PyUnicode_Check(kind) && PyUnicode_CompareWithASCIIString(kind, "int5") == 0;
    int is8 = kind && PyUnicode_Check(kind) && PyUnicode_CompareWithASCIIString(kind, "int8") == 0;
    if (!((is4 || is5) && (len == 5 || len == 6)) && !(is4 && len == 7) && !(is8 && len == 4)) {
        PyErr_Format(PyExc_TypeError,
                     "weight '%s' must be a float32 array, ('int4' or 'int5', qweight, scales, "
                     "mins, group_size[, mins_in_memory]), ('int4', qweight, scales, mins, "
                     "group_size, mins_in_memory, codes) or ('int8', qweight, scales, "
                     "group_size)",
                     name);
        return -1;
    }
    PyObject *ogs = PyTuple_GET_ITEM(obj, is8 ? 3 : 4);
    const int mins_in_memory = len >= 6 ? PyObject_IsTrue(PyTuple_GET_ITEM(obj, 5)) : 0;
    if (mins_in_memory < 0) return -1;
    w->mins_in_memory = mins_in_memory;
    if (len >= 6 && PyLong_Check(PyTuple_GET_ITEM(obj, 5)) &&
        !PyBool_Check(PyTuple_GET_ITEM(obj, 5))) { /* the zero point of implicit minimums */
        const long zp = PyLong_AsLong(PyTuple_GET_ITEM(obj, 5));
        if (zp < 1 || zp > 255 || is8) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "weight '%s': zero point must be 1..255 (INT4, INT5)",
                         name);
            return -1;
        }
        w->zero_point = (int)zp;
    }
    long gs = PyLong_Check(ogs) ? PyLong_AsLong(ogs) : -1;
    if (gs != 32 && gs != 64 && gs != 128) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "weight '%s': group_size must be 32, 64 or 128", name);
        return -1;
    }
    if (cols % 32 || cols % gs) {
        PyErr_Format(PyExc_ValueError,
                     "weight '%s': %d input columns are not a multiple of 32 and of the group "
                     "size %ld",
                     name, cols, gs);
        return -1;
    }
    w->group_size = (int)gs;
    const Py_ssize_t ng = cols / gs;
    if (is4 || is5) {
        w->type = is4 ? POCKET_WT_Q4 : POCKET_WT_Q5;
        if (model_keep(self, PyTuple_GET_ITEM(obj, 1), name, 'B', 2, rows,
                       is4 ? cols / 2 : cols / 32 * 20, &w->data) ||
            model_keep(self, PyTuple_GET_ITEM(obj, 2), name, 'e', 2, rows, ng,
                       (const void **)&w->scales) ||
            model_keep(self, PyTuple_GET_ITEM(obj, 3), name, 'e', 2, rows, ng,
                       (const void **)&w->mins))
            return -1;
        PyObject *codes = len == 7 ? PyTuple_GET_ITEM(obj, 6) : Py_None;
        if (codes != Py_None) {
            const Py_ssize_t nc = PyTuple_Check(codes) ? PyTuple_GET_SIZE(codes) : 0;
            if ((nc != 3 && nc != 4) || gs != 32) {
                PyErr_Format(PyExc_TypeError,
                             "weight '%s': codes must be None or (scale codes, min codes, "
                             "steps[, groups per step]) of a group-32 weight",
                             name);
                return -1;
            }
            long per = 0; /* groups per pair of steps; 0: the whole row */
            if (nc == 4) {
                per = PyLong_AsLong(PyTuple_GET_ITEM(codes, 3));
                if (per < 1 || per > ng || ng % per) {
                    PyErr_Clear();
                    PyErr_Format(PyExc_ValueError,
                                 "weight '%s': groups per step must divide the %zd groups of "
                                 "a row",
                                 name, ng);
                    return -1;
                }
            }
            w->code_groups = (int)per;
            const Py_ssize_t nsteps = per ? ng / per : 1;
            if (model_keep(self, PyTuple_GET_ITEM(codes, 0), name, 'B', 2, rows, ng,
                           (const void **)&w->scale_codes) ||
                model_keep(self, PyTuple_GET_ITEM(codes, 1), name, 'b', 2, rows, ng,
                           (const void **)&w->min_codes) ||
                model_keep(self, PyTuple_GET_ITEM(codes, 2), name, 'e', 2, rows, 2 * nsteps,
                           (const void **)&w->code_steps))
                return -1;
        }
    } else {
        w->type = POCKET_WT_Q8;
        if (model_keep(self, PyTuple_GET_ITEM(obj, 1), name, 'b', 2, rows, cols, &w->data) ||
            model_keep(self, PyTuple_GET_ITEM(obj, 2), name, 'e', 2, rows, ng,
                       (const void **)&w->scales))
            return -1;
    }
    return 0;
}

/* ---- NativeModel ------------------------------------------------------------------------ */

static void model_release_views(ModelObject *self) {
    for (Py_ssize_t k = 0; k < self->nviews; k++) PyBuffer_Release(&self->views[k]);
    PyMem_Free(self->views);
    self->views = NULL;
    self->nviews = self->capviews = 0;
}

static void model_dealloc(ModelObject *self) {
    if (self->model) {
        pocket_model_destroy(self->model);
        self->model = NULL;
    }
    model_release_views(self);
    if (self->lock) {
        PyThread_free_lock(self->lock);
        self->lock = NULL;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *model_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"config", "weights", "capacity", "act_q8", "level", "threads",
                             "pool", "avxvnni", NULL};
    PyObject *cfg, *weights, *opool = Py_None;
    int capacity, act_q8 = 0, level = POCKET_LEVEL_AUTO, threads = 1, avxvnni = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!i|iiiOi:NativeModel", kwlist, &PyDict_Type,
                                     &cfg, &PyDict_Type, &weights, &capacity, &act_q8, &level,
                                     &threads, &opool, &avxvnni))
        return NULL;
    if (pocket_py_check_pool(opool, threads) < 0 || pocket_py_check_avxvnni(avxvnni) < 0)
        return NULL;
    const pocket_kernel_table *kt = pocket_py_check_level(level);
    if (!kt) return NULL;
    if (act_q8 < 0 || act_q8 >= 1 << (2 * POCKET_Q8_ONE_DIGIT_SHIFT)) {
        PyErr_Format(PyExc_ValueError, "act_q8 must be a mask of Q8_* bits (0..1023), got %d",
                     act_q8);
        return NULL;
    }
    if (capacity < 1 || capacity > (1 << 24)) {
        PyErr_Format(PyExc_ValueError, "capacity must be in 1..%d, got %d", 1 << 24, capacity);
        return NULL;
    }

    pocket_model_config c;
    memset(&c, 0, sizeof c);
    double eps, escale, ascale, theta, theta_local;
    int tie;
    if (cfg_int(cfg, "vocab_size", 1, 1 << 24, &c.vocab_size) ||
        cfg_int(cfg, "d_model", 1, 1 << 20, &c.d_model) ||
        cfg_int(cfg, "n_layers", 1, 4096, &c.n_layers) ||
        cfg_int(cfg, "n_heads", 1, 4096, &c.n_heads) ||
        cfg_int(cfg, "n_kv_heads", 1, 4096, &c.n_kv_heads) ||
        cfg_int(cfg, "head_dim", 2, 4096, &c.head_dim) ||
        cfg_int(cfg, "d_ff", 1, 1 << 20, &c.d_ff) || cfg_bool(cfg, "qkv_bias", &c.qkv_bias) ||
        cfg_bool(cfg, "qk_norm", &c.qk_norm) ||
        cfg_bool(cfg, "sandwich_norms", &c.sandwich_norms) ||
        cfg_bool(cfg, "tie_embeddings", &tie) ||
        cfg_float(cfg, "norm_eps", 0, 0.0, &eps) ||
        cfg_float(cfg, "embed_scale", 0, 0.0, &escale) ||
        cfg_float(cfg, "attn_scale", 1, -1.0, &ascale) ||
        cfg_float(cfg, "rope_theta", 0, 0.0, &theta) ||
        cfg_float(cfg, "rope_theta_local", 1, 0.0, &theta_local))
        return NULL;
    if (c.n_heads % c.n_kv_heads || c.head_dim % 2 ||
        (long long)c.n_heads * c.head_dim > (1 << 20)) {
        PyErr_SetString(PyExc_ValueError,
                        "config: n_heads must be a multiple of n_kv_heads, head_dim even, and "
                        "n_heads * head_dim at most 2^20");
        return NULL;
    }
    if (eps < 0 || theta <= 0 || theta_local < 0) {
        PyErr_SetString(PyExc_ValueError, "config: norm_eps, rope_theta must be positive");
        return NULL;
    }
    c.norm_eps = (float)eps;
    c.embed_scale = (float)escale;
    c.attn_scale = ascale == -1.0 ? (float)(1.0 / sqrt((double)c.head_dim)) : (float)ascale;
    c.rope_theta = theta;
    c.rope_theta_local = theta_local;
    c.max_positions = capacity;
    c.avxvnni = avxvnni;
    {
        PyObject *rs = cfg_item(cfg, "release_source", 0);
        int truth = rs ? PyObject_IsTrue(rs) : 0;
        if (truth < 0) return NULL;
        c.release_source = truth;
        PyObject *rl = cfg_item(cfg, "release_lookups", 0);
        truth = rl ? PyObject_IsTrue(rl) : 0;
        if (truth < 0) return NULL;
        c.release_lookups = truth;
        PyObject *hp = cfg_item(cfg, "huge_pages", 0);
        truth = hp ? PyObject_IsTrue(hp) : 0;
        if (truth < 0) return NULL;
        c.huge_pages = truth;
        PyObject *cs = cfg_item(cfg, "compact_tiles", 0);
        truth = cs ? PyObject_IsTrue(cs) : 0;
        if (truth < 0) return NULL;
        c.compact_tiles = truth;
        PyObject *hs = cfg_item(cfg, "head_screen", 0);
        if (hs) {
            const long k = PyLong_AsLong(hs);
            if (k == -1 && PyErr_Occurred()) return NULL;
            if (k < 0 || k > 256) {
                PyErr_SetString(PyExc_ValueError, "config head_screen must be 0 to 256");
                return NULL;
            }
            c.head_screen = (int)k;
        }
        PyObject *amx = cfg_item(cfg, "amx", 0);
        truth = amx ? PyObject_IsTrue(amx) : 0;
        if (truth < 0) return NULL;
        c.amx = truth;
        PyObject *one = cfg_item(cfg, "amx_one_term", 0);
        long mask = one ? PyLong_AsLong(one) : 0;
        if (mask == -1 && PyErr_Occurred()) return NULL;
        if (mask < 0 || mask > POCKET_Q8_ALL) {
            PyErr_Format(PyExc_ValueError,
                         "config: amx_one_term must be a mask of Q8_* bits (0..%d), got %ld",
                         POCKET_Q8_ALL, mask);
            return NULL;
        }
        c.amx_one_term = (int)mask;
    }
    {
        PyObject *act = cfg_item(cfg, "activation", 1);
        if (!act) return NULL;
        if (PyUnicode_Check(act) && PyUnicode_CompareWithASCIIString(act, "silu") == 0)
            c.act_gelu = 0;
        else if (PyUnicode_Check(act) && PyUnicode_CompareWithASCIIString(act, "gelu_tanh") == 0)
            c.act_gelu = 1;
        else {
            PyErr_SetString(PyExc_ValueError, "config: activation must be 'silu' or 'gelu_tanh'");
            return NULL;
        }
        PyObject *sw = cfg_item(cfg, "sliding_window", 0);
        if (sw && sw != Py_None) {
            if (cfg_int(cfg, "sliding_window", 1, INT_MAX, &c.sliding_window)) return NULL;
        }
    }
    int lora_rank = 0; /* optional: the rank of the weights' LoRA adapters (0: none) */
    if (cfg_item(cfg, "lora_rank", 0) &&
        cfg_int(cfg, "lora_rank", 0, POCKET_MAX_LORA_RANK, &lora_rank))
        return NULL;
    int lora_f16 = 0; /* optional: 1 when the adapters are float16 (else float32) */
    if (cfg_item(cfg, "lora_f16", 0) && cfg_int(cfg, "lora_f16", 0, 1, &lora_f16)) return NULL;

    ModelObject *self = (ModelObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->lock = PyThread_allocate_lock();
    if (!self->lock) {
        Py_DECREF(self);
        PyErr_NoMemory();
        return NULL;
    }
    self->lock_pid = this_process();
    self->vocab = c.vocab_size;
    self->n_layers = c.n_layers;
    self->max_positions = capacity;
    self->act_q8 = act_q8;
    self->level = kt->level;

    const int d = c.d_model, qd = c.n_heads * c.head_dim, kvd = c.n_kv_heads * c.head_dim;
    const int ff = c.d_ff, hd = c.head_dim;
    pocket_layer_weights *layers =
        (pocket_layer_weights *)PyMem_Calloc((size_t)c.n_layers, sizeof *layers);
    if (!layers) {
        Py_DECREF(self);
        PyErr_NoMemory();
        return NULL;
    }
    pocket_weight embed, head;
    const float *final_norm = NULL;
    PyObject *types = cfg_item(cfg, "layer_types", 1);
    char name[128];
    int rc;
    if (!types || !PyList_Check(types) || PyList_GET_SIZE(types) != c.n_layers) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "config: layer_types must be a list of n_layers "
                                              "strings");
        types = weights = NULL;
        goto fail;
    }
    /* read from copies: Python code that a value runs (a flag's __bool__, an int's __index__)
     * must not free what is still being read by emptying the caller's dict or list */
    types = PyList_AsTuple(types);
    weights = types ? PyDict_Copy(weights) : NULL;
    if (!weights) goto fail;
    if (model_matrix(self, weights, "embed.weight", c.vocab_size, d, &embed)) goto fail;
    /* like the reference: lm_head when present, else the (tied) embedding */
    if (PyDict_GetItemString(weights, "lm_head.weight") || !tie) {
        if (model_matrix(self, weights, "lm_head.weight", c.vocab_size, d, &head)) goto fail;
    } else {
        head = embed;
    }
    if (model_vector(self, weights, "norm.weight", d, &final_norm)) goto fail;
    /* optional: the head patch, both tensors or neither */
    pocket_head_patch patch;
    int has_patch = 0;
    {
        PyObject *pw = PyDict_GetItemString(weights, "head_patch.weight");
        PyObject *pi = PyDict_GetItemString(weights, "head_patch.ids");
        if (!pw != !pi) {
            PyErr_SetString(PyExc_ValueError, "weights 'head_patch.weight' and "
                                              "'head_patch.ids' come together");
            goto fail;
        }
        if (pw) {
            memset(&patch, 0, sizeof patch);
            if (!PyTuple_Check(pw) || PyTuple_GET_SIZE(pw) != 4 ||
                !PyUnicode_Check(PyTuple_GET_ITEM(pw, 0)) ||
                PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(pw, 0), "int8") != 0) {
                PyErr_SetString(PyExc_ValueError, "weight 'head_patch.weight' must be "
                                                  "('int8', qweight, scales, 32)");
                goto fail;
            }
            PyObject *ok = PyTuple_GET_ITEM(pw, 1);
            Py_buffer pv;
            if (!PyObject_CheckBuffer(ok) || PyObject_GetBuffer(ok, &pv, PyBUF_RECORDS_RO) < 0) {
                PyErr_Clear();
                PyErr_SetString(PyExc_TypeError, "weight 'head_patch.weight' must hold an int8 "
                                                  "numpy array");
                goto fail;
            }
            const Py_ssize_t K = pv.ndim == 2 ? pv.shape[0] : -1;
            const Py_ssize_t cols = pv.ndim == 2 ? pv.shape[1] : -1;
            PyBuffer_Release(&pv);
            if (K < 1 || K > c.vocab_size || cols != d) {
                PyErr_Format(PyExc_ValueError, "weight 'head_patch.weight' must have shape "
                                               "(K, %d) with 1 <= K <= vocab_size (%d)",
                             d, c.vocab_size);
                goto fail;
            }
            if (model_matrix(self, weights, "head_patch.weight", (int)K, d, &patch.weight))
                goto fail;
            if (patch.weight.group_size != 32) {
                PyErr_SetString(PyExc_ValueError, "weight 'head_patch.weight' must be INT8 "
                                                  "group 32");
                goto fail;
            }
            if (model_keep(self, pi, "head_patch.ids", 'i', 1, K, 0,
                           (const void **)&patch.ids))
                goto fail;
            for (Py_ssize_t k = 0; k < K; k++)
                if (patch.ids[k] < 0 || patch.ids[k] >= c.vocab_size ||
                    (k > 0 && patch.ids[k] <= patch.ids[k - 1])) {
                    PyErr_Format(PyExc_ValueError, "weight 'head_patch.ids' must be strictly "
                                                   "increasing ids in 0..%d; ids[%zd] = %d",
                                 c.vocab_size - 1, k, patch.ids[k]);
                    goto fail;
                }
            if (c.head_screen > 0 && head.type == POCKET_WT_Q8 && (act_q8 & POCKET_Q8_HEAD)) {
                PyErr_Format(PyExc_ValueError, "weight 'head_patch.weight': a head patch cannot "
                                               "go with a screened INT8 head (head_screen %d); "
                                               "set head_screen to 0",
                             c.head_screen);
                goto fail;
            }
            has_patch = 1;
        }
    }
    for (int l = 0; l < c.n_layers; l++) {
        pocket_layer_weights *L = &layers[l];
        PyObject *t = PyTuple_GET_ITEM(types, l);
        if (PyUnicode_Check(t) && PyUnicode_CompareWithASCIIString(t, "sliding") == 0)
            L->sliding = 1;
        else if (!(PyUnicode_Check(t) && PyUnicode_CompareWithASCIIString(t, "global") == 0)) {
            PyErr_Format(PyExc_ValueError, "config: layer_types[%d] must be 'global' or "
                                           "'sliding'", l);
            goto fail;
        }
        if (L->sliding && c.sliding_window <= 0) {
            PyErr_SetString(PyExc_ValueError, "config: sliding layers need a sliding_window");
            goto fail;
        }
#define LNAME(suffix) (PyOS_snprintf(name, sizeof name, "layers.%d." suffix, l), name)
        if (model_vector(self, weights, LNAME("attn_norm.weight"), d, &L->attn_norm) ||
            model_vector(self, weights, LNAME("mlp_norm.weight"), d, &L->mlp_norm) ||
            model_matrix(self, weights, LNAME("attn.w_q.weight"), qd, d, &L->wq) ||
            model_matrix(self, weights, LNAME("attn.w_k.weight"), kvd, d, &L->wk) ||
            model_matrix(self, weights, LNAME("attn.w_v.weight"), kvd, d, &L->wv) ||
            model_matrix(self, weights, LNAME("attn.w_o.weight"), d, qd, &L->wo) ||
            model_matrix(self, weights, LNAME("mlp.w_gate.weight"), ff, d, &L->wgate) ||
            model_matrix(self, weights, LNAME("mlp.w_up.weight"), ff, d, &L->wup) ||
            model_matrix(self, weights, LNAME("mlp.w_down.weight"), d, ff, &L->wdown))
            goto fail;
        if (c.qkv_bias &&
            (model_vector(self, weights, LNAME("attn.w_q.bias"), qd, &L->q_bias) ||
             model_vector(self, weights, LNAME("attn.w_k.bias"), kvd, &L->k_bias) ||
             model_vector(self, weights, LNAME("attn.w_v.bias"), kvd, &L->v_bias)))
            goto fail;
        if (c.qk_norm &&
            (model_vector(self, weights, LNAME("attn.q_norm.weight"), hd, &L->q_norm) ||
             model_vector(self, weights, LNAME("attn.k_norm.weight"), hd, &L->k_norm)))
            goto fail;
        if (c.sandwich_norms &&
            (model_vector(self, weights, LNAME("post_attn_norm.weight"), d, &L->post_attn_norm) ||
             model_vector(self, weights, LNAME("post_mlp_norm.weight"), d, &L->post_mlp_norm)))
            goto fail;
        /* optional: the int8 KV cache's key smoothing (pocket_layer_weights.k_smooth) */
        if (PyMapping_HasKeyString(weights, LNAME("attn.k_smooth"))) {
            if (model_vector(self, weights, name, kvd, &L->k_smooth)) goto fail;
            for (int e = 0; e < kvd; e++)
                if (!(L->k_smooth[e] > 0.0f && L->k_smooth[e] < INFINITY)) {
                    PyErr_Format(PyExc_ValueError, "%s must be positive and finite", name);
                    goto fail;
                }
        }
        /* optional: LoRA adapters, "<weight>.lora_at" [cols, rank] (A transposed) and
         * "<weight>.lora_bt" [rank, rows] (B transposed, its scale folded in) */
        if (lora_rank) {
            static const char *const mats[7] = {"attn.w_q", "attn.w_k", "attn.w_v",
                                                "attn.w_o", "mlp.w_gate", "mlp.w_up",
                                                "mlp.w_down"};
            pocket_weight *ws[7] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->wgate, &L->wup,
                                    &L->wdown};
            char name_b[128];
            for (int k = 0; k < 7; k++) {
                pocket_weight *w = ws[k];
                PyOS_snprintf(name, sizeof name, "layers.%d.%s.lora_at", l, mats[k]);
                PyOS_snprintf(name_b, sizeof name_b, "layers.%d.%s.lora_bt", l, mats[k]);
                PyObject *oa = PyDict_GetItemString(weights, name);
                PyObject *ob = PyDict_GetItemString(weights, name_b);
                if (!oa != !ob) {
                    PyErr_Format(PyExc_ValueError, "weights '%s' and '%s' come together",
                                 name, name_b);
                    goto fail;
                }
                if (!oa) continue;
                const char code = lora_f16 ? 'e' : 'f';
                if (model_keep(self, oa, name, code, 2, w->cols, lora_rank, &w->lora_at) ||
                    model_keep(self, ob, name_b, code, 2, lora_rank, w->rows, &w->lora_bt))
                    goto fail;
                w->lora_rank = lora_rank;
                w->lora_f16 = lora_f16;
            }
        }
#undef LNAME
    }
    pocket_pool *pool = pocket_py_pool(opool);
    rc = pocket_model_create(&c, layers, &embed, &head, final_norm, has_patch ? &patch : NULL,
                             kt, act_q8, pool, pool ? threads : 1, &self->model);
    if (rc != POCKET_OK) {
        if (rc == POCKET_ENOMEM)
            PyErr_NoMemory();
        else if (rc == POCKET_EUNSUPPORTED)
            PyErr_SetString(PyExc_ValueError, "NativeModel: amx needs the avx512 kernel level "
                                              "and a CPU and OS with AMX-BF16");
        else if (rc == POCKET_ECORRUPT)
            PyErr_SetString(PyExc_ValueError, "NativeModel: a weight's quantization scales "
                                              "are not finite or contradict their stored codes: "
                                              "the weights are damaged (a deploy file's "
                                              "checksums find which)");
        else
            PyErr_Format(PyExc_ValueError, "NativeModel: the engine rejected the model "
                                           "(status %d)", rc);
        goto fail;
    }
    PyMem_Free(layers);
    Py_DECREF(types);
    Py_DECREF(weights);
    return (PyObject *)self;
fail:
    PyMem_Free(layers);
    Py_XDECREF(types);
    Py_XDECREF(weights);
    Py_DECREF(self);
    return NULL;
}

/* int32 ids: format 'i' (or 'l' where long is 32-bit), 1-D, C order. */
static int get_ids(PyObject *obj, Arr *a) {
    a->held = 0;
    if (!obj || !PyObject_CheckBuffer(obj) ||
        PyObject_GetBuffer(obj, &a->v, PyBUF_RECORDS_RO) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "ids must be an int32 numpy array, got %s",
                     obj ? Py_TYPE(obj)->tp_name : "nothing");
        return -1;
    }
    a->held = 1;
    char code = format_code(a->v.format);
    if (!((code == 'i' || code == 'l') && a->v.itemsize == 4)) {
        PyErr_Format(PyExc_TypeError, "ids must have dtype int32, got buffer format '%s'",
                     a->v.format ? a->v.format : "B");
        arr_release(a);
        return -1;
    }
    if (a->v.ndim != 1 || !PyBuffer_IsContiguous(&a->v, 'C')) {
        PyErr_SetString(PyExc_ValueError, "ids must be a 1-D C-contiguous array");
        arr_release(a);
        return -1;
    }
    return 0;
}

/* Every id within the vocabulary. */
static int check_token_ids(const ModelObject *self, const int32_t *p, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (p[i] < 0 || p[i] >= self->vocab) {
            PyErr_Format(PyExc_ValueError, "token id %d is out of range 0..%d", (int)p[i],
                         self->vocab - 1);
            return -1;
        }
    return 0;
}

/* A copy of the int32 array `a`, or NULL with an exception: the engine reads the copy, so that
 * another thread writing the caller's array while the engine runs without the GIL cannot
 * change the checked ids or positions. */
static int32_t *copy_int32(const Arr *a) {
    int32_t *p = (int32_t *)PyMem_Malloc(a->v.len ? (size_t)a->v.len : 1);
    if (p)
        memcpy(p, a->v.buf, (size_t)a->v.len);
    else
        PyErr_NoMemory();
    return p;
}

/* The caller's logits: a writable C-contiguous float32 array [rows, vocab] (or [vocab] when
 * one_dim and rows == 1) that shares no memory with `a` or `b` (either may be NULL). */
static int get_logits(const ModelObject *self, PyObject *obj, Arr *lg, Py_ssize_t rows,
                      int one_dim, const Arr *a, const Arr *b) {
    if (!obj || !PyObject_CheckBuffer(obj) || PyObject_GetBuffer(obj, &lg->v, PyBUF_RECORDS) < 0) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "logits must be a writable float32 numpy array");
        return -1;
    }
    lg->held = 1;
    if (!has_dtype(&lg->v, 'f') || !PyBuffer_IsContiguous(&lg->v, 'C')) {
        PyErr_SetString(PyExc_TypeError, "logits must be a C-contiguous float32 array");
        return -1;
    }
    const int shape_ok =
        (lg->v.ndim == 2 && lg->v.shape[0] == rows && lg->v.shape[1] == self->vocab) ||
        (one_dim && rows == 1 && lg->v.ndim == 1 && lg->v.shape[0] == self->vocab);
    if (!shape_ok) {
        PyErr_Format(PyExc_ValueError, "logits must have shape (%zd, %d)%s", rows, self->vocab,
                     one_dim ? " or (vocab,)" : "");
        return -1;
    }
    if ((a && overlaps(a, lg)) || (b && overlaps(b, lg))) {
        PyErr_SetString(PyExc_ValueError, "logits must not share memory with the token arrays");
        return -1;
    }
    return 0;
}

static PyObject *model_forward(ModelObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"kv", "ids", "start_pos", "logits", "all_logits", "threads", "pool",
                             "screen", NULL};
    PyObject *okv, *oids, *ologits, *opool = Py_None;
    long start_pos;
    int all_logits = 0, threads = 1, screen = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOlO|piOp:forward", kwlist, &okv, &oids,
                                     &start_pos, &ologits, &all_logits, &threads, &opool,
                                     &screen))
        return NULL;
    if (!PyObject_TypeCheck(okv, &KVType) || ((KVObject *)okv)->owner != self) {
        PyErr_SetString(PyExc_TypeError, "kv must be a NativeKV created for this model");
        return NULL;
    }
    KVObject *kvo = (KVObject *)okv;
    if (pocket_py_check_pool(opool, threads) < 0) return NULL;
    Arr ids = {0}, lg = {0};
    int32_t *p = NULL;
    PyObject *result = NULL;
    if (get_ids(oids, &ids) < 0 || !(p = copy_int32(&ids))) goto done;
    {
        const Py_ssize_t n = ids.v.shape[0];
        if (n < 1) {
            PyErr_SetString(PyExc_ValueError, "forward() needs at least one token");
            goto done;
        }
        if (start_pos < 0 || n > kvo->capacity || start_pos > (long)kvo->capacity - (long)n) {
            PyErr_Format(PyExc_ValueError,
                         "%zd tokens at position %ld do not fit the KV cache capacity of %d", n,
                         start_pos, kvo->capacity);
            goto done;
        }
        if (check_token_ids(self, p, n) < 0 ||
            get_logits(self, ologits, &lg, all_logits ? n : 1, !all_logits, &ids, NULL) < 0)
            goto done;
        pocket_pool *pool = pocket_py_pool(opool);
        int rc;
        PyThread_type_lock lock = model_lock(self);
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(lock, WAIT_LOCK);
        const uint8_t one = 1;
        pocket_model_set_screen(self->model, screen && !all_logits ? &one : NULL);
        rc = pocket_model_forward(self->model, kvo->kv, p, (int)n, (int)start_pos,
                                  (float *)lg.v.buf, all_logits, pool, pool ? threads : 1);
        PyThread_release_lock(lock);
        Py_END_ALLOW_THREADS
        result = pocket_py_status_result(rc);
    }
done:
    PyMem_Free(p);
    arr_release(&ids);
    arr_release(&lg);
    return result;
}

/* A sequence of NativeKV objects of this model, distinct, as a new array of n pointers, and in
 * *held a tuple of them that the caller keeps until the engine is done: a list could drop a
 * cache (another thread emptying it) while the engine runs without the GIL. */
static pocket_kv **get_kvs(ModelObject *self, PyObject *okvs, Py_ssize_t n, int repeats,
                           PyObject **held) {
    PyObject *list = PySequence_Fast(okvs, "kvs must be a sequence of NativeKV");
    PyObject *seq = list ? PySequence_Tuple(list) : NULL;
    Py_XDECREF(list);
    if (!seq) return NULL;
    pocket_kv **out = NULL;
    if (PyTuple_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "%zd KV caches for %zd tokens", PyTuple_GET_SIZE(seq),
                     n);
        goto done;
    }
    out = (pocket_kv **)PyMem_Calloc((size_t)(n ? n : 1), sizeof *out);
    if (!out) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyTuple_GET_ITEM(seq, i);
        if (!PyObject_TypeCheck(o, &KVType) || ((KVObject *)o)->owner != self) {
            PyErr_SetString(PyExc_TypeError, "kvs must be NativeKV objects created for this model");
            goto fail;
        }
        out[i] = ((KVObject *)o)->kv;
        for (Py_ssize_t k = 0; k < i && !repeats; k++)
            if (out[k] == out[i]) {
                PyErr_Format(PyExc_ValueError, "KV cache %zd appears twice in one batch", i);
                goto fail;
            }
    }
    goto done;
fail:
    PyMem_Free(out);
    out = NULL;
done:
    if (out)
        *held = seq;
    else
        Py_DECREF(seq);
    return out;
}

/* forward_batch (one row per cache) and verify_batch (a cache may have several rows, at
 * increasing positions): the same arguments, the same checks. */
static PyObject *batch_call(ModelObject *self, PyObject *args, PyObject *kwds, int repeats) {
    static char *kwlist[] = {"kvs", "ids", "pos", "logits", "threads", "pool", "screen", NULL};
    const char *name = repeats ? "verify_batch" : "forward_batch";
    PyObject *okvs, *oids, *opos, *ologits, *opool = Py_None, *oscreen = Py_None;
    int threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, repeats ? "OOOO|iOO:verify_batch"
                                                         : "OOOO|iOO:forward_batch",
                                     kwlist, &okvs, &oids, &opos, &ologits, &threads, &opool,
                                     &oscreen))
        return NULL;
    if (oscreen != Py_None && !PyBytes_Check(oscreen)) {
        PyErr_Format(PyExc_TypeError, "%s() screen must be None or bytes, one per row", name);
        return NULL;
    }
    if (pocket_py_check_pool(opool, threads) < 0) return NULL;
    Arr ids = {0}, pos = {0}, lg = {0};
    pocket_kv **kvs = NULL;
    int32_t *p = NULL, *ps = NULL;
    PyObject *held = NULL, *result = NULL;
    if (get_ids(oids, &ids) < 0 || get_ids(opos, &pos) < 0) goto done;
    {
        const Py_ssize_t n = ids.v.shape[0];
        if (n < 1 || pos.v.shape[0] != n) {
            PyErr_Format(PyExc_ValueError, "%s() needs one or more tokens and one position each",
                         name);
            goto done;
        }
        if (!(kvs = get_kvs(self, okvs, n, repeats, &held)) || !(p = copy_int32(&ids)) ||
            !(ps = copy_int32(&pos)))
            goto done;
        if (check_token_ids(self, p, n) < 0) goto done;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (ps[i] < 0 || ps[i] >= pocket_kv_capacity(kvs[i])) {
                PyErr_Format(PyExc_ValueError, "position %d does not fit KV cache %zd (capacity %d)",
                             (int)ps[i], i, pocket_kv_capacity(kvs[i]));
                goto done;
            }
            /* a row reads the keys below its position: those of its cache's rows before it */
            for (Py_ssize_t k = 0; k < i && repeats; k++)
                if (kvs[k] == kvs[i] && ps[k] >= ps[i]) {
                    PyErr_Format(PyExc_ValueError, "rows %zd and %zd of one KV cache are at "
                                 "positions %d and %d: its rows must come in increasing "
                                 "positions", k, i, (int)ps[k], (int)ps[i]);
                    goto done;
                }
        }
        if (oscreen != Py_None && PyBytes_GET_SIZE(oscreen) != n) {
            PyErr_Format(PyExc_ValueError, "%s() screen has %zd entries for %zd rows", name,
                         PyBytes_GET_SIZE(oscreen), n);
            goto done;
        }
        if (get_logits(self, ologits, &lg, n, 0, &ids, &pos) < 0) goto done;
        const uint8_t *scr =
            oscreen != Py_None ? (const uint8_t *)PyBytes_AS_STRING(oscreen) : NULL;
        pocket_pool *pool = pocket_py_pool(opool);
        int rc;
        PyThread_type_lock lock = model_lock(self);
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(lock, WAIT_LOCK);
        pocket_model_set_screen(self->model, scr);
        rc = (repeats ? pocket_model_verify_batch : pocket_model_forward_batch)(
            self->model, kvs, p, ps, (int)n, (float *)lg.v.buf, pool, pool ? threads : 1);
        PyThread_release_lock(lock);
        Py_END_ALLOW_THREADS
        result = pocket_py_status_result(rc);
    }
done:
    PyMem_Free(kvs);
    Py_XDECREF(held);
    PyMem_Free(p);
    PyMem_Free(ps);
    arr_release(&ids);
    arr_release(&pos);
    arr_release(&lg);
    return result;
}

static PyObject *model_forward_batch(ModelObject *self, PyObject *args, PyObject *kwds) {
    return batch_call(self, args, kwds, 0);
}

static PyObject *model_verify_batch(ModelObject *self, PyObject *args, PyObject *kwds) {
    return batch_call(self, args, kwds, 1);
}

static PyObject *model_kv_copy(ModelObject *self, PyObject *args) {
    PyObject *odst, *osrc;
    int n;
    if (!PyArg_ParseTuple(args, "OOi:kv_copy", &odst, &osrc, &n)) return NULL;
    if (!PyObject_TypeCheck(odst, &KVType) || ((KVObject *)odst)->owner != self ||
        !PyObject_TypeCheck(osrc, &KVType) || ((KVObject *)osrc)->owner != self) {
        PyErr_SetString(PyExc_TypeError, "kv_copy() takes two NativeKV objects of this model");
        return NULL;
    }
    KVObject *dst = (KVObject *)odst, *src = (KVObject *)osrc;
    if (dst == src || dst->fmt != src->fmt || n < 0 || n > src->capacity || n > dst->capacity) {
        PyErr_Format(PyExc_ValueError, "kv_copy(): cannot copy %d positions between these caches "
                     "(capacities %d and %d, same format and distinct caches needed)", n,
                     src->capacity, dst->capacity);
        return NULL;
    }
    int rc;
    PyThread_type_lock lock = model_lock(self);
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(lock, WAIT_LOCK); /* no forward writes either cache meanwhile */
    rc = pocket_kv_copy(dst->kv, src->kv, n);
    PyThread_release_lock(lock);
    Py_END_ALLOW_THREADS
    return pocket_py_status_result(rc);
}

static PyObject *model_get_vocab(ModelObject *self, void *c) {
    (void)c;
    return PyLong_FromLong(self->vocab);
}
static PyObject *model_get_capacity(ModelObject *self, void *c) {
    (void)c;
    return PyLong_FromLong(self->max_positions);
}
static PyObject *model_get_act_q8(ModelObject *self, void *c) {
    (void)c;
    return PyLong_FromLong(self->act_q8);
}
static PyObject *model_get_level(ModelObject *self, void *c) {
    (void)c;
    return PyUnicode_FromString(pocket_level_name(self->level));
}

static PyObject *model_get_tile_bytes(ModelObject *self, void *c) {
    (void)c;
    size_t coded = 0;
    const size_t total = pocket_model_tile_bytes(self->model, &coded);
    return Py_BuildValue("(nn)", (Py_ssize_t)total, (Py_ssize_t)coded);
}

static PyGetSetDef model_getset[] = {
    {"vocab_size", (getter)model_get_vocab, NULL, "vocabulary size", NULL},
    {"capacity", (getter)model_get_capacity, NULL, "the largest KV cache capacity", NULL},
    {"act_q8", (getter)model_get_act_q8, NULL, "products with int8 activations (Q8_* bits)", NULL},
    {"level", (getter)model_get_level, NULL, "kernel level in use", NULL},
    {"tile_bytes", (getter)model_get_tile_bytes, NULL,
     "(bytes of the repacked weights, of which in compact tiles)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef model_methods[] = {
    {"forward", (PyCFunction)(void (*)(void))model_forward, METH_VARARGS | METH_KEYWORDS,
     "forward(kv, ids, start_pos, logits, all_logits=False, threads=1, pool=None)\n\n"
     "Run int32 ids at positions start_pos.. of kv; write float32 logits [n, vocab]\n"
     "(all_logits) or [vocab] (the last token). Releases the GIL."},
    {"verify_batch", (PyCFunction)(void (*)(void))model_verify_batch,
     METH_VARARGS | METH_KEYWORDS,
     "verify_batch(kvs, ids, pos, logits, threads=1, pool=None)\n\n"
     "Drafted tokens of several sequences in one pass: row i is ids[i] at pos[i] of kvs[i]\n"
     "(a sequence may have several rows, at increasing positions); each row what a one-token\n"
     "forward at its position computes. logits float32 [n, vocab]."},
    {"forward_batch", (PyCFunction)(void (*)(void))model_forward_batch,
     METH_VARARGS | METH_KEYWORDS,
     "forward_batch(kvs, ids, pos, logits, threads=1, pool=None)\n\n"
     "One token per sequence: int32 ids[i] at position pos[i] of kvs[i] (distinct NativeKV\n"
     "caches); write float32 logits [n, vocab]. One pass over the weights. Releases the GIL."},
    {"kv_copy", (PyCFunction)model_kv_copy, METH_VARARGS,
     "kv_copy(dst, src, n)\n\nCopy positions [0, n) of the NativeKV src into dst."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ModelType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pocketlm._native.NativeModel",
    .tp_basicsize = sizeof(ModelObject),
    .tp_dealloc = (destructor)model_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "NativeModel(config, weights, capacity, act_q8=0, level=-1, threads=1, pool=None, "
              "avxvnni=1): the whole forward pass in C.",
    .tp_new = model_new,
    .tp_methods = model_methods,
    .tp_getset = model_getset,
};

/* ---- NativeKV --------------------------------------------------------------------------- */

static void kv_dealloc(KVObject *self) {
    if (self->kv) {
        pocket_kv_destroy(self->kv);
        self->kv = NULL;
    }
    Py_XDECREF(self->owner);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static const char *const KV_FORMAT_NAMES[] = {"f32", "f16", "q8"}; /* by POCKET_KV_* */

static PyObject *kv_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"model", "capacity", "format", NULL};
    PyObject *om;
    int capacity, fmt = -1;
    const char *fname = "f32";
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!i|s:NativeKV", kwlist, &ModelType, &om,
                                     &capacity, &fname))
        return NULL;
    for (int f = 0; f < 3; f++)
        if (!strcmp(fname, KV_FORMAT_NAMES[f])) fmt = f;
    if (fmt < 0) {
        PyErr_Format(PyExc_ValueError, "NativeKV: format must be 'f32', 'f16' or 'q8', got '%s'",
                     fname);
        return NULL;
    }
    ModelObject *mo = (ModelObject *)om;
    if (!mo->model) {
        PyErr_SetString(PyExc_ValueError, "NativeKV: the model is not initialized");
        return NULL;
    }
    if (capacity < 1 || capacity > mo->max_positions) {
        PyErr_Format(PyExc_ValueError, "KV cache capacity must be in 1..%d, got %d",
                     mo->max_positions, capacity);
        return NULL;
    }
    KVObject *self = (KVObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    int rc;
    /* creation does not touch the model's mutable state: no lock needed */
    rc = pocket_kv_create(mo->model, capacity, fmt, &self->kv);
    if (rc != POCKET_OK) {
        Py_DECREF(self);
        if (rc == POCKET_ENOMEM) return PyErr_NoMemory();
        if (rc == POCKET_EUNSUPPORTED) {
            PyErr_SetString(PyExc_ValueError, "NativeKV: the 'q8' format needs a head_dim that "
                                              "is a multiple of 16");
            return NULL;
        }
        PyErr_Format(PyExc_ValueError, "NativeKV: invalid arguments (status %d)", rc);
        return NULL;
    }
    Py_INCREF(om);
    self->owner = mo;
    self->capacity = capacity;
    self->fmt = fmt;
    return (PyObject *)self;
}

static PyObject *kv_get_capacity(KVObject *self, void *c) {
    (void)c;
    return PyLong_FromLong(self->capacity);
}
static PyObject *kv_get_format(KVObject *self, void *c) {
    (void)c;
    return PyUnicode_FromString(KV_FORMAT_NAMES[self->fmt]);
}
static PyObject *kv_get_nbytes(KVObject *self, void *c) {
    (void)c;
    return PyLong_FromSize_t(pocket_kv_nbytes(self->kv));
}

static PyGetSetDef kv_getset[] = {
    {"capacity", (getter)kv_get_capacity, NULL, "positions", NULL},
    {"format", (getter)kv_get_format, NULL, "keys and values: 'f32', 'f16' or 'q8'", NULL},
    {"nbytes", (getter)kv_get_nbytes, NULL, "bytes of keys and values", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject KVType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pocketlm._native.NativeKV",
    .tp_basicsize = sizeof(KVObject),
    .tp_dealloc = (destructor)kv_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "NativeKV(model, capacity, format='f32'): a KV cache of a NativeModel, float32, "
              "float16 or int8 ('q8') keys and values.",
    .tp_new = kv_new,
    .tp_getset = kv_getset,
};

/* ---- registration ------------------------------------------------------------------------ */

int pocket_py_add_model_types(PyObject *m) {
    if (PyType_Ready(&ModelType) < 0 || PyType_Ready(&KVType) < 0) return -1;
    if (pocket_py_add_type(m, "NativeModel", &ModelType) < 0 ||
        pocket_py_add_type(m, "NativeKV", &KVType) < 0)
        return -1;
    return PyModule_AddIntConstant(m, "MODEL_API", MODEL_API);
}
