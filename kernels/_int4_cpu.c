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
 *
 * int4_matmul_q8 (the engine option int8_activations) rounds x to int8 per block of
 * 32 columns first, as llama.cpp's Q8_1 (d = absmax / 127), and sums q times the
 * codes in integers (u8 codes x s8 q, four products a 32-bit lane: AVX-512 VNNI,
 * AVX-VNNI, AVX2's maddubs or portable C; `q8_paths()`), each 8 columns' sum scaled
 * by d and s in float32: its own table of builds, picked by the shared `pick_in`.
 */
#include "_int4_cpu.h"
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#define MAX_ROWS 16    /* activation rows per call (decode batches) */
#define MAX_THREADS 64
#define LANES 8        /* portable build: partial sums per column parity */
#define CHUNK 4        /* SIMD builds: rows of x that share one pass over a row of W */

typedef struct {
    const float *xe, *xo;   /* [M, K/2] even and odd columns of x (float builds) */
    const int8_t *qe, *qo;  /* [M, K/2] the same of x quantized to int8 (q8 builds) */
    const float *dl;        /* [M, K/8] q8: the block scale of each 8 columns */
    const int32_t *qoff;    /* [M, K/8] q8: -8 times the sum of q over each 8 columns */
    const float *xsum;      /* [M, G] x (q8: its dequantized int8) summed per group */
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


/* The int8-activation (q8) builds: x quantized per block of Q8_BLOCK columns to
 * int8 (d = absmax / 127, q = round(x / d)), so a group's sum of x times codes is
 * sum over its blocks of d * (integer sum of q times c), each 8-column piece of a
 * block scaled by d as an int32 lane (4 bytes of W, 8 columns) of the SIMD builds
 * is; the offset (8 s + zs) times the dequantized x's group sum as above. */
#define Q8_BLOCK 32

static void q8_rows_portable(const Job *job) {
    const Py_ssize_t half = job->k / 2, hg = job->group / 2, groups = job->k / job->group;
    for (Py_ssize_t n = job->n0; n < job->n1; n++) {
        const uint8_t *row = job->w + n * half;
        for (Py_ssize_t m = 0; m < job->m; m++) {
            float acc = 0.0f, offsets = 0.0f;
            for (Py_ssize_t g = 0; g < groups; g++) {
                float ga = 0.0f;
                for (Py_ssize_t j = g * hg; j < (g + 1) * hg; j += 4) {
                    int32_t dot = 0;
                    for (int l = 0; l < 4; l++)
                        dot += (row[j + l] & 15) * job->qe[m * half + j + l] +
                               (row[j + l] >> 4) * job->qo[m * half + j + l];
                    ga += (float)dot * job->dl[m * (half / 4) + j / 4];
                }
                const float s = job->s[n * groups + g];
                const float offset = 8.0f * s + (job->zs ? job->zs[n * groups + g] : 0.0f);
                acc += s * ga;
                offsets += offset * job->xsum[m * groups + g];
            }
            job->y[m * job->n + n] = acc - offsets;
        }
    }
}

#if defined(__GNUC__) && defined(__x86_64__)
#define HAVE_X86_SIMD 1
#include <immintrin.h>

/* rows_NAME: a build's row loop over the job's rows of W, CHUNK rows of x at a time
 * through NAME (inlined for each count of rows 1..CHUNK). */
#define DEFINE_ROWS(NAME, TARGET)                                                        \
    __attribute__((target(TARGET))) static void rows_##NAME(const Job *job) {            \
        for (Py_ssize_t n = job->n0; n < job->n1; n++)                                   \
            for (Py_ssize_t m0 = 0; m0 < job->m; m0 += CHUNK) {                          \
                switch (job->m - m0 < CHUNK ? job->m - m0 : CHUNK) {                     \
                case 1: NAME(job, n, m0, 1); break;                                      \
                case 2: NAME(job, n, m0, 2); break;                                      \
                case 3: NAME(job, n, m0, 3); break;                                      \
                default: NAME(job, n, m0, 4); break;                                     \
                }                                                                        \
            }                                                                            \
    }

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
    DEFINE_ROWS(NAME, TARGET)

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

/* One q8 SIMD build, as DEFINE_ROW: STEP packed bytes of W per step, their low and
 * high nibbles (unsigned bytes) times the int8 even and odd columns of x by DOT
 * (u8 x s8 summed in fours into int32 lanes, added to its first argument), each lane
 * converted and scaled by its block's d into the group's float sum. */
#define DEFINE_ROW_Q8(NAME, TARGET, VEC, IVEC, STEP, LOADB, SET1B, AND, SRLI16, DOT,     \
                      IZERO, CVT, SET1, ZERO, LOADU, FMADD, HSUM)                        \
    __attribute__((target(TARGET), always_inline)) static inline void NAME(             \
        const Job *job, Py_ssize_t n, Py_ssize_t m0, const int M) {                     \
        const Py_ssize_t half = job->k / 2, hg = job->group / 2;                        \
        const Py_ssize_t groups = job->k / job->group;                                  \
        const uint8_t *row = job->w + n * half;                                         \
        const IVEC low = SET1B(15);                                                     \
        VEC acc[CHUNK], ga[CHUNK];                                                      \
        float offsets[CHUNK] = {0};                                                     \
        for (int i = 0; i < M; i++) acc[i] = ZERO();                                    \
        for (Py_ssize_t g = 0; g < groups; g++) {                                       \
            const uint8_t *b = row + g * hg;                                            \
            for (int i = 0; i < M; i++) ga[i] = ZERO();                                 \
            for (Py_ssize_t j = 0; j < hg; j += STEP) {                                 \
                const IVEC c = LOADB(b + j);                                            \
                const IVEC lo = AND(c, low), hi = AND(SRLI16(c, 4), low);               \
                for (int i = 0; i < M; i++) {                                           \
                    const Py_ssize_t at = (m0 + i) * half + g * hg + j;                 \
                    IVEC d = DOT(IZERO(), lo, LOADB(job->qe + at));                     \
                    d = DOT(d, hi, LOADB(job->qo + at));                                \
                    ga[i] = FMADD(CVT(d), LOADU(job->dl + at / 4), ga[i]);              \
                }                                                                       \
            }                                                                           \
            const float s = job->s[n * groups + g];                                     \
            const float offset = 8.0f * s + (job->zs ? job->zs[n * groups + g] : 0.0f); \
            const VEC sv = SET1(s);                                                     \
            for (int i = 0; i < M; i++) {                                               \
                acc[i] = FMADD(ga[i], sv, acc[i]);                                      \
                offsets[i] += offset * job->xsum[(m0 + i) * groups + g];                \
            }                                                                           \
        }                                                                               \
        for (int i = 0; i < M; i++)                                                     \
            job->y[(m0 + i) * job->n + n] = HSUM(acc[i]) - offsets[i];                  \
    }                                                                                   \
    DEFINE_ROWS(NAME, TARGET)

#define Q8_TARGET_512 "avx512f,avx512bw,avx512dq,avx512vl,avx512vnni"
#define Q8_TARGET_AVXVNNI "avx2,fma,avxvnni"

__attribute__((target("avx2,fma"), always_inline)) static inline __m256i load32(
    const void *p) {
    return _mm256_loadu_si256((const __m256i *)p);
}
/* u8 x s8 in fours into int32 lanes without VNNI: maddubs (pairs into int16: at most
 * 2 * 15 * 127, no saturation) then madd by ones */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256i dot_avx2(
    __m256i acc, __m256i u, __m256i s) {
    const __m256i pairs = _mm256_maddubs_epi16(u, s);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
__attribute__((target(Q8_TARGET_AVXVNNI), always_inline)) static inline __m256i dot_avxvnni(
    __m256i acc, __m256i u, __m256i s) {
    return _mm256_dpbusd_avx_epi32(acc, u, s);
}

/* The AVX-512 VNNI build: 64 packed bytes (128 columns) per step whatever the group,
 * each 32-byte half within one group (a group that is a multiple of 64 columns), so
 * each lane, its integer sum of q (c - 8) (the dot product started from qoff), is
 * scaled by its block's d times its group's s before the row's sum; a
 * row's last 32 bytes (K an odd multiple of 64) are read masked. R rows of W (a
 * constant 1..Q8_ROWS where inlined) against rows m0 .. m0 + M - 1 of x per pass, each
 * step's x read once for the R rows. */
#define Q8_ROWS 4
__attribute__((target(Q8_TARGET_512), always_inline)) static inline void q8_avx512vnni(
    const Job *job, Py_ssize_t n, Py_ssize_t m0, const int M, const int R) {
    const Py_ssize_t half = job->k / 2, hg = job->group / 2, groups = job->k / job->group;
    const __m512i low = _mm512_set1_epi8(15);
    __m512 acc[CHUNK][Q8_ROWS];
    float offsets[CHUNK][Q8_ROWS] = {{0}};
    for (int i = 0; i < M; i++)
        for (int r = 0; r < R; r++) acc[i][r] = _mm512_setzero_ps();
    for (int r = 0; job->zs && r < R; r++) /* the codes' 8 is in qoff */
        for (Py_ssize_t g = 0; g < groups; g++)
            for (int i = 0; i < M; i++)
                offsets[i][r] +=
                    job->zs[(n + r) * groups + g] * job->xsum[(m0 + i) * groups + g];
    for (Py_ssize_t j = 0; j < half; j += 64) {
        const int full = half - j >= 64;
        const __mmask64 bytes = full ? ~(__mmask64)0 : (__mmask64)0xFFFFFFFFu;
        const __mmask16 lanes = full ? 0xFFFF : 0x00FF;
        __m512i lo[Q8_ROWS], hi[Q8_ROWS];
        __m512 sv[Q8_ROWS];
        for (int r = 0; r < R; r++) {
            const uint8_t *b = job->w + (n + r) * half + j;
            /* the next pass's rows: 120 calls of SmolLM2's step 12.4 -> 8.5 ms (cold) */
            _mm_prefetch((const char *)(b + Q8_ROWS * half), _MM_HINT_T0);
            const __m512i c = _mm512_maskz_loadu_epi8(bytes, b);
            lo[r] = _mm512_and_si512(c, low);
            hi[r] = _mm512_and_si512(_mm512_srli_epi16(c, 4), low);
            const float *s = job->s + (n + r) * groups;
            sv[r] = _mm512_insertf32x8(_mm512_set1_ps(s[j / hg]),
                                       _mm256_set1_ps(full ? s[(j + 32) / hg] : 0.0f), 1);
        }
        for (int i = 0; i < M; i++) {
            const Py_ssize_t at = (m0 + i) * half + j;
            const __m512i qe = _mm512_maskz_loadu_epi8(bytes, job->qe + at);
            const __m512i qo = _mm512_maskz_loadu_epi8(bytes, job->qo + at);
            const __m512 dl = _mm512_maskz_loadu_ps(lanes, job->dl + at / 4);
            const __m512i qoff = _mm512_maskz_loadu_epi32(lanes, job->qoff + at / 4);
            for (int r = 0; r < R; r++) {
                __m512i d = _mm512_dpbusd_epi32(qoff, lo[r], qe);
                d = _mm512_dpbusd_epi32(d, hi[r], qo);
                acc[i][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(dl, sv[r]),
                                            acc[i][r]);
            }
        }
    }
    for (int i = 0; i < M; i++)
        for (int r = 0; r < R; r++)
            job->y[(m0 + i) * job->n + n + r] =
                _mm512_reduce_add_ps(acc[i][r]) - offsets[i][r];
}

#define Q8_512_M(n, m0, M)                                                               \
    do {                                                                                 \
        if (job->n1 - (n) >= Q8_ROWS) q8_avx512vnni(job, n, m0, M, Q8_ROWS);             \
        else                                                                             \
            for (Py_ssize_t r = n; r < job->n1; r++) q8_avx512vnni(job, r, m0, M, 1);    \
    } while (0)

__attribute__((target(Q8_TARGET_512))) static void rows_q8_avx512vnni(const Job *job) {
    for (Py_ssize_t n = job->n0; n < job->n1; n += Q8_ROWS)
        for (Py_ssize_t m0 = 0; m0 < job->m; m0 += CHUNK) {
            switch (job->m - m0 < CHUNK ? job->m - m0 : CHUNK) {
            case 1: Q8_512_M(n, m0, 1); break;
            case 2: Q8_512_M(n, m0, 2); break;
            case 3: Q8_512_M(n, m0, 3); break;
            default: Q8_512_M(n, m0, 4); break;
            }
        }
}
DEFINE_ROW_Q8(q8_avxvnni, Q8_TARGET_AVXVNNI, __m256, __m256i, 32, load32, _mm256_set1_epi8,
              _mm256_and_si256, _mm256_srli_epi16, dot_avxvnni, _mm256_setzero_si256,
              _mm256_cvtepi32_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm256_loadu_ps,
              _mm256_fmadd_ps, hsum8)
DEFINE_ROW_Q8(q8_avx2, "avx2,fma", __m256, __m256i, 32, load32, _mm256_set1_epi8,
              _mm256_and_si256, _mm256_srli_epi16, dot_avx2, _mm256_setzero_si256,
              _mm256_cvtepi32_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm256_loadu_ps,
              _mm256_fmadd_ps, hsum8)

static int has_avx512vnni(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni");
}
static int has_avxvnni(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("avxvnni");
}
#endif

#define MIN_GROUP_AVX512 32
#define MIN_GROUP_AVX2 16
#define MIN_GROUP_PORTABLE 16
#include "_cpu_paths.h"

/* The q8 builds, best first (int4_matmul_q8) */
static const Path Q8_PATHS[] = {
#ifdef HAVE_X86_SIMD
    {"avx512vnni", rows_q8_avx512vnni, 64, has_avx512vnni},
    {"avxvnni", rows_q8_avxvnni, 64, has_avxvnni},
    {"avx2", rows_q8_avx2, 64, has_avx2},
#endif
    {"portable", q8_rows_portable, Q8_BLOCK, always},
};
#define N_Q8_PATHS ((Py_ssize_t)(sizeof(Q8_PATHS) / sizeof(Q8_PATHS[0])))

/* q8_paths() -> the names of the q8 builds this CPU runs, best first */
static PyObject *q8_paths(PyObject *self, PyObject *unused) {
    return names_in(Q8_PATHS, N_Q8_PATHS);
}

/* Splits x [m, k] into its even and odd columns and sums it per group (float builds). */
static void split_float(const float *xs, float *xe, float *xo, float *xsum, Py_ssize_t m,
                        Py_ssize_t k, Py_ssize_t group) {
    const Py_ssize_t groups = k / group;
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
}

/* Quantizes x [m, k] per block of Q8_BLOCK columns (d = absmax / 127, q = round(x /
 * d), ties to even; an all-zero block: d = 0, q = 0) into its even and odd columns,
 * each 8 columns' d in `dl` and -8 times their sum of q in `qoff`, and the dequantized
 * x (d times the block's integer sum) summed per group. */
static void split_q8(const float *xs, int8_t *qe, int8_t *qo, float *dl, int32_t *qoff,
                     float *xsum, Py_ssize_t m, Py_ssize_t k, Py_ssize_t group) {
    const Py_ssize_t groups = k / group, per_group = group / Q8_BLOCK;
    for (Py_ssize_t r = 0; r < m; r++)
        for (Py_ssize_t g = 0; g < groups; g++) {
            float sum = 0.0f;
            for (Py_ssize_t blk = g * per_group; blk < (g + 1) * per_group; blk++) {
                const float *x = xs + r * k + blk * Q8_BLOCK;
                float amax = 0.0f;
                for (int i = 0; i < Q8_BLOCK; i++) {
                    const float a = x[i] < 0 ? -x[i] : x[i];
                    if (a > amax) amax = a;
                }
                const float d = amax / 127.0f;
                int32_t qsum = 0;
                for (int i = 0; i < Q8_BLOCK; i++) {
                    const int32_t q = d > 0.0f ? (int32_t)nearbyintf(x[i] / d) : 0;
                    const Py_ssize_t j = r * k / 2 + blk * Q8_BLOCK / 2 + i / 2;
                    if (i % 2) qo[j] = (int8_t)q;
                    else qe[j] = (int8_t)q;
                    if (i % 8 == 0) qoff[r * k / 8 + blk * Q8_BLOCK / 8 + i / 8] = 0;
                    qoff[r * k / 8 + blk * Q8_BLOCK / 8 + i / 8] -= 8 * q;
                    qsum += q;
                }
                for (int i = 0; i < Q8_BLOCK / 8; i++)
                    dl[r * k / 8 + blk * Q8_BLOCK / 8 + i] = d;
                sum += d * (float)qsum;
            }
            xsum[r * groups + g] = sum;
        }
}

/* int4_matmul and int4_matmul_q8: the arguments' checks, x's preparation, the split
 * across threads. */
static PyObject *matmul(PyObject *args, int q8) {
    Py_buffer x = {0}, w = {0}, s = {0}, zs = {0}, y = {0};
    PyObject *zs_obj;
    Py_ssize_t m, n, k, group, threads;
    const char *path_name = NULL;
    if (!PyArg_ParseTuple(args, "y*y*y*Ow*nnnnn|z", &x, &w, &s, &zs_obj, &y, &m, &n, &k,
                          &group, &threads, &path_name))
        return NULL;
    PyObject *result = NULL;
    void *scratch = NULL;
    const Py_ssize_t unit = q8 ? Q8_BLOCK : 16;
    if (zs_obj != Py_None && PyObject_GetBuffer(zs_obj, &zs, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (m < 1 || m > MAX_ROWS || n < 1 || threads < 1 || threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError,
                     "m=%zd (1..%d), n=%zd (>= 1), threads=%zd (1..%d) out of range", m,
                     MAX_ROWS, n, threads, MAX_THREADS);
        goto done;
    }
    if (group < unit || group > 1024 || group % unit || k < group || k % group) {
        PyErr_Format(PyExc_ValueError,
                     "group=%zd must be a multiple of %zd up to 1024 dividing k=%zd", group,
                     unit, k);
        goto done;
    }
    const Path *path = q8 ? pick_in(Q8_PATHS, N_Q8_PATHS, path_name, group)
                          : pick(path_name, group);
    if (!path) goto done;
    const Py_ssize_t groups = k / group;
    if (!sized(&x, "x", m * k, 4) || !sized(&w, "packed", n * k / 2, 1) ||
        !sized(&s, "scale", n * groups, 4) || !sized(&y, "out", m * n, 4) ||
        (zs.buf && !sized(&zs, "zero_scale", n * groups, 4)))
        goto done;
    /* float: xe, xo [m, k/2] float; q8: dl [m, k/8] float, qoff [m, k/8] int32, qe,
     * qo [m, k/2] int8; then xsum [m, groups] float */
    const size_t xbytes = (size_t)(q8 ? 8 * m * k / 8 + m * k : 4 * m * k);
    scratch = malloc(xbytes + sizeof(float) * m * groups);
    if (!scratch) {
        PyErr_NoMemory();
        goto done;
    }
    float *xsum = (float *)((char *)scratch + xbytes);
    Job job = {0};
    if (q8) {
        float *dl = scratch;
        int32_t *qoff = (int32_t *)(dl + m * k / 8);
        int8_t *qe = (int8_t *)(qoff + m * k / 8), *qo = qe + m * k / 2;
        split_q8(x.buf, qe, qo, dl, qoff, xsum, m, k, group);
        job.qe = qe, job.qo = qo, job.dl = dl, job.qoff = qoff;
    } else {
        float *xe = scratch, *xo = xe + m * k / 2;
        split_float(x.buf, xe, xo, xsum, m, k, group);
        job.xe = xe, job.xo = xo;
    }
    job.xsum = xsum, job.w = w.buf, job.s = s.buf, job.zs = zs.buf, job.y = y.buf;
    job.m = m, job.n = n, job.k = k, job.group = group;
    run_split(path, &job, threads);
    result = Py_None;
    Py_INCREF(result);
done:
    free(scratch);
    PyBuffer_Release(&x);
    PyBuffer_Release(&w);
    PyBuffer_Release(&s);
    PyBuffer_Release(&y);
    if (zs.buf) PyBuffer_Release(&zs);
    return result;
}

int int4_weight_init(Int4Weight *w, const char *name) {
    if (w->n < 1 || w->group < 16 || w->group > 1024 || w->group % 16 || w->k < w->group ||
        w->k % w->group) {
        PyErr_Format(PyExc_ValueError,
                     "%s: [%zd, %zd] at group=%zd (a multiple of 16 up to 1024 dividing k)",
                     name, w->n, w->k, w->group);
        return 0;
    }
    w->q8_path = pick_in(Q8_PATHS, N_Q8_PATHS, NULL, w->group);
    if (!w->q8_path) PyErr_Clear(); /* a group no q8 build takes: float only */
    w->path = pick(NULL, w->group);
    return w->path != NULL;
}

Py_ssize_t int4_scratch_floats(const Int4Weight *w, Py_ssize_t m) {
    /* the float split's (the q8 one's is half as big), then x's sums per group */
    return m * w->k + m * (w->k / w->group);
}

void int4_apply(const Int4Weight *w, const float *x, Py_ssize_t m, float *y,
                float *scratch, int q8) {
    const Py_ssize_t k = w->k;
    float *xsum = scratch + m * k;
    Job job = {0};
    if (q8) { /* laid out as `matmul` lays it */
        float *dl = scratch;
        int32_t *qoff = (int32_t *)(dl + m * k / 8);
        int8_t *qe = (int8_t *)(qoff + m * k / 8), *qo = qe + m * k / 2;
        split_q8(x, qe, qo, dl, qoff, xsum, m, k, w->group);
        job.qe = qe, job.qo = qo, job.dl = dl, job.qoff = qoff;
    } else {
        float *xe = scratch, *xo = xe + m * k / 2;
        split_float(x, xe, xo, xsum, m, k, w->group);
        job.xe = xe, job.xo = xo;
    }
    job.xsum = xsum, job.w = w->w, job.s = w->s, job.zs = w->zs;
    job.y = y, job.m = m, job.n = w->n, job.k = k, job.group = w->group;
    job.n0 = 0, job.n1 = w->n;
    ((const Path *)(q8 ? w->q8_path : w->path))->fn(&job);
}

/* int4_matmul(x, packed, scale, zero_scale, out, m, n, k, group, threads[, path]) */
static PyObject *int4_matmul(PyObject *self, PyObject *args) { return matmul(args, 0); }

/* int4_matmul_q8(x, packed, scale, zero_scale, out, m, n, k, group, threads[, path]) */
static PyObject *int4_matmul_q8(PyObject *self, PyObject *args) { return matmul(args, 1); }

static PyMethodDef methods[] = {
    {"int4_matmul", int4_matmul, METH_VARARGS,
     "int4_matmul(x, packed, scale, zero_scale, out, m, n, k, group, threads[, path]): "
     "out[m, n] = x @ W^T for float32 x [m, k] and pack-quantized int4 W [n, k]; path "
     "names a build from paths() (default: the best one for the group)"},
    {"int4_matmul_q8", int4_matmul_q8, METH_VARARGS,
     "int4_matmul_q8(x, packed, scale, zero_scale, out, m, n, k, group, threads[, path]): "
     "int4_matmul with x quantized to int8 per block of 32 columns (absmax / 127) and "
     "int4 x int8 integer dot products; path names a build from q8_paths()"},
    PATHS_METHOD,
    {"q8_paths", q8_paths, METH_NOARGS,
     "q8_paths() -> names of the int8-activation builds this CPU runs, best first"},
    {"layer_new", int4_layer_new, METH_VARARGS,
     "layer_new(ln1, ln2, eps, qkv, o, gate_up, down, heads, kv_heads, head_dim) -> a "
     "decoder layer for layer_decode; each weight a tuple (packed, scale, zero_scale "
     "or None, n, k, group)"},
    {"layer_decode", int4_layer_decode, METH_VARARGS,
     "layer_decode(layer, x, cos, sin, key, value, slots, tables, context_lens, m, "
     "block_size, scale[, q8[, attention]]): one decode step of the layer for m rows, x "
     "updated in place, each row's K/V written to its slot of the bf16 cache; q8 the "
     "weights with int8 activations as bits, attention a path from "
     "layer_attention_paths() (default: the best that takes the shape)"},
    {"layer_attention_paths", int4_layer_attention_paths, METH_NOARGS,
     "layer_attention_paths() -> the attention builds of layer_decode this CPU runs, "
     "best first"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_int4_cpu",
                                    "Fused int4 weight-only matmul for a CPU", -1, methods};

PyMODINIT_FUNC PyInit__int4_cpu(void) { return PyModule_Create(&module); }
