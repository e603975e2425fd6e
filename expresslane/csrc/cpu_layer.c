/* One decoder layer (and the head) of a one-lane model for S tokens (one: a decode step).

   The same arithmetic as expresslane/step/packed.py's layer for a Llama-family layer
   (one lane, where every DTP reduce is the identity): RMSNorm, the Q/K/V product (+ biases),
   qwen3's RMSNorm of each query and key head over head_dim (q_norm / k_norm: 0 without), RoPE (rotate-half or interleaved pairs), the KV-cache write at slot position % cap (fp32, or
   rounded to fp16 or bf16 as torch rounds: kv_dtype), attention over the first min(live, cap)
   slots masked by their positions (and the sliding window; cpu_attention.c), the output
   product, the residual, RMSNorm, the gate/up product, SiLU(gate) * up, the down product and
   the residual, all fp32. Products are el_matmul (cpu_matmul.c: each weight read once for all S
   tokens, the verify step of speculative decoding); the rest is here, so that a layer is one
   call from Python: the step's cost is the weights, not ~20 small ops.

   A layer is described once by an int64 array (`layer_fields()` names its entries: sizes and
   the addresses of the packed weights and of the layer's cache); per token only the residual,
   the RoPE angles, the position and the live bound change. `scratch` (layer_scratch bytes)
   holds every intermediate, so a step allocates nothing. */

#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_attention.h"
#include "cpu_kernels.h"
#include "cpu_layer.h"
#include "simd.h"

/* a matrix: its format, then the six addresses of a qmat_t */
#define MAT(X, m) X(m##_fmt) X(m) X(m##_scale) X(m##_rowsum) X(m##_mins) X(m##_high) X(m##_sub)
/* a product: up to three row ranges, each a matrix in its own format (GGUF files mix them: Q
   and K in Q5_0, V in Q8_0), with its rows (0: absent) */
#define PARTS(X, m) MAT(X, m) X(m##_rows) MAT(X, m##_1) X(m##_1_rows) MAT(X, m##_2) X(m##_2_rows)
#define FIELDS(X)                                                                              \
    X(dim) X(heads) X(kv_heads) X(head_dim) X(ffn) X(cap) X(window) X(rope_half) X(kv_dtype)    \
    X(attention_norm) X(qkv_bias) X(q_norm) X(k_norm) X(ffn_norm) X(k_cache) X(v_cache)        \
    X(pos_cache)                                                                               \
    PARTS(X, qkv) PARTS(X, wo) PARTS(X, w13) PARTS(X, w2)
#define AS_ENUM(name) F_##name,
enum { FIELDS(AS_ENUM) F_COUNT };
#define AS_NAME(name) #name,
static const char *field_names[] = {FIELDS(AS_NAME)};
int el_layer_fields(const char *const **names) {
    *names = field_names;
    return F_COUNT;
}

#define PTR(d, f, T) ((T *)(uintptr_t)(d)[F_##f])

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* floats of, per token: qkv, attention output, normed input, gate/up, product output; once:
   attention's scores and chunk parts; then the products' activation parts (bytes) */
int64_t el_layer_scratch(int64_t D, int64_t Hq, int64_t Hkv, int64_t hd, int64_t F,
                             int64_t slots, int64_t S) {
    int64_t per = (Hq + 2 * Hkv) * hd + Hq * hd + max3(D, F, Hq * hd) + 2 * F + D;
    int64_t once = el_attend_scratch(Hq, hd, slots);
    return (S * per + once) * 4 + 64 + el_matmul_scratch(S, 1, max3(D, F, Hq * hd));
}

#ifdef EL_X86

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

/* W x for S tokens: x (S, K) -> y (S, N), part by part (a part's rows into y's columns) */
static int product(const int64_t *part, const float *x, float *y, int64_t S, int64_t N, int64_t K,
                   int threads, void *work, int lowp) {
    const int64_t stride = F_qkv_1_fmt - F_qkv_fmt; /* one part's entries */
    int rc = 0;
    for (int64_t p = 0, at = 0; p < 3 && part[p * stride + 7] > 0; at += part[p * stride + 7], p++)
        rc |= el_matmul_into((const qmat_t *)&part[p * stride], x, y + at, N, S,
                             part[p * stride + 7], K, threads, work, lowp);
    return rc;
}
#define PRODUCT(d, w, x, y, S, N, K, threads, work) \
    product(&(d)[F_##w##_fmt], (x), (y), (S), (N), (K), (threads), (work), lowp)

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
   whose rows do not depend on S: a token's result does not depend on S. lowp: the products
   take x at llama.cpp's precision where the format allows (cpu_kernels.h's xparts_t; a
   prompt's opt-in). */
T_F int el_layer(const int64_t *d, float *h, int64_t S, const float *c, const float *s,
                 int64_t position, int64_t live, float eps, char *scratch, int threads, int lowp) {
    const int64_t D = d[F_dim], Hq = d[F_heads], Hkv = d[F_kv_heads], hd = d[F_head_dim];
    const int64_t F = d[F_ffn], cap = d[F_cap], nq = (Hq + 2 * Hkv) * hd, half = hd / 2;
    if ((hd + 15) / 16 > 32) return -2; /* attend_chunk's accumulators */
    const int64_t n = live < cap ? live : cap;
    float *qkv = (float *)scratch, *o = qkv + S * nq, *xn = o + S * Hq * hd;
    float *gu = xn + S * max3(D, F, Hq * hd), *y = gu + S * 2 * F, *sc = y + S * D;
    char *work = (char *)(((uintptr_t)(sc + el_attend_scratch(Hq, hd, cap)) + 63) & ~(uintptr_t)63);
    int rc = 0;
    const int par = threads > 1 && S >= PARALLEL_MIN; /* a prompt's tokens: each on any thread */
#pragma omp parallel for schedule(static) num_threads(threads) if (par)
    for (int64_t t = 0; t < S; t++) rms_norm(h + t * D, PTR(d, attention_norm, const float), D, eps, xn + t * D);
    rc |= PRODUCT(d, qkv, xn, qkv, S, nq, D, threads, work);
    const float *bias = PTR(d, qkv_bias, const float);
    const float *qn = PTR(d, q_norm, const float), *kn = PTR(d, k_norm, const float);
    const el_kv_t kv = {Hq, Hkv, hd, cap, d[F_window], (int)d[F_kv_dtype], PTR(d, k_cache, char),
                        PTR(d, v_cache, char), PTR(d, pos_cache, int64_t)};
    /* slots of distinct tokens differ while S <= cap: the writes are then any thread's */
#pragma omp parallel for schedule(static) num_threads(threads) if (par && S <= cap)
    for (int64_t t = 0; t < S; t++) {
        float *q = qkv + t * nq, *k = q + Hq * hd, *v = k + Hkv * hd;
        if (bias)
            for (int64_t i = 0; i < nq; i++) q[i] += bias[i];
        if (qn) /* in place: rms_norm reads x whole (its sum of squares) before writing */
            for (int64_t j = 0; j < Hq + Hkv; j++)
                rms_norm(q + j * hd, j < Hq ? qn : kn, hd, eps, q + j * hd);
        rope(q, Hq, hd, c + t * half, s + t * half, (int)d[F_rope_half]);
        rope(k, Hkv, hd, c + t * half, s + t * half, (int)d[F_rope_half]);
        el_kv_write(&kv, (position + t) % cap, position + t, k, v);
    }
    el_attend_tokens(&kv, qkv, nq, position, S, n, sc, o, threads);
    rc |= PRODUCT(d, wo, o, y, S, D, Hq * hd, threads, work);
#pragma omp parallel for schedule(static) num_threads(threads) if (par)
    for (int64_t t = 0; t < S; t++) {
        for (int64_t i = t * D; i < (t + 1) * D; i++) h[i] += y[i];
        rms_norm(h + t * D, PTR(d, ffn_norm, const float), D, eps, xn + t * D);
    }
    rc |= PRODUCT(d, w13, xn, gu, S, 2 * F, D, threads, work);
#pragma omp parallel for schedule(static) num_threads(threads) if (par)
    for (int64_t t = 0; t < S; t++) silu_mul(gu + t * 2 * F, gu + t * 2 * F + F, F, xn + t * F);
    rc |= PRODUCT(d, w2, xn, y, S, D, F, threads, work);
    for (int64_t i = 0; i < S * D; i++) h[i] += y[i];
    return rc;
}

/* final RMSNorm and the head for S tokens: logits (S, V); returns the first argmax of the last
   token's logits (or -1: unsupported) */
int64_t el_head(const qmat_t *w, const float *norm, const float *h, int64_t S, int64_t V,
                    int64_t D, float eps, float *logits, char *scratch, int threads) {
    float *xn = (float *)scratch;
    char *work = (char *)(((uintptr_t)(xn + S * D) + 63) & ~(uintptr_t)63);
    for (int64_t t = 0; t < S; t++) rms_norm(h + t * D, norm, D, eps, xn + t * D);
    if (el_matmul(w, xn, logits, S, 1, V, D, threads, work, 0)) return -1;
    const float *last = logits + (S - 1) * V;
    int64_t best = 0;
    for (int64_t i = 1; i < V; i++)
        if (last[i] > last[best]) best = i;
    return best;
}
#else
int el_layer(const int64_t *d, float *h, int64_t S, const float *c, const float *s,
             int64_t position, int64_t live, float eps, char *scratch, int threads, int lowp) {
    (void)d, (void)h, (void)S, (void)c, (void)s, (void)position, (void)live, (void)eps;
    (void)scratch, (void)threads, (void)lowp;
    return -1;
}
int64_t el_head(const qmat_t *w, const float *norm, const float *h, int64_t S, int64_t V,
                    int64_t D, float eps, float *logits, char *scratch, int threads) {
    (void)w, (void)norm, (void)h, (void)S, (void)V, (void)D, (void)eps, (void)logits;
    (void)scratch, (void)threads;
    return -1;
}
#endif

