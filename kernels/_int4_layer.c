/* A Llama decoder layer's decode step on a CPU in one call: a float32 model whose
 * projections are int4 (q/k/v fused, gate/up fused: gpuagent.engine.weights) and
 * whose paged KV cache is bf16. Python side: kernels.int4_layer.
 *
 * For m rows (each its sequence's one new token), in the order and arithmetic of
 * the torch layer it stands for (gpuagent.engine.model.TransformerBlock):
 *   h = RMSNorm(x) (float32: x * rsqrt(mean(x^2) + eps), times the weight)
 *   q, k, v = h W_qkv^T (int4_apply, the matmul int4_matmul runs), RoPE on q and k
 *   (x * cos + rotate_half(x) * sin, sin signed as model.rope_cos_sin makes it)
 *   k, v rounded to bf16 (to nearest even) into each row's slot of the cache
 *   attention of each query head over its kv head's first context_len positions,
 *   read through the row's block table (softmax in float32)
 *   x += o_proj(attention); x += down(silu(gate) * up) of RMSNorm(x)
 * The matmuls are int4_matmul's own row loops on this thread (int4_matmul_q8's for
 * the weights the bits of `q8` name: the engine option int8_activations); the
 * attention takes a kv head's query heads together (each position's K and V
 * converted once for them), in AVX2 + FMA where the CPU has it, else portable C.
 * Sums are ordered differently from torch's (attention, the norm's mean), so
 * results agree within float32 rounding, not bit for bit.
 *
 * layer_new checks the shapes once and holds the weights' buffers; layer_decode
 * checks every index it will follow (slots, block tables, context lengths) before it
 * writes anything, and runs with the GIL released.
 */
#include "_int4_cpu.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define LAYER_MAX_ROWS 16
#define MAX_HELD 14 /* two norms, four weights of up to three buffers */

typedef struct {
    Py_buffer held[MAX_HELD];
    int nheld;
    const float *ln1, *ln2;
    float eps;
    Int4Weight qkv, o, gate_up, down;
    Py_ssize_t hidden, heads, kv_heads, head_dim, inter;
} Layer;

static const char CAPSULE[] = "releasegate.int4_layer";

static void layer_free(PyObject *capsule) {
    Layer *layer = PyCapsule_GetPointer(capsule, CAPSULE);
    if (!layer) return;
    for (int i = 0; i < layer->nheld; i++) PyBuffer_Release(&layer->held[i]);
    free(layer);
}

/* A view of `obj` kept for the layer's life: exactly `bytes` long, or NULL with a
 * ValueError naming `name`. */
static const void *hold(Layer *layer, PyObject *obj, Py_ssize_t bytes, const char *name,
                        const char *part) {
    Py_buffer *b = &layer->held[layer->nheld];
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    layer->nheld++;
    if (b->len != bytes) {
        PyErr_Format(PyExc_ValueError, "%s%s holds %zd bytes, expected %zd", name, part,
                     b->len, bytes);
        return NULL;
    }
    return b->buf;
}

static int weight_from(Layer *layer, PyObject *spec, Int4Weight *w, const char *name) {
    PyObject *packed, *scale, *zero_scale;
    if (!PyTuple_Check(spec) ||
        !PyArg_ParseTuple(spec, "OOOnnn", &packed, &scale, &zero_scale, &w->n, &w->k,
                          &w->group)) {
        PyErr_Format(PyExc_TypeError,
                     "%s must be (packed, scale, zero_scale or None, n, k, group)", name);
        return 0;
    }
    if (!int4_weight_init(w, name)) return 0;
    const Py_ssize_t scales = w->n * (w->k / w->group) * 4;
    w->w = hold(layer, packed, w->n * w->k / 2, name, " packed");
    if (!w->w) return 0;
    w->s = hold(layer, scale, scales, name, " scale");
    if (!w->s) return 0;
    w->zs = NULL;
    if (zero_scale != Py_None && !(w->zs = hold(layer, zero_scale, scales, name,
                                                 " zero_scale")))
        return 0;
    return 1;
}

static int shape_is(Py_ssize_t got, Py_ssize_t want, const char *what) {
    if (got == want) return 1;
    PyErr_Format(PyExc_ValueError, "%s is %zd, expected %zd", what, got, want);
    return 0;
}

PyObject *int4_layer_new(PyObject *self, PyObject *args) {
    PyObject *ln1, *ln2, *qkv, *o, *gate_up, *down;
    float eps;
    Py_ssize_t heads, kv_heads, head_dim;
    if (!PyArg_ParseTuple(args, "OOfOOOOnnn", &ln1, &ln2, &eps, &qkv, &o, &gate_up, &down,
                          &heads, &kv_heads, &head_dim))
        return NULL;
    if (heads < 1 || kv_heads < 1 || heads % kv_heads || head_dim < 2 || head_dim % 2) {
        PyErr_Format(PyExc_ValueError,
                     "heads=%zd, kv_heads=%zd, head_dim=%zd: heads must be a multiple of "
                     "kv_heads and head_dim even",
                     heads, kv_heads, head_dim);
        return NULL;
    }
    Layer *layer = calloc(1, sizeof(Layer));
    if (!layer) return PyErr_NoMemory();
    PyObject *capsule = PyCapsule_New(layer, CAPSULE, layer_free);
    if (!capsule) {
        free(layer);
        return NULL;
    }
    layer->eps = eps, layer->heads = heads, layer->kv_heads = kv_heads;
    layer->head_dim = head_dim;
    if (!weight_from(layer, qkv, &layer->qkv, "qkv") ||
        !weight_from(layer, o, &layer->o, "o_proj") ||
        !weight_from(layer, gate_up, &layer->gate_up, "gate_up") ||
        !weight_from(layer, down, &layer->down, "down_proj"))
        goto fail;
    const Py_ssize_t hidden = layer->o.n;
    layer->hidden = hidden, layer->inter = layer->gate_up.n / 2;
    if (!shape_is(layer->qkv.n, (heads + 2 * kv_heads) * head_dim, "qkv's rows") ||
        !shape_is(layer->qkv.k, hidden, "qkv's columns") ||
        !shape_is(layer->o.k, heads * head_dim, "o_proj's columns") ||
        !shape_is(layer->gate_up.n, 2 * layer->inter, "gate_up's rows") ||
        !shape_is(layer->gate_up.k, hidden, "gate_up's columns") ||
        !shape_is(layer->down.k, layer->inter, "down_proj's columns") ||
        !shape_is(layer->down.n, hidden, "down_proj's rows"))
        goto fail;
    if (!(layer->ln1 = hold(layer, ln1, hidden * 4, "input_layernorm", "")) ||
        !(layer->ln2 = hold(layer, ln2, hidden * 4, "post_attention_layernorm", "")))
        goto fail;
    return capsule;
fail:
    Py_DECREF(capsule);
    return NULL;
}

/* ------------------------------------------------------------------ the arithmetic */

static inline uint16_t to_bf16(float f) { /* torch's rounding: nearest, ties to even */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float from_bf16(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void rms_norm(const float *x, const float *weight, float eps, Py_ssize_t m,
                     Py_ssize_t n, float *out) {
    for (Py_ssize_t r = 0; r < m; r++) {
        const float *row = x + r * n;
        double squares = 0.0;
        for (Py_ssize_t i = 0; i < n; i++) squares += (double)row[i] * row[i];
        const float inv = 1.0f / sqrtf((float)(squares / (double)n) + eps);
        for (Py_ssize_t i = 0; i < n; i++) {
            const float normed = row[i] * inv;
            out[r * n + i] = normed * weight[i];
        }
    }
}

/* v [d] rotated in place: v * cos + (v2, v1) * sin, sin's first half negative */
static void rope(float *v, const float *cos, const float *sin, Py_ssize_t d,
                 float *tmp) {
    const Py_ssize_t half = d / 2;
    memcpy(tmp, v, sizeof(float) * d);
    for (Py_ssize_t i = 0; i < d; i++) {
        const float a = tmp[i] * cos[i];
        const float b = tmp[i < half ? i + half : i - half] * sin[i];
        v[i] = a + b;
    }
}

/* The attention of one kv head's `group` query heads (q [group, d], contiguous) over
 * `len` positions at cache slots `slots` (rows of `stride` bf16 values, this head's
 * at `head * d`): out [group, d] = softmax(q.k * scale) v per query head. Each
 * position's K and V are converted once for the whole group. `scores` holds
 * group * len floats. */
typedef struct {
    const float *q;
    const uint16_t *key, *value;
    const Py_ssize_t *slots;
    Py_ssize_t len, stride, head, d, group;
    float scale;
    float *scores, *out;
} Attend;

/* slots[t] for positions 0 .. len - 1 through a block table */
static void context_slots(const int32_t *table, Py_ssize_t len, Py_ssize_t block_size,
                          Py_ssize_t *slots) {
    for (Py_ssize_t t = 0, b = 0; t < len; b++)
        for (Py_ssize_t o = 0; o < block_size && t < len; o++, t++)
            slots[t] = (Py_ssize_t)table[b] * block_size + o;
}

/* scores -> probabilities per query head, in place: exp(s - max) / sum */
static void softmax_rows(const Attend *a) {
    for (Py_ssize_t g = 0; g < a->group; g++) {
        float *row = a->scores + g * a->len, top = -INFINITY, total = 0.0f;
        for (Py_ssize_t t = 0; t < a->len; t++)
            if (row[t] > top) top = row[t];
        for (Py_ssize_t t = 0; t < a->len; t++) total += row[t] = expf(row[t] - top);
        for (Py_ssize_t t = 0; t < a->len; t++) row[t] /= total;
    }
}

static void attend_portable(const Attend *a) {
    const Py_ssize_t d = a->d;
    for (Py_ssize_t t = 0; t < a->len; t++) {
        const uint16_t *k = a->key + a->slots[t] * a->stride + a->head * d;
        for (Py_ssize_t g = 0; g < a->group; g++) {
            float dot = 0.0f;
            for (Py_ssize_t i = 0; i < d; i++) dot += a->q[g * d + i] * from_bf16(k[i]);
            a->scores[g * a->len + t] = dot * a->scale;
        }
    }
    softmax_rows(a);
    for (Py_ssize_t i = 0; i < a->group * d; i++) a->out[i] = 0.0f;
    for (Py_ssize_t t = 0; t < a->len; t++) {
        const uint16_t *v = a->value + a->slots[t] * a->stride + a->head * d;
        for (Py_ssize_t g = 0; g < a->group; g++) {
            const float p = a->scores[g * a->len + t];
            for (Py_ssize_t i = 0; i < d; i++) a->out[g * d + i] += p * from_bf16(v[i]);
        }
    }
}

#define ATTEND_MAX_GROUP 8 /* the AVX2 build's query heads per kv head */
#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
#define HAVE_ATTEND_AVX2 1

__attribute__((target("avx2,fma"), always_inline)) static inline __m256 bf16x8(
    const uint16_t *p) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* e^x for 8 lanes, x <= 0 (scores less their max): 2^n e^r, n = round(x log2 e),
 * r = x - n ln 2 (in two parts), e^r by its degree-6 Taylor polynomial (|r| <= ln 2
 * / 2: relative error about 2e-7, float32 rounding's order); below -87 (e^x under
 * float32's normal range) 0. */
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 exp8(__m256 x) {
    const __m256 low = _mm256_set1_ps(-87.0f);
    const __m256 under = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
    x = _mm256_max_ps(x, low);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

/* softmax_rows with 8 positions a step */
__attribute__((target("avx2,fma"))) static void softmax_rows_avx2(const Attend *a) {
    for (Py_ssize_t g = 0; g < a->group; g++) {
        float *row = a->scores + g * a->len, top = -INFINITY, total = 0.0f;
        for (Py_ssize_t t = 0; t < a->len; t++)
            if (row[t] > top) top = row[t];
        const __m256 top8 = _mm256_set1_ps(top);
        __m256 sum8 = _mm256_setzero_ps();
        Py_ssize_t t = 0;
        for (; t + 8 <= a->len; t += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + t), top8));
            _mm256_storeu_ps(row + t, e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, sum8);
        for (int i = 0; i < 8; i++) total += lanes[i];
        for (; t < a->len; t++) total += row[t] = expf(row[t] - top);
        const __m256 inv = _mm256_set1_ps(1.0f / total);
        for (t = 0; t + 8 <= a->len; t += 8)
            _mm256_storeu_ps(row + t, _mm256_mul_ps(_mm256_loadu_ps(row + t), inv));
        for (; t < a->len; t++) row[t] *= 1.0f / total;
    }
}

/* The AVX2 build's passes, inlined for each group size G (1..ATTEND_MAX_GROUP) so that
 * the sums stay in registers. q.k: each position's key converted once, G sums of 8
 * lanes over d. */
__attribute__((target("avx2,fma"), always_inline)) static inline void scores_avx2(
    const Attend *a, const int G) {
    const Py_ssize_t d = a->d;
    for (Py_ssize_t t = 0; t < a->len; t++) {
        const uint16_t *k = a->key + a->slots[t] * a->stride + a->head * d;
        __m256 acc[ATTEND_MAX_GROUP];
        for (int g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();
        for (Py_ssize_t i = 0; i < d; i += 8) {
            const __m256 kv = bf16x8(k + i);
            for (int g = 0; g < G; g++)
                acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(a->q + g * d + i), kv, acc[g]);
        }
        for (int g = 0; g < G; g++) {
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[g]),
                                  _mm256_extractf128_ps(acc[g], 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            h = _mm_add_ss(h, _mm_movehdup_ps(h));
            a->scores[g * a->len + t] = _mm_cvtss_f32(h) * a->scale;
        }
    }
}

/* p.v over columns i0 .. i0 + 8 NC of the G heads' outputs, summed in G * NC
 * registers across every position (each position's values converted once). */
__attribute__((target("avx2,fma"), always_inline)) static inline void values_avx2(
    const Attend *a, Py_ssize_t i0, const int G, const int NC) {
    __m256 acc[12];
    for (int j = 0; j < G * NC; j++) acc[j] = _mm256_setzero_ps();
    for (Py_ssize_t t = 0; t < a->len; t++) {
        const uint16_t *v = a->value + a->slots[t] * a->stride + a->head * a->d + i0;
        __m256 vv[4];
        for (int c = 0; c < NC; c++) vv[c] = bf16x8(v + 8 * c);
        for (int g = 0; g < G; g++) {
            const __m256 p = _mm256_broadcast_ss(a->scores + g * a->len + t);
            for (int c = 0; c < NC; c++)
                acc[g * NC + c] = _mm256_fmadd_ps(p, vv[c], acc[g * NC + c]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < NC; c++)
            _mm256_storeu_ps(a->out + g * a->d + i0 + 8 * c, acc[g * NC + c]);
}

/* Columns a p.v pass takes for G heads: as many as leave the sums and values in
 * registers (G * NC + NC <= 12 of 16), whole multiples of 8 dividing d. */
static int value_chunks(int group, Py_ssize_t d) {
    int chunks = group <= 2 ? 4 : group <= 4 ? 2 : 1;
    while (d % (8 * chunks)) chunks /= 2;
    return chunks;
}

#define ATTEND_G(G)                                                                      \
    case G:                                                                              \
        scores_avx2(a, G);                                                               \
        softmax_rows_avx2(a);                                                            \
        for (Py_ssize_t i0 = 0; i0 < a->d; i0 += 8 * chunks) {                           \
            if (chunks == 4) values_avx2(a, i0, G, 4);                                   \
            else if (chunks == 2) values_avx2(a, i0, G, 2);                              \
            else values_avx2(a, i0, G, 1);                                               \
        }                                                                                \
        break;

/* attend_portable with 8 columns a step (d a multiple of 8, 1 <= group <= 8) */
__attribute__((target("avx2,fma"))) static void attend_avx2(const Attend *a) {
    const int chunks = value_chunks((int)a->group, a->d);
    switch (a->group) {
        ATTEND_G(1) ATTEND_G(2) ATTEND_G(3) ATTEND_G(4)
        ATTEND_G(5) ATTEND_G(6) ATTEND_G(7) ATTEND_G(8)
    }
}
#endif

static int attend_avx2_runs(void) {
#ifdef HAVE_ATTEND_AVX2
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

/* The AVX2 build where it runs and takes the shape, unless `portable` */
static void attend(const Attend *a, int portable) {
#ifdef HAVE_ATTEND_AVX2
    if (!portable && a->d % 8 == 0 && a->group <= ATTEND_MAX_GROUP && attend_avx2_runs()) {
        attend_avx2(a);
        return;
    }
#endif
    attend_portable(a);
}

PyObject *int4_layer_attention_paths(PyObject *self, PyObject *unused) {
    return attend_avx2_runs() ? Py_BuildValue("(ss)", "avx2", "portable")
                              : Py_BuildValue("(s)", "portable");
}

typedef struct {
    float *h, *qkv, *att, *gu, *act, *y, *scores, *tmp, *mm;
    Py_ssize_t *slots;
} Scratch;

static void decode_rows(const Layer *l, float *x, const float *cos, const float *sin,
                        uint16_t *key, uint16_t *value, const int64_t *slots,
                        const int32_t *tables, const int32_t *context_lens, Py_ssize_t m,
                        Py_ssize_t max_blocks, Py_ssize_t block_size, float scale,
                        int q8, int portable, const Scratch *s) {
    const Py_ssize_t d = l->head_dim, hidden = l->hidden, inter = l->inter;
    const Py_ssize_t kvh = l->kv_heads, group = l->heads / kvh, width = l->qkv.n;
    rms_norm(x, l->ln1, l->eps, m, hidden, s->h);
    int4_apply(&l->qkv, s->h, m, s->qkv, s->mm, q8 & 1);
    for (Py_ssize_t r = 0; r < m; r++) {
        float *row = s->qkv + r * width;
        for (Py_ssize_t head = 0; head < l->heads + kvh; head++)
            rope(row + head * d, cos + r * d, sin + r * d, d, s->tmp);
        if (slots[r] < 0) continue; /* as write_kv: slot -1 is not written */
        for (Py_ssize_t i = 0; i < kvh * d; i++) {
            key[slots[r] * kvh * d + i] = to_bf16(row[l->heads * d + i]);
            value[slots[r] * kvh * d + i] = to_bf16(row[(l->heads + kvh) * d + i]);
        }
    }
    for (Py_ssize_t r = 0; r < m; r++) {
        context_slots(tables + r * max_blocks, context_lens[r], block_size, s->slots);
        for (Py_ssize_t head = 0; head < kvh; head++) {
            const Attend a = {s->qkv + r * width + head * group * d,
                              key,
                              value,
                              s->slots,
                              context_lens[r],
                              kvh * d,
                              head,
                              d,
                              group,
                              scale,
                              s->scores,
                              s->att + (r * l->heads + head * group) * d};
            attend(&a, portable);
        }
    }
    int4_apply(&l->o, s->att, m, s->y, s->mm, q8 & 2);
    for (Py_ssize_t i = 0; i < m * hidden; i++) x[i] += s->y[i];
    rms_norm(x, l->ln2, l->eps, m, hidden, s->h);
    int4_apply(&l->gate_up, s->h, m, s->gu, s->mm, q8 & 4);
    for (Py_ssize_t r = 0; r < m; r++)
        for (Py_ssize_t i = 0; i < inter; i++) {
            const float gate = s->gu[r * 2 * inter + i];
            const float silu = gate / (1.0f + expf(-gate));
            s->act[r * inter + i] = silu * s->gu[r * 2 * inter + inter + i];
        }
    int4_apply(&l->down, s->act, m, s->y, s->mm, q8 & 8);
    for (Py_ssize_t i = 0; i < m * hidden; i++) x[i] += s->y[i];
}

/* ------------------------------------------------------------------- the call */

static int sized_as(const Py_buffer *b, Py_ssize_t bytes, const char *name) {
    if (b->len == bytes) return 1;
    PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, expected %zd", name, b->len, bytes);
    return 0;
}

/* Every index the step follows, checked: slots within the cache (or -1), context
 * lengths within 1 .. the table's reach, the blocks they cover within the cache. */
static int indices_ok(const int64_t *slots, const int32_t *tables,
                      const int32_t *context_lens, Py_ssize_t m, Py_ssize_t max_blocks,
                      Py_ssize_t block_size, Py_ssize_t num_slots) {
    const Py_ssize_t num_blocks = num_slots / block_size;
    for (Py_ssize_t r = 0; r < m; r++) {
        if (slots[r] < -1 || slots[r] >= num_slots) {
            PyErr_Format(PyExc_ValueError, "row %zd: slot %lld is outside the cache's %zd",
                         r, (long long)slots[r], num_slots);
            return 0;
        }
        const Py_ssize_t len = context_lens[r];
        if (len < 1 || len > max_blocks * block_size) {
            PyErr_Format(PyExc_ValueError,
                         "row %zd: context length %zd outside 1..%zd (its block table)", r,
                         len, max_blocks * block_size);
            return 0;
        }
        for (Py_ssize_t b = 0; b < (len + block_size - 1) / block_size; b++) {
            const int32_t block = tables[r * max_blocks + b];
            if (block < 0 || block >= num_blocks) {
                PyErr_Format(PyExc_ValueError,
                             "row %zd: block table entry %zd is %d, outside the cache's "
                             "%zd blocks",
                             r, b, (int)block, num_blocks);
                return 0;
            }
        }
    }
    return 1;
}

PyObject *int4_layer_decode(PyObject *self, PyObject *args) {
    PyObject *capsule;
    Py_buffer x = {0}, cos = {0}, sin = {0}, key = {0}, value = {0}, slots = {0},
              tables = {0}, lens = {0};
    Py_ssize_t m, block_size;
    float scale;
    int q8 = 0;
    const char *attention = NULL;
    if (!PyArg_ParseTuple(args, "Ow*y*y*w*w*y*y*y*nnf|iz", &capsule, &x, &cos, &sin, &key,
                          &value, &slots, &tables, &lens, &m, &block_size, &scale, &q8,
                          &attention))
        return NULL;
    PyObject *result = NULL;
    void *memory = NULL;
    const Layer *l = PyCapsule_GetPointer(capsule, CAPSULE);
    if (!l) goto done;
    const int portable = attention && !strcmp(attention, "portable");
    if (attention && !portable && !(!strcmp(attention, "avx2") && attend_avx2_runs())) {
        PyErr_Format(PyExc_ValueError, "attention path %s does not run here", attention);
        goto done;
    }
    const Py_ssize_t d = l->head_dim, row_bytes = l->kv_heads * d * 2;
    if (m < 1 || m > LAYER_MAX_ROWS || block_size < 1) {
        PyErr_Format(PyExc_ValueError, "m=%zd (1..%d), block_size=%zd (>= 1) out of range",
                     m, LAYER_MAX_ROWS, block_size);
        goto done;
    }
    if (!sized_as(&x, m * l->hidden * 4, "x") || !sized_as(&cos, m * d * 4, "cos") ||
        !sized_as(&sin, m * d * 4, "sin") || !sized_as(&slots, m * 8, "slots") ||
        !sized_as(&lens, m * 4, "context_lens") || !sized_as(&value, key.len, "value"))
        goto done;
    if (key.len % (row_bytes * block_size) || tables.len % (m * 4) || tables.len == 0) {
        PyErr_Format(PyExc_ValueError,
                     "key holds %zd bytes, not whole blocks of %zd rows of %zd; block "
                     "tables hold %zd bytes, not m=%zd rows of int32",
                     key.len, block_size, row_bytes, tables.len, m);
        goto done;
    }
    const Int4Weight *ws[] = {&l->qkv, &l->o, &l->gate_up, &l->down};
    const char *names[] = {"qkv", "o_proj", "gate_up", "down_proj"};
    for (int i = 0; i < 4; i++)
        if ((q8 >> i & 1) && !ws[i]->q8_path) {
            PyErr_Format(PyExc_ValueError,
                         "%s: no int8-activation build takes group=%zd", names[i],
                         ws[i]->group);
            goto done;
        }
    const Py_ssize_t max_blocks = tables.len / (m * 4), num_slots = key.len / row_bytes;
    if (!indices_ok(slots.buf, tables.buf, lens.buf, m, max_blocks, block_size, num_slots))
        goto done;
    Py_ssize_t longest = 0, mm = 0;
    for (Py_ssize_t r = 0; r < m; r++)
        if (((const int32_t *)lens.buf)[r] > longest) longest = ((const int32_t *)lens.buf)[r];
    for (int i = 0; i < 4; i++)
        if (int4_scratch_floats(ws[i], m) > mm) mm = int4_scratch_floats(ws[i], m);
    const Py_ssize_t sizes[] = {m * l->hidden, m * l->qkv.n,       m * l->heads * d,
                                m * l->gate_up.n, m * l->inter,    m * l->hidden,
                                longest * (l->heads / l->kv_heads), d, mm};
    Py_ssize_t total = 0;
    for (int i = 0; i < 9; i++) total += sizes[i];
    /* the context's slots first (aligned as malloc aligns), then the floats */
    memory = malloc(sizeof(Py_ssize_t) * longest + sizeof(float) * total);
    if (!memory) {
        PyErr_NoMemory();
        goto done;
    }
    float **parts[9];
    Scratch s;
    parts[0] = &s.h, parts[1] = &s.qkv, parts[2] = &s.att, parts[3] = &s.gu;
    parts[4] = &s.act, parts[5] = &s.y, parts[6] = &s.scores, parts[7] = &s.tmp;
    parts[8] = &s.mm;
    s.slots = memory;
    float *at = (float *)(s.slots + longest);
    for (int i = 0; i < 9; i++) *parts[i] = at, at += sizes[i];
    Py_BEGIN_ALLOW_THREADS
    decode_rows(l, x.buf, cos.buf, sin.buf, key.buf, value.buf, slots.buf, tables.buf,
                lens.buf, m, max_blocks, block_size, scale, q8, portable, &s);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    free(memory);
    Py_buffer *bufs[] = {&x, &cos, &sin, &key, &value, &slots, &tables, &lens};
    for (int i = 0; i < 8; i++)
        if (bufs[i]->obj) PyBuffer_Release(bufs[i]);
    return result;
}
