/* The merge of 16-bit words from their exponent and rest planes, in one pass.
 *
 * merge16(exponent, rest, out, exponent_base, rest_base): for each element i,
 *   e = (exponent[i] + exponent_base) mod 256, r = (rest[i] + rest_base) mod 256,
 *   word i = (r & 0x80) << 8 | e << 7 | (r & 0x7f), written little-endian
 * the inverse of `lossless_planes.split_words` for bf16 and fp16 (see there). The
 * planes are read and the words written once, with the GIL released; numpy's
 * version of the same took four passes over the words. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* out: 2n bytes, each word little-endian (the safetensors byte order) */
static void merge(const uint8_t *exponent, const uint8_t *rest, uint8_t *out,
                  Py_ssize_t n, uint8_t exponent_base, uint8_t rest_base) {
    for (Py_ssize_t i = 0; i < n; i++) {
        uint8_t e = (uint8_t)(exponent[i] + exponent_base);
        uint8_t r = (uint8_t)(rest[i] + rest_base);
        out[2 * i] = (uint8_t)((e << 7) | (r & 0x7f));
        out[2 * i + 1] = (uint8_t)((r & 0x80) | (e >> 1));
    }
}

static PyObject *merge16(PyObject *self, PyObject *args) {
    Py_buffer exponent, rest, out;
    int exponent_base = 0, rest_base = 0;
    if (!PyArg_ParseTuple(args, "y*y*w*|ii", &exponent, &rest, &out, &exponent_base,
                          &rest_base))
        return NULL;
    PyObject *result = NULL;
    if (exponent.len != rest.len || out.len != 2 * exponent.len) {
        PyErr_Format(PyExc_ValueError,
                     "merge16: %zd exponent bytes, %zd rest bytes and %zd output "
                     "bytes (expected n, n and 2n)",
                     exponent.len, rest.len, out.len);
    } else if (exponent_base < 0 || exponent_base > 255 || rest_base < 0 ||
               rest_base > 255) {
        PyErr_Format(PyExc_ValueError, "merge16: bases %d and %d are not bytes",
                     exponent_base, rest_base);
    } else {
        Py_BEGIN_ALLOW_THREADS merge((const uint8_t *)exponent.buf,
                                     (const uint8_t *)rest.buf, (uint8_t *)out.buf,
                                     exponent.len, (uint8_t)exponent_base,
                                     (uint8_t)rest_base);
        Py_END_ALLOW_THREADS result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&exponent);
    PyBuffer_Release(&rest);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"merge16", merge16, METH_VARARGS,
     "merge16(exponent, rest, out, exponent_base=0, rest_base=0): 16-bit words "
     "from their exponent and sign+mantissa planes, written into out."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_merge16",
    "The one-pass merge of 16-bit words from their planes.", -1, methods,
};

PyMODINIT_FUNC PyInit__merge16(void) { return PyModule_Create(&module); }
