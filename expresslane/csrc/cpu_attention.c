/* A layer's attention over its KV cache, for S queries: flash-decoding in chunks of ATT_CHUNK
   slots merged in slot order (below, and the reasons), over an fp32 cache or one of 16 bits a
   value (--kv-cache-dtype: fp16 or bf16, widened as they are loaded, rounded as torch rounds as
   they are written). cpu_layer.c's layer calls it between its Q/K/V and output products. */

#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_attention.h"
#include "cpu_kernels.h"
#include "simd.h"

#define ATT_CHUNK 64 /* slots of one attention task */

/* partial floats of one chunk: per query head its max, its sum, then Hq * hd outputs */
static int64_t att_part(int64_t Hq, int64_t hd) { return Hq * (hd + 2); }

static int64_t att_parts(int64_t Hq, int64_t hd, int64_t slots) {
    return ((slots + ATT_CHUNK - 1) / ATT_CHUNK) * att_part(Hq, hd);
}

int64_t el_attend_scratch(int64_t Hq, int64_t hd, int64_t slots) {
    return Hq * slots + att_parts(Hq, hd, slots);
}

#ifdef EL_X86
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

/* one slot's keys and values (Hkv hd each) written, rounded to the cache's type */
T_F void el_kv_write(const el_kv_t *kv, int64_t slot, int64_t position, const float *k,
                 const float *v) {
    const int64_t row = kv->Hkv * kv->hd;
    for (int64_t i = 0; i < row; i++)
        store_kv(kv->k, kv->kvt, slot * row + i, k[i]), store_kv(kv->v, kv->kvt, slot * row + i, v[i]);
    kv->pos[slot] = position;
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
static void attend(const el_kv_t *kv, const float *q, int64_t position, int64_t n, float *sc,
                   float *parts, float *o, int threads) {
    const int64_t Hq = kv->Hq, hd = kv->hd;
    const int64_t nch = (n + ATT_CHUNK - 1) / ATT_CHUNK, stride = att_part(Hq, hd);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && nch >= 2)
    for (int64_t c = 0; c < nch; c++) {
        const int64_t s0 = c * ATT_CHUNK, s1 = s0 + ATT_CHUNK < n ? s0 + ATT_CHUNK : n;
        attend_chunk(q, Hq, kv->Hkv, kv->k, kv->v, kv->pos, hd, n, s0, s1, position, kv->window,
                     sc, parts + c * stride, kv->kvt);
    }
    merge_chunks(parts, nch, Hq, hd, o);
}

/* o (S, Hq hd) for S queries at position .. position + S - 1 over the first n slots; sc: the
   scores and parts of attend, Hq cap + att_parts(cap) floats. With threads and enough tokens
   (a prompt's), the queries go round the threads, each query on one thread over its own share
   of sc: one fork for all S rather than one per query, and short prompts (one chunk) in
   parallel too. A query's bits do not depend on its thread (attend's chunks are fixed). */
void el_attend_tokens(const el_kv_t *kv, const float *qkv, int64_t nq, int64_t position,
                      int64_t S, int64_t n, float *sc, float *o, int threads) {
    const int64_t Hq = kv->Hq, hd = kv->hd, cap = kv->cap;
    const int64_t need = Hq * n + att_parts(Hq, hd, n), have = Hq * cap + att_parts(Hq, hd, cap);
#ifdef _OPENMP
    if (threads > 1 && S >= PARALLEL_MIN && threads * need <= have) {
#pragma omp parallel for schedule(static, 1) num_threads(threads)
        for (int64_t t = 0; t < S; t++) {
            float *mine = sc + omp_get_thread_num() * need;
            attend(kv, qkv + t * nq, position + t, n, mine, mine + Hq * n, o + t * Hq * hd, 1);
        }
        return;
    }
#endif
    for (int64_t t = 0; t < S; t++)
        attend(kv, qkv + t * nq, position + t, n, sc, sc + Hq * cap, o + t * Hq * hd, threads);
}
#endif
