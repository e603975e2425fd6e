/* One decoder layer (and the head) of a one-lane model for one token, and the Python module.

   The same arithmetic as expresslane/packed_step.py's decode_layer for a Llama-family layer
   (one lane, where every DTP reduce is the identity): RMSNorm, the Q/K/V product (+ biases),
   RoPE (rotate-half or interleaved pairs), the KV-cache write at slot position % cap, attention
   over the first min(live, cap) slots masked by their positions (and the sliding window), the
   output product, the residual, RMSNorm, the gate/up product, SiLU(gate) * up, the down product
   and the residual, all fp32. Products are el_matvec (cpu_matvec.c); everything else is here so
   that a layer is one call from Python: the step's cost is the weights, not ~20 small ops.

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

/* floats of: qkv, attention output, normed input, gate/up, scores, product output; then the
   product's activation parts (bytes) */
static int64_t layer_scratch(int64_t D, int64_t Hq, int64_t Hkv, int64_t hd, int64_t F,
                             int64_t slots) {
    int64_t floats = (Hq + 2 * Hkv) * hd + Hq * hd + max3(D, F, Hq * hd) + 2 * F + slots + D;
    return floats * 4 + 64 + el_matvec_scratch(1, max3(D, F, Hq * hd));
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

T_F static void axpy(float *y, float a, const float *x, int64_t n) { /* y += a x */
    __m512 av = _mm512_set1_ps(a);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        __m512 r = _mm512_fmadd_ps(av, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i));
        _mm512_mask_storeu_ps(y + i, m, r);
    }
}

static void rms_norm(const float *x, const float *g, int64_t D, float eps, float *out) {
    float ss = dot(x, x, D);
    float r = 1.0f / sqrtf(ss / (float)D + eps);
    for (int64_t i = 0; i < D; i++) out[i] = x[i] * r * g[i];
}

static void rope(float *v, int64_t heads, int64_t hd, const float *c, const float *s, int half) {
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

static void attend(const int64_t *d, const float *q, int64_t position, int64_t n, float *sc,
                   float *o) {
    const int64_t Hq = d[F_heads], Hkv = d[F_kv_heads], hd = d[F_head_dim], win = d[F_window];
    const float *kc = PTR(d, k_cache, const float), *vc = PTR(d, v_cache, const float);
    const int64_t *pc = PTR(d, pos_cache, const int64_t);
    const float scale = 1.0f / sqrtf((float)hd);
    for (int64_t h = 0; h < Hq; h++) {
        const int64_t g = h / (Hq / Hkv);
        const float *qh = q + h * hd;
        float mx = -INFINITY, sum = 0.0f;
        for (int64_t s = 0; s < n; s++) {
            const int64_t p = pc[s];
            const int ok = p >= 0 && p <= position && (win == 0 || p > position - win);
            sc[s] = ok ? dot(qh, kc + (s * Hkv + g) * hd, hd) * scale : -INFINITY;
            mx = sc[s] > mx ? sc[s] : mx;
        }
        for (int64_t s = 0; s < n; s++) {
            sc[s] = sc[s] == -INFINITY ? 0.0f : expf(sc[s] - mx);
            sum += sc[s];
        }
        float *oh = o + h * hd;
        for (int64_t i = 0; i < hd; i++) oh[i] = 0.0f;
        for (int64_t s = 0; s < n; s++)
            if (sc[s] != 0.0f) axpy(oh, sc[s] / sum, vc + (s * Hkv + g) * hd, hd);
    }
}

#define MATVEC(d, w, x, y, N, K, threads, work)                                                \
    el_matvec((const qmat_t *)&(d)[F_##w##_fmt], (x), (y), 1, (N), (K), (threads), (work))

static int layer(const int64_t *d, float *h, const float *c, const float *s, int64_t position,
                 int64_t live, float eps, char *scratch, int threads) {
    const int64_t D = d[F_dim], Hq = d[F_heads], Hkv = d[F_kv_heads], hd = d[F_head_dim];
    const int64_t F = d[F_ffn], cap = d[F_cap], nq = (Hq + 2 * Hkv) * hd;
    const int64_t n = live < cap ? live : cap;
    float *qkv = (float *)scratch, *o = qkv + nq, *xn = o + Hq * hd;
    float *gu = xn + max3(D, F, Hq * hd), *sc = gu + 2 * F, *y = sc + cap;
    char *work = (char *)(((uintptr_t)(y + D) + 63) & ~(uintptr_t)63);
    int rc = 0;
    rms_norm(h, PTR(d, attention_norm, const float), D, eps, xn);
    rc |= MATVEC(d, qkv, xn, qkv, nq, D, threads, work);
    const float *bias = PTR(d, qkv_bias, const float);
    if (bias)
        for (int64_t i = 0; i < nq; i++) qkv[i] += bias[i];
    float *q = qkv, *k = qkv + Hq * hd, *v = k + Hkv * hd;
    rope(q, Hq, hd, c, s, (int)d[F_rope_half]);
    rope(k, Hkv, hd, c, s, (int)d[F_rope_half]);
    const int64_t slot = position % cap;
    float *kc = PTR(d, k_cache, float), *vc = PTR(d, v_cache, float);
    for (int64_t i = 0; i < Hkv * hd; i++) kc[slot * Hkv * hd + i] = k[i], vc[slot * Hkv * hd + i] = v[i];
    PTR(d, pos_cache, int64_t)[slot] = position;
    attend(d, q, position, n, sc, o);
    rc |= MATVEC(d, wo, o, y, D, Hq * hd, threads, work);
    for (int64_t i = 0; i < D; i++) h[i] += y[i];
    rms_norm(h, PTR(d, ffn_norm, const float), D, eps, xn);
    rc |= MATVEC(d, w13, xn, gu, 2 * F, D, threads, work);
    for (int64_t i = 0; i < F; i++) xn[i] = gu[i] / (1.0f + expf(-gu[i])) * gu[F + i];
    rc |= MATVEC(d, w2, xn, y, D, F, threads, work);
    for (int64_t i = 0; i < D; i++) h[i] += y[i];
    return rc;
}

/* final RMSNorm and the head: logits (V,), returns their first argmax (or -1: unsupported) */
static int64_t head(const qmat_t *w, const float *norm, const float *h, int64_t V, int64_t D,
                    float eps, float *logits, char *scratch, int threads) {
    float *xn = (float *)scratch;
    char *work = (char *)(((uintptr_t)(xn + D) + 63) & ~(uintptr_t)63);
    rms_norm(h, norm, D, eps, xn);
    if (el_matvec(w, xn, logits, 1, V, D, threads, work)) return -1;
    int64_t best = 0;
    for (int64_t i = 1; i < V; i++)
        if (logits[i] > logits[best]) best = i;
    return best;
}
#else
static int layer(const int64_t *d, float *h, const float *c, const float *s, int64_t position,
                 int64_t live, float eps, char *scratch, int threads) {
    (void)d, (void)h, (void)c, (void)s, (void)position, (void)live, (void)eps, (void)scratch;
    (void)threads;
    return -1;
}
static int64_t head(const qmat_t *w, const float *norm, const float *h, int64_t V, int64_t D,
                    float eps, float *logits, char *scratch, int threads) {
    (void)w, (void)norm, (void)h, (void)V, (void)D, (void)eps, (void)logits, (void)scratch;
    (void)threads;
    return -1;
}
#endif

/* ---- Python: addresses in, status out -------------------------------------------------------- */
#define ADDR(p) ((void *)(uintptr_t)(p))

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
    long long position, live;
    float eps;
    int threads, rc;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKKLLfKi", &d, &h, &c, &s, &position, &live, &eps, &scratch,
                          &threads))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = layer(ADDR(d), ADDR(h), ADDR(c), ADDR(s), position, live, eps, ADDR(scratch), threads);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_head(PyObject *self, PyObject *args) {
    int fmt, threads;
    unsigned long long w, scale, rowsum, mins, norm, h, logits, scratch;
    long long V, D;
    float eps;
    long long best;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKKKKKKLLfKKi", &fmt, &w, &scale, &rowsum, &mins, &norm, &h, &V,
                          &D, &eps, &logits, &scratch, &threads))
        return NULL;
    qmat_t m = {fmt, ADDR(w), ADDR(scale), ADDR(rowsum), ADDR(mins)};
    Py_BEGIN_ALLOW_THREADS
    best = head(&m, ADDR(norm), ADDR(h), V, D, eps, ADDR(logits), ADDR(scratch), threads);
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
    long long D, Hq, Hkv, hd, F, slots;
    (void)self;
    if (!PyArg_ParseTuple(args, "LLLLLL", &D, &Hq, &Hkv, &hd, &F, &slots)) return NULL;
    return PyLong_FromLongLong(layer_scratch(D, Hq, Hkv, hd, F, slots));
}

static PyMethodDef methods[] = {
    {"features", py_features, METH_NOARGS, "bit mask: 1 AVX-512, 2 AVX512_BF16, 4 AVX512_VNNI"},
    {"matvec", py_matvec, METH_VARARGS,
     "matvec(fmt, w, scale, rowsum, mins, x, y, L, N, K, threads) -> status (0 = done)"},
    {"layer_fields", py_layer_fields, METH_NOARGS, "names of a layer descriptor's int64 entries"},
    {"layer_scratch", py_layer_scratch, METH_VARARGS,
     "layer_scratch(D, Hq, Hkv, hd, F, slots) -> bytes of scratch a layer (or the head) needs"},
    {"layer", py_layer, METH_VARARGS,
     "layer(desc, h, cos, sin, position, live, eps, scratch, threads) -> status; h updated"},
    {"head", py_head, METH_VARARGS,
     "head(fmt, w, scale, rowsum, mins, norm, h, V, D, eps, logits, scratch, threads) -> argmax"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_kernels",
                                    "AVX-512 decode step of one-lane models (csrc/)", -1, methods};

PyMODINIT_FUNC PyInit__cpu_kernels(void) { return PyModule_Create(&module); }
