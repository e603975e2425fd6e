/* One decoder layer (and the head) of a one-lane model for one token or S, and the Python module.

   The same arithmetic as expresslane/packed_step.py's decode_layer for a Llama-family layer
   (one lane, where every DTP reduce is the identity): RMSNorm, the Q/K/V product (+ biases),
   RoPE (rotate-half or interleaved pairs), the KV-cache write at slot position % cap, attention
   over the first min(live, cap) slots masked by their positions (and the sliding window), the
   output product, the residual, RMSNorm, the gate/up product, SiLU(gate) * up, the down product
   and the residual, all fp32. Products are el_matvec (cpu_matvec.c), for S tokens el_matmul
   (cpu_matmul.c: each weight read once for all of them, the verify step of speculative
   decoding); everything else is here so that a layer is one call from Python: the step's cost
   is the weights, not ~20 small ops.

   A layer is described once by an int64 array (`layer_fields()` names its entries: sizes and
   the addresses of the packed weights and of the layer's cache); per token only the residual,
   the RoPE angles, the position and the live bound change. `scratch` (layer_scratch bytes)
   holds every intermediate, so a step allocates nothing. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>

#include "cpu_kernels.h"

/* a matrix: its format, then the four addresses of a qmat_t */
#define MAT(X, m) X(m##_fmt) X(m) X(m##_scale) X(m##_rowsum) X(m##_mins)
#define FIELDS(X)                                                                              \
    X(dim) X(heads) X(kv_heads) X(head_dim) X(ffn) X(cap) X(window) X(rope_half)                \
    X(attention_norm) X(qkv_bias) X(ffn_norm) X(k_cache) X(v_cache) X(pos_cache)               \
    MAT(X, qkv) MAT(X, wo) MAT(X, w13) MAT(X, w2)
#define AS_ENUM(name) F_##name,
enum { FIELDS(AS_ENUM) F_COUNT };
#define AS_NAME(name) #name,
static const char *field_names[] = {FIELDS(AS_NAME)};

#define PTR(d, f, T) ((T *)(uintptr_t)(d)[F_##f])

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* floats of, per token: qkv, attention output, normed input, gate/up, product output; once:
   scores; then the products' activation parts (bytes) */
static int64_t layer_scratch(int64_t D, int64_t Hq, int64_t Hkv, int64_t hd, int64_t F,
                             int64_t slots, int64_t S) {
    int64_t per = (Hq + 2 * Hkv) * hd + Hq * hd + max3(D, F, Hq * hd) + 2 * F + D;
    return (S * per + Hq * slots) * 4 + 64 + el_matmul_scratch(S, 1, max3(D, F, Hq * hd));
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define T_F __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

T_F static float dot(const float *a, const float *b, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

T_F static void rms_norm(const float *x, const float *g, int64_t D, float eps, float *out) {
    float ss = dot(x, x, D);
    float r = 1.0f / sqrtf(ss / (float)D + eps);
    for (int64_t i = 0; i < D; i++) out[i] = x[i] * r * g[i];
}

T_F static void rope(float *v, int64_t heads, int64_t hd, const float *c, const float *s, int half) {
    int64_t m = hd / 2;
    for (int64_t h = 0; h < heads; h++, v += hd) {
        for (int64_t i = 0; i < m; i++) {
            int64_t i0 = half ? i : 2 * i, i1 = half ? i + m : 2 * i + 1;
            float x0 = v[i0], x1 = v[i1];
            v[i0] = x0 * c[i] - x1 * s[i];
            v[i1] = half ? x1 * c[i] + x0 * s[i] : x0 * s[i] + x1 * c[i];
        }
    }
}

/* e^x for x <= 0 (scores minus their max): 2^n 2^f, 2^f by its degree-6 Taylor polynomial on
   |f| <= 1/2 (relative error ~1e-7, an ulp); exactly 0 below -87 */
T_F static inline __m512 exp_neg(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)),
                                   _mm512_set1_ps(1.4426950408889634f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022650695910071f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.69314718055994531f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    __m512 r = _mm512_scalef_ps(p, n);
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ), r);
}

#define MASK(n, i) ((n) - (i) >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << ((n) - (i))) - 1))

/* 16 floats from p, the last partial chunk masked (masked moves are slow on some cores) */
T_F static inline __m512 load16(const float *p, int64_t n, int64_t i) {
    return n - i >= 16 ? _mm512_loadu_ps(p + i) : _mm512_maskz_loadu_ps(MASK(n, i), p + i);
}

/* softmax(q k / sqrt(hd)) v for the G query heads of KV head g, over n slots: each key and value
   row is read once for the G heads. sc: G * n floats; o: G * hd floats, G * ceil(hd/16) <= 32. */
T_F static inline __attribute__((always_inline)) void attend_group_impl(
    const float *q, int64_t G, const float *kc, const float *vc, const int64_t *pc, int64_t Hkv,
    int64_t g, int64_t hd, int64_t n, int64_t position, int64_t win, float *sc, float *o,
    const int64_t chunks) {
    const float scale = 1.0f / sqrtf((float)hd);
    for (int64_t s = 0; s < n; s++) {
        const int64_t p = pc[s];
        const int ok = p >= 0 && p <= position && (win == 0 || p > position - win);
        const float *k = kc + (s * Hkv + g) * hd;
        for (int64_t j = 0; j < G; j++) {
            if (!ok) {
                sc[j * n + s] = -INFINITY;
                continue;
            }
            __m512 acc = _mm512_setzero_ps();
            for (int64_t i = 0; i < hd; i += 16)
                acc = _mm512_fmadd_ps(load16(q + j * hd, hd, i), load16(k, hd, i), acc);
            sc[j * n + s] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
    for (int64_t j = 0; j < G; j++) { /* softmax of row j, in place; padding lanes give 0 */
        float *r = sc + j * n;
        __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int64_t s = 0; s < n; s += 16)
            mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), MASK(n, s), r + s));
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        for (int64_t s = 0; s < n; s += 16) {
            __m512 e = exp_neg(_mm512_sub_ps(_mm512_mask_loadu_ps(m, MASK(n, s), r + s), m));
            if (n - s >= 16) _mm512_storeu_ps(r + s, e);
            else _mm512_mask_storeu_ps(r + s, MASK(n, s), e);
            sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(MASK(n, s), e));
        }
        const float inv = 1.0f / _mm512_reduce_add_ps(sum);
        for (int64_t s = 0; s < n; s++) r[s] *= inv;
    }
    __m512 acc[32];
    for (int64_t a = 0; a < G * chunks; a++) acc[a] = _mm512_setzero_ps();
    for (int64_t s = 0; s < n; s++) {
        const float *v = vc + (s * Hkv + g) * hd;
        for (int64_t c = 0; c < chunks; c++) {
            const __m512 vv = load16(v, hd, 16 * c);
            for (int64_t j = 0; j < G; j++)
                acc[j * chunks + c] = _mm512_fmadd_ps(_mm512_set1_ps(sc[j * n + s]), vv,
                                                      acc[j * chunks + c]);
        }
    }
    for (int64_t j = 0; j < G; j++)
        for (int64_t c = 0; c < chunks; c++) {
            if (hd - 16 * c >= 16) _mm512_storeu_ps(o + j * hd + 16 * c, acc[j * chunks + c]);
            else _mm512_mask_storeu_ps(o + j * hd + 16 * c, MASK(hd, 16 * c), acc[j * chunks + c]);
        }
}

/* head_dim 64 and 128 (most models) with the chunk count known: the accumulators stay in registers */
T_F static void attend_group(const float *q, int64_t G, const float *kc, const float *vc,
                             const int64_t *pc, int64_t Hkv, int64_t g, int64_t hd, int64_t n,
                             int64_t position, int64_t win, float *sc, float *o) {
    if (hd == 64)
        attend_group_impl(q, G, kc, vc, pc, Hkv, g, 64, n, position, win, sc, o, 4);
    else if (hd == 128)
        attend_group_impl(q, G, kc, vc, pc, Hkv, g, 128, n, position, win, sc, o, 8);
    else
        attend_group_impl(q, G, kc, vc, pc, Hkv, g, hd, n, position, win, sc, o, (hd + 15) / 16);
}

static void attend(const int64_t *d, const float *q, int64_t position, int64_t n, float *sc,
                   float *o, int threads) {
    const int64_t Hq = d[F_heads], Hkv = d[F_kv_heads], hd = d[F_head_dim], G = Hq / Hkv;
    const float *kc = PTR(d, k_cache, const float), *vc = PTR(d, v_cache, const float);
    const int64_t *pc = PTR(d, pos_cache, const int64_t);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n >= 512)
    for (int64_t g = 0; g < Hkv; g++)
        attend_group(q + g * G * hd, G, kc, vc, pc, Hkv, g, hd, n, position, d[F_window],
                     sc + g * G * n, o + g * G * hd);
}

/* W x for S tokens: x (S, K) -> y (S, N); one token is el_matvec itself */
#define PRODUCT(d, w, x, y, S, N, K, threads, work)                                             \
    el_matmul((const qmat_t *)&(d)[F_##w##_fmt], (x), (y), (S), 1, (N), (K), (threads), (work))

/* out = silu(gate) * up, silu(z) = z sigmoid(z), sigmoid from u = e^-|z| in (0, 1] */
T_F static void silu_mul(const float *gate, const float *up, int64_t F, float *out) {
    for (int64_t i = 0; i < F; i += 16) {
        const __mmask16 m = MASK(F, i);
        const __m512 z = _mm512_maskz_loadu_ps(m, gate + i);
        const __m512 u = exp_neg(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(z)));
        const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_GE_OQ),
                                                u, _mm512_set1_ps(1.0f));
        const __m512 sig = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), u));
        const __m512 r = _mm512_mul_ps(_mm512_mul_ps(z, sig), _mm512_maskz_loadu_ps(m, up + i));
        _mm512_mask_storeu_ps(out + i, m, r);
    }
}

/* S tokens at positions position .. position + S - 1 (S = 1: a decode step; more: a verify
   step), h (S, D) updated; c, s: the RoPE rows of those positions. Every key and value is
   written first, then each query attends over the first min(live, cap) slots masked by their
   positions: causal among the new tokens because a later token's position is masked for an
   earlier query. Per token the same calls in the same order as one token alone, and products
   with el_matvec's bits: a token's result does not depend on S. */
T_F static int layer(const int64_t *d, float *h, int64_t S, const float *c, const float *s,
                     int64_t position, int64_t live, float eps, char *scratch, int threads) {
    const int64_t D = d[F_dim], Hq = d[F_heads], Hkv = d[F_kv_heads], hd = d[F_head_dim];
    const int64_t F = d[F_ffn], cap = d[F_cap], nq = (Hq + 2 * Hkv) * hd, half = hd / 2;
    if ((Hq / Hkv) * ((hd + 15) / 16) > 32) return -2; /* attend_group's accumulators */
    const int64_t n = live < cap ? live : cap;
    float *qkv = (float *)scratch, *o = qkv + S * nq, *xn = o + S * Hq * hd;
    float *gu = xn + S * max3(D, F, Hq * hd), *y = gu + S * 2 * F, *sc = y + S * D;
    char *work = (char *)(((uintptr_t)(sc + Hq * cap) + 63) & ~(uintptr_t)63);
    int rc = 0;
    for (int64_t t = 0; t < S; t++) rms_norm(h + t * D, PTR(d, attention_norm, const float), D, eps, xn + t * D);
    rc |= PRODUCT(d, qkv, xn, qkv, S, nq, D, threads, work);
    const float *bias = PTR(d, qkv_bias, const float);
    float *kc = PTR(d, k_cache, float), *vc = PTR(d, v_cache, float);
    for (int64_t t = 0; t < S; t++) {
        float *q = qkv + t * nq, *k = q + Hq * hd, *v = k + Hkv * hd;
        if (bias)
            for (int64_t i = 0; i < nq; i++) q[i] += bias[i];
        rope(q, Hq, hd, c + t * half, s + t * half, (int)d[F_rope_half]);
        rope(k, Hkv, hd, c + t * half, s + t * half, (int)d[F_rope_half]);
        const int64_t slot = (position + t) % cap;
        for (int64_t i = 0; i < Hkv * hd; i++) kc[slot * Hkv * hd + i] = k[i], vc[slot * Hkv * hd + i] = v[i];
        PTR(d, pos_cache, int64_t)[slot] = position + t;
    }
    for (int64_t t = 0; t < S; t++) attend(d, qkv + t * nq, position + t, n, sc, o + t * Hq * hd, threads);
    rc |= PRODUCT(d, wo, o, y, S, D, Hq * hd, threads, work);
    for (int64_t i = 0; i < S * D; i++) h[i] += y[i];
    for (int64_t t = 0; t < S; t++) rms_norm(h + t * D, PTR(d, ffn_norm, const float), D, eps, xn + t * D);
    rc |= PRODUCT(d, w13, xn, gu, S, 2 * F, D, threads, work);
    for (int64_t t = 0; t < S; t++) silu_mul(gu + t * 2 * F, gu + t * 2 * F + F, F, xn + t * F);
    rc |= PRODUCT(d, w2, xn, y, S, D, F, threads, work);
    for (int64_t i = 0; i < S * D; i++) h[i] += y[i];
    return rc;
}

/* final RMSNorm and the head for S tokens: logits (S, V); returns the first argmax of the last
   token's logits (or -1: unsupported) */
static int64_t head(const qmat_t *w, const float *norm, const float *h, int64_t S, int64_t V,
                    int64_t D, float eps, float *logits, char *scratch, int threads) {
    float *xn = (float *)scratch;
    char *work = (char *)(((uintptr_t)(xn + S * D) + 63) & ~(uintptr_t)63);
    for (int64_t t = 0; t < S; t++) rms_norm(h + t * D, norm, D, eps, xn + t * D);
    if (el_matmul(w, xn, logits, S, 1, V, D, threads, work)) return -1;
    const float *last = logits + (S - 1) * V;
    int64_t best = 0;
    for (int64_t i = 1; i < V; i++)
        if (last[i] > last[best]) best = i;
    return best;
}
#else
static int layer(const int64_t *d, float *h, int64_t S, const float *c, const float *s,
                 int64_t position, int64_t live, float eps, char *scratch, int threads) {
    (void)d, (void)h, (void)S, (void)c, (void)s, (void)position, (void)live, (void)eps;
    (void)scratch, (void)threads;
    return -1;
}
static int64_t head(const qmat_t *w, const float *norm, const float *h, int64_t S, int64_t V,
                    int64_t D, float eps, float *logits, char *scratch, int threads) {
    (void)w, (void)norm, (void)h, (void)S, (void)V, (void)D, (void)eps, (void)logits;
    (void)scratch, (void)threads;
    return -1;
}
#endif

/* ---- Python: addresses in, status out -------------------------------------------------------- */
#define ADDR(p) ((void *)(uintptr_t)(p))

/* matvec: S = 1 (el_matvec); matmul: S tokens, x (S, L, K) -> y (S, L, N) (el_matmul) */
static PyObject *py_matmul(PyObject *self, PyObject *args) {
    int fmt, threads;
    unsigned long long w, scale, rowsum, mins, x, y;
    long long S, L, N, K;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKKKKKKLLLLi", &fmt, &w, &scale, &rowsum, &mins, &x, &y, &S, &L,
                          &N, &K, &threads))
        return NULL;
    qmat_t m = {fmt, ADDR(w), ADDR(scale), ADDR(rowsum), ADDR(mins)};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = el_matmul(&m, ADDR(x), ADDR(y), S, L, N, K, threads, NULL);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_matvec(PyObject *self, PyObject *args) {
    int fmt, threads;
    unsigned long long w, scale, rowsum, mins, x, y;
    long long L, N, K;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKKKKKKLLLi", &fmt, &w, &scale, &rowsum, &mins, &x, &y, &L, &N,
                          &K, &threads))
        return NULL;
    qmat_t m = {fmt, ADDR(w), ADDR(scale), ADDR(rowsum), ADDR(mins)};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = el_matvec(&m, ADDR(x), ADDR(y), L, N, K, threads, NULL);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_layer(PyObject *self, PyObject *args) {
    unsigned long long d, h, c, s, scratch;
    long long position, live, S = 1;
    float eps;
    int threads, rc;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKKLLfKi|L", &d, &h, &c, &s, &position, &live, &eps, &scratch,
                          &threads, &S))
        return NULL;
    if (S < 1) S = 1;
    Py_BEGIN_ALLOW_THREADS
    rc = layer(ADDR(d), ADDR(h), S, ADDR(c), ADDR(s), position, live, eps, ADDR(scratch), threads);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_head(PyObject *self, PyObject *args) {
    int fmt, threads;
    unsigned long long w, scale, rowsum, mins, norm, h, logits, scratch;
    long long V, D, S = 1;
    float eps;
    long long best;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKKKKKKLLfKKi|L", &fmt, &w, &scale, &rowsum, &mins, &norm, &h,
                          &V, &D, &eps, &logits, &scratch, &threads, &S))
        return NULL;
    if (S < 1) S = 1;
    qmat_t m = {fmt, ADDR(w), ADDR(scale), ADDR(rowsum), ADDR(mins)};
    Py_BEGIN_ALLOW_THREADS
    best = head(&m, ADDR(norm), ADDR(h), S, V, D, eps, ADDR(logits), ADDR(scratch), threads);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(best);
}

static PyObject *py_features(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    return PyLong_FromLong(el_features());
}

static PyObject *py_layer_fields(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    PyObject *t = PyTuple_New(F_COUNT);
    for (int i = 0; t && i < F_COUNT; i++) PyTuple_SET_ITEM(t, i, PyUnicode_FromString(field_names[i]));
    return t;
}

static PyObject *py_layer_scratch(PyObject *self, PyObject *args) {
    long long D, Hq, Hkv, hd, F, slots, S = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "LLLLLL|L", &D, &Hq, &Hkv, &hd, &F, &slots, &S)) return NULL;
    return PyLong_FromLongLong(layer_scratch(D, Hq, Hkv, hd, F, slots, S < 1 ? 1 : S));
}

static PyMethodDef methods[] = {
    {"features", py_features, METH_NOARGS, "bit mask: 1 AVX-512, 2 AVX512_BF16, 4 AVX512_VNNI"},
    {"matvec", py_matvec, METH_VARARGS,
     "matvec(fmt, w, scale, rowsum, mins, x, y, L, N, K, threads) -> status (0 = done)"},
    {"matmul", py_matmul, METH_VARARGS,
     "matmul(fmt, w, scale, rowsum, mins, x, y, S, L, N, K, threads) -> status: S tokens"},
    {"layer_fields", py_layer_fields, METH_NOARGS, "names of a layer descriptor's int64 entries"},
    {"layer_scratch", py_layer_scratch, METH_VARARGS,
     "layer_scratch(D, Hq, Hkv, hd, F, slots[, S]) -> bytes of scratch a layer (or the head) "
     "needs for S tokens"},
    {"layer", py_layer, METH_VARARGS,
     "layer(desc, h, cos, sin, position, live, eps, scratch, threads[, S]) -> status; h (S, D) "
     "updated"},
    {"head", py_head, METH_VARARGS,
     "head(fmt, w, scale, rowsum, mins, norm, h, V, D, eps, logits, scratch, threads[, S]) -> "
     "argmax of the last token's logits"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_kernels",
                                    "AVX-512 decode step of one-lane models (csrc/)", -1, methods};

PyMODINIT_FUNC PyInit__cpu_kernels(void) { return PyModule_Create(&module); }
