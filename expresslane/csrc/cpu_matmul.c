/* Products for S tokens at once (the verify step of speculative decoding, S = k + 1 <= 16):
   y[s, l, n] = sum_k W[l, n, k] x[s, l, k], fp32 results, every format of cpu_matvec.c.

   A batch-1 product is bound by streaming the weights; S tokens through S products would stream
   them S times. Here each weight row is read from memory once: the tokens go in blocks of up to
   5 (the accumulators of a block fill the vector registers), and the rows in groups of about
   256 KB that every block reads in turn, the first from memory, the others from L2. (Re-reading
   each row from L1 for the next block right away was slower: it stalls the weight stream.)
   What the tokens of a block share is computed once per weight vector: the fp16 conversion,
   Q8_0's correction term and block scales, the nibble split and scales of Q4_1. The block's
   activations are interleaved chunk by chunk (pack_block), so that one pointer reaches them.

   Each (row, token) is computed exactly as el_matvec computes it: the same activation parts
   (el_split_x), the same accumulators in the same order, the same final sums. So a verify step
   over S tokens gives the bits of S single-token steps (greedy speculative output equals plain
   greedy decoding on this path, tie-breaks included); tests/test_cpu_kernels.py checks it. The
   integer formats' dot products are exact, so there only the floating-point parts keep their
   order. Row groups are split over `threads` OpenMP threads. Block sizes and the group size
   were chosen by timing SmolLM2's matrices on a Zen 5 core; the whole verify step's cost by
   its number of rows is the last line of `expresslane bench MODEL --speculative-config`. */

#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define T_F __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define T_BF __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define T_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c")))
#define INLINE static inline __attribute__((always_inline))
#define TMAX 8 /* bound of the per-block arrays (and of the blocks of one call) */
#define FMA_TOKENS 5       /* fp32 / fp16 / bf16: 4 accumulators a token (BY_T's largest T) */
#define INT_TOKENS 5       /* int8 / Q8_0 / Q4_1: 2 accumulators a token (6 was slower) */
#define GROUP_BYTES 262144 /* rows re-read from L2 by each block of tokens */
#define MASK16(n) ((__mmask16)((1u << (n)) - 1))

/* ---- the block's activations, interleaved --------------------------------------------------
   For a block of T tokens the activations (or their parts) are copied chunk by chunk with the
   tokens side by side: chunk c of token t at (c T + t) * CB bytes. The kernels then address
   every token from one pointer with constant offsets (T is a constant in each instance), which
   keeps the general registers free and the reads sequential. The bits are the same parts. */
static int64_t chunk_bytes(int fmt) { /* one chunk of one token: its parts side by side */
    return fmt == FMT_F32 || fmt == FMT_F16 ? 64 : fmt == FMT_Q4_1 ? 256 : 128;
}
static int64_t chunks(int fmt, int64_t K, int64_t Kp) { /* per token */
    return fmt == FMT_F32 || fmt == FMT_F16 ? (K + 15) / 16 : fmt == FMT_BF16 ? Kp / 32
           : fmt == FMT_Q4_1                ? Kp / 128
                                            : Kp / 64;
}

static void pack_block(int fmt, const xparts_t *P, const float *x, int64_t K, const int64_t *v,
                       int T, char *dst) {
    const int64_t Kp = P->Kp, n = chunks(fmt, K, Kp), cb = chunk_bytes(fmt);
    for (int64_t c = 0; c < n; c++)
        for (int t = 0; t < T; t++) {
            char *o = dst + (c * T + t) * cb;
            if (fmt == FMT_F32 || fmt == FMT_F16) { /* 16 floats, zeros past K */
                const int64_t m = K - c * 16 < 16 ? K - c * 16 : 16;
                memcpy(o, x + v[t] * K + c * 16, (size_t)m * 4);
                memset(o + m * 4, 0, (size_t)(16 - m) * 4);
            } else if (fmt == FMT_Q4_1) { /* group c: a_lo, a_hi, b_lo, b_hi, 64 bytes each */
                const char *a = P->a + v[t] * Kp * 2, *b = P->b + v[t] * Kp * 2;
                memcpy(o, a + c * 64, 64);
                memcpy(o + 64, a + Kp / 2 + c * 64, 64);
                memcpy(o + 128, b + c * 64, 64);
                memcpy(o + 192, b + Kp / 2 + c * 64, 64);
            } else { /* 64 bytes of the hi part, then of the lo part */
                memcpy(o, P->a + v[t] * Kp * 2 + c * 64, 64);
                memcpy(o + 64, P->b + v[t] * Kp * 2 + c * 64, 64);
            }
        }
}

#define AT(c, t, off) (xp + ((c) * T + (t)) * CB + (off)) /* chunk c of token t */

/* ---- float32 and float16: one conversion of each weight vector for the block's tokens ------ */
T_F INLINE __m512 ld_f32(const void *w, int64_t k) { return _mm512_loadu_ps((const float *)w + k); }
T_F INLINE __m512 ldm_f32(const void *w, int64_t k, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, (const float *)w + k);
}
T_F INLINE __m512 ld_f16(const void *w, int64_t k) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k)));
}
T_F INLINE __m512 ldm_f16(const void *w, int64_t k, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w + k));
}
#define XF(c, t) _mm512_loadu_ps((const float *)AT(c, t, 0))

/* el_matvec's row_f32 / row_f16 for T tokens: 4 accumulators each, the same chunks in each; x
   past K is zero here where el_matvec masks it (the same products) */
#define DEF_FMA_ROWS(NAME, LD, LDM)                                                          \
    T_F INLINE void NAME##_t(const void *w, const char *xp, int64_t K, float *out,           \
                             const int T) {                                                  \
        const int64_t CB = 64;                                                               \
        __m512 a[TMAX][4];                                                                   \
        for (int t = 0; t < T; t++)                                                          \
            a[t][0] = a[t][1] = a[t][2] = a[t][3] = _mm512_setzero_ps();                     \
        int64_t k = 0;                                                                       \
        for (; k + 64 <= K; k += 64) {                                                       \
            const int64_t c = k / 16;                                                        \
            const __m512 w0 = LD(w, k), w1 = LD(w, k + 16), w2 = LD(w, k + 32),              \
                         w3 = LD(w, k + 48);                                                 \
            for (int t = 0; t < T; t++) {                                                    \
                a[t][0] = _mm512_fmadd_ps(w0, XF(c, t), a[t][0]);                            \
                a[t][1] = _mm512_fmadd_ps(w1, XF(c + 1, t), a[t][1]);                        \
                a[t][2] = _mm512_fmadd_ps(w2, XF(c + 2, t), a[t][2]);                        \
                a[t][3] = _mm512_fmadd_ps(w3, XF(c + 3, t), a[t][3]);                        \
            }                                                                                \
        }                                                                                    \
        for (; k + 16 <= K; k += 16) {                                                       \
            const __m512 w0 = LD(w, k);                                                      \
            for (int t = 0; t < T; t++) a[t][0] = _mm512_fmadd_ps(w0, XF(k / 16, t), a[t][0]); \
        }                                                                                    \
        if (k < K) {                                                                         \
            const __m512 w0 = LDM(w, k, MASK16(K - k));                                      \
            for (int t = 0; t < T; t++) a[t][1] = _mm512_fmadd_ps(w0, XF(k / 16, t), a[t][1]); \
        }                                                                                    \
        for (int t = 0; t < T; t++)                                                          \
            out[t] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[t][0], a[t][1]),     \
                                                        _mm512_add_ps(a[t][2], a[t][3])));   \
    }
DEF_FMA_ROWS(rows_f32, ld_f32, ldm_f32)
DEF_FMA_ROWS(rows_f16, ld_f16, ldm_f16)

/* ---- bfloat16: vdpbf16ps of each weight vector with every token's hi and lo parts --------- */
#define BF(p) ((__m512bh)_mm512_loadu_si512(p))
T_BF INLINE void rows_bf16_t(const uint16_t *w, const char *xp, int64_t K, float *out,
                             const int T) {
    const int64_t CB = 128; /* 32 values: hi, then lo */
    __m512 a0[TMAX], a1[TMAX], b0[TMAX], b1[TMAX];
    for (int t = 0; t < T; t++) a0[t] = a1[t] = b0[t] = b1[t] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        const int64_t c = k / 32;
        const __m512bh w0 = BF(w + k), w1 = BF(w + k + 32);
        for (int t = 0; t < T; t++) {
            a0[t] = _mm512_dpbf16_ps(a0[t], w0, BF(AT(c, t, 0)));
            b0[t] = _mm512_dpbf16_ps(b0[t], w0, BF(AT(c, t, 64)));
            a1[t] = _mm512_dpbf16_ps(a1[t], w1, BF(AT(c + 1, t, 0)));
            b1[t] = _mm512_dpbf16_ps(b1[t], w1, BF(AT(c + 1, t, 64)));
        }
    }
    for (; k < K; k += 32) { /* x parts are zero-padded to a multiple of 64 */
        const __m512bh w0 =
            K - k >= 32 ? BF(w + k)
                        : (__m512bh)_mm512_maskz_loadu_epi16((1u << (K - k)) - 1, w + k);
        for (int t = 0; t < T; t++) {
            a0[t] = _mm512_dpbf16_ps(a0[t], w0, BF(AT(k / 32, t, 0)));
            b0[t] = _mm512_dpbf16_ps(b0[t], w0, BF(AT(k / 32, t, 64)));
        }
    }
    for (int t = 0; t < T; t++)
        out[t] = _mm512_reduce_add_ps(
            _mm512_add_ps(_mm512_add_ps(a0[t], a1[t]), _mm512_add_ps(b0[t], b1[t])));
}

/* ---- int8 (one scale per row): exact integer sums, so any order gives el_matvec's ---------- */
#define XI(c, t, off) _mm512_loadu_si512(AT(c, t, off))
T_VNNI INLINE void rows_i8_t(const int8_t *w, const char *xp, int64_t K, int64_t *dh,
                             int64_t *dl, const int T) {
    const int64_t CB = 128; /* 64 bytes: hi, then lo */
    __m512i a[TMAX], b[TMAX];
    for (int t = 0; t < T; t++) a[t] = b[t] = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 64) { /* x parts are padded to a multiple of 64 */
        _mm_prefetch((const char *)(w + k) + 1024, _MM_HINT_T0);
        const __m512i w0 = K - k >= 64
                               ? _mm512_loadu_si512(w + k)
                               : _mm512_maskz_loadu_epi8(((__mmask64)1 << (K - k)) - 1, w + k);
        for (int t = 0; t < T; t++) {
            a[t] = _mm512_dpbusd_epi32(a[t], XI(k / 64, t, 0), w0);
            b[t] = _mm512_dpbusd_epi32(b[t], XI(k / 64, t, 64), w0);
        }
    }
    for (int t = 0; t < T; t++) {
        dh[t] = _mm512_reduce_add_epi32(a[t]);
        dl[t] = _mm512_reduce_add_epi32(b[t]);
    }
}

/* ---- q8_0: per weight vector its correction sum w 128 and its two block scales, once ------- */
T_VNNI INLINE __m512 q8_0_scales(__m128i d2) {
    const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(_mm_cvtph_ps(d2)));
}
/* c: 256 sum w 128 for the weight vector; t = 256 (sum w (a + 128)) - c + sum w b, the same
   integer as el_matvec's 256 (sum w (a + 128) - sum w 128) + sum w b (mod 2^32: shifts
   distribute), with the low-byte product accumulated onto it directly */
T_VNNI INLINE __m512 q8_0_tok(__m512i wv, __m512i c, __m512 dv, __m512i xh, __m512i xl) {
    const __m512i z = _mm512_setzero_si512();
    __m512i hi = _mm512_sub_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(z, xh, wv), 8), c);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(hi, xl, wv)), dv);
}
T_VNNI INLINE __m512i q8_0_corr(__m512i wv) {
    const __m512i c128 = _mm512_set1_epi8((char)128);
    return _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), c128, wv), 8);
}

T_VNNI INLINE void rows_q8_0_t(const int8_t *w, const uint16_t *d, const char *xp, int64_t K,
                               float *out, const int T) {
    const int64_t CB = 128;
    __m512 acc0[TMAX], acc1[TMAX];
    for (int t = 0; t < T; t++) acc0[t] = acc1[t] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 128 <= K; k += 128) {
        const int64_t c = k / 64;
        int64_t dd;
        memcpy(&dd, d + k / 32, 8);
        const __m128i d4 = _mm_cvtsi64_si128(dd);
        const __m512i w0 = _mm512_loadu_si512(w + k), w1 = _mm512_loadu_si512(w + k + 64);
        const __m512i c0 = q8_0_corr(w0), c1 = q8_0_corr(w1);
        const __m512 dv0 = q8_0_scales(d4), dv1 = q8_0_scales(_mm_srli_si128(d4, 4));
        for (int t = 0; t < T; t++) {
            acc0[t] = _mm512_add_ps(acc0[t], q8_0_tok(w0, c0, dv0, XI(c, t, 0), XI(c, t, 64)));
            acc1[t] = _mm512_add_ps(acc1[t],
                                    q8_0_tok(w1, c1, dv1, XI(c + 1, t, 0), XI(c + 1, t, 64)));
        }
    }
    for (; k < K; k += 64) { /* K is a multiple of 32; x parts are padded */
        const int two = K - k >= 64;
        int32_t d2;
        memcpy(&d2, d + k / 32, two ? 4 : 2);
        if (!two) d2 &= 0xFFFF;
        const __m512i wv =
            two ? _mm512_loadu_si512(w + k) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, w + k);
        const __m512i c = q8_0_corr(wv);
        const __m512 dv = q8_0_scales(_mm_cvtsi32_si128(d2));
        for (int t = 0; t < T; t++)
            acc0[t] = _mm512_add_ps(acc0[t],
                                    q8_0_tok(wv, c, dv, XI(k / 64, t, 0), XI(k / 64, t, 64)));
    }
    for (int t = 0; t < T; t++) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[t], acc1[t]));
}

/* ---- q4_1: per nibble group its split and its four block scales, once ----------------------- */
T_VNNI INLINE void q4_1_group(__m512i v, __m128i d4, __m512i *lo, __m512i *hi, __m512 *dv) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i pick = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    *lo = _mm512_and_si512(v, low4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    *dv = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(_mm_cvtph_ps(d4)));
}
/* p: one token's group chunk, a_lo a_hi b_lo b_hi */
T_VNNI INLINE __m512 q4_1_tok(__m512i lo, __m512i hi, __m512 dv, const char *p) {
    const __m512i z = _mm512_setzero_si512();
    __m512i A = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo, _mm512_loadu_si512(p)), hi,
                                    _mm512_loadu_si512(p + 64));
    __m512i B = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo, _mm512_loadu_si512(p + 128)), hi,
                                    _mm512_loadu_si512(p + 192));
    __m512i t = _mm512_add_epi32(_mm512_slli_epi32(A, 8), B);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(t), dv);
}

T_VNNI static float q4_1_mins(const uint16_t *mn, const float *xs, int64_t nb) {
    __m512 macc = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 16 <= nb; b += 16)
        macc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + b))),
                               _mm512_loadu_ps(xs + b), macc);
    float m = _mm512_reduce_add_ps(macc);
    for (; b < nb; b++) m += _cvtsh_ss(mn[b]) * xs[b];
    return m;
}

/* xs: per token its block sums of x */
T_VNNI INLINE void rows_q4_1_t(const uint8_t *q, const uint16_t *d, const uint16_t *mn,
                               const char *xp, const float *const *xs, int64_t K, float *dot,
                               float *mdot, const int T) {
    const int64_t CB = 256;
    __m512 acc0[TMAX], acc1[TMAX];
    for (int t = 0; t < T; t++) acc0[t] = acc1[t] = _mm512_setzero_ps();
    const int64_t nb = K / 32;
    int64_t g = 0; /* groups of 4 blocks: 64 bytes of nibbles, 4 scales */
    for (; (g + 2) * 4 <= nb; g += 2) {
        int64_t dd[2];
        memcpy(dd, d + g * 4, 16);
        __m512i lo0, hi0, lo1, hi1;
        __m512 dv0, dv1;
        q4_1_group(_mm512_loadu_si512(q + g * 64), _mm_cvtsi64_si128(dd[0]), &lo0, &hi0, &dv0);
        q4_1_group(_mm512_loadu_si512(q + g * 64 + 64), _mm_cvtsi64_si128(dd[1]), &lo1, &hi1, &dv1);
        for (int t = 0; t < T; t++) {
            acc0[t] = _mm512_add_ps(acc0[t], q4_1_tok(lo0, hi0, dv0, AT(g, t, 0)));
            acc1[t] = _mm512_add_ps(acc1[t], q4_1_tok(lo1, hi1, dv1, AT(g + 1, t, 0)));
        }
    }
    for (; g * 4 < nb; g++) { /* the last 1-4 blocks: masked */
        int64_t left = nb - g * 4 >= 4 ? 4 : nb - g * 4;
        __mmask64 m = left == 4 ? ~(__mmask64)0 : (((__mmask64)1 << (16 * left)) - 1);
        int64_t dd = 0;
        memcpy(&dd, d + g * 4, (size_t)(2 * left));
        __m512i lo, hi;
        __m512 dv;
        q4_1_group(_mm512_maskz_loadu_epi8(m, q + g * 64), _mm_cvtsi64_si128(dd), &lo, &hi, &dv);
        for (int t = 0; t < T; t++)
            acc0[t] = _mm512_add_ps(acc0[t], q4_1_tok(lo, hi, dv, AT(g, t, 0)));
    }
    for (int t = 0; t < T; t++) {
        mdot[t] = q4_1_mins(mn, xs[t], nb);
        dot[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[t], acc1[t]));
    }
}

/* ---- a row for a block of T tokens, T a constant inside each case (accumulators in registers) */
#define BY_T(CALL)           \
    switch (T) {             \
    case 1: CALL(1); break;  \
    case 2: CALL(2); break;  \
    case 3: CALL(3); break;  \
    case 4: CALL(4); break;  \
    default: CALL(5); break; \
    }

T_F static void block_fma(int fmt, const char *wr, const char *xp, int64_t K, int T,
                          float *res) {
#define F32(n) rows_f32_t(wr, xp, K, res, n)
#define F16(n) rows_f16_t(wr, xp, K, res, n)
    if (fmt == FMT_F32) BY_T(F32) else BY_T(F16)
}

T_BF static void block_bf16(const char *wr, const char *xp, int64_t K, int T, float *res) {
#define BF16(n) rows_bf16_t((const uint16_t *)wr, xp, K, res, n)
    BY_T(BF16)
}

T_VNNI static void block_int(const qmat_t *w, int64_t r, const char *wr, const xparts_t *P,
                             const char *xp, int64_t K, const int64_t *v, int T, float *res) {
    const int fmt = (int)w->fmt;
    if (fmt == FMT_I8) {
        int64_t dh[TMAX] = {0}, dl[TMAX] = {0};
#define I8(n) rows_i8_t((const int8_t *)wr, xp, K, dh, dl, n)
        BY_T(I8)
        const int64_t rs = ((const int32_t *)w->rowsum)[r];
        const double sc = (double)((const float *)w->scale)[r];
        for (int t = 0; t < T; t++) {
            double val = 256.0 * (double)(dh[t] - 128 * rs) + dl[t];
            res[t] = (float)((double)P->sx[v[t]] * sc * val);
        }
    } else if (fmt == FMT_Q8_0) {
        const uint16_t *d = (const uint16_t *)w->scale + r * (K / 32);
#define Q8(n) rows_q8_0_t((const int8_t *)wr, d, xp, K, res, n)
        BY_T(Q8)
        for (int t = 0; t < T; t++) res[t] = P->sx[v[t]] * res[t];
    } else {
        const uint16_t *d = (const uint16_t *)w->scale + r * (K / 32);
        const uint16_t *mn = (const uint16_t *)w->mins + r * (K / 32);
        const float *bsum[TMAX];
        float dot[TMAX], mdot[TMAX];
        for (int t = 0; t < T; t++) bsum[t] = P->xs + v[t] * (P->Kp / 32);
#define Q4(n) rows_q4_1_t((const uint8_t *)wr, d, mn, xp, bsum, K, dot, mdot, n)
        BY_T(Q4)
        for (int t = 0; t < T; t++) res[t] = P->sx[v[t]] * dot[t] + mdot[t];
    }
}

static int block_tokens(int fmt) { return fmt >= FMT_I8 ? INT_TOKENS : FMA_TOKENS; }

int64_t el_matmul_scratch(int64_t S, int64_t L, int64_t K) {
    const int64_t Kp = (K + 127) / 128 * 128; /* packed blocks: at most 4 Kp bytes a token */
    return el_matvec_scratch(S * L, K) + S * L * 4 * Kp + 64;
}

int el_matmul(const qmat_t *w, const float *x, float *y, int64_t S, int64_t L, int64_t N,
              int64_t K, int threads, void *work) {
    if (S == 1) return el_matvec(w, x, y, L, N, K, threads, work);
    if (S > TMAX * 4) /* at most TMAX blocks a call: the rest after */
        return el_matmul(w, x, y, TMAX * 4, L, N, K, threads, work) |
               el_matmul(w, x + TMAX * 4 * L * K, y + TMAX * 4 * L * N, S - TMAX * 4, L, N, K,
                         threads, work);
    const int fmt = (int)w->fmt;
    if (!el_supports(fmt)) return -1;
    void *own = NULL;
    if (!work) {
        work = own = aligned_alloc(64, (size_t)el_matmul_scratch(S, L, K));
        if (!work) return -3;
    }
    xparts_t P;
    el_split_x(fmt, x, S * L, K, work, &P); /* vector s L + l: token s, lane l */
    const int64_t tb = block_tokens(fmt), blocks = (S + tb - 1) / tb;
    const int64_t per_token = chunks(fmt, K, P.Kp) * chunk_bytes(fmt);
    char *pk = (char *)work + (el_matvec_scratch(S * L, K) + 63) / 64 * 64;
    int Ts[TMAX]; /* blocks of even size: 6 = 3 + 3, not 4 + 2 */
    for (int64_t b = 0, s0 = 0; b < blocks; b++) {
        Ts[b] = (int)((S - s0 + (blocks - b) - 1) / (blocks - b));
        s0 += Ts[b];
    }
    for (int64_t l = 0; l < L; l++) /* lane l's tokens from l S per_token on, block by block */
        for (int64_t b = 0, s0 = 0; b < blocks; s0 += Ts[b], b++) {
            int64_t v[TMAX];
            for (int t = 0; t < Ts[b]; t++) v[t] = (s0 + t) * L + l;
            pack_block(fmt, &P, x, K, v, Ts[b], pk + (l * S + s0) * per_token);
        }
    /* rows in groups that stay in L2 while each block of tokens reads them (a row re-read at
       once from L1 stalls the weight stream); at least one group per thread */
    const int64_t rows = L * N, rb = el_row_bytes(fmt, K);
    int64_t per = GROUP_BYTES / rb > 1 ? GROUP_BYTES / rb : 1;
    if (threads > 1 && per > (rows + threads - 1) / threads) per = (rows + threads - 1) / threads;
    const int64_t groups = (rows + per - 1) / per;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t gi = 0; gi < groups; gi++) {
        const int64_t r0 = gi * per, r1 = r0 + per < rows ? r0 + per : rows;
        for (int64_t b = 0, s0 = 0; b < blocks; s0 += Ts[b], b++) {
            const int T = Ts[b];
            for (int64_t r = r0; r < r1; r++) {
                const int64_t l = r / N;
                const char *wr = (const char *)w->data + r * rb;
                const char *xp = pk + (l * S + s0) * per_token;
                int64_t v[TMAX];
                float res[TMAX];
                for (int t = 0; t < T; t++) v[t] = (s0 + t) * L + l;
                if (fmt == FMT_F32 || fmt == FMT_F16)
                    block_fma(fmt, wr, xp, K, T, res);
                else if (fmt == FMT_BF16)
                    block_bf16(wr, xp, K, T, res);
                else
                    block_int(w, r, wr, &P, xp, K, v, T, res);
                for (int t = 0; t < T; t++) y[v[t] * N + (r - l * N)] = res[t];
            }
        }
    }
    free(own);
    return 0;
}
#else
int64_t el_matmul_scratch(int64_t S, int64_t L, int64_t K) { (void)S, (void)L, (void)K; return 0; }
int el_matmul(const qmat_t *w, const float *x, float *y, int64_t S, int64_t L, int64_t N,
              int64_t K, int threads, void *work) {
    (void)w, (void)x, (void)y, (void)S, (void)L, (void)N, (void)K, (void)threads, (void)work;
    return -1;
}
#endif
