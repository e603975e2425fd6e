/* The products of the decode step, for S tokens at once: y[s, l, n] = sum_k W[l, n, k] x[s, l, k],
   fp32 results; one token (a plain decode step) is S = 1, a verify step of speculative decoding
   S = k + 1 <= 16.

   Batch-1 products are bound by streaming the weights; S tokens through S products would stream
   them S times. Here each weight row is read from memory once: a verify's S <= 8 tokens go in one
   block, up to 16 in two, longer prompts in blocks of up to 5 (the accumulators of a block fill the
   vector registers; in one block of 6-8, fp32's spill a little), and the rows in groups of about
   256 KB that every block reads in turn, the first from memory, the others from L2. (Re-reading
   each row from L1 for the next block right away was slower: it stalls the weight stream.) A row is
   read front to back with several accumulators (rows of a few hundred bytes read as interleaved
   streams defeat the hardware prefetcher, sequential rows do not). What the tokens of a block share
   is computed once per weight vector: the fp16 conversion, Q8_0's correction term and block scales,
   the nibble split and scales (cpu_nibble.c).

     float32   AVX-512F FMA.              float16   F16C conversion, then FMA.
     bfloat16  AVX512_BF16 dot products (vdpbf16ps) with x's two bf16 parts (lowp: the hi
               part alone, x rounded to bf16 as llama.cpp's).
     int8      AVX512_VNNI (vpdpbusd, u8 x s8 -> s32) with x's two bytes (cpu_activations.c):
               sum w q = 256 (sum w (a+128) - 128 sum w) + sum w b, exactly in integers;
               y = sx * scale[n] * that, the row sums of w precomputed.
     q8_0      GGUF's blocks of 32 int8 with an f16 scale each, stored planar (values, then
               scales): as int8, per block (the 128 sum w correction from a third vpdpbusd),
               each block's integer dot scaled by its d in fp32. With x in 8 bits (lowp, a
               prompt's opt-in) the hi part alone, sum w (q + 128) - 128 sum w, and a scale
               of x per block.

   Where the CPU has AMX tiles (el_features' HAS_AMX), bf16 and int8 go to cpu_amx.c instead: a
   tile product takes up to 16 tokens at once; so do Q8_0 and the nibble formats but NVFP4 for a
   prompt's chunks (EL_PROMPT, exact x; cpu_amx_blocks.c), whose bits need not be a decode
   step's.

   Every kernel but int8's (whose integer sums are exact in any order) leaves a row's result
   as 16 lanes, summed 16 rows at a time (EL_TILES).

   Every (row, token) is computed by the same instructions in the same order whatever the block
   it is in and whatever S: the kernels are instantiated per block size T, and T only repeats
   the per-token work. So a verify step over S tokens gives the bits of S single-token steps
   (greedy speculative output equals plain greedy decoding, tie-breaks included);
   tests/test_packed_verify.py checks it. Row groups are split over `threads` OpenMP threads
   (the OpenMP runtime torch loaded). Block sizes and the group size were chosen by timing
   SmolLM2's matrices on a Zen 5 core. */

#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "simd.h"

#define FMA_TOKENS 5       /* fp32 / fp16 / bf16: 4 accumulators a token (BY_T's largest T) */
#define INT_TOKENS 5       /* integer formats: 2-4 accumulators a token (6 was slower) */
#define GROUP_BYTES 262144 /* rows re-read from L2 by each block of tokens */

#ifdef EL_X86
#define AT(c, t, off) (xp + ((c) * T + (t)) * CB + (off)) /* chunk c of token t */

/* ---- float32 and float16: one conversion of each weight vector for the block's tokens ------ */
#define XF(c, t) _mm512_loadu_ps((const float *)AT(c, t, 0))

/* a row of fp32 / fp16 weights for T tokens: 4 accumulators each, the same chunks in each; x
   past K is zero (packed so) and the weights past K masked */
#define DEF_FMA_ROWS(NAME, LD, LDM, ES) /* ES: bytes a weight */                          \
    T_F INLINE void NAME##_t(const void *w, const char *xp, int64_t K, __m512 *out,          \
                             const int T) {                                                  \
        const int64_t CB = 64;                                                               \
        __m512 a[TMAX][4];                                                                   \
        for (int t = 0; t < T; t++)                                                          \
            a[t][0] = a[t][1] = a[t][2] = a[t][3] = _mm512_setzero_ps();                     \
        int64_t k = 0;                                                                       \
        for (; k + 64 <= K; k += 64) {                                                       \
            for (int p = 0; p < 64 * (ES); p += 64) /* this iteration's lines, further on */  \
                _mm_prefetch((const char *)w + k * (ES) + PREFETCH_AHEAD + p, _MM_HINT_T0);  \
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
        for (int t = 0; t < T; t++) /* 16 lanes, summed with the tile's (EL_TILES) */        \
            out[t] = _mm512_add_ps(_mm512_add_ps(a[t][0], a[t][1]),                          \
                                   _mm512_add_ps(a[t][2], a[t][3]));                         \
    }
DEF_FMA_ROWS(rows_f32, ld_f32, ldm_f32, 4)
DEF_FMA_ROWS(rows_f16, ld_f16, ldm_f16, 2)

/* ---- bfloat16: vdpbf16ps of each weight vector with every token's hi and lo parts --------- */
/* x in two planes (el_pack_block): chunk c of token t at (c T + t) 64 bytes among the hi parts,
   and 2 Kp T bytes further among the lo parts; for one token, x_hi then x_lo. Chunks of hi and
   lo side by side (128 bytes a chunk) streamed SmolLM2's w2 (K = 1536) 20% slower with 2 threads
   on the 2-vCPU VM, the other shapes the same (why is not known). */
T_BF INLINE void rows_bf16_t(const uint16_t *w, const char *xp, int64_t K, __m512 *out,
                             const int T, const int LOWP) { /* LOWP: the hi parts alone */
    const int64_t CB = 64, LO = 2 * ((K + 127) / 128 * 128) * T; /* 32 values; the lo plane */
    __m512 a0[TMAX], a1[TMAX], b0[TMAX], b1[TMAX];
    for (int t = 0; t < T; t++) a0[t] = a1[t] = b0[t] = b1[t] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        _mm_prefetch((const char *)(w + k) + PREFETCH_AHEAD, _MM_HINT_T0);
        _mm_prefetch((const char *)(w + k) + PREFETCH_AHEAD + 64, _MM_HINT_T0);
        const int64_t c = k / 32;
        const __m512bh w0 = BF(w + k), w1 = BF(w + k + 32);
        for (int t = 0; t < T; t++) {
            a0[t] = _mm512_dpbf16_ps(a0[t], w0, BF(AT(c, t, 0)));
            a1[t] = _mm512_dpbf16_ps(a1[t], w1, BF(AT(c + 1, t, 0)));
            if (LOWP) continue;
            b0[t] = _mm512_dpbf16_ps(b0[t], w0, BF(AT(c, t, LO)));
            b1[t] = _mm512_dpbf16_ps(b1[t], w1, BF(AT(c + 1, t, LO)));
        }
    }
    for (; k < K; k += 32) { /* x parts are zero-padded to a multiple of 64 */
        const __m512bh w0 =
            K - k >= 32 ? BF(w + k)
                        : AS_BH(_mm512_maskz_loadu_epi16((1u << (K - k)) - 1, w + k));
        for (int t = 0; t < T; t++) {
            a0[t] = _mm512_dpbf16_ps(a0[t], w0, BF(AT(k / 32, t, 0)));
            if (!LOWP) b0[t] = _mm512_dpbf16_ps(b0[t], w0, BF(AT(k / 32, t, LO)));
        }
    }
    for (int t = 0; t < T; t++) /* 16 lanes, summed with the tile's (EL_TILES) */
        out[t] = _mm512_add_ps(_mm512_add_ps(a0[t], a1[t]), _mm512_add_ps(b0[t], b1[t]));
}

/* ---- int8 (one scale per row): exact integer sums, so any order gives the same ------------ */
#define XI(c, t, off) _mm512_loadu_si512(AT(c, t, off))
T_VNNI INLINE void rows_i8_t(const int8_t *w, const char *xp, int64_t K, int64_t *dh,
                             int64_t *dl, const int T) {
    const int64_t CB = 128; /* 64 bytes: hi, then lo */
    __m512i a[TMAX][2], b[TMAX][2];
    for (int t = 0; t < T; t++) a[t][0] = a[t][1] = b[t][0] = b[t][1] = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 128 <= K; k += 128) { /* short rows: the next ones are prefetched */
        _mm_prefetch((const char *)(w + k) + PREFETCH_AHEAD, _MM_HINT_T0);
        _mm_prefetch((const char *)(w + k) + PREFETCH_AHEAD + 64, _MM_HINT_T0);
        const __m512i w0 = _mm512_loadu_si512(w + k), w1 = _mm512_loadu_si512(w + k + 64);
        for (int t = 0; t < T; t++) {
            a[t][0] = _mm512_dpbusd_epi32(a[t][0], XI(k / 64, t, 0), w0);
            b[t][0] = _mm512_dpbusd_epi32(b[t][0], XI(k / 64, t, 64), w0);
            a[t][1] = _mm512_dpbusd_epi32(a[t][1], XI(k / 64 + 1, t, 0), w1);
            b[t][1] = _mm512_dpbusd_epi32(b[t][1], XI(k / 64 + 1, t, 64), w1);
        }
    }
    for (; k < K; k += 64) { /* x parts are padded to a multiple of 128 */
        const __m512i w0 = K - k >= 64
                               ? _mm512_loadu_si512(w + k)
                               : _mm512_maskz_loadu_epi8(((__mmask64)1 << (K - k)) - 1, w + k);
        for (int t = 0; t < T; t++) {
            a[t][0] = _mm512_dpbusd_epi32(a[t][0], XI(k / 64, t, 0), w0);
            b[t][0] = _mm512_dpbusd_epi32(b[t][0], XI(k / 64, t, 64), w0);
        }
    }
    for (int t = 0; t < T; t++) {
        dh[t] = _mm512_reduce_add_epi32(_mm512_add_epi32(a[t][0], a[t][1]));
        dl[t] = _mm512_reduce_add_epi32(_mm512_add_epi32(b[t][0], b[t][1]));
    }
}

/* ---- q8_0: per weight vector its correction sum w 128 and its two block scales, once ------- */
T_VNNI INLINE __m512 q8_0_scales(__m128i d2) {
    const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(_mm_cvtph_ps(d2)));
}
/* c: 256 sum w 128 for the weight vector; t = 256 (sum w (a + 128)) - c + sum w b, which is
   256 (sum w (a + 128) - sum w 128) + sum w b = sum w q exactly (mod 2^32: shifts distribute),
   with the low-byte product accumulated onto it directly */
T_VNNI INLINE __m512 q8_0_tok(__m512i wv, __m512i c, __m512 dv, __m512i xh, __m512i xl,
                              __m512 acc) {
    const __m512i z = _mm512_setzero_si512();
    __m512i hi = _mm512_sub_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(z, xh, wv), 8), c);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(hi, xl, wv)), dv, acc);
}
/* LOWP: sum w (q + 128) - c with c = 128 sum w, x's one byte (q + 128) at xh, times the
   blocks' d and x's block scales xs (16 lanes: each block's on its 8) */
T_VNNI INLINE __m512 q8_0_tok8(__m512i wv, __m512i c, __m512 dv, __m512i xh, __m512 xs,
                               __m512 acc) {
    const __m512i t = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), xh, wv), c);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(dv, xs), acc);
}
/* 128 sum w per 4 weights (LOWP), or 256 times that */
T_VNNI INLINE __m512i q8_0_corr(__m512i wv, const int LOWP) {
    const __m512i c128 = _mm512_set1_epi8((char)128);
    const __m512i c = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c128, wv);
    return LOWP ? c : _mm512_slli_epi32(c, 8);
}
#ifdef EL_AVX2 /* x as q itself (cpu_kernels.h X16): one vpmaddwd a 16 values, c unused */
#define Q8_EXACT(wv, c, dv, cc, t, acc)                                                     \
    _mm512_fmadd_ps(_mm512_cvtepi32_ps(el_dot_s8_x16(wv, AT(cc, t, 0))), dv, acc)
#else
#define Q8_EXACT(wv, c, dv, cc, t, acc) q8_0_tok(wv, c, dv, XI(cc, t, 0), XI(cc, t, 64), acc)
#endif
#define Q8_TOK(wv, c, dv, cc, t, acc)                                                       \
    (LOWP ? q8_0_tok8(wv, c, dv, XI(cc, t, 0), _mm512_loadu_ps((const float *)AT(cc, t, 64)), acc) \
          : Q8_EXACT(wv, c, dv, cc, t, acc))

T_VNNI INLINE void rows_q8_0_t(const int8_t *w, const uint16_t *d, const char *xp, int64_t K,
                               const float *sx, __m512 *out, const int T, const int LOWP) {
    const int64_t CB = 128; /* LOWP: 64 bytes of x, then its 16 lanes of block scales */
    __m512 acc0[TMAX], acc1[TMAX];
    for (int t = 0; t < T; t++) acc0[t] = acc1[t] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 128 <= K; k += 128) {
        const int64_t c = k / 64;
        int64_t dd;
        memcpy(&dd, d + k / 32, 8);
        const __m128i d4 = _mm_cvtsi64_si128(dd);
        const __m512i w0 = _mm512_loadu_si512(w + k), w1 = _mm512_loadu_si512(w + k + 64);
        const __m512i c0 = q8_0_corr(w0, LOWP), c1 = q8_0_corr(w1, LOWP);
        const __m512 dv0 = q8_0_scales(d4), dv1 = q8_0_scales(_mm_srli_si128(d4, 4));
        for (int t = 0; t < T; t++) {
            acc0[t] = Q8_TOK(w0, c0, dv0, c, t, acc0[t]);
            acc1[t] = Q8_TOK(w1, c1, dv1, c + 1, t, acc1[t]);
        }
    }
    for (; k < K; k += 64) { /* K is a multiple of 32; x parts are padded */
        const int two = K - k >= 64;
        int32_t d2;
        memcpy(&d2, d + k / 32, two ? 4 : 2);
        if (!two) d2 &= 0xFFFF;
        const __m512i wv =
            two ? _mm512_loadu_si512(w + k) : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, w + k);
        const __m512i c = q8_0_corr(wv, LOWP);
        const __m512 dv = q8_0_scales(_mm_cvtsi32_si128(d2));
        for (int t = 0; t < T; t++) acc0[t] = Q8_TOK(wv, c, dv, k / 64, t, acc0[t]);
    }
    for (int t = 0; t < T; t++)
        out[t] = _mm512_mul_ps(_mm512_add_ps(acc0[t], acc1[t]), _mm512_set1_ps(sx[t]));
}

/* ---- rows for a block of T tokens, T a constant inside each case ------------------------ */
T_F static void span_fma(const span_t *sp, int64_t r0, int64_t r1) {
    const int64_t K = sp->K, rb = el_row_bytes((int)sp->w->fmt, K);
#define F32(n) EL_TILES(sp, r0, r1, rb, n, rows_f32_t(wr, xp, K, lanes, n))
#define F16(n) EL_TILES(sp, r0, r1, rb, n, rows_f16_t(wr, xp, K, lanes, n))
    if (sp->w->fmt == FMT_F32) BY_T(sp->T, F32) else BY_T(sp->T, F16)
}

T_BF static void span_bf16(const span_t *sp, int64_t r0, int64_t r1) {
    const int64_t K = sp->K, rb = 2 * K;
#define BF16(n, lp) EL_TILES(sp, r0, r1, rb, n, rows_bf16_t((const uint16_t *)wr, xp, K, lanes, n, lp))
    BY_T_LOWP(sp->T, sp->P->lowp, BF16)
}

T_VNNI INLINE void row_i8(const span_t *sp, int64_t r, const char *wr, const char *xp,
                          const int64_t *v, float *res, const int T) {
    int64_t dh[TMAX], dl[TMAX];
    rows_i8_t((const int8_t *)wr, xp, sp->K, dh, dl, T);
    const int64_t rs = ((const int32_t *)sp->w->rowsum)[r];
    const double sc = (double)((const float *)sp->w->scale)[r];
    for (int t = 0; t < T; t++) {
        double val = 256.0 * (double)(dh[t] - 128 * rs) + dl[t];
        res[t] = (float)((double)sp->P->sx[v[t]] * sc * val);
    }
}

T_VNNI INLINE void row_q8_0(const span_t *sp, int64_t r, const char *wr, const char *xp,
                            const int64_t *v, __m512 *lanes, const int T, const int LOWP) {
    const uint16_t *d = (const uint16_t *)sp->w->scale + r * (sp->K / 32);
    float sx[TMAX];
    for (int t = 0; t < T; t++) sx[t] = sp->P->sx[v[t]];
    rows_q8_0_t((const int8_t *)wr, d, xp, sp->K, sx, lanes, T, LOWP);
}

T_VNNI static void span_int(const span_t *sp, int64_t r0, int64_t r1) {
    const int64_t rb = sp->K;
#define I8(n) EL_ROWS(sp, r0, r1, rb, n, row_i8(sp, r, wr, xp, v, res, n))
#define Q8(n, lp) EL_TILES(sp, r0, r1, rb, n, row_q8_0(sp, r, wr, xp, v, lanes, n, lp))
    if (sp->w->fmt == FMT_I8) {
        BY_T(sp->T, I8)
    } else {
        BY_T_LOWP(sp->T, sp->P->lowp, Q8)
    }
}

static int block_tokens(int fmt) { return fmt >= FMT_I8 ? INT_TOKENS : FMA_TOKENS; }

static int64_t padded(int64_t K) { return (K + 127) / 128 * 128; }

int64_t el_matmul_scratch(int64_t S, int64_t L, int64_t K) {
    /* the split parts, then the packed blocks: at most 4 Kp bytes a token */
    const int64_t own = el_split_scratch(S * L, K) + S * L * 4 * padded(K) + 64;
    const int64_t amx = el_amx_scratch(S < TMAX * INT_TOKENS ? S : TMAX * INT_TOKENS, L, K);
    return own > amx ? own : amx;
}

/* S <= TMAX (a verify step) in one block: each further block repeats the per-weight work (a
   row's conversion or unpacking) and re-reads it from L2, and on the Xeon (1 thread,
   SmolLM2-135M) a verify of 6 rows as 3 + 3 cost 2.49-2.95 plain steps for Q8_0 and Q4_K_M
   against 2.20-2.55 as one block of 6 (BENCHMARKS.md, "A verify of up to 8 rows in one
   block"). Up to 2 TMAX (a short prompt, an agent's next turn) in two: 16 tokens as 8 + 8, not
   4 x 4, prefilled in 0.84-0.93x the time on the block formats (2 threads). Longer runs in
   blocks of even size, 6 = 3 + 3 rather than 5 + 1, of at most block_tokens: blocks of 6 or 8
   there took 1.1-1.25x the time at 40 tokens (cpu_nibble.c). */
static int64_t token_blocks(int fmt, int64_t S, int *Ts) {
    const int64_t tb = S <= TMAX ? S : S <= 2 * TMAX ? (S + 1) / 2 : block_tokens(fmt);
    const int64_t blocks = (S + tb - 1) / tb;
    for (int64_t b = 0, s0 = 0; b < blocks; b++) {
        Ts[b] = (int)((S - s0 + (blocks - b) - 1) / (blocks - b));
        s0 += Ts[b];
    }
    return blocks;
}

static int matmul(const qmat_t *w, const float *x, float *y, int64_t ldy, int64_t S, int64_t L,
                  int64_t N, int64_t K, int threads, void *work, int lowp) {
    if (S > TMAX * INT_TOKENS) /* at most TMAX blocks a call: the rest after */
        return matmul(w, x, y, ldy, TMAX * INT_TOKENS, L, N, K, threads, work, lowp) |
               matmul(w, x + TMAX * INT_TOKENS * L * K, y + TMAX * INT_TOKENS * L * ldy, ldy,
                      S - TMAX * INT_TOKENS, L, N, K, threads, work, lowp);
    const int fmt = (int)w->fmt, flags = lowp;
    lowp &= EL_LOWP;
    if (!el_supports(fmt)) return -1;
    if (el_amx_takes(fmt, K, S, flags))
        return el_matmul_amx(w, x, y, ldy, S, L, N, K, threads, work, lowp);
    if ((fmt == FMT_Q8_0 || IS_NIBBLE(fmt)) && K % BLOCK_VALUES(fmt)) return -2;
    void *own = NULL;
    if (!work) {
        work = own = aligned_alloc(64, (size_t)el_matmul_scratch(S, L, K));
        if (!work) return -3;
    }
    xparts_t P;
    el_split_x(fmt, x, S * L, K, work, &P, threads, lowp); /* vector s L + l: token s, lane l */
    int Ts[TMAX];
    const int64_t blocks = token_blocks(fmt, S, Ts);
    const int64_t per_token = el_chunks(fmt, K, P.Kp) * el_chunk_bytes(fmt, P.lowp);
    char *pk = (char *)work + (el_split_scratch(S * L, K) + 63) / 64 * 64;
    int64_t starts[TMAX]; /* of the blocks */
    for (int64_t b = 0, s0 = 0; b < blocks; s0 += Ts[b], b++) starts[b] = s0;
    /* lane l's tokens from l S per_token on, block by block */
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && S * L >= PARALLEL_MIN)
    for (int64_t lb = 0; lb < L * blocks; lb++) {
        const int64_t l = lb / blocks, b = lb % blocks, s0 = starts[b];
        int64_t v[TMAX];
        for (int t = 0; t < Ts[b]; t++) v[t] = (s0 + t) * L + l;
        el_pack_block(fmt, &P, x, K, v, Ts[b], pk + (l * S + s0) * per_token);
    }
    /* rows in groups that stay in L2 while each block of tokens reads them (a row re-read at
       once from L1 stalls the weight stream); at least one group per thread */
    const int64_t rows = L * N, rb = el_row_bytes(fmt, K);
    const int64_t most = GROUP_BYTES / rb > 1 ? GROUP_BYTES / rb : 1;
    /* a whole number of groups per thread, as even as rows allow: 3 groups of 227 rows on 2
       threads left one thread 2/3 of a bf16 product (the 2026-11-27 CPU regression) */
    const int64_t t = threads > 1 ? threads : 1;
    int64_t groups = ((rows + most - 1) / most + t - 1) / t * t;
    /* one block of tokens (S <= 8: a decode or verify step) re-reads nothing, so the rows go
       a tile at a time (int8's one by one), each thread a contiguous half */
    const int tiled = fmt != FMT_I8; /* EL_TILES */
    const int64_t per = blocks == 1 ? (tiled ? TILE_ROWS : 1) : (rows + groups - 1) / groups;
    groups = (rows + per - 1) / per;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t gi = 0; gi < groups; gi++) {
        const int64_t r0 = gi * per, r1 = r0 + per < rows ? r0 + per : rows;
        span_t sp = {w, &P, x, pk, y, S, L, N, K, ldy, per_token, 0, 1};
        for (int64_t b = 0; b < blocks; sp.s0 += Ts[b], b++) {
            sp.T = Ts[b];
            if (fmt == FMT_F32 || fmt == FMT_F16)
                span_fma(&sp, r0, r1);
            else if (fmt == FMT_BF16)
                span_bf16(&sp, r0, r1);
            else if (IS_NIBBLE(fmt))
                el_span_nibble(&sp, r0, r1);
            else
                span_int(&sp, r0, r1);
        }
    }
    free(own);
    return 0;
}

int el_matmul(const qmat_t *w, const float *x, float *y, int64_t S, int64_t L, int64_t N,
              int64_t K, int threads, void *work, int lowp) {
    return matmul(w, x, y, N, S, L, N, K, threads, work, lowp);
}

int el_matmul_into(const qmat_t *w, const float *x, float *y, int64_t ldy, int64_t S, int64_t N,
                   int64_t K, int threads, void *work, int lowp) {
    return matmul(w, x, y, ldy, S, 1, N, K, threads, work, lowp);
}
#else
int64_t el_matmul_scratch(int64_t S, int64_t L, int64_t K) { (void)S, (void)L, (void)K; return 0; }
int el_matmul(const qmat_t *w, const float *x, float *y, int64_t S, int64_t L, int64_t N,
              int64_t K, int threads, void *work, int lowp) {
    (void)w, (void)x, (void)y, (void)S, (void)L, (void)N, (void)K, (void)threads, (void)work;
    (void)lowp;
    return -1;
}
int el_matmul_into(const qmat_t *w, const float *x, float *y, int64_t ldy, int64_t S, int64_t N,
                   int64_t K, int threads, void *work, int lowp) {
    (void)w, (void)x, (void)y, (void)ldy, (void)S, (void)N, (void)K, (void)threads, (void)work;
    (void)lowp;
    return -1;
}
#endif
