/* The int4 weight-only matmul for a few rows of float32 activations on a CPU
 * (decode), fused: y[m, n] = sum_k x[m, k] W[n, k], W = (c - 8) s[n, g] - zs[n, g],
 * each weight byte read once and never written out as a float matrix (the torch
 * reference dequantizes the whole W per call). Python side: kernels.int4_cpu.
 *
 * The pack-quantized layout (kernels.weight_matmul): W [N, K] as int32 words
 * [N, K / 8], least significant nibble first, so on a little-endian machine byte j
 * of a row holds columns 2j (low nibble) and 2j + 1 (high nibble), each stored as
 * c = q + 8. Per group: sum_k x_k (c_k - 8) s - x_k zs
 *                      = s (sum_k x_k c_k) - (8 s + zs) (sum_k x_k):
 * x is split into its even and odd columns once per call (so a byte's two nibbles
 * meet their two columns in the same lane) and summed per group; each group's codes
 * are converted to float32 once for every row of x, multiplied into a per-group sum,
 * and that sum scaled into the row's total; the group offsets are summed beside it.
 * Rows of W are split across threads when the caller asks for several.
 *
 * Three builds of that loop, picked at run time: AVX-512 (16 codes per step, for
 * groups that are a multiple of 32) and AVX2 + FMA (8 per step) on x86-64 with GCC or
 * clang, and a portable one everywhere (the fallback, and what the tests compare
 * them with; `paths()` names the ones this CPU runs).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROWS 16    /* activation rows per call (decode batches) */
#define MAX_THREADS 64
#define LANES 8        /* portable build: partial sums per column parity */
#define CHUNK 4        /* SIMD builds: rows of x that share one pass over a row of W */

typedef struct {
    const float *xe, *xo;   /* [M, K/2] even and odd columns of x */
    const float *xsum;      /* [M, G] x summed per group */
    const uint8_t *w;       /* [N, K/2] packed bytes */
    const float *s, *zs;    /* [N, G]; zs may be NULL */
    float *y;               /* [M, N] */
    Py_ssize_t m, n, k, group, n0, n1;
} Job;

static void rows_portable(const Job *job) {
    const Py_ssize_t half = job->k / 2, hg = job->group / 2, groups = job->k / job->group;
    float lo[512], hi[512]; /* one group's codes, by column parity */
    for (Py_ssize_t n = job->n0; n < job->n1; n++) {
        const uint8_t *row = job->w + n * half;
        float acc[MAX_ROWS] = {0};     /* s * sum x c, over the whole row */
        float offsets[MAX_ROWS] = {0}; /* (8 s + zs) * sum x, over the row */
        for (Py_ssize_t g = 0; g < groups; g++) {
            const uint8_t *b = row + g * hg;
            const float s = job->s[n * groups + g];
            const float offset = 8.0f * s + (job->zs ? job->zs[n * groups + g] : 0.0f);
            for (Py_ssize_t j = 0; j < hg; j++) {
                lo[j] = (float)(b[j] & 15);
                hi[j] = (float)(b[j] >> 4);
            }
            for (Py_ssize_t m = 0; m < job->m; m++) {
                const float *xe = job->xe + m * half + g * hg;
                const float *xo = job->xo + m * half + g * hg;
                float part[LANES] = {0};
                for (Py_ssize_t j = 0; j < hg; j += LANES)
                    for (int l = 0; l < LANES; l++)
                        part[l] += xe[j + l] * lo[j + l] + xo[j + l] * hi[j + l];
                float dot = 0.0f;
                for (int l = 0; l < LANES; l++) dot += part[l];
                acc[m] += s * dot;
                offsets[m] += offset * job->xsum[m * groups + g];
            }
        }
        for (Py_ssize_t m = 0; m < job->m; m++) job->y[m * job->n + n] = acc[m] - offsets[m];
    }
}

#if defined(__GNUC__) && defined(__x86_64__)
#define HAVE_X86_SIMD 1
#include <immintrin.h>

/* One SIMD build: row of W `n` against rows m0 .. m0 + M - 1 of x, M a constant 1..CHUNK
 * where it is inlined. VEC is the vector type, STEP its float lanes, LOAD_CODES widens
 * STEP packed bytes at p to int32 lanes, and the rest are the ISA's intrinsics. */
#define DEFINE_ROW(NAME, TARGET, VEC, IVEC, STEP, LOAD_CODES, SET1I, AND, SRLI, CVT, SET1,  \
                   ZERO, LOADU, FMADD, HSUM)                                                \
    __attribute__((target(TARGET), always_inline)) static inline void NAME(                 \
        const Job *job, Py_ssize_t n, Py_ssize_t m0, const int M) {                         \
        const Py_ssize_t half = job->k / 2, hg = job->group / 2;                            \
        const Py_ssize_t groups = job->k / job->group;                                      \
        const uint8_t *row = job->w + n * half;                                             \
        const IVEC low = SET1I(15);                                                         \
        VEC acc[CHUNK], ga[CHUNK];                                                          \
        float offsets[CHUNK] = {0};                                                         \
        for (int i = 0; i < M; i++) acc[i] = ZERO();                                        \
        for (Py_ssize_t g = 0; g < groups; g++) {                                           \
            const uint8_t *b = row + g * hg;                                                \
            for (int i = 0; i < M; i++) ga[i] = ZERO();                                     \
            for (Py_ssize_t j = 0; j < hg; j += STEP) {                                     \
                const IVEC c = LOAD_CODES(b + j);                                           \
                const VEC lo = CVT(AND(c, low)), hi = CVT(SRLI(c, 4));                      \
                for (int i = 0; i < M; i++) {                                               \
                    const Py_ssize_t at = (m0 + i) * half + g * hg + j;                     \
                    ga[i] = FMADD(LOADU(job->xe + at), lo, ga[i]);                          \
                    ga[i] = FMADD(LOADU(job->xo + at), hi, ga[i]);                          \
                }                                                                           \
            }                                                                               \
            const float s = job->s[n * groups + g];                                         \
            const float offset = 8.0f * s + (job->zs ? job->zs[n * groups + g] : 0.0f);     \
            const VEC sv = SET1(s);                                                         \
            for (int i = 0; i < M; i++) {                                                   \
                acc[i] = FMADD(ga[i], sv, acc[i]);                                          \
                offsets[i] += offset * job->xsum[(m0 + i) * groups + g];                    \
            }                                                                               \
        }                                                                                   \
        for (int i = 0; i < M; i++)                                                         \
            job->y[(m0 + i) * job->n + n] = HSUM(acc[i]) - offsets[i];                      \
    }                                                                                       \
    __attribute__((target(TARGET))) static void rows_##NAME(const Job *job) {               \
        for (Py_ssize_t n = job->n0; n < job->n1; n++)                                      \
            for (Py_ssize_t m0 = 0; m0 < job->m; m0 += CHUNK) {                             \
                switch (job->m - m0 < CHUNK ? job->m - m0 : CHUNK) {                        \
                case 1: NAME(job, n, m0, 1); break;                                         \
                case 2: NAME(job, n, m0, 2); break;                                         \
                case 3: NAME(job, n, m0, 3); break;                                         \
                default: NAME(job, n, m0, 4); break;                                        \
                }                                                                           \
            }                                                                               \
    }

__attribute__((target("avx2,fma"), always_inline)) static inline __m256i codes8(
    const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

__attribute__((target("avx2,fma"), always_inline)) static inline float hsum8(__m256 v) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}

__attribute__((target("avx512f"), always_inline)) static inline __m512i codes16(
    const uint8_t *p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}

DEFINE_ROW(avx2, "avx2,fma", __m256, __m256i, 8, codes8, _mm256_set1_epi32,
           _mm256_and_si256, _mm256_srli_epi32, _mm256_cvtepi32_ps, _mm256_set1_ps,
           _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps, hsum8)
DEFINE_ROW(avx512, "avx512f", __m512, __m512i, 16, codes16, _mm512_set1_epi32,
           _mm512_and_si512, _mm512_srli_epi32, _mm512_cvtepi32_ps, _mm512_set1_ps,
           _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps, _mm512_reduce_add_ps)
#endif

#define MIN_GROUP_AVX512 32
#define MIN_GROUP_AVX2 16
#define MIN_GROUP_PORTABLE 16
#include "_cpu_paths.h"

/* int4_matmul(x, packed, scale, zero_scale, out, m, n, k, group, threads[, path]) */
static PyObject *int4_matmul(PyObject *self, PyObject *args) {
    Py_buffer x = {0}, w = {0}, s = {0}, zs = {0}, y = {0};
    PyObject *zs_obj;
    Py_ssize_t m, n, k, group, threads;
    const char *path_name = NULL;
    if (!PyArg_ParseTuple(args, "y*y*y*Ow*nnnnn|z", &x, &w, &s, &zs_obj, &y, &m, &n, &k,
                          &group, &threads, &path_name))
        return NULL;
    PyObject *result = NULL;
    float *xe = NULL, *xsum = NULL;
    if (zs_obj != Py_None && PyObject_GetBuffer(zs_obj, &zs, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (m < 1 || m > MAX_ROWS || n < 1 || threads < 1 || threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError,
                     "m=%zd (1..%d), n=%zd (>= 1), threads=%zd (1..%d) out of range", m,
                     MAX_ROWS, n, threads, MAX_THREADS);
        goto done;
    }
    if (group < 16 || group > 1024 || group % 16 || k < group || k % group) {
        PyErr_Format(PyExc_ValueError,
                     "group=%zd must be a multiple of 16 up to 1024 dividing k=%zd", group, k);
        goto done;
    }
    const Path *path = pick(path_name, group);
    if (!path) goto done;
    const Py_ssize_t groups = k / group;
    if (!sized(&x, "x", m * k, 4) || !sized(&w, "packed", n * k / 2, 1) ||
        !sized(&s, "scale", n * groups, 4) || !sized(&y, "out", m * n, 4) ||
        (zs.buf && !sized(&zs, "zero_scale", n * groups, 4)))
        goto done;
    xe = malloc(sizeof(float) * m * k);
    xsum = malloc(sizeof(float) * m * groups);
    if (!xe || !xsum) {
        PyErr_NoMemory();
        goto done;
    }
    float *xo = xe + m * k / 2;
    const float *xs = x.buf;
    for (Py_ssize_t r = 0; r < m; r++)
        for (Py_ssize_t g = 0; g < groups; g++) {
            float sum = 0.0f;
            for (Py_ssize_t j = g * group / 2; j < (g + 1) * group / 2; j++) {
                xe[r * k / 2 + j] = xs[r * k + 2 * j];
                xo[r * k / 2 + j] = xs[r * k + 2 * j + 1];
                sum += xs[r * k + 2 * j] + xs[r * k + 2 * j + 1];
            }
            xsum[r * groups + g] = sum;
        }
    const Job job = {xe, xo, xsum, w.buf, s.buf, zs.buf, y.buf, m, n, k, group, 0, 0};
    run_split(path, &job, threads);
    result = Py_None;
    Py_INCREF(result);
done:
    free(xe);
    free(xsum);
    PyBuffer_Release(&x);
    PyBuffer_Release(&w);
    PyBuffer_Release(&s);
    PyBuffer_Release(&y);
    if (zs.buf) PyBuffer_Release(&zs);
    return result;
}

static PyMethodDef methods[] = {
    {"int4_matmul", int4_matmul, METH_VARARGS,
     "int4_matmul(x, packed, scale, zero_scale, out, m, n, k, group, threads[, path]): "
     "out[m, n] = x @ W^T for float32 x [m, k] and pack-quantized int4 W [n, k]; path "
     "names a build from paths() (default: the best one for the group)"},
    PATHS_METHOD,
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_int4_cpu",
                                    "Fused int4 weight-only matmul for a CPU", -1, methods};

PyMODINIT_FUNC PyInit__int4_cpu(void) { return PyModule_Create(&module); }
