/* The activations of a product in the form its kernels read, and what this CPU can run.

     float32, float16  x as it is (F16C converts the weights).
     bfloat16          x = x_hi + x_lo, two bf16 parts (x_hi = bf16(x), x_lo = bf16(x - x_hi)):
                       16 significant bits, so vdpbf16ps gives the fp32 product to ~1e-5.
     int8, q8_0        x in 16-bit fixed point per vector, q = round(x / sx), |q| <= 32767,
                       as two bytes q = 256 a + b with a + 128 and b unsigned (vpdpbusd's
                       unsigned operand; the weights are the signed one).
     nibble formats    x in signed 16-bit fixed point q = 256 a + b, |q| <= 32639 so that
                       |a|, |b| <= 128 fit in int8 (the nibbles are the unsigned operand),
                       arranged per group of four 32-value blocks like the nibbles; and the
                       sums of the rounded x per block and per half block (the blocks'
                       offsets).
     lowp (opt-in)     bfloat16: x_hi alone (x's bf16 round). q8_0 and nibble formats: one
                       byte a value (half the dot products) with a scale per 32-value block,
                       as llama.cpp's q8_0 activations (one scale per vector lost ~4x the
                       precision to the outliers of real activations): q = round(x / sx_b),
                       |q| <= 127, sx_b = max |x| over the block / 127; q8_0 as the byte
                       q + 128, the nibble formats q itself arranged as above, with the sums
                       of the rounded x (split_nibble8). In place of the `b` parts, per chunk
                       the blocks' scales as 16 lanes (each block's where its products land).

   For S tokens the parts of a block of tokens are then interleaved chunk by chunk
   (el_pack_block), the same bytes in another order; in the AVX2 build, the formats X16 names
   (cpu_kernels.h: the grids', Q8_0) as q = 256 a + b itself, 16 bits a value. */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "simd.h"

static int64_t padded(int64_t K) { return (K + 127) / 128 * 128; }

/* bytes of a row's data: fp32 4K, bf16/fp16 2K, int8/q8_0 K, nibble formats K / 2, crumbs K / 4,
   q1_0 K / 8 */
int64_t el_row_bytes(int fmt, int64_t K) {
    return fmt == FMT_F32    ? 4 * K
           : IS_BITS(fmt)   ? K / 8
           : IS_CRUMB(fmt)  ? K / 4
           : IS_NIBBLE(fmt) ? K / 2
           : fmt >= FMT_I8  ? K
                            : 2 * K;
}

int64_t el_split_scratch(int64_t V, int64_t K) {
    /* x parts (4 bytes a value at most), block and half-block sums of x, the scales of x */
    return (4 * V * padded(K) + 4 * V * (padded(K) / 32 + padded(K) / 16) + 4 * V + 127) / 64 * 64;
}

/* chunk: one token's parts side by side for one step of a kernel */
int64_t el_chunk_bytes(int fmt, int lowp) { /* lowp: the bytes of x, then 16 lanes of scales */
    return fmt == FMT_F32 || fmt == FMT_F16 ? 64 : IS_NIBBLE(fmt) ? (lowp ? 192 : 256) : 128;
}
int64_t el_chunks(int fmt, int64_t K, int64_t Kp) { /* per token */
    return fmt == FMT_F32 || fmt == FMT_F16 ? (K + 15) / 16 : fmt == FMT_BF16 ? Kp / 32
           : IS_NIBBLE(fmt)                 ? Kp / 128
                                            : Kp / 64;
}

/* 64 values of a chunk (a nibble group's lo or hi; Q8_0's 64) as X16 takes them, q = 256 a + b
   (Q8_0: a stored plus 128, b unsigned; the nibbles' both signed), per 32 of them the even ones,
   then the odd */
static void pack_x16(const char *a, const char *b, int q8, int16_t *o) {
    for (int j = 0; j < 64; j++) {
        const int hi = q8 ? (uint8_t)a[j] - 128 : (int8_t)a[j];
        const int lo = q8 ? (uint8_t)b[j] : (int8_t)b[j];
        o[(j & ~31) + (j & 1) * 16 + (j & 31) / 2] = (int16_t)(256 * hi + lo);
    }
}

void el_pack_block(int fmt, const xparts_t *P, const float *x, int64_t K, const int64_t *v, int T,
                   char *dst) {
    const int64_t Kp = P->Kp, n = el_chunks(fmt, K, Kp), cb = el_chunk_bytes(fmt, P->lowp);
    for (int64_t c = 0; c < n; c++)
        for (int t = 0; t < T; t++) {
            char *o = dst + (c * T + t) * cb;
            if (fmt == FMT_F32 || fmt == FMT_F16) { /* 16 floats, zeros past K */
                const int64_t m = K - c * 16 < 16 ? K - c * 16 : 16;
                memcpy(o, x + v[t] * K + c * 16, (size_t)m * 4);
                memset(o + m * 4, 0, (size_t)(16 - m) * 4);
            } else if (IS_NIBBLE(fmt)) { /* group c: a_lo, a_hi, b_lo, b_hi, 64 bytes each */
                const char *a = P->a + v[t] * Kp * 2, *b = P->b + v[t] * Kp * 2;
                if (X16(fmt) && !P->lowp) {
                    pack_x16(a + c * 64, b + c * 64, 0, (int16_t *)o);
                    pack_x16(a + Kp / 2 + c * 64, b + Kp / 2 + c * 64, 0, (int16_t *)(o + 128));
                    continue;
                }
                memcpy(o, a + c * 64, 64);
                memcpy(o + 64, a + Kp / 2 + c * 64, 64);
                memcpy(o + 128, b + c * 64, 64); /* lowp: the group's 16 lanes of scales */
                if (P->lowp) continue;
                memcpy(o + 192, b + Kp / 2 + c * 64, 64);
            } else if (fmt == FMT_BF16) { /* two planes: every hi chunk, then every lo chunk */
                o = dst + (c * T + t) * 64;
                memcpy(o, P->a + v[t] * Kp * 2 + c * 64, 64);
                if (!P->lowp) memcpy(o + n * T * 64, P->b + v[t] * Kp * 2 + c * 64, 64);
            } else if (X16(fmt) && !P->lowp) { /* Q8_0: q itself */
                pack_x16(P->a + v[t] * Kp * 2 + c * 64, P->b + v[t] * Kp * 2 + c * 64, 1,
                         (int16_t *)o);
            } else { /* 64 bytes of the hi part, then of the lo part (lowp: the scales) */
                memcpy(o, P->a + v[t] * Kp * 2 + c * 64, 64);
                memcpy(o + 64, P->b + v[t] * Kp * 2 + c * 64, 64);
            }
        }
}

#ifdef EL_X86
int el_features(void) {
    static int f = -1;
    if (f >= 0) return f;
    __builtin_cpu_init();
    int g = 0;
#ifdef EL_AVX2 /* every kernel on AVX2's halves (simd_avx2.h): the bits name the formats' sets */
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2"))
        g = HAS_AVX512 | HAS_BF16 | HAS_VNNI;
    return f = g;
#endif
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        g |= HAS_AVX512;
    if ((g & HAS_AVX512) && __builtin_cpu_supports("avx512bf16")) g |= HAS_BF16;
    if ((g & HAS_AVX512) && __builtin_cpu_supports("avx512vnni")) g |= HAS_VNNI;
    const char *amx = getenv("EXPRESSLANE_AMX");
    const int emulate = amx && !strcmp(amx, "emulate"), off = amx && !strcmp(amx, "0");
    if ((g & HAS_BF16) && (emulate ? el_amx_emulate() : !off && el_amx_usable())) g |= HAS_AMX;
    return f = g;
}

/* round(v inv) to nearest even (as lrintf), clamped to [-top, top] */
T_F INLINE __m512i round_clamp(__m512 v, __m512 inv, int32_t top) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv));
    return _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(top)), _mm512_set1_epi32(-top));
}

T_BF static void split_bf16(const float *x, int64_t K, int64_t Kp, uint16_t *hi, uint16_t *lo) {
    for (int64_t k = 0; k < Kp; k += 16) {
        __mmask16 m = MASK_PAD(K, k);
        __m512 v = _mm512_maskz_loadu_ps(m, x + k);
        __m256bh h = _mm512_cvtneps_pbh(v); /* round to nearest even */
        __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
        __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, hf)); /* v - hf is exact */
        _mm256_storeu_si256((__m256i *)(hi + k), (__m256i)h);
        _mm256_storeu_si256((__m256i *)(lo + k), (__m256i)l);
    }
}

/* the 32 values of x from k in 8 bits with their block's scale (lowp's form): q to q[0..1]
   (two vectors of 16), the scale returned (1 for a block of zeros) */
T_VNNI INLINE float block8(const float *x, int64_t K, int64_t k, __m512i *q) {
    const __m512 v0 = _mm512_maskz_loadu_ps(MASK_PAD(K, k), x + k);
    const __m512 v1 = _mm512_maskz_loadu_ps(MASK_PAD(K, k + 16), x + k + 16);
    const float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float sx = a > 0.0f ? a / 127.0f : 1.0f;
    const __m512 inv = _mm512_set1_ps(1.0f / sx);
    q[0] = round_clamp(v0, inv, 127), q[1] = round_clamp(v1, inv, 127);
    return sx;
}

/* lowp (q8_0): hi = q + 128 per block, and per 64 values the 16 lanes of their two blocks'
   scales (8 each) to sv */
T_VNNI static void split_q8(const float *x, int64_t K, int64_t Kp, uint8_t *hi, float *sv) {
    for (int64_t k = 0; k < Kp; k += 32) {
        __m512i q[2];
        const float sx = block8(x, K, k, q);
        for (int h = 0; h < 2; h++)
            _mm_storeu_si128((__m128i *)(hi + k + 16 * h),
                             _mm512_cvtepi32_epi8(_mm512_add_epi32(q[h], _mm512_set1_epi32(128))));
        _mm256_storeu_ps(sv + k / 4, _mm256_set1_ps(sx)); /* block k / 32: lanes 8 (k / 32 % 2) */
    }
}

T_VNNI static float split_i16(const float *x, int64_t K, int64_t Kp, uint8_t *hi, uint8_t *lo) {
    const float a = abs_max(x, K), sx = a > 0.0f ? a / 32767.0f : 1.0f;
    const __m512 inv = _mm512_set1_ps(1.0f / sx);
    for (int64_t k = 0; k < Kp; k += 16) {
        const __m512i q = round_clamp(_mm512_maskz_loadu_ps(MASK_PAD(K, k), x + k), inv, 32767);
        __m512i hb = _mm512_add_epi32(_mm512_srai_epi32(q, 8), _mm512_set1_epi32(128));
        __m512i lb = _mm512_and_si512(q, _mm512_set1_epi32(255)); /* q - 256 floor(q / 256) */
        _mm_storeu_si128((__m128i *)(hi + k), _mm512_cvtepi32_epi8(hb));
        _mm_storeu_si128((__m128i *)(lo + k), _mm512_cvtepi32_epi8(lb));
    }
    return sx;
}

/* the 16 bytes of x's half block at k (k % 16 == 0) where the nibble kernels read them: per
   group of 4 blocks [blocks' values 0-15 | values 16-31], like the nibbles (q6: the order of
   the formats with a scale per 16 values, weights/blocks.py: a half block's first 8 values
   low, 8 high) */
T_VNNI INLINE void put_nibble_order(__m128i b8, int64_t k, int8_t *lo, int8_t *hi, int q6) {
    const int64_t blk = k / 32, at = (blk / 4) * 64 + (blk % 4) * 16;
    if (q6) {
        const int64_t j = k % 32 ? 8 : 0;
        _mm_storel_epi64((__m128i *)(lo + at + j), b8);
        _mm_storel_epi64((__m128i *)(hi + at + j), _mm_unpackhi_epi64(b8, b8));
    } else {
        _mm_storeu_si128((__m128i *)((k % 32 ? hi : lo) + at), b8);
    }
}

/* x in 16-bit fixed point, q = 256 a + b, |q| <= 32639; to xs the sums of the rounded x per
   block (Kp / 32), then per half block (Kp / 16 after them): sx times integer sums (exact; |sum|
   < 2^21), as the 8-bit form takes them. The offsets then see the x the products see, so a row
   is sum w x' for x' = sx q: the rounding error of x weighs the weights, not the unsigned
   values (0..15 for Q4_0, up to 241 for IQ4), which x's own fp32 sums made it do (about twice
   the error). */
T_VNNI static float split_nibble(const float *x, int64_t K, int64_t Kp, int8_t *a_lo,
                                 int8_t *a_hi, int8_t *b_lo, int8_t *b_hi, float *xs, int q6) {
    const float a = abs_max(x, K), sx = a > 0.0f ? a / 32639.0f : 1.0f;
    const __m512 inv = _mm512_set1_ps(1.0f / sx);
    float *half = xs + Kp / 32;
    int32_t h0 = 0;
    for (int64_t k = 0; k < Kp; k += 16) {
        const __m512i q = round_clamp(_mm512_maskz_loadu_ps(MASK_PAD(K, k), x + k), inv, 32639);
        const __m512i ah = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(128)), 8);
        const __m512i bl = _mm512_sub_epi32(q, _mm512_slli_epi32(ah, 8));
        put_nibble_order(_mm512_cvtepi32_epi8(ah), k, a_lo, a_hi, q6);
        put_nibble_order(_mm512_cvtepi32_epi8(bl), k, b_lo, b_hi, q6);
        const int32_t h = _mm512_reduce_add_epi32(q);
        half[k / 16] = sx * (float)h;
        if (k % 32) xs[k / 32] = sx * (float)(h0 + h);
        h0 = h;
    }
    return sx;
}

/* lowp: q per block as a, in the same order, and per group of 4 blocks the 16 lanes of their
   scales (block i's on lanes 4i..4i + 3, where its products land) to sv. The sums are those
   of the rounded x, sx_b sum q (integer sums, exact): the offsets then see the x the products
   see, so a row is sum w x' for x' = sx_b q. (With x's own sums the rounding error of x
   multiplied the uncentred nibbles, 0..15, rather than the weights: Q4_0's last logits
   measured ~2.5x further from fp32's than llama.cpp's.) */
T_VNNI static void split_nibble8(const float *x, int64_t K, int64_t Kp, int8_t *a_lo,
                                 int8_t *a_hi, float *sv, float *xs, int q6) {
    float *half = xs + Kp / 32;
    for (int64_t k = 0; k < Kp; k += 32) {
        __m512i q[2];
        const float sx = block8(x, K, k, q);
        put_nibble_order(_mm512_cvtepi32_epi8(q[0]), k, a_lo, a_hi, q6);
        put_nibble_order(_mm512_cvtepi32_epi8(q[1]), k + 16, a_lo, a_hi, q6);
        _mm_storeu_ps(sv + k / 8, _mm_set1_ps(sx)); /* block k / 32: lanes 4 (k / 32 % 4) */
        const int32_t h0 = _mm512_reduce_add_epi32(q[0]), h1 = _mm512_reduce_add_epi32(q[1]);
        half[k / 16] = sx * (float)h0, half[k / 16 + 1] = sx * (float)h1;
        xs[k / 32] = sx * (float)(h0 + h1);
    }
}

int el_supports(int fmt) {
    int need = fmt == FMT_BF16 ? HAS_BF16 : fmt >= FMT_I8 ? HAS_VNNI : HAS_AVX512;
    return fmt >= FMT_F32 && fmt < FMT_COUNT && (el_features() & need) == need;
}

void el_split_x(int fmt, const float *x, int64_t V, int64_t K, void *work, xparts_t *p,
                int threads, int lowp) {
    const int64_t Kp = padded(K);
    p->Kp = Kp;
    p->lowp = lowp && (IS_NIBBLE(fmt) || fmt == FMT_Q8_0 || fmt == FMT_BF16);
    p->a = p->b = NULL, p->xs = p->sx = NULL;
    if (fmt == FMT_F32 || fmt == FMT_F16) return; /* x is read as it is */
    p->a = (char *)work; /* per vector 2 Kp bytes (nibble formats: a_lo, a_hi), then 2 Kp more */
    p->b = p->a + V * Kp * 2;
    p->xs = (float *)(p->b + V * Kp * 2);
    p->sx = p->xs + V * (Kp / 32 + Kp / 16);
    /* each vector on its own: split by many threads where there are enough (a prompt's) */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && V >= PARALLEL_MIN)
    for (int64_t v = 0; v < V; v++) {
        const float *xv = x + v * K;
        char *pa = p->a + v * Kp * 2, *pb = p->b + v * Kp * 2;
        float *xs = p->xs + v * (Kp / 32 + Kp / 16);
        p->sx[v] = 1.0f; /* lowp: the scales are per block */
        if (fmt == FMT_BF16)
            split_bf16(xv, K, Kp, (uint16_t *)pa, (uint16_t *)pb);
        else if (IS_NIBBLE(fmt) && p->lowp)
            split_nibble8(xv, K, Kp, (int8_t *)pa, (int8_t *)pa + Kp / 2, (float *)pb, xs,
                          IS_SWAPPED(fmt));
        else if (IS_NIBBLE(fmt))
            p->sx[v] = split_nibble(xv, K, Kp, (int8_t *)pa, (int8_t *)pa + Kp / 2, (int8_t *)pb,
                                    (int8_t *)pb + Kp / 2, xs, IS_SWAPPED(fmt));
        else if (p->lowp)
            split_q8(xv, K, Kp, (uint8_t *)pa, (float *)pb);
        else
            p->sx[v] = split_i16(xv, K, Kp, (uint8_t *)pa, (uint8_t *)pb);
    }
}
#else
int el_features(void) { return 0; }
int el_supports(int fmt) { (void)fmt; return 0; }
void el_split_x(int fmt, const float *x, int64_t V, int64_t K, void *work, xparts_t *p,
                int threads, int lowp) {
    (void)fmt, (void)x, (void)V, (void)K, (void)work, (void)p, (void)threads, (void)lowp;
}
#endif
