/* What the int4 extension's two sources share (_int4_cpu.c: the matmul and its
 * builds; _int4_layer.c: a decoder layer's decode step over it). */
#ifndef RELEASEGATE_INT4_CPU_H
#define RELEASEGATE_INT4_CPU_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* One int4 weight W [n, k] as the matmul reads it (pack-quantized bytes [n, k/2],
 * scales [n, k/group], zero_scale likewise or NULL) and the builds that run it: the
 * float one, and the int8-activation one (NULL where none takes the group). */
typedef struct {
    const uint8_t *w;
    const float *s, *zs;
    Py_ssize_t n, k, group;
    const void *path, *q8_path;
} Int4Weight;

/* Picks the best builds for w->group and checks the shape; 0 with a ValueError
 * naming `name` where no float build applies. */
int int4_weight_init(Int4Weight *w, const char *name);

/* Floats of scratch `int4_apply` needs for `m` rows of x times `w`. */
Py_ssize_t int4_scratch_floats(const Int4Weight *w, Py_ssize_t m);

/* y[m, n] = x[m, k] W^T on this thread, as `int4_matmul` computes it, or with `q8`
 * as `int4_matmul_q8` does (w->q8_path set); needs no GIL. */
void int4_apply(const Int4Weight *w, const float *x, Py_ssize_t m, float *y,
                float *scratch, int q8);

/* _int4_layer.c's functions (module docstrings there) */
PyObject *int4_layer_new(PyObject *self, PyObject *args);
PyObject *int4_layer_decode(PyObject *self, PyObject *args);
PyObject *int4_layer_attention_paths(PyObject *self, PyObject *unused);

#endif
