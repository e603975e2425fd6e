/* Batch-1 products of the CPU decode step: y[l, n] = sum_k W[l, n, k] x[l, k], fp32 results.

   One weight row at a time, front to back (several accumulators, so the loop is bound by
   memory, not by add latency): rows of a few hundred bytes read as 4 interleaved streams defeat
   the hardware prefetcher, sequential rows do not. Each format needs AVX-512, checked at run
   time (el_features); the compiled Python path runs where a kernel is missing.

     float32   AVX-512F FMA.
     float16   F16C conversion, then FMA.
     bfloat16  AVX512_BF16 dot products (vdpbf16ps). x is split as x_hi + x_lo, two bf16 parts
               (x_hi = bf16(x), x_lo = bf16(x - x_hi)): 16 significant bits, products and sums
               in fp32, so the result is the fp32 product to ~1e-5 relative.
     int8      AVX512_VNNI (vpdpbusd, u8 x s8 -> s32). x is quantized to 16-bit fixed point
               per vector, q = round(x / sx), |q| <= 32767, written as two bytes q = 256 a + b:
               a + 128 and b are unsigned. Then sum w q = 256 (sum w (a+128) - 128 sum w)
               + sum w b, exactly in integers; y = sx * scale[n] * that. The row sums of w
               come precomputed. Error: 1/65534 of max|x| per element, far below the weights'
               int8 rounding.
     q8_0      GGUF's blocks of 32 int8 with an f16 scale each, stored planar (values, then
               scales): as int8, per block (the 128 sum w correction from a third vpdpbusd),
               each block's integer dot scaled by its d in fp32.
     q4_1      GGUF's blocks of 32 nibbles, w = d q + m, planar (nibbles in GGUF's in-block
               order, d, m): the nibbles are the unsigned operand and x's two bytes signed
               (q = 256 a + b, |a|, |b| <= 128), so sum_b d_b sum q x + sum_b m_b sum x; the
               block sums of x are exact fp32.
   Rows are split over `threads` OpenMP threads (the OpenMP runtime torch loaded). */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define T_F __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define T_BF __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define T_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c")))

int el_features(void) {
    static int f = -1;
    if (f >= 0) return f;
    __builtin_cpu_init();
    int g = 0;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        g |= HAS_AVX512;
    if ((g & HAS_AVX512) && __builtin_cpu_supports("avx512bf16")) g |= HAS_BF16;
    if ((g & HAS_AVX512) && __builtin_cpu_supports("avx512vnni")) g |= HAS_VNNI;
    return f = g;
}

#define MASK16(n) ((__mmask16)((1u << (n)) - 1))

/* ---- float32 and float16: (convert and) FMA, 64 values per step, 4 accumulators ----------- */
T_F static inline __m512 ld_f32(const void *w, int64_t k) {
    return _mm512_loadu_ps((const float *)w + k);
}
T_F static inline __m512 ldm_f32(const void *w, int64_t k, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, (const float *)w + k);
}
T_F static inline __m512 ld_f16(const void *w, int64_t k) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k)));
}
T_F static inline __m512 ldm_f16(const void *w, int64_t k, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w + k));
}

#define DEF_FMA_ROW(NAME, LD, LDM)                                                          \
    T_F static float NAME(const void *w, const float *x, int64_t K) {                       \
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                         \
        int64_t k = 0;                                                                      \
        for (; k + 64 <= K; k += 64) {                                                      \
            a0 = _mm512_fmadd_ps(LD(w, k), _mm512_loadu_ps(x + k), a0);                     \
            a1 = _mm512_fmadd_ps(LD(w, k + 16), _mm512_loadu_ps(x + k + 16), a1);           \
            a2 = _mm512_fmadd_ps(LD(w, k + 32), _mm512_loadu_ps(x + k + 32), a2);           \
            a3 = _mm512_fmadd_ps(LD(w, k + 48), _mm512_loadu_ps(x + k + 48), a3);           \
        }                                                                                   \
        for (; k + 16 <= K; k += 16) a0 = _mm512_fmadd_ps(LD(w, k), _mm512_loadu_ps(x + k), a0); \
        if (k < K) {                                                                        \
            __mmask16 m = MASK16(K - k);                                                    \
            a1 = _mm512_fmadd_ps(LDM(w, k, m), _mm512_maskz_loadu_ps(m, x + k), a1);        \
        }                                                                                   \
        return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3))); \
    }
DEF_FMA_ROW(row_f32, ld_f32, ldm_f32)
DEF_FMA_ROW(row_f16, ld_f16, ldm_f16)

/* ---- bfloat16: vdpbf16ps on (x_hi, x_lo), 64 values per step ------------------------------ */
T_BF static void split_bf16(const float *x, int64_t K, int64_t Kp, uint16_t *hi, uint16_t *lo) {
    for (int64_t k = 0; k < Kp; k += 16) {
        __mmask16 m = K - k >= 16 ? (__mmask16)0xFFFF : K > k ? MASK16(K - k) : 0;
        __m512 v = _mm512_maskz_loadu_ps(m, x + k);
        __m256bh h = _mm512_cvtneps_pbh(v); /* round to nearest even */
        __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
        __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, hf)); /* v - hf is exact */
        _mm256_storeu_si256((__m256i *)(hi + k), (__m256i)h);
        _mm256_storeu_si256((__m256i *)(lo + k), (__m256i)l);
    }
}

#define BF(p) ((__m512bh)_mm512_loadu_si512(p))
T_BF static float row_bf16(const uint16_t *w, const uint16_t *xh, const uint16_t *xl, int64_t K) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        __m512bh w0 = BF(w + k), w1 = BF(w + k + 32);
        a0 = _mm512_dpbf16_ps(a0, w0, BF(xh + k));
        b0 = _mm512_dpbf16_ps(b0, w0, BF(xl + k));
        a1 = _mm512_dpbf16_ps(a1, w1, BF(xh + k + 32));
        b1 = _mm512_dpbf16_ps(b1, w1, BF(xl + k + 32));
    }
    for (; k < K; k += 32) { /* x parts are zero-padded to a multiple of 64 */
        __m512bh w0 = K - k >= 32 ? BF(w + k)
                                  : (__m512bh)_mm512_maskz_loadu_epi16((1u << (K - k)) - 1, w + k);
        a0 = _mm512_dpbf16_ps(a0, w0, BF(xh + k));
        b0 = _mm512_dpbf16_ps(b0, w0, BF(xl + k));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(b0, b1)));
}

/* ---- int8: vpdpbusd on the two bytes of 16-bit fixed-point x, 128 values per step --------- */
T_VNNI static float split_i16(const float *x, int64_t K, int64_t Kp, uint8_t *hi, uint8_t *lo) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __mmask16 m = K - k >= 16 ? (__mmask16)0xFFFF : MASK16(K - k);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(m, x + k)));
    }
    float a = _mm512_reduce_max_ps(amax);
    float sx = a > 0.0f ? a / 32767.0f : 1.0f;
    __m512 inv = _mm512_set1_ps(1.0f / sx);
    __m512i lim = _mm512_set1_epi32(32767), neg = _mm512_set1_epi32(-32767);
    for (int64_t k = 0; k < Kp; k += 16) {
        __mmask16 m = K - k >= 16 ? (__mmask16)0xFFFF : K > k ? MASK16(K - k) : 0;
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + k), inv));
        q = _mm512_max_epi32(_mm512_min_epi32(q, lim), neg);
        __m512i hb = _mm512_add_epi32(_mm512_srai_epi32(q, 8), _mm512_set1_epi32(128));
        __m512i lb = _mm512_and_si512(q, _mm512_set1_epi32(255)); /* q - 256 floor(q / 256) */
        _mm_storeu_si128((__m128i *)(hi + k), _mm512_cvtepi32_epi8(hb));
        _mm_storeu_si128((__m128i *)(lo + k), _mm512_cvtepi32_epi8(lb));
    }
    return sx;
}

/* sum_k w (a + 128) and sum_k w b for one row; the next rows are prefetched (short int8 rows) */
T_VNNI static void row_i8(const int8_t *w, const uint8_t *xh, const uint8_t *xl, int64_t K,
                          int64_t *dh, int64_t *dl) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, b0 = a0, b1 = a0;
    int64_t k = 0;
    for (; k + 128 <= K; k += 128) {
        _mm_prefetch((const char *)(w + k) + 1024, _MM_HINT_T0);
        _mm_prefetch((const char *)(w + k) + 1088, _MM_HINT_T0);
        __m512i w0 = _mm512_loadu_si512(w + k), w1 = _mm512_loadu_si512(w + k + 64);
        a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(xh + k), w0);
        b0 = _mm512_dpbusd_epi32(b0, _mm512_loadu_si512(xl + k), w0);
        a1 = _mm512_dpbusd_epi32(a1, _mm512_loadu_si512(xh + k + 64), w1);
        b1 = _mm512_dpbusd_epi32(b1, _mm512_loadu_si512(xl + k + 64), w1);
    }
    for (; k < K; k += 64) { /* x parts are padded to a multiple of 64 */
        __m512i w0 = K - k >= 64 ? _mm512_loadu_si512(w + k)
                                 : _mm512_maskz_loadu_epi8(((__mmask64)1 << (K - k)) - 1, w + k);
        a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(xh + k), w0);
        b0 = _mm512_dpbusd_epi32(b0, _mm512_loadu_si512(xl + k), w0);
    }
    *dh = _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a1));
    *dl = _mm512_reduce_add_epi32(_mm512_add_epi32(b0, b1));
}

/* ---- q8_0: int8 blocks of 32 with an f16 scale, planar -------------------------------------- */
/* (masked byte and word loads are slow on some cores: only the last partial step uses them) */
T_VNNI static inline __m512 q8_0_step(__m512i wv, __m128i d2, const uint8_t *xh,
                                      const uint8_t *xl) {
    const __m512i c128 = _mm512_set1_epi8((char)128), z = _mm512_setzero_si512();
    const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512i hi = _mm512_sub_epi32(_mm512_dpbusd_epi32(z, _mm512_loadu_si512(xh), wv),
                                  _mm512_dpbusd_epi32(z, c128, wv)); /* sum w a */
    __m512i t = _mm512_add_epi32(_mm512_slli_epi32(hi, 8),
                                 _mm512_dpbusd_epi32(z, _mm512_loadu_si512(xl), wv));
    __m512 dv = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(_mm_cvtph_ps(d2)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(t), dv);
}

T_VNNI static float row_q8_0(const int8_t *w, const uint16_t *d, const uint8_t *xh,
                             const uint8_t *xl, int64_t K) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
    int64_t k = 0;
    for (; k + 128 <= K; k += 128) {
        int64_t dd;
        memcpy(&dd, d + k / 32, 8);
        __m128i d4 = _mm_cvtsi64_si128(dd);
        acc0 = _mm512_add_ps(acc0, q8_0_step(_mm512_loadu_si512(w + k), d4, xh + k, xl + k));
        acc1 = _mm512_add_ps(acc1, q8_0_step(_mm512_loadu_si512(w + k + 64),
                                             _mm_srli_si128(d4, 4), xh + k + 64, xl + k + 64));
    }
    for (; k < K; k += 64) { /* K is a multiple of 32; x parts are padded */
        int two = K - k >= 64;
        int32_t d2;
        memcpy(&d2, d + k / 32, two ? 4 : 2);
        if (!two) d2 &= 0xFFFF;
        __m512i wv = two ? _mm512_loadu_si512(w + k) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, w + k);
        acc0 = _mm512_add_ps(acc0, q8_0_step(wv, _mm_cvtsi32_si128(d2), xh + k, xl + k));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

/* ---- q4_1: nibble blocks of 32, w = d q + m, planar ---------------------------------------- */
/* x as signed 16-bit fixed point q = 256 a + b, |q| <= 32639 so that a, b fit in int8, arranged
   per group of 4 blocks like the nibbles: [blocks' values 0-15 | values 16-31]; and the fp32 sum
   of x over each block. */
T_VNNI static float split_q4(const float *x, int64_t K, int64_t Kp, int8_t *a_lo, int8_t *a_hi,
                             int8_t *b_lo, int8_t *b_hi, float *xs) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        __mmask16 m = K - k >= 16 ? (__mmask16)0xFFFF : MASK16(K - k);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(m, x + k)));
    }
    float a = _mm512_reduce_max_ps(amax);
    float sx = a > 0.0f ? a / 32639.0f : 1.0f, inv = 1.0f / sx;
    for (int64_t k = 0; k < Kp; k++) {
        int32_t q = k < K ? (int32_t)lrintf(x[k] * inv) : 0;
        q = q > 32639 ? 32639 : q < -32639 ? -32639 : q;
        int32_t ah = (q + 128) >> 8, bl = q - 256 * ah;
        int64_t blk = k / 32, j = k % 32, at = (blk / 4) * 64 + (blk % 4) * 16 + (j % 16);
        if (j < 16) a_lo[at] = (int8_t)ah, b_lo[at] = (int8_t)bl;
        else a_hi[at] = (int8_t)ah, b_hi[at] = (int8_t)bl;
    }
    for (int64_t b = 0; b * 32 < K; b++) {
        float s = 0.0f;
        for (int64_t j = 0; j < 32 && b * 32 + j < K; j++) s += x[b * 32 + j];
        xs[b] = s;
    }
    return sx;
}

T_VNNI static inline __m512 q4_1_step(__m512i v, __m128i d4, const int8_t *al,
                                      const int8_t *ah, const int8_t *bl, const int8_t *bh) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), z = _mm512_setzero_si512();
    const __m512i pick = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    __m512i A = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo, _mm512_loadu_si512(al)), hi,
                                    _mm512_loadu_si512(ah));
    __m512i B = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo, _mm512_loadu_si512(bl)), hi,
                                    _mm512_loadu_si512(bh));
    __m512i t = _mm512_add_epi32(_mm512_slli_epi32(A, 8), B);
    __m512 dv = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(_mm_cvtph_ps(d4)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(t), dv);
}

T_VNNI static void row_q4_1(const uint8_t *q, const uint16_t *d, const uint16_t *mn,
                            const int8_t *a_lo, const int8_t *a_hi, const int8_t *b_lo,
                            const int8_t *b_hi, const float *xs, int64_t K, float *dot,
                            float *mdot) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0, macc = acc0;
    const int64_t nb = K / 32;
    int64_t g = 0; /* groups of 4 blocks: 64 bytes of nibbles, 4 scales */
    for (; (g + 2) * 4 <= nb; g += 2) {
        int64_t dd[2];
        memcpy(dd, d + g * 4, 16);
        acc0 = _mm512_add_ps(acc0, q4_1_step(_mm512_loadu_si512(q + g * 64), _mm_cvtsi64_si128(dd[0]),
                                             a_lo + g * 64, a_hi + g * 64, b_lo + g * 64, b_hi + g * 64));
        acc1 = _mm512_add_ps(acc1, q4_1_step(_mm512_loadu_si512(q + g * 64 + 64),
                                             _mm_cvtsi64_si128(dd[1]), a_lo + g * 64 + 64,
                                             a_hi + g * 64 + 64, b_lo + g * 64 + 64, b_hi + g * 64 + 64));
    }
    for (; g * 4 < nb; g++) { /* the last 1-4 blocks: masked */
        int64_t left = nb - g * 4 >= 4 ? 4 : nb - g * 4;
        __mmask64 m = left == 4 ? ~(__mmask64)0 : (((__mmask64)1 << (16 * left)) - 1);
        int64_t dd = 0;
        memcpy(&dd, d + g * 4, (size_t)(2 * left));
        acc0 = _mm512_add_ps(acc0, q4_1_step(_mm512_maskz_loadu_epi8(m, q + g * 64), _mm_cvtsi64_si128(dd),
                                             a_lo + g * 64, a_hi + g * 64, b_lo + g * 64, b_hi + g * 64));
    }
    int64_t b = 0;
    for (; b + 16 <= nb; b += 16)
        macc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + b))),
                               _mm512_loadu_ps(xs + b), macc);
    float m = _mm512_reduce_add_ps(macc);
    for (; b < nb; b++) m += _cvtsh_ss(mn[b]) * xs[b];
    *dot = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    *mdot = m;
}

/* ---- the product ------------------------------------------------------------------------------ */
static int64_t padded(int64_t K) { return (K + 127) / 128 * 128; }

/* bytes per row: fp32 4K, bf16/fp16 2K, int8/q8_0 K, q4_1 K / 2 */
int64_t el_row_bytes(int fmt, int64_t K) {
    return fmt == FMT_F32 ? 4 * K : fmt == FMT_Q4_1 ? K / 2 : fmt >= FMT_I8 ? K : 2 * K;
}

int el_supports(int fmt) {
    int need = fmt == FMT_BF16 ? HAS_BF16 : fmt >= FMT_I8 ? HAS_VNNI : HAS_AVX512;
    return fmt >= FMT_F32 && fmt <= FMT_Q4_1 && (el_features() & need) == need;
}

int64_t el_matvec_scratch(int64_t L, int64_t K) {
    /* x parts (4 bytes a value at most), block sums of x, the scales of x */
    return (4 * L * padded(K) + 4 * L * (padded(K) / 32) + 4 * L + 127) / 64 * 64;
}

int el_split_x(int fmt, const float *x, int64_t V, int64_t K, void *work, xparts_t *p) {
    const int64_t Kp = padded(K);
    p->Kp = Kp;
    p->a = p->b = NULL, p->xs = p->sx = NULL;
    if (fmt == FMT_F32 || fmt == FMT_F16) return 0; /* x is read as it is */
    p->a = (char *)work; /* per vector 2 Kp bytes (q4_1: a_lo, a_hi), then 2 Kp more */
    p->b = p->a + V * Kp * 2;
    p->xs = (float *)(p->b + V * Kp * 2);
    p->sx = p->xs + V * (Kp / 32);
    for (int64_t v = 0; v < V; v++) {
        const float *xv = x + v * K;
        char *pa = p->a + v * Kp * 2, *pb = p->b + v * Kp * 2;
        if (fmt == FMT_BF16)
            split_bf16(xv, K, Kp, (uint16_t *)pa, (uint16_t *)pb);
        else if (fmt == FMT_Q4_1)
            p->sx[v] = split_q4(xv, K, Kp, (int8_t *)pa, (int8_t *)pa + Kp / 2, (int8_t *)pb,
                                (int8_t *)pb + Kp / 2, p->xs + v * (Kp / 32));
        else
            p->sx[v] = split_i16(xv, K, Kp, (uint8_t *)pa, (uint8_t *)pb);
    }
    return 0;
}

int el_matvec(const qmat_t *w, const float *x, float *y, int64_t L, int64_t N, int64_t K,
              int threads, void *work) {
    const int fmt = (int)w->fmt;
    if (!el_supports(fmt)) return -1;
    const int64_t Kp = padded(K), rb = el_row_bytes(fmt, K);
    void *own = NULL;
    if (fmt != FMT_F32 && fmt != FMT_F16 && !work) {
        work = own = aligned_alloc(64, (size_t)el_matvec_scratch(L, K));
        if (!work) return -3;
    }
    xparts_t parts;
    el_split_x(fmt, x, L, K, work, &parts);
    char *xa = parts.a, *xb = parts.b;
    float *sx = parts.sx, *xs = parts.xs;
    const int64_t rows = L * N;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t l = r / N;
        const char *wr = (const char *)w->data + r * rb;
        const char *pa = xa + l * Kp * 2, *pb = xb + l * Kp * 2;
        if (fmt == FMT_F32) {
            y[r] = row_f32(wr, x + l * K, K);
        } else if (fmt == FMT_F16) {
            y[r] = row_f16(wr, x + l * K, K);
        } else if (fmt == FMT_BF16) {
            y[r] = row_bf16((const uint16_t *)wr, (const uint16_t *)pa, (const uint16_t *)pb, K);
        } else if (fmt == FMT_I8) {
            int64_t dh, dl;
            row_i8((const int8_t *)wr, (const uint8_t *)pa, (const uint8_t *)pb, K, &dh, &dl);
            double v = 256.0 * (double)(dh - 128 * (int64_t)((const int32_t *)w->rowsum)[r]) + dl;
            y[r] = (float)((double)sx[l] * (double)((const float *)w->scale)[r] * v);
        } else if (fmt == FMT_Q8_0) {
            const uint16_t *d = (const uint16_t *)w->scale + r * (K / 32);
            y[r] = sx[l] * row_q8_0((const int8_t *)wr, d, (const uint8_t *)pa, (const uint8_t *)pb, K);
        } else {
            const uint16_t *d = (const uint16_t *)w->scale + r * (K / 32);
            const uint16_t *mn = (const uint16_t *)w->mins + r * (K / 32);
            float dot, mdot;
            row_q4_1((const uint8_t *)wr, d, mn, (const int8_t *)pa, (const int8_t *)pa + Kp / 2,
                     (const int8_t *)pb, (const int8_t *)pb + Kp / 2, xs + l * (Kp / 32), K, &dot,
                     &mdot);
            y[r] = sx[l] * dot + mdot;
        }
    }
    free(own);
    return 0;
}
#else
int el_features(void) { return 0; }
int el_supports(int fmt) { (void)fmt; return 0; }
int64_t el_matvec_scratch(int64_t L, int64_t K) { (void)L, (void)K; return 0; }
int el_matvec(const qmat_t *w, const float *x, float *y, int64_t L, int64_t N, int64_t K,
              int threads, void *work) {
    (void)w, (void)x, (void)y, (void)L, (void)N, (void)K, (void)threads, (void)work;
    return -1;
}
#endif
