/* The Python module `expresslane._cpu_kernels`: addresses in, status out (step/native.py). A
   matrix is passed as its format and the six addresses of a qmat_t (0 for none). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "cpu_kernels.h"
#include "cpu_layer.h"

#define ADDR(p) ((void *)(uintptr_t)(p))

/* S tokens, x (S, L, K) -> y (S, L, N) (el_matmul; one token is S = 1) */
static PyObject *py_matmul(PyObject *self, PyObject *args) {
    int fmt, threads, lowp = 0;
    unsigned long long w, scale, rowsum, mins, high, sub, x, y;
    long long S, L, N, K;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKKKKKKKKLLLLi|i", &fmt, &w, &scale, &rowsum, &mins, &high, &sub,
                          &x, &y, &S, &L, &N, &K, &threads, &lowp))
        return NULL;
    qmat_t m = {fmt, ADDR(w), ADDR(scale), ADDR(rowsum), ADDR(mins), ADDR(high), ADDR(sub)};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = el_matmul(&m, ADDR(x), ADDR(y), S, L, N, K, threads, NULL, lowp);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

/* a block-format matrix's N rows of K values -> out (fp32, or bf16 with bf16 != 0) */
static PyObject *py_dequant(PyObject *self, PyObject *args) {
    int fmt, bf16, threads;
    unsigned long long w, scale, rowsum, mins, high, sub, out;
    long long N, K;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKKKKKKKLLii", &fmt, &w, &scale, &rowsum, &mins, &high, &sub,
                          &out, &N, &K, &bf16, &threads))
        return NULL;
    qmat_t m = {fmt, ADDR(w), ADDR(scale), ADDR(rowsum), ADDR(mins), ADDR(high), ADDR(sub)};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = el_dequant(&m, N, K, ADDR(out), bf16, threads);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_layer(PyObject *self, PyObject *args) {
    unsigned long long d, h, c, s, scratch;
    long long position, live, S;
    float eps;
    int threads, rc, lowp = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKKLLfKiL|i", &d, &h, &c, &s, &position, &live, &eps, &scratch,
                          &threads, &S, &lowp))
        return NULL;
    if (S < 1) S = 1;
    Py_BEGIN_ALLOW_THREADS
    rc = el_layer(ADDR(d), ADDR(h), S, ADDR(c), ADDR(s), position, live, eps, ADDR(scratch),
                  threads, lowp);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(rc);
}

static PyObject *py_head(PyObject *self, PyObject *args) {
    int fmt, threads;
    unsigned long long w, scale, rowsum, mins, high, sub, norm, h, logits, scratch;
    long long V, D, S;
    float eps;
    long long best;
    (void)self;
    if (!PyArg_ParseTuple(args, "iKKKKKKKKLLfKKiL", &fmt, &w, &scale, &rowsum, &mins, &high, &sub,
                          &norm, &h, &V, &D, &eps, &logits, &scratch, &threads, &S))
        return NULL;
    if (S < 1) S = 1;
    qmat_t m = {fmt, ADDR(w), ADDR(scale), ADDR(rowsum), ADDR(mins), ADDR(high), ADDR(sub)};
    Py_BEGIN_ALLOW_THREADS
    best = el_head(&m, ADDR(norm), ADDR(h), S, V, D, eps, ADDR(logits), ADDR(scratch), threads);
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(best);
}

static PyObject *py_features(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    return PyLong_FromLong(el_features());
}

static PyObject *py_layer_fields(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    const char *const *names;
    const int n = el_layer_fields(&names);
    PyObject *t = PyTuple_New(n);
    for (int i = 0; t && i < n; i++) PyTuple_SET_ITEM(t, i, PyUnicode_FromString(names[i]));
    return t;
}

static PyObject *py_layer_scratch(PyObject *self, PyObject *args) {
    long long D, Hq, Hkv, hd, F, slots, S;
    (void)self;
    if (!PyArg_ParseTuple(args, "LLLLLLL", &D, &Hq, &Hkv, &hd, &F, &slots, &S)) return NULL;
    return PyLong_FromLongLong(el_layer_scratch(D, Hq, Hkv, hd, F, slots, S < 1 ? 1 : S));
}

static PyMethodDef methods[] = {
    {"features", py_features, METH_NOARGS, "bit mask: 1 AVX-512, 2 AVX512_BF16, 4 AVX512_VNNI, 8 AMX-BF16 tiles in use"},
    {"matmul", py_matmul, METH_VARARGS,
     "matmul(fmt, w, scale, rowsum, mins, high, sub, x, y, S, L, N, K, threads, lowp=0) -> "
     "status (lowp: csrc/cpu_kernels.h's EL_LOWP | EL_PROMPT flags)"},
    {"dequant", py_dequant, METH_VARARGS,
     "dequant(fmt, w, scale, rowsum, mins, high, sub, out, N, K, bf16, threads) -> status"},
    {"layer_fields", py_layer_fields, METH_NOARGS, "names of a layer descriptor's int64 entries"},
    {"layer_scratch", py_layer_scratch, METH_VARARGS,
     "layer_scratch(D, Hq, Hkv, hd, F, slots, S) -> bytes of scratch a layer (or the head) "
     "needs for S tokens"},
    {"layer", py_layer, METH_VARARGS,
     "layer(desc, h, cos, sin, position, live, eps, scratch, threads, S, lowp=False) -> status; "
     "h (S, D) updated"},
    {"head", py_head, METH_VARARGS,
     "head(fmt, w, scale, rowsum, mins, high, sub, norm, h, V, D, eps, logits, scratch, threads, "
     "S) -> argmax of the last token's logits"},
    {NULL, NULL, 0, NULL}};

#ifdef EL_AVX2 /* the same kernels built for AVX2 (simd_avx2.h) */
#define MODULE_NAME "_cpu_kernels_avx2"
#define MODULE_INIT PyInit__cpu_kernels_avx2
#else
#define MODULE_NAME "_cpu_kernels"
#define MODULE_INIT PyInit__cpu_kernels
#endif
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, MODULE_NAME,
                                    "AVX-512 decode step of one-lane models (csrc/)", -1, methods};

PyMODINIT_FUNC MODULE_INIT(void) { return PyModule_Create(&module); }
