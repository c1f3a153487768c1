/* The group-wise int8 weight-only matmul for a few rows of float32 activations on a
 * CPU (decode), fused: y[m, n] = sum_k x[m, k] W[n, k], W = c[n, k] s[n, k / g], each
 * weight byte read once and never written out as a float matrix. The layout is
 * llama.cpp's Q8_0 (groups of 32 codes in -127..127 under one scale) with the codes
 * and scales in two arrays: the output head of SmolLM2's GGUF is stored so. Python
 * side: kernels.int8_cpu.
 *
 * Each weight is made once per pass as the float32 product c * s (the very value the
 * reference's dequantized matrix holds) and multiplied into the sums of up to CHUNK
 * rows of x at a time, so a few rows share each conversion; more rows go a CHUNK at a
 * time over a block of N_BLOCK rows of W. Rows of W are split across threads when the
 * caller asks for several.
 *
 * Three builds of that loop, picked at run time: AVX-512 (16 codes per step) and
 * AVX2 + FMA (8 per step) on x86-64 with GCC or clang, and a portable one everywhere
 * (the fallback, and what the tests compare them with; `paths()` names the ones this
 * CPU runs).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROWS 16    /* activation rows per call (decode batches) */
#define MAX_THREADS 64
#define LANES 8        /* portable build: partial sums */
#define CHUNK 8        /* SIMD builds: rows of x that share one pass over a row of W */
#define N_BLOCK 64     /* SIMD builds: rows of W (K bytes each, in L2) that one CHUNK of
                        * x rows (in L1) passes over before the next CHUNK: 16 rows of x
                        * at once are more than a 32 KiB L1 at K = 576 */

typedef struct {
    const float *x;         /* [M, K] */
    const int8_t *w;        /* [N, K] codes */
    const float *s;         /* [N, K / group] */
    float *y;               /* [M, N] */
    Py_ssize_t m, n, k, group, n0, n1;
} Job;

static void rows_portable(const Job *job) {
    const Py_ssize_t k = job->k, group = job->group, groups = k / group;
    float w[1024]; /* one group's codes times its scale */
    for (Py_ssize_t n = job->n0; n < job->n1; n++) {
        const int8_t *row = job->w + n * k;
        float part[MAX_ROWS][LANES] = {{0}};
        for (Py_ssize_t g = 0; g < groups; g++) {
            const float s = job->s[n * groups + g];
            for (Py_ssize_t j = 0; j < group; j++) w[j] = (float)row[g * group + j] * s;
            for (Py_ssize_t m = 0; m < job->m; m++) {
                const float *x = job->x + m * k + g * group;
                for (Py_ssize_t j = 0; j < group; j += LANES)
                    for (int l = 0; l < LANES; l++) part[m][l] += x[j + l] * w[j + l];
            }
        }
        for (Py_ssize_t m = 0; m < job->m; m++) {
            float dot = 0.0f;
            for (int l = 0; l < LANES; l++) dot += part[m][l];
            job->y[m * job->n + n] = dot;
        }
    }
}

#if defined(__GNUC__) && defined(__x86_64__)
#define HAVE_X86_SIMD 1
#include <immintrin.h>

/* One SIMD build: row of W `n` against rows m0 .. m0 + M - 1 of x, M a constant 1..CHUNK
 * where it is inlined. VEC is the vector type, STEP its float lanes, LOAD_CODES widens
 * STEP int8 codes at p to float lanes, and the rest are the ISA's intrinsics. Each code
 * vector is scaled once (c * s, the float32 product the reference's dequantized matrix
 * holds) and multiplied into every row's sum. */
#define DEFINE_ROW(NAME, TARGET, VEC, STEP, LOAD_CODES, SET1, ZERO, LOADU, MUL, FMADD,  \
                   HSUM)                                                                \
    __attribute__((target(TARGET), always_inline)) static inline void NAME(             \
        const Job *job, Py_ssize_t n, Py_ssize_t m0, const int M) {                     \
        const Py_ssize_t k = job->k, group = job->group, groups = k / group;            \
        const int8_t *row = job->w + n * k;                                             \
        const float *x = job->x + m0 * k;                                               \
        VEC acc[CHUNK];                                                                 \
        for (int i = 0; i < M; i++) acc[i] = ZERO();                                    \
        for (Py_ssize_t g = 0; g < groups; g++) {                                       \
            const VEC sv = SET1(job->s[n * groups + g]);                                \
            for (Py_ssize_t j = g * group; j < (g + 1) * group; j += STEP) {            \
                const VEC w = MUL(LOAD_CODES(row + j), sv);                             \
                for (int i = 0; i < M; i++) acc[i] = FMADD(LOADU(x + i * k + j), w, acc[i]); \
            }                                                                           \
        }                                                                               \
        for (int i = 0; i < M; i++) job->y[(m0 + i) * job->n + n] = HSUM(acc[i]);       \
    }                                                                                   \
    __attribute__((target(TARGET))) static void rows_##NAME(const Job *job) {           \
        for (Py_ssize_t nb = job->n0; nb < job->n1; nb += N_BLOCK)                      \
            for (Py_ssize_t m0 = 0; m0 < job->m; m0 += CHUNK) {                         \
                const Py_ssize_t end = nb + N_BLOCK < job->n1 ? nb + N_BLOCK : job->n1; \
                const int rows = job->m - m0 < CHUNK ? (int)(job->m - m0) : CHUNK;      \
                for (Py_ssize_t n = nb; n < end; n++) switch (rows) {                   \
                    case 1: NAME(job, n, m0, 1); break;                                 \
                    case 2: NAME(job, n, m0, 2); break;                                 \
                    case 3: NAME(job, n, m0, 3); break;                                 \
                    case 4: NAME(job, n, m0, 4); break;                                 \
                    case 5: NAME(job, n, m0, 5); break;                                 \
                    case 6: NAME(job, n, m0, 6); break;                                 \
                    case 7: NAME(job, n, m0, 7); break;                                 \
                    default: NAME(job, n, m0, 8); break;                                \
                    }                                                                   \
            }                                                                           \
    }

__attribute__((target("avx2,fma"), always_inline)) static inline __m256 codes8(
    const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

__attribute__((target("avx2,fma"), always_inline)) static inline float hsum8(__m256 v) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}

__attribute__((target("avx512f"), always_inline)) static inline __m512 codes16(
    const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

DEFINE_ROW(avx2, "avx2,fma", __m256, 8, codes8, _mm256_set1_ps, _mm256_setzero_ps,
           _mm256_loadu_ps, _mm256_mul_ps, _mm256_fmadd_ps, hsum8)
DEFINE_ROW(avx512, "avx512f", __m512, 16, codes16, _mm512_set1_ps, _mm512_setzero_ps,
           _mm512_loadu_ps, _mm512_mul_ps, _mm512_fmadd_ps, _mm512_reduce_add_ps)
#endif

#define MIN_GROUP_AVX512 16
#define MIN_GROUP_AVX2 8
#define MIN_GROUP_PORTABLE 8
#include "_cpu_paths.h"

/* int8_matmul(x, codes, scale, out, m, n, k, group, threads[, path]) */
static PyObject *int8_matmul(PyObject *self, PyObject *args) {
    Py_buffer x = {0}, w = {0}, s = {0}, y = {0};
    Py_ssize_t m, n, k, group, threads;
    const char *path_name = NULL;
    if (!PyArg_ParseTuple(args, "y*y*y*w*nnnnn|z", &x, &w, &s, &y, &m, &n, &k, &group,
                          &threads, &path_name))
        return NULL;
    PyObject *result = NULL;
    if (m < 1 || m > MAX_ROWS || n < 1 || threads < 1 || threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError,
                     "m=%zd (1..%d), n=%zd (>= 1), threads=%zd (1..%d) out of range", m,
                     MAX_ROWS, n, threads, MAX_THREADS);
        goto done;
    }
    if (group < 8 || group > 1024 || group % 8 || k < group || k % group) {
        PyErr_Format(PyExc_ValueError,
                     "group=%zd must be a multiple of 8 up to 1024 dividing k=%zd", group, k);
        goto done;
    }
    const Path *path = pick(path_name, group);
    if (!path) goto done;
    if (!sized(&x, "x", m * k, 4) || !sized(&w, "codes", n * k, 1) ||
        !sized(&s, "scale", n * (k / group), 4) || !sized(&y, "out", m * n, 4))
        goto done;
    const Job job = {x.buf, w.buf, s.buf, y.buf, m, n, k, group, 0, 0};
    run_split(path, &job, threads);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&w);
    PyBuffer_Release(&s);
    PyBuffer_Release(&y);
    return result;
}

static PyMethodDef methods[] = {
    {"int8_matmul", int8_matmul, METH_VARARGS,
     "int8_matmul(x, codes, scale, out, m, n, k, group, threads[, path]): "
     "out[m, n] = x @ W^T for float32 x [m, k] and group-wise int8 W [n, k] "
     "(codes [n, k] int8, scale [n, k / group] float32); path names a build from "
     "paths() (default: the best one for the group)"},
    PATHS_METHOD,
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_int8_cpu",
                                    "Group-wise int8 weight-only matmul for a CPU", -1,
                                    methods};

PyMODINIT_FUNC PyInit__int8_cpu(void) { return PyModule_Create(&module); }
