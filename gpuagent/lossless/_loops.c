/* The lossless coder's two inner loops (gpuagent.lossless.planes and
 * .huffman), compiled: numpy spent as long on each as the rest of its
 * coding or decoding put together.
 *
 * merge16(exponent, rest, out, exponent_base, rest_base): for each element i,
 *   e = (exponent[i] + exponent_base) mod 256, r = (rest[i] + rest_base) mod 256,
 *   word i = (r & 0x80) << 8 | e << 7 | (r & 0x7f), written little-endian
 * the inverse of `planes.split_words` for bf16 and fp16 (see there). The
 * planes are read and the words written once, with the GIL released; numpy's
 * version of the same took four passes over the words.
 *
 * huffman_stream(symbols, codes, lengths) -> bytes: one Huffman stream as zstd
 * reads it (RFC 8878 4.2.2: read backward from the end-mark bit, so the first
 * symbol's code sits just under that bit, most significant bit first): written
 * here from the last symbol up, each code above the ones before it in a
 * little-endian bit container. codes: uint32 per symbol value, lengths: uint8
 * bits (<= 24) of each; a symbol with no entry is refused. */
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

#define MAX_CODE_BITS 24

/* Writes the stream into out (room for total bits + 1, rounded up to bytes, plus
 * 8), returns its length in bytes. */
static Py_ssize_t stream(const uint8_t *symbols, Py_ssize_t n, const uint32_t *codes,
                         const uint8_t *lengths, uint8_t *out) {
    uint64_t bits = 0; /* pending bits, lowest first */
    int count = 0;     /* < 32 between symbols */
    Py_ssize_t size = 0;
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        bits |= (uint64_t)codes[symbols[i]] << count;
        count += lengths[symbols[i]];
        if (count >= 32) {
            for (int b = 0; b < 4; b++)
                out[size++] = (uint8_t)(bits >> (8 * b));
            bits >>= 32;
            count -= 32;
        }
    }
    bits |= (uint64_t)1 << count; /* the end mark */
    for (count += 1; count > 0; count -= 8) {
        out[size++] = (uint8_t)bits;
        bits >>= 8;
    }
    return size;
}

static PyObject *huffman_stream(PyObject *self, PyObject *args) {
    Py_buffer symbols, codes, lengths;
    if (!PyArg_ParseTuple(args, "y*y*y*", &symbols, &codes, &lengths))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t table = lengths.len;
    const uint8_t *sym = (const uint8_t *)symbols.buf;
    const uint8_t *len = (const uint8_t *)lengths.buf;
    uint32_t code[256];
    int max_bits = 0;
    if (codes.len != 4 * table || table > 256) {
        PyErr_Format(PyExc_ValueError,
                     "huffman_stream: %zd code bytes for %zd lengths (expected 4 "
                     "per length, at most 256 lengths)",
                     codes.len, table);
        goto done;
    }
    for (Py_ssize_t v = 0; v < table; v++) {
        const uint8_t *c = (const uint8_t *)codes.buf + 4 * v;
        code[v] = (uint32_t)c[0] | (uint32_t)c[1] << 8 | (uint32_t)c[2] << 16 |
                  (uint32_t)c[3] << 24;
        if (len[v] > MAX_CODE_BITS || code[v] >> len[v]) { /* shift < 32 */
            PyErr_Format(PyExc_ValueError,
                         "huffman_stream: symbol %zd has code %u in %d bits", v,
                         code[v], len[v]);
            goto done;
        }
        if (len[v] > max_bits)
            max_bits = len[v];
    }
    for (Py_ssize_t i = 0; i < symbols.len; i++) {
        if (sym[i] >= table) {
            PyErr_Format(PyExc_ValueError,
                         "huffman_stream: symbol %d at %zd has no code (%zd codes)",
                         sym[i], i, table);
            goto done;
        }
    }
    Py_ssize_t room = (symbols.len * max_bits + 1) / 8 + 8;
    result = PyBytes_FromStringAndSize(NULL, room);
    if (result == NULL)
        goto done;
    Py_ssize_t size;
    Py_BEGIN_ALLOW_THREADS size =
        stream(sym, symbols.len, code, len, (uint8_t *)PyBytes_AS_STRING(result));
    Py_END_ALLOW_THREADS if (_PyBytes_Resize(&result, size) < 0) result = NULL;
done:
    PyBuffer_Release(&symbols);
    PyBuffer_Release(&codes);
    PyBuffer_Release(&lengths);
    return result;
}

static PyMethodDef methods[] = {
    {"merge16", merge16, METH_VARARGS,
     "merge16(exponent, rest, out, exponent_base=0, rest_base=0): 16-bit words "
     "from their exponent and sign+mantissa planes, written into out."},
    {"huffman_stream", huffman_stream, METH_VARARGS,
     "huffman_stream(symbols, codes, lengths) -> bytes: one Huffman stream as zstd "
     "reads it backward."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_loops",
    "The lossless coder's inner loops: the merge of 16-bit words from their planes, "
    "and the writing of one Huffman stream.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__loops(void) { return PyModule_Create(&module); }
