/* One decoder layer (and the head) of a one-lane model for S tokens (one: a decode step).

   The same arithmetic as expresslane/step/packed.py's decode_layer for a Llama-family layer
   (one lane, where every DTP reduce is the identity): RMSNorm, the Q/K/V product (+ biases),
   RoPE (rotate-half or interleaved pairs), the KV-cache write at slot position % cap (fp32, or
   rounded to fp16 or bf16 as torch rounds: kv_dtype), attention
   over the first min(live, cap) slots masked by their positions (and the sliding window), the
   output product, the residual, RMSNorm, the gate/up product, SiLU(gate) * up, the down product
   and the residual, all fp32. Products are el_matmul (cpu_matmul.c: each weight read once for all S
   tokens, the verify step of speculative decoding); everything else is here so that a layer is one call from Python: the step's cost
   is the weights, not ~20 small ops.

   A layer is described once by an int64 array (`layer_fields()` names its entries: sizes and
   the addresses of the packed weights and of the layer's cache); per token only the residual,
   the RoPE angles, the position and the live bound change. `scratch` (layer_scratch bytes)
   holds every intermediate, so a step allocates nothing. */

#include <math.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

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
    X(attention_norm) X(qkv_bias) X(ffn_norm) X(k_cache) X(v_cache) X(pos_cache)               \
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

#define ATT_CHUNK 64 /* slots of one attention task (below, with attend) */

/* partial floats of one chunk: per query head its max, its sum, then Hq * hd outputs */
static int64_t att_part(int64_t Hq, int64_t hd) { return Hq * (hd + 2); }

/* floats of, per token: qkv, attention output, normed input, gate/up, product output; once:
   scores, the attention's chunk parts; then the products' activation parts (bytes) */
static int64_t att_parts(int64_t Hq, int64_t hd, int64_t slots) {
    return ((slots + ATT_CHUNK - 1) / ATT_CHUNK) * att_part(Hq, hd);
}
int64_t el_layer_scratch(int64_t D, int64_t Hq, int64_t Hkv, int64_t hd, int64_t F,
                             int64_t slots, int64_t S) {
    int64_t per = (Hq + 2 * Hkv) * hd + Hq * hd + max3(D, F, Hq * hd) + 2 * F + D;
    int64_t once = Hq * slots + att_parts(Hq, hd, slots);
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

/* Attention is split into chunks of ATT_CHUNK slots at fixed offsets (flash-decoding): each
   chunk is a task with, per query head, its own max, sum and unnormalised output, and the
   chunks are merged in slot order. A chunk's sums depend only on its own slots, and a chunk
   holding no visible key is skipped, so a row's bits depend neither on the live bound n (a
   verify step reads past a lone step's n: masked slots add exact zeros) nor on the thread
   count; and the tasks spread the fp32 cache's stream (its bytes pass the weights' near 2,000
   slots of SmolLM2) over every thread.

   A task reads each slot's key row (every KV head: Hkv hd floats, front to back) once for the
   scores of all heads, and fetches the value row ATT_AHEAD slots on meanwhile, so that the
   values are in cache when each head sums them. Read a KV head at a time, rows Hkv hd floats
   apart, the loads waited on memory (perf: the slowest instructions were loads of a row's
   third and fourth cache lines), at about 8 GB/s a thread. Scoring 16 slots at once, their
   dots left as lanes and summed together (simd.h's sums16), was no faster (2026-11-28, two
   versions: decode at 1,000 slots 0.94x and 0.98x the tok/s, a 256-token prompt level): the
   stream, not the sums, sets the pace. */
#define ATT_AHEAD 4

/* the cache's element types (a descriptor's kv_dtype; step/native.py's KV_DTYPES): fp32, or
   16 bits a value (--kv-cache-dtype), half the bytes a slot streams */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

/* 16 values of a cache row at i as fp32 (the last partial chunk masked); kvt is a constant
   where attend_chunk_impl is inlined, so each type's loop has its own loads */
T_F INLINE __m512 load_kv(const char *p, int kvt, int64_t n, int64_t i) {
    if (kvt == KV_F32) return load16((const float *)p, n, i);
    const uint16_t *u = (const uint16_t *)p + i;
    const __m256i b = n - i >= 16 ? _mm256_loadu_si256((const __m256i *)u)
                                  : _mm256_maskz_loadu_epi16(MASK(n, i), u);
    if (kvt == KV_F16) return _mm512_cvtph_ps(b);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)); /* bf16 */
}

/* x rounded to the cache's type and stored at p[i], bit for bit as torch's .to(dtype) rounds:
   to nearest, ties to even (c10's round_to_nearest_even for bf16, NaN as 0x7FC0) */
T_F static inline void store_kv(char *p, int kvt, int64_t i, float x) {
    if (kvt == KV_F32) {
        ((float *)p)[i] = x;
    } else if (kvt == KV_F16) {
        ((uint16_t *)p)[i] = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
    } else {
        union { float f; uint32_t u; } b = {x};
        ((uint16_t *)p)[i] = x != x ? 0x7FC0 : (uint16_t)((b.u + 0x7FFF + ((b.u >> 16) & 1)) >> 16);
    }
}

/* a slot holding position p, to a query at `position` (window win, 0: none) */
static inline int visible(int64_t p, int64_t position, int64_t win) {
    return p >= 0 && p <= position && (win == 0 || p > position - win);
}

T_F static inline void prefetch_bytes(const char *p, int64_t count) {
    for (int64_t i = 0; i < count; i += 64) __builtin_prefetch(p + i, 0, 3);
}

/* The Hq query heads (G per KV head) over slots [s0, s1): scores in sc (head h at sc + h n),
   part = m[Hq], l[Hq], o[Hq][hd] with o = sum_s e^(score_s - m) v_s. chunks = ceil(hd / 16)
   <= 32 accumulators (a constant for head_dim 64 and 128); kvt: the cache's type, a constant. */
T_F static inline __attribute__((always_inline)) void attend_chunk_impl(
    const float *q, int64_t Hq, int64_t Hkv, const char *kc, const char *vc, const int64_t *pc,
    int64_t hd, int64_t n, int64_t s0, int64_t s1, int64_t position, int64_t win, float *sc,
    float *part, const int64_t chunks, const int kvt) {
    const float scale = 1.0f / sqrtf((float)hd);
    const int64_t G = Hq / Hkv, es = kvt == KV_F32 ? 4 : 2, row = Hkv * hd * es; /* bytes */
    float *m = part, *l = part + Hq, *o = part + 2 * Hq;
    int any = 0; /* a visible key: else the chunk weighs 0 (merge_chunks), and nothing is summed */
    for (int64_t s = s0; s < s1 && !any; s++) any = visible(pc[s], position, win);
    if (!any) {
        for (int64_t h = 0; h < Hq; h++) m[h] = -INFINITY, l[h] = 0.0f;
        return;
    }
    for (int64_t s = s0; s < s1; s++) {
        const int ok = visible(pc[s], position, win);
        if (s + ATT_AHEAD < n) { /* rows of the cache only */
            prefetch_bytes(kc + (s + ATT_AHEAD) * row, row);
            prefetch_bytes(vc + (s + ATT_AHEAD) * row, row);
        }
        for (int64_t h = 0; h < Hq; h++) {
            if (!ok) {
                sc[h * n + s] = -INFINITY;
                continue;
            }
            const char *k = kc + s * row + (h / G) * hd * es;
            __m512 acc = _mm512_setzero_ps();
            for (int64_t c = 0; c < chunks; c++)
                acc = _mm512_fmadd_ps(load16(q + h * hd, hd, 16 * c), load_kv(k, kvt, hd, 16 * c),
                                      acc);
            sc[h * n + s] = _mm512_reduce_add_ps(acc) * scale;
        }
    }
    for (int64_t h = 0; h < Hq; h++) { /* e^(score - max) in place; lanes by s - s0 */
        float *r = sc + h * n;
        __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int64_t s = s0; s < s1; s += 16)
            mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY),
                                                        MASK(s1, s), r + s));
        m[h] = _mm512_reduce_max_ps(mx);
        const __m512 mv = _mm512_set1_ps(m[h]);
        for (int64_t s = s0; s < s1; s += 16) {
            __m512 e = exp_neg(_mm512_sub_ps(_mm512_mask_loadu_ps(mv, MASK(s1, s), r + s), mv));
            _mm512_mask_storeu_ps(r + s, MASK(s1, s), e);
            sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(MASK(s1, s), e));
        }
        l[h] = m[h] == -INFINITY ? 0.0f : _mm512_reduce_add_ps(sum);
    }
    for (int64_t h = 0; h < Hq; h++) { /* head by head: its accumulators in registers */
        __m512 acc[32];
        for (int64_t c = 0; c < chunks; c++) acc[c] = _mm512_setzero_ps();
        for (int64_t s = s0; s < s1; s++) {
            const char *v = vc + s * row + (h / G) * hd * es;
            const __m512 e = _mm512_set1_ps(sc[h * n + s]);
            for (int64_t c = 0; c < chunks; c++)
                acc[c] = _mm512_fmadd_ps(e, load_kv(v, kvt, hd, 16 * c), acc[c]);
        }
        for (int64_t c = 0; c < chunks; c++)
            _mm512_mask_storeu_ps(o + h * hd + 16 * c, MASK(hd, 16 * c), acc[c]);
    }
}

/* head_dim 64 and 128 (most models) with the chunk count known: the accumulators stay in
   registers; one loop per cache type */
T_F static void attend_chunk(const float *q, int64_t Hq, int64_t Hkv, const char *kc,
                             const char *vc, const int64_t *pc, int64_t hd, int64_t n,
                             int64_t s0, int64_t s1, int64_t position, int64_t win, float *sc,
                             float *part, int kvt) {
#define IMPL(HD, CH, T) \
    attend_chunk_impl(q, Hq, Hkv, kc, vc, pc, HD, n, s0, s1, position, win, sc, part, CH, T)
#define BY_TYPE(HD, CH)                                                                    \
    (kvt == KV_F16 ? IMPL(HD, CH, KV_F16) : kvt == KV_BF16 ? IMPL(HD, CH, KV_BF16) \
                                                           : IMPL(HD, CH, KV_F32))
    if (hd == 64)
        BY_TYPE(64, 4);
    else if (hd == 128)
        BY_TYPE(128, 8);
    else
        BY_TYPE(hd, (hd + 15) / 16);
#undef BY_TYPE
#undef IMPL
}

/* o (Hq hd): the chunks' parts merged in slot order. A chunk with no visible key (max -inf)
   weighs 0 and is skipped; each max is overwritten by its chunk's weight. */
T_F static void merge_chunks(float *parts, int64_t nch, int64_t Hq, int64_t hd, float *o) {
    const int64_t stride = att_part(Hq, hd);
    for (int64_t h = 0; h < Hq; h++) {
        float M = -INFINITY, L = 0.0f;
        for (int64_t c = 0; c < nch; c++) M = fmaxf(M, parts[c * stride + h]);
        for (int64_t c = 0; c < nch; c++) {
            float *w = parts + c * stride + h;
            *w = *w == -INFINITY ? 0.0f : _mm512_cvtss_f32(exp_neg(_mm512_set1_ps(*w - M)));
            L += *w * parts[c * stride + Hq + h];
        }
        const __m512 inv = _mm512_set1_ps(L > 0.0f ? 1.0f / L : 0.0f);
        for (int64_t i = 0; i < hd; i += 16) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t c = 0; c < nch; c++) {
                const float w = parts[c * stride + h];
                if (w != 0.0f)
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(w),
                                          load16(parts + c * stride + 2 * Hq + h * hd, hd, i), acc);
            }
            _mm512_mask_storeu_ps(o + h * hd + i, MASK(hd, i), _mm512_mul_ps(acc, inv));
        }
    }
}

/* o (Hq hd) for one query at `position` over the first n slots; sc: Hq n scores, parts:
   ceil(n / ATT_CHUNK) chunks' parts */
static void attend(const int64_t *d, const float *q, int64_t position, int64_t n, float *sc,
                   float *parts, float *o, int threads) {
    const int64_t Hq = d[F_heads], Hkv = d[F_kv_heads], hd = d[F_head_dim];
    const char *kc = PTR(d, k_cache, const char), *vc = PTR(d, v_cache, const char);
    const int64_t *pc = PTR(d, pos_cache, const int64_t);
    const int64_t nch = (n + ATT_CHUNK - 1) / ATT_CHUNK, stride = att_part(Hq, hd);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && nch >= 2)
    for (int64_t c = 0; c < nch; c++) {
        const int64_t s0 = c * ATT_CHUNK, s1 = s0 + ATT_CHUNK < n ? s0 + ATT_CHUNK : n;
        attend_chunk(q, Hq, Hkv, kc, vc, pc, hd, n, s0, s1, position, d[F_window], sc,
                     parts + c * stride, (int)d[F_kv_dtype]);
    }
    merge_chunks(parts, nch, Hq, hd, o);
}

/* o (S, Hq hd) for S queries at position .. position + S - 1 over the first n slots; sc: the
   scores and parts of attend, Hq cap + att_parts(cap) floats. With threads and enough tokens
   (a prompt's), the queries go round the threads, each query on one thread over its own share
   of sc: one fork for all S rather than one per query, and short prompts (one chunk) in
   parallel too. A query's bits do not depend on its thread (attend's chunks are fixed). */
static void attend_tokens(const int64_t *d, const float *qkv, int64_t nq, int64_t position,
                          int64_t S, int64_t n, float *sc, float *o, int threads) {
    const int64_t Hq = d[F_heads], hd = d[F_head_dim], cap = d[F_cap];
    const int64_t need = Hq * n + att_parts(Hq, hd, n), have = Hq * cap + att_parts(Hq, hd, cap);
#ifdef _OPENMP
    if (threads > 1 && S >= PARALLEL_MIN && threads * need <= have) {
#pragma omp parallel for schedule(static, 1) num_threads(threads)
        for (int64_t t = 0; t < S; t++) {
            float *mine = sc + omp_get_thread_num() * need;
            attend(d, qkv + t * nq, position + t, n, mine, mine + Hq * n, o + t * Hq * hd, 1);
        }
        return;
    }
#endif
    for (int64_t t = 0; t < S; t++)
        attend(d, qkv + t * nq, position + t, n, sc, sc + Hq * cap, o + t * Hq * hd, threads);
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
    char *work = (char *)(((uintptr_t)(sc + Hq * cap + att_parts(Hq, hd, cap)) + 63) & ~(uintptr_t)63);
    int rc = 0;
    const int par = threads > 1 && S >= PARALLEL_MIN; /* a prompt's tokens: each on any thread */
#pragma omp parallel for schedule(static) num_threads(threads) if (par)
    for (int64_t t = 0; t < S; t++) rms_norm(h + t * D, PTR(d, attention_norm, const float), D, eps, xn + t * D);
    rc |= PRODUCT(d, qkv, xn, qkv, S, nq, D, threads, work);
    const float *bias = PTR(d, qkv_bias, const float);
    char *kc = PTR(d, k_cache, char), *vc = PTR(d, v_cache, char);
    const int kvt = (int)d[F_kv_dtype];
    /* slots of distinct tokens differ while S <= cap: the writes are then any thread's */
#pragma omp parallel for schedule(static) num_threads(threads) if (par && S <= cap)
    for (int64_t t = 0; t < S; t++) {
        float *q = qkv + t * nq, *k = q + Hq * hd, *v = k + Hkv * hd;
        if (bias)
            for (int64_t i = 0; i < nq; i++) q[i] += bias[i];
        rope(q, Hq, hd, c + t * half, s + t * half, (int)d[F_rope_half]);
        rope(k, Hkv, hd, c + t * half, s + t * half, (int)d[F_rope_half]);
        const int64_t slot = (position + t) % cap;
        for (int64_t i = 0; i < Hkv * hd; i++)
            store_kv(kc, kvt, slot * Hkv * hd + i, k[i]), store_kv(vc, kvt, slot * Hkv * hd + i, v[i]);
        PTR(d, pos_cache, int64_t)[slot] = position + t;
    }
    attend_tokens(d, qkv, nq, position, S, n, sc, o, threads);
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

