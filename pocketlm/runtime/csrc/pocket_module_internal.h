/* Internal: what the two sources of the CPython module pocketlm._native share.
 *
 *   pocket_module.c        the kernels' functions (matmul_q4, matmul_q8, quantize_act_q8, ...),
 *                          ThreadPool, the argument checks, the module and its initialization
 *   pocket_module_model.c  NativeModel and NativeKV, the wrapper of the inference engine
 *
 * Include after Python.h. Not part of the public API. */
#ifndef POCKET_MODULE_INTERNAL_H
#define POCKET_MODULE_INTERNAL_H

#include <stdint.h>

#include "pocket_kernels.h"

/* ---- ThreadPool (pocket_module.c) ---------------------------------------------------------- */

typedef struct {
    PyObject_HEAD pocket_pool *pool;
    int size;
} PoolObject;

extern PyTypeObject PocketPool_Type;

/* The pool behind a checked `pool` argument (a ThreadPool or None: NULL). */
static inline pocket_pool *pocket_py_pool(PyObject *pool) {
    return pool == Py_None ? NULL : ((PoolObject *)pool)->pool;
}

/* ---- arrays taken through the buffer protocol ------------------------------------------------ */

typedef struct {
    Py_buffer v;
    int held;
} Arr;

static inline void arr_release(Arr *a) {
    if (a->held) PyBuffer_Release(&a->v);
    a->held = 0;
}

static inline const char *dtype_name(char code) {
    switch (code) {
    case 'f': return "float32";
    case 'e': return "float16";
    case 'B': return "uint8";
    case 'b': return "int8";
    case 'i': return "int32";
    default: return "?";
    }
}

static inline int host_little_endian(void) {
    const uint16_t one = 1;
    return *(const unsigned char *)&one == 1;
}

/* The element type code of a buffer format ('f', 'e', 'B', ...), or 0 if it is not one
 * native scalar. */
static inline char format_code(const char *fmt) {
    if (!fmt) return 'B';
    if (*fmt == '@' || *fmt == '=' || (*fmt == '<' && host_little_endian()) ||
        ((*fmt == '>' || *fmt == '!') && !host_little_endian()))
        fmt++;
    if (fmt[0] == '\0' || fmt[1] != '\0') return 0;
    return fmt[0];
}

/* Whether a buffer holds native scalars of element type `code` ('f', 'e', 'B', 'b' or 'i'). */
static inline int has_dtype(const Py_buffer *v, char code) {
    return format_code(v->format) == code &&
           v->itemsize == (code == 'f' || code == 'i' ? 4 : code == 'e' ? 2 : 1);
}

static inline int overlaps(const Arr *a, const Arr *b) {
    if (!a->held || !b->held || a->v.len == 0 || b->v.len == 0) return 0;
    const char *a0 = (const char *)a->v.buf, *b0 = (const char *)b->v.buf;
    return a0 < b0 + b->v.len && b0 < a0 + a->v.len;
}

/* ---- argument checks and results (pocket_module.c) ------------------------------------------ */

/* The kernel table for `level` (POCKET_LEVEL_AUTO: the best), or NULL with an exception. */
const pocket_kernel_table *pocket_py_check_level(int level);
/* 0 when `pool` is a ThreadPool or None and threads is in 1..1024, else -1 with an exception. */
int pocket_py_check_pool(PyObject *pool, int threads);
/* 0 when avxvnni (the avx2 level's products: 1 on AVX-VNNI where the CPU has it, 0 on AVX2's
 * multiply-add pairs) is 0 or 1, else -1 with a ValueError. */
int pocket_py_check_avxvnni(int avxvnni);
/* NULL with the exception for a negative POCKET_* status. */
PyObject *pocket_py_raise_status(int rc);
/* None for POCKET_OK, else NULL with the status's exception. */
PyObject *pocket_py_status_result(int rc);
/* Add `type` (ready) to module m as `name`; -1 with an exception on failure. */
int pocket_py_add_type(PyObject *m, const char *name, PyTypeObject *type);

/* ---- NativeModel, NativeKV (pocket_module_model.c) ------------------------------------------ */

/* Ready the NativeModel and NativeKV types and add them (and MODEL_API) to module m; -1 with an
 * exception on failure. */
int pocket_py_add_model_types(PyObject *m);

#endif /* POCKET_MODULE_INTERNAL_H */
