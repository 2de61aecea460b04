/* pocketlm._native: the CPython wrapper of the native kernels.
 *
 * Every argument is checked here before any kernel runs (dtype, dimensions, C order, shapes
 * consistent with each other, group size, output writable and not overlapping an input), so a
 * bad call raises TypeError / ValueError instead of reading out of bounds. The GIL is released
 * while the kernels run. Arrays are taken through the buffer protocol (numpy is not needed to
 * build this module); no alignment is required.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <math.h>
#include <string.h>

#include "pocket_kernels.h"
#include "pocket_model.h"
#include "pocket_module_internal.h"

#define KERNEL_API 1

/* The kernel table of each level this CPU supports (NULL otherwise), looked up once at import:
 * the CPU check is not repeated per call. Read-only after module initialization. */
static const pocket_kernel_table *level_tables[POCKET_LEVEL_COUNT];
static int best_level = POCKET_LEVEL_SCALAR;

/* ---- ThreadPool ------------------------------------------------------------------------- */

static void pool_dealloc(PoolObject *self) {
    if (self->pool) {
        pocket_pool *p = self->pool;
        self->pool = NULL;
        Py_BEGIN_ALLOW_THREADS
        pocket_pool_destroy(p);
        Py_END_ALLOW_THREADS
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *pool_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"threads", NULL};
    int n;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i:ThreadPool", kwlist, &n)) return NULL;
    if (n < 1 || n > 1024) {
        PyErr_Format(PyExc_ValueError, "ThreadPool: threads must be in 1..1024, got %d", n);
        return NULL;
    }
    PoolObject *self = (PoolObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->pool = pocket_pool_create(n);
    if (!self->pool) {
        Py_DECREF(self);
        PyErr_SetString(PyExc_MemoryError, "ThreadPool: cannot create the worker threads");
        return NULL;
    }
    self->size = pocket_pool_size(self->pool);
    return (PyObject *)self;
}

static PyObject *pool_get_size(PoolObject *self, void *closure) {
    (void)closure;
    return PyLong_FromLong(self->size);
}

static PyGetSetDef pool_getset[] = {
    {"size", (getter)pool_get_size, NULL, "threads of the pool, the caller included", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject PocketPool_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "pocketlm._native.ThreadPool",
    .tp_basicsize = sizeof(PoolObject),
    .tp_dealloc = (destructor)pool_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "ThreadPool(threads): worker threads for the matrix products (rows are split into fixed ranges).",
    .tp_new = pool_new,
    .tp_getset = pool_getset,
};

/* ---- argument checks -------------------------------------------------------------------- */

/* Take `obj` as a C-contiguous 2-D array of element type `code`. */
static int get_array(PyObject *obj, const char *name, char code, int writable, Arr *a) {
    a->held = 0;
    if (obj == NULL || obj == Py_None || !PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a %s numpy array, got %s", name,
                     dtype_name(code), obj ? Py_TYPE(obj)->tp_name : "nothing");
        return -1;
    }
    int flags = PyBUF_RECORDS_RO | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &a->v, flags) < 0) {
        if (writable && PyObject_GetBuffer(obj, &a->v, PyBUF_RECORDS_RO) == 0) {
            PyBuffer_Release(&a->v);
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s must be a writable array", name);
        } else {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s must be a %s numpy array (no usable buffer)", name,
                         dtype_name(code));
        }
        return -1;
    }
    a->held = 1;
    if (!has_dtype(&a->v, code)) {
        PyErr_Format(PyExc_TypeError, "%s must have dtype %s, got buffer format '%s'", name,
                     dtype_name(code), a->v.format ? a->v.format : "B");
        arr_release(a);
        return -1;
    }
    if (a->v.ndim != 2) {
        PyErr_Format(PyExc_ValueError, "%s must be 2-D, got %d dimension(s)", name, a->v.ndim);
        arr_release(a);
        return -1;
    }
    if (!PyBuffer_IsContiguous(&a->v, 'C')) {
        PyErr_Format(PyExc_ValueError, "%s must be C-contiguous", name);
        arr_release(a);
        return -1;
    }
    for (int d = 0; d < 2; d++)
        if (a->v.shape[d] > INT_MAX) {
            PyErr_Format(PyExc_ValueError, "%s is too large (dimension %zd)", name,
                         a->v.shape[d]);
            arr_release(a);
            return -1;
        }
    return 0;
}

static int check_shape(const Arr *a, const char *name, Py_ssize_t d0, Py_ssize_t d1) {
    if (a->v.shape[0] != d0 || a->v.shape[1] != d1) {
        PyErr_Format(PyExc_ValueError, "%s has shape (%zd, %zd), expected (%zd, %zd)", name,
                     a->v.shape[0], a->v.shape[1], d0, d1);
        return -1;
    }
    return 0;
}

/* The kernel table for `level` (POCKET_LEVEL_AUTO: the best), or NULL with an exception. */
const pocket_kernel_table *pocket_py_check_level(int level) {
    if (level == POCKET_LEVEL_AUTO) level = best_level;
    if (level < 0 || level >= POCKET_LEVEL_COUNT) {
        PyErr_Format(PyExc_ValueError, "unknown kernel level %d", level);
        return NULL;
    }
    if (!level_tables[level]) {
        PyErr_Format(PyExc_ValueError, "kernel level '%s' is not %s", pocket_level_name(level),
                     pocket_level_compiled(level) ? "supported by this CPU"
                                                  : "compiled into this build");
        return NULL;
    }
    return level_tables[level];
}

int pocket_py_check_pool(PyObject *pool, int threads) {
    if (pool != Py_None && !PyObject_TypeCheck(pool, &PocketPool_Type)) {
        PyErr_Format(PyExc_TypeError, "pool must be a ThreadPool or None, got %s",
                     Py_TYPE(pool)->tp_name);
        return -1;
    }
    if (threads < 1 || threads > 1024) {
        PyErr_Format(PyExc_ValueError, "threads must be in 1..1024, got %d", threads);
        return -1;
    }
    return 0;
}

PyObject *pocket_py_raise_status(int rc) {
    if (rc == POCKET_ENOMEM)
        PyErr_NoMemory();
    else if (rc == POCKET_EUNSUPPORTED)
        PyErr_SetString(PyExc_ValueError, "the kernel level is not supported by this CPU");
    else
        PyErr_Format(PyExc_ValueError, "native kernel rejected its arguments (status %d)", rc);
    return NULL;
}

int pocket_py_check_avxvnni(int avxvnni) {
    if (avxvnni == 0 || avxvnni == 1) return 0;
    PyErr_Format(PyExc_ValueError, "avxvnni must be 0 or 1, got %d", avxvnni);
    return -1;
}

PyObject *pocket_py_status_result(int rc) {
    if (rc != POCKET_OK) return pocket_py_raise_status(rc);
    Py_RETURN_NONE;
}

/* ---- matmul_q4 / matmul_q8 -------------------------------------------------------------- */

#define MATMUL_DOC \
    "matmul_q4(x, qweight, scales, mins, group_size, out, act_q8=False, level=-1, threads=1,\n" \
    "          pool=None)\n" \
    "matmul_q8(x, qweight, scales, group_size, out, act_q8=False, level=-1, threads=1,\n" \
    "          pool=None)\n\n" \
    "out[:] = x @ W.T for an INT4 (uint8 qweight [rows, cols/2], float16 scales and mins\n" \
    "[rows, cols/group_size]) or INT8 (int8 qweight [rows, cols], float16 scales) weight;\n" \
    "x float32 [n, cols], out float32 [n, rows]. act_q8 quantizes x per block of 32 to int8\n" \
    "first. level: -1 (best) or a LEVEL_* value. Returns None."

static PyObject *do_matmul(int bits, PyObject *args, PyObject *kwds) {
    static char *kw4[] = {"x",      "qweight", "scales", "mins", "group_size", "out",
                          "act_q8", "level",   "threads", "pool", NULL};
    static char *kw8[] = {"x",     "qweight", "scales", "group_size", "out", "act_q8",
                          "level", "threads", "pool",   NULL};
    PyObject *ox, *oq, *os, *om = NULL, *oy, *opool = Py_None;
    int gs, act_q8 = 0, level = POCKET_LEVEL_AUTO, threads = 1;
    int ok = bits == 4
                 ? PyArg_ParseTupleAndKeywords(args, kwds, "OOOOiO|piiO:matmul_q4", kw4, &ox, &oq,
                                               &os, &om, &gs, &oy, &act_q8, &level, &threads,
                                               &opool)
                 : PyArg_ParseTupleAndKeywords(args, kwds, "OOOiO|piiO:matmul_q8", kw8, &ox, &oq,
                                               &os, &gs, &oy, &act_q8, &level, &threads, &opool);
    if (!ok) return NULL;
    if (gs != 32 && gs != 64 && gs != 128) {
        PyErr_Format(PyExc_ValueError, "group_size must be 32, 64 or 128, got %d", gs);
        return NULL;
    }
    const pocket_kernel_table *kt = pocket_py_check_level(level);
    if (!kt || pocket_py_check_pool(opool, threads) < 0) return NULL;

    Arr x = {0}, q = {0}, s = {0}, m = {0}, y = {0};
    PyObject *result = NULL;
    if (get_array(ox, "x", 'f', 0, &x) < 0) goto done;
    if (get_array(oq, "qweight", bits == 4 ? 'B' : 'b', 0, &q) < 0) goto done;
    if (get_array(os, "scales", 'e', 0, &s) < 0) goto done;
    if (bits == 4 && get_array(om, "mins", 'e', 0, &m) < 0) goto done;
    if (get_array(oy, "out", 'f', 1, &y) < 0) goto done;

    Py_ssize_t n = x.v.shape[0], cols = x.v.shape[1], rows = q.v.shape[0];
    Py_ssize_t wcols = bits == 4 ? 2 * q.v.shape[1] : q.v.shape[1];
    if (rows == 0 || wcols == 0) {
        PyErr_Format(PyExc_ValueError, "qweight is empty (shape (%zd, %zd))", q.v.shape[0],
                     q.v.shape[1]);
        goto done;
    }
    if (wcols % 32) {
        PyErr_Format(PyExc_ValueError,
                     "the weight has %zd input columns, which is not a multiple of 32", wcols);
        goto done;
    }
    if (wcols % gs) {
        PyErr_Format(PyExc_ValueError,
                     "the weight has %zd input columns, not a multiple of group_size %d", wcols,
                     gs);
        goto done;
    }
    if (cols != wcols) {
        PyErr_Format(PyExc_ValueError, "x has %zd features, the weight expects %zd", cols,
                     wcols);
        goto done;
    }
    if (wcols > INT_MAX || rows > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "the weight is too large");
        goto done;
    }
    if (check_shape(&s, "scales", rows, wcols / gs) < 0) goto done;
    if (bits == 4 && check_shape(&m, "mins", rows, wcols / gs) < 0) goto done;
    if (check_shape(&y, "out", n, rows) < 0) goto done;
    if (overlaps(&y, &x) || overlaps(&y, &q) || overlaps(&y, &s) || overlaps(&y, &m)) {
        PyErr_SetString(PyExc_ValueError, "out must not share memory with an input");
        goto done;
    }

    {
        pocket_pool *pool = pocket_py_pool(opool);
        int rc;
        Py_BEGIN_ALLOW_THREADS
        if (bits == 4)
            rc = pocket_linear_q4_k(kt, pool, threads, act_q8, (const float *)x.v.buf, (int)n,
                                    (int)cols, (const uint8_t *)q.v.buf,
                                    (const uint16_t *)s.v.buf, (const uint16_t *)m.v.buf,
                                    (int)rows, gs, (float *)y.v.buf);
        else
            rc = pocket_linear_q8_k(kt, pool, threads, act_q8, (const float *)x.v.buf, (int)n,
                                    (int)cols, (const int8_t *)q.v.buf,
                                    (const uint16_t *)s.v.buf, (int)rows, gs, (float *)y.v.buf);
        Py_END_ALLOW_THREADS
        result = pocket_py_status_result(rc);
    }
done:
    arr_release(&x);
    arr_release(&q);
    arr_release(&s);
    arr_release(&m);
    arr_release(&y);
    return result;
}

static PyObject *py_matmul_q4(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    return do_matmul(4, args, kwds);
}

static PyObject *py_matmul_q8(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    return do_matmul(8, args, kwds);
}

/* ---- quantize_act_q8 -------------------------------------------------------------------- */

static PyObject *py_quantize_act_q8(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    static char *kw[] = {"x", "qx", "dx", "sx", "level", NULL};
    PyObject *ox, *oq, *od, *os;
    int level = POCKET_LEVEL_AUTO;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|i:quantize_act_q8", kw, &ox, &oq, &od,
                                     &os, &level))
        return NULL;
    const pocket_kernel_table *t = pocket_py_check_level(level);
    if (!t) return NULL;
    Arr x = {0}, q = {0}, d = {0}, s = {0};
    PyObject *result = NULL;
    if (get_array(ox, "x", 'f', 0, &x) < 0) goto done;
    if (get_array(oq, "qx", 'b', 1, &q) < 0) goto done;
    if (get_array(od, "dx", 'f', 1, &d) < 0) goto done;
    if (get_array(os, "sx", 'f', 1, &s) < 0) goto done;
    Py_ssize_t n = x.v.shape[0], cols = x.v.shape[1];
    if (cols == 0 || cols % 32) {
        PyErr_Format(PyExc_ValueError, "x has %zd features, not a positive multiple of 32",
                     cols);
        goto done;
    }
    if (n > INT_MAX / 2) {
        PyErr_SetString(PyExc_ValueError, "x is too large");
        goto done;
    }
    if (check_shape(&q, "qx", n, cols) < 0 || check_shape(&d, "dx", n, cols / 32) < 0 ||
        check_shape(&s, "sx", n, cols / 32) < 0)
        goto done;
    if (overlaps(&q, &x) || overlaps(&d, &x) || overlaps(&s, &x) || overlaps(&q, &d) ||
        overlaps(&q, &s) || overlaps(&d, &s)) {
        PyErr_SetString(PyExc_ValueError, "qx, dx and sx must not share memory with each other "
                                          "or with x");
        goto done;
    }
    {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = t->quantize_act_q8((const float *)x.v.buf, (int)n, (int)cols, (int8_t *)q.v.buf,
                                (float *)d.v.buf, (float *)s.v.buf);
        Py_END_ALLOW_THREADS
        result = pocket_py_status_result(rc);
    }
done:
    arr_release(&x);
    arr_release(&q);
    arr_release(&d);
    arr_release(&s);
    return result;
}

/* ---- cpu_info --------------------------------------------------------------------------- */

static PyObject *py_cpu_info(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    static const struct {
        unsigned bit;
        const char *name;
    } names[] = {
        {POCKET_CPU_X86_64, "x86_64"},         {POCKET_CPU_AARCH64, "aarch64"},
        {POCKET_CPU_AVX2, "avx2"},             {POCKET_CPU_FMA, "fma"},
        {POCKET_CPU_F16C, "f16c"},             {POCKET_CPU_AVX512F, "avx512f"},
        {POCKET_CPU_AVX512BW, "avx512bw"},     {POCKET_CPU_AVX512DQ, "avx512dq"},
        {POCKET_CPU_AVX512VL, "avx512vl"},     {POCKET_CPU_AVX512VNNI, "avx512vnni"},
        {POCKET_CPU_AVXVNNI, "avxvnni"},       {POCKET_CPU_AMX_INT8, "amx_int8"},
        {POCKET_CPU_AMX_BF16, "amx_bf16"},     {POCKET_CPU_NEON, "neon"},
        {POCKET_CPU_ASIMD_DOT, "asimd_dot"},
    };
    unsigned f = pocket_cpu_features();
    PyObject *d = PyDict_New(), *feat = PyDict_New(), *sup = PyList_New(0),
             *comp = PyList_New(0);
    if (!d || !feat || !sup || !comp) goto fail;
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++)
        if (PyDict_SetItemString(feat, names[k].name, (f & names[k].bit) ? Py_True : Py_False))
            goto fail;
    for (int l = 0; l < POCKET_LEVEL_COUNT; l++) {
        PyObject *s = PyUnicode_FromString(pocket_level_name(l));
        if (!s) goto fail;
        int bad = (pocket_level_compiled(l) && PyList_Append(comp, s)) ||
                  (level_tables[l] && PyList_Append(sup, s));
        Py_DECREF(s);
        if (bad) goto fail;
    }
    {
        PyObject *best = PyUnicode_FromString(pocket_level_name(best_level));
        if (!best || PyDict_SetItemString(d, "best", best)) {
            Py_XDECREF(best);
            goto fail;
        }
        Py_DECREF(best);
    }
    if (PyDict_SetItemString(d, "features", feat) || PyDict_SetItemString(d, "levels", sup) ||
        PyDict_SetItemString(d, "compiled", comp))
        goto fail;
    Py_DECREF(feat);
    Py_DECREF(sup);
    Py_DECREF(comp);
    return d;
fail:
    Py_XDECREF(d);
    Py_XDECREF(feat);
    Py_XDECREF(sup);
    Py_XDECREF(comp);
    return NULL;
}

static PyObject *py_amx_available(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(pocket_model_amx_available());
}

static PyObject *py_ops_name(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    static char *kw[] = {"level", "avxvnni", NULL};
    int level = POCKET_LEVEL_AUTO, avxvnni = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|ii:ops_name", kw, &level, &avxvnni))
        return NULL;
    if (pocket_py_check_avxvnni(avxvnni) < 0) return NULL;
    const pocket_kernel_table *t = pocket_py_check_level(level);
    return t ? PyUnicode_FromString(pocket_level_ops_name(t, avxvnni)) : NULL;
}

/* ---- act_digits ------------------------------------------------------------------------- */

static PyObject *py_act_digits(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    static char *kw[] = {"x", "q1", "q2", "dd", "bsum", "digits", "level", NULL};
    PyObject *ox, *o1, *o2, *od, *ob;
    int digits = 2, level = POCKET_LEVEL_AUTO;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO|ii:act_digits", kw, &ox, &o1, &o2, &od,
                                     &ob, &digits, &level))
        return NULL;
    const pocket_kernel_table *t = pocket_py_check_level(level);
    if (!t) return NULL;
    if (digits != 1 && digits != 2) {
        PyErr_Format(PyExc_ValueError, "digits must be 1 or 2, got %d", digits);
        return NULL;
    }
    Arr x = {0}, q1 = {0}, q2 = {0}, d = {0}, b = {0};
    PyObject *result = NULL;
    if (get_array(ox, "x", 'f', 0, &x) < 0 || get_array(o1, "q1", 'b', 1, &q1) < 0 ||
        get_array(o2, "q2", 'b', 1, &q2) < 0 || get_array(od, "dd", 'f', 1, &d) < 0 ||
        get_array(ob, "bsum", 'f', 1, &b) < 0)
        goto done;
    Py_ssize_t n = x.v.shape[0], cols = x.v.shape[1];
    if (cols == 0 || cols % 32 || cols > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "x has %zd features, not a positive multiple of 32",
                     cols);
        goto done;
    }
    if (n > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "x is too large");
        goto done;
    }
    if (check_shape(&q1, "q1", n, cols) < 0 || check_shape(&q2, "q2", n, cols) < 0 ||
        check_shape(&d, "dd", n, cols / 32) < 0 || check_shape(&b, "bsum", n, cols / 32) < 0)
        goto done;
    {
        const Arr *outs[5] = {&x, &q1, &q2, &d, &b};
        for (int i = 0; i < 5; i++)
            for (int j = i + 1; j < 5; j++)
                if (overlaps(outs[i], outs[j])) {
                    PyErr_SetString(PyExc_ValueError,
                                    "x, q1, q2, dd and bsum must not share memory");
                    goto done;
                }
    }
    {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = pocket_model_act_digits(t, (const float *)x.v.buf, (int)n, (int)cols, digits,
                                     (int8_t *)q1.v.buf, (int8_t *)q2.v.buf, (float *)d.v.buf,
                                     (float *)b.v.buf);
        Py_END_ALLOW_THREADS
        result = pocket_py_status_result(rc);
    }
done:
    arr_release(&x);
    arr_release(&q1);
    arr_release(&q2);
    arr_release(&d);
    arr_release(&b);
    return result;
}

/* ---- matmul_f32 ------------------------------------------------------------------------- */

static PyObject *py_matmul_f32(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    static char *kw[] = {"x", "w", "out", "level", NULL};
    PyObject *ox, *ow, *oy;
    int level = POCKET_LEVEL_AUTO;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|i:matmul_f32", kw, &ox, &ow, &oy, &level))
        return NULL;
    const pocket_kernel_table *t = pocket_py_check_level(level);
    if (!t) return NULL;
    Arr x = {0}, w = {0}, y = {0};
    PyObject *result = NULL;
    if (get_array(ox, "x", 'f', 0, &x) < 0 || get_array(ow, "w", 'f', 0, &w) < 0 ||
        get_array(oy, "out", 'f', 1, &y) < 0)
        goto done;
    Py_ssize_t n = x.v.shape[0], cols = x.v.shape[1], rows = w.v.shape[0];
    if (cols == 0 || cols > INT_MAX || n > INT_MAX || rows > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "x has shape (%zd, %zd): needs 1 to %d features", n, cols,
                     INT_MAX);
        goto done;
    }
    if (check_shape(&w, "w", rows, cols) < 0 || check_shape(&y, "out", n, rows) < 0) goto done;
    if (overlaps(&y, &x) || overlaps(&y, &w)) {
        PyErr_SetString(PyExc_ValueError, "out must not share memory with x or w");
        goto done;
    }
    {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = pocket_model_matmul_f32(t, (const float *)x.v.buf, (int)n, (int)cols,
                                     (const float *)w.v.buf, (int)rows, (float *)y.v.buf);
        Py_END_ALLOW_THREADS
        result = pocket_py_status_result(rc);
    }
done:
    arr_release(&x);
    arr_release(&w);
    arr_release(&y);
    return result;
}

static PyObject *py_lora(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    static char *kw[] = {"x", "at", "bt", "out", "step", "level", NULL};
    PyObject *ox, *oa, *ob, *oy;
    int step = 0, level = POCKET_LEVEL_AUTO;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|ii:lora", kw, &ox, &oa, &ob, &oy, &step,
                                     &level))
        return NULL;
    const pocket_kernel_table *t = pocket_py_check_level(level);
    if (!t) return NULL;
    Arr x = {0}, a = {0}, b = {0}, y = {0};
    PyObject *result = NULL;
    if (get_array(ox, "x", 'f', 0, &x) < 0) goto done;
    char code = 'e'; /* float16 adapters, else float32 */
    if (get_array(oa, "at", 'e', 0, &a) < 0) {
        PyErr_Clear();
        code = 'f';
        if (get_array(oa, "at", 'f', 0, &a) < 0) goto done;
    }
    if (get_array(ob, "bt", code, 0, &b) < 0 || get_array(oy, "out", 'f', 1, &y) < 0) goto done;
    Py_ssize_t n = x.v.shape[0], cols = x.v.shape[1], rank = a.v.shape[1], rows = b.v.shape[1];
    if (cols == 0 || cols > INT_MAX || n > INT_MAX || rows > INT_MAX || rank < 1 ||
        rank > POCKET_MAX_LORA_RANK || step < 0) {
        PyErr_SetString(PyExc_ValueError, "x [n, cols], at [cols, rank] (rank 1..256), "
                                          "bt [rank, rows] and step >= 0 are required");
        goto done;
    }
    if (check_shape(&a, "at", cols, rank) < 0 || check_shape(&b, "bt", rank, rows) < 0 ||
        check_shape(&y, "out", n, rows) < 0)
        goto done;
    if (overlaps(&y, &x) || overlaps(&y, &a) || overlaps(&y, &b)) {
        PyErr_SetString(PyExc_ValueError, "out must not share memory with x, at or bt");
        goto done;
    }
    {
        pocket_weight w = {0};
        w.rows = (int)rows;
        w.cols = (int)cols;
        w.lora_rank = (int)rank;
        w.lora_f16 = code == 'e';
        w.lora_at = a.v.buf;
        w.lora_bt = b.v.buf;
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = pocket_model_lora(t, &w, (const float *)x.v.buf, (int)n, (float *)y.v.buf, step);
        Py_END_ALLOW_THREADS
        result = pocket_py_status_result(rc);
    }
done:
    arr_release(&x);
    arr_release(&a);
    arr_release(&b);
    arr_release(&y);
    return result;
}

/* ---- module ----------------------------------------------------------------------------- */

int pocket_py_add_type(PyObject *m, const char *name, PyTypeObject *type) {
    Py_INCREF(type);
    if (PyModule_AddObject(m, name, (PyObject *)type) < 0) {
        Py_DECREF(type);
        return -1;
    }
    return 0;
}

static PyMethodDef methods[] = {
    {"matmul_q4", (PyCFunction)(void (*)(void))py_matmul_q4, METH_VARARGS | METH_KEYWORDS,
     MATMUL_DOC},
    {"matmul_q8", (PyCFunction)(void (*)(void))py_matmul_q8, METH_VARARGS | METH_KEYWORDS,
     MATMUL_DOC},
    {"quantize_act_q8", (PyCFunction)(void (*)(void))py_quantize_act_q8,
     METH_VARARGS | METH_KEYWORDS,
     "quantize_act_q8(x, qx, dx, sx, level=-1): x float32 [n, cols] -> qx int8 [n, cols],\n"
     "dx float32 [n, cols/32] (block scales), sx float32 [n, cols/32] (dx * sum of qx)."},
    {"act_digits", (PyCFunction)(void (*)(void))py_act_digits, METH_VARARGS | METH_KEYWORDS,
     "act_digits(x, q1, q2, dd, bsum, digits=2, level=-1): the engine's int8 activation\n"
     "digits of x float32 [n, cols]: q1, q2 int8 [n, cols] (q2 untouched with digits=1),\n"
     "dd float32 [n, cols/32] (x ~ dd * (128 q1 + q2), or dd * q1), bsum float32 [n, cols/32]."},
    {"lora", (PyCFunction)(void (*)(void))py_lora, METH_VARARGS | METH_KEYWORDS,
     "lora(x, at, bt, out, step=0, level=-1): out float32 [n, rows] += (x float32 [n, cols]\n"
     "at) bt, a LoRA adapter's part of a product: at [cols, rank] (A transposed) and\n"
     "bt [rank, rows] (B transposed), both float32 or both float16, by the operations a\n"
     "NativeModel at that kernel level runs (the same bits at every level); step > 0: tokens\n"
     "and output columns in ranges of step, as the engine's blocks and threads split them."},
    {"matmul_f32", (PyCFunction)(void (*)(void))py_matmul_f32, METH_VARARGS | METH_KEYWORDS,
     "matmul_f32(x, w, out, level=-1): out float32 [n, rows] = x float32 [n, cols] times\n"
     "w float32 [rows, cols] transposed, by the float32-weight product a NativeModel at that\n"
     "kernel level runs (the same bits at every level)."},
    {"ops_name", (PyCFunction)(void (*)(void))py_ops_name, METH_VARARGS | METH_KEYWORDS,
     "ops_name(level=-1, avxvnni=1) -> str: the operations a NativeModel created now at that\n"
     "kernel level (and avxvnni) runs on ('portable', 'avx2', 'avx2+avxvnni', 'avx512', 'neon')."},
    {"amx_available", py_amx_available, METH_NOARGS,
     "amx_available() -> bool: whether NativeModel can run prefill products on AMX-BF16\n"
     "(config 'amx'): built with it, the CPU has it, the OS granted the tile state."},
    {"cpu_info", py_cpu_info, METH_NOARGS,
     "cpu_info() -> dict: detected CPU features, supported and compiled kernel levels, best."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "pocketlm._native",
    "Native quantized matrix kernels of pocketlm (see pocketlm.runtime.kernels.native).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    for (int l = 0; l < POCKET_LEVEL_COUNT; l++) {
        level_tables[l] = pocket_kernels(l);
        if (level_tables[l]) best_level = l;
    }
    if (PyType_Ready(&PocketPool_Type) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    if (pocket_py_add_type(m, "ThreadPool", &PocketPool_Type) < 0 ||
        pocket_py_add_model_types(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "LEVEL_AUTO", POCKET_LEVEL_AUTO) ||
        PyModule_AddIntConstant(m, "LEVEL_SCALAR", POCKET_LEVEL_SCALAR) ||
        PyModule_AddIntConstant(m, "LEVEL_AVX2", POCKET_LEVEL_AVX2) ||
        PyModule_AddIntConstant(m, "LEVEL_AVX512", POCKET_LEVEL_AVX512) ||
        PyModule_AddIntConstant(m, "LEVEL_NEON", POCKET_LEVEL_NEON) ||
        PyModule_AddIntConstant(m, "KERNEL_API", KERNEL_API) ||
        PyModule_AddIntConstant(m, "Q8_QKV", POCKET_Q8_QKV) ||
        PyModule_AddIntConstant(m, "Q8_WO", POCKET_Q8_WO) ||
        PyModule_AddIntConstant(m, "Q8_GATE_UP", POCKET_Q8_GATE_UP) ||
        PyModule_AddIntConstant(m, "Q8_DOWN", POCKET_Q8_DOWN) ||
        PyModule_AddIntConstant(m, "Q8_HEAD", POCKET_Q8_HEAD) ||
        PyModule_AddIntConstant(m, "Q8_ONE_DIGIT_SHIFT", POCKET_Q8_ONE_DIGIT_SHIFT) ||
        PyModule_AddIntConstant(m, "QBLOCK", POCKET_QBLOCK) ||
        PyModule_AddIntConstant(m, "AMX_MIN_TOKENS", POCKET_AMX_MIN_TOKENS)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
