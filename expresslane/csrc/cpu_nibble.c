/* The products of GGUF's 1- to 6-bit formats, read as stored (re-laid at load by
   expresslane/weights/gguf_blocks.py for 64-byte loads; never dequantized): for a block of T
   tokens, one weight row at a time, each group of 128 values (four 32-value blocks) split into its
   values and scales once and used for every token of the block.

   Every value is q = (4 low bits, or 2 for the crumb formats) + 4 (bit 2: q3_K) + 16 (bit 4) +
   32 (bit 5), unsigned (the grid formats: u, the grid value of a 4-bit index plus 128), in a
   block with a scale and an offset, w = d_b q + m_b:

     q4_0   d f16, m = -8 d              q4_1   d, m f16
     q5_0   d f16, m = -16 d             q5_1   d, m f16
     q1_0   d f16 per 128, m = -d, q = 2 bit (its bits as q5's masks, no nibbles)
     q4_K   per 256: d, dmin f16, per 32 a 6-bit scale s and min m: w = (d s) q - (dmin m)
     q5_K   as q4_K, one more bit
     q6_K   per 256: d f16, per 16 an int8 scale s: w = (d s) (q - 32)
     q3_K   per 256: d f16, per 16 an int8 scale s: w = (d s) (q - 4), q of 3 bits
     q2_K   per 256: d, dmin f16, per 16 a 4-bit scale s and min m: w = (d s) q - (dmin m)
     iq4_NL d f16, q an index into a grid of 16 (weights/blocks.py): w = d (u - 128)
     mxfp4  as iq4_NL on MXFP4's grid, d = 2^(e - 128) (an f16 at load)
     nvfp4  as mxfp4 with a d per 16 values (half NVFP4's UE4M3 scale, an f16 at load), its
            blocks with their middle quarters swapped as stored
     iq4_XS per 256: d f16, per 32 an int8 scale s: w = (d s) (u - 128)
     codebooks  GGUF's IQ3_S ... IQ1_M re-laid as nibbles (weights/grids.py): as iq4_XS on
            their own grid, with a scale per 32 or (IQ2_XS, IQ2_S, IQ1_M) per 16 values, times
            a power of two f: w = (d s f) (u - 128)

   Q3_K and Q2_K keep 2 low bits a value as stored (crumbs, four a byte), spread into the
   nibbles' two vectors by one broadcast load and two shifts. The grid formats' nibbles are
   looked up (vpshufb) into u = grid + 128, unsigned, whose offset is -128.

   The nibbles are vpdpbusd's unsigned operand, x's two signed bytes (cpu_activations.c) the
   other: per block sum q x = 256 sum q a + sum q b exactly in int32 (< 2^24, so exact in fp32
   too; the IQ4 formats' u up to 241 reach 2^26, rounded once to fp32), times d_b in fp32.
   The offsets are sum_b m_b sum_{k in b} x', from the block sums of the rounded x', so that a
   row is sum w x' (cpu_activations.c). With x in 8 bits (xparts_t's lowp, a prompt's opt-in)
   a is q itself with a scale per block, sum q a times d_b sx_b (half the dot products). The
   blocks of the formats with 16-value scales (Q6_K, Q3_K, Q2_K) come with their middle 8-value
   quarters swapped (weights/blocks.py; NVFP4's as stored), so that a byte's two nibbles share a
   scale: its lanes' scales go by halves of quarters. The high bits come as byte masks
   (vpmovm2b): for each group the mask of its low-nibble values, then of its high-nibble ones (per
   bit); Q1_0's one bit too.

   The group loader, the grids and the list of formats are cpu_nibble.h's, shared with
   cpu_dequant.c, which writes the values themselves. */

#include "cpu_nibble.h"

#ifdef EL_X86

/* acc plus one token's part of a group (one fused multiply-add by the scales): p its chunk
   a_lo a_hi b_lo b_hi (LOWP: a_lo a_hi, then x's block scales as 16 lanes, which multiply the
   weights' first) */
/* src + u1 . s1 + u2 . s2 per dword; U6: every u below 64 (not a grid's), which the AVX2 build
   sums in one widening (simd.h DPBUSD2_U6) */
#define DOT2(U6, src, u1, s1, u2, s2)                                                             \
    ((U6) ? DPBUSD2_U6(src, u1, s1, u2, s2)                                                      \
          : _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(src, u1, s1), u2, s2))
T_VNNI INLINE __m512 group_tok(const group_t *G, const char *p, __m512 acc, const int LOWP,
                               const int U6) {
#ifdef EL_AVX2
    if (!U6 && !LOWP) /* x as x16 (el_pack_block's X16): the same integers, a third the work */
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(el_dot_x16(G->lo, G->hi, p)), G->dv, acc);
#endif
    const __m512i z = _mm512_setzero_si512();
    const __m512i al = _mm512_loadu_si512(p), ah = _mm512_loadu_si512(p + 64);
    __m512i t = DOT2(U6, z, G->lo, al, G->hi, ah);
    if (LOWP) {
        const __m512 s = _mm512_mul_ps(G->dv, _mm512_loadu_ps((const float *)(p + 128)));
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), s, acc);
    }
    /* 256 sum q a + sum q b: b's dot products accumulate onto a's shifted (an add less; exact
       in int32, as shifts distribute over the sums) */
    const __m512i bl = _mm512_loadu_si512(p + 128), bh = _mm512_loadu_si512(p + 192);
    t = DOT2(U6, _mm512_slli_epi32(t, 8), G->lo, bl, G->hi, bh);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), G->dv, acc);
}

/* c where a format with an int8 scale per 16 values (IS_HALF16) has the offset - c d s_j f
   (its values q - c, f the codebooks' power of two): Q6_K 32, Q3_K 4, the GRID16 codebooks 128;
   Q2_K 0 (mins of its own, - dmin m_j) */
INLINE int half_center(const int FMT) {
    return FMT == FMT_Q6_K ? 32 : FMT == FMT_Q3_K ? 4 : FMT == FMT_Q2_K ? 0 : 128;
}

/* sum_b m_b (sum of x over block b) as 16 lanes to be summed, for each of T tokens (xs[t]: the
   token's block sums then half-block sums): each scale vector is loaded and converted once for
   all T, and every token's sum runs over the blocks in the same order whatever T is */
T_VNNI INLINE void offset_lanes(const int FMT, const uint16_t *d, const uint16_t *mn,
                                const int8_t *sub, const float *const *xs, int64_t nb,
                                int64_t Kp, __m512 *off, const int T) {
    __m512 acc[TMAX];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    if (FMT == FMT_Q4_K || FMT == FMT_Q5_K || IS_XS(FMT)) { /* per 32 values: the K-quants'
        - dmin m_j, the XS grids' - 128 f d s_j; a superblock of 8 blocks at a time */
        __m256 a8[TMAX];
        for (int t = 0; t < T; t++) a8[t] = _mm256_setzero_ps();
        for (int64_t sb = 0; sb < nb / 8; sb++) {
            int64_t m8;
            memcpy(&m8, IS_XS(FMT) ? sub + sb * 8 : sub + sb * 16 + 8, 8);
            const __m128i m = _mm_cvtsi64_si128(m8);
            __m256 mf = _mm256_cvtepi32_ps(IS_XS(FMT) ? _mm256_cvtepi8_epi32(m)
                                                      : _mm256_cvtepu8_epi32(m));
            const uint16_t h = IS_XS(FMT) ? d[sb] : mn[sb];
            __m256 dm = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(h)), mf);
            for (int t = 0; t < T; t++)
                a8[t] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(xs[t] + sb * 8), a8[t]);
        }
        const __m256 k = _mm256_set1_ps(IS_XS(FMT) ? -128.0f * grid_f(FMT) : -1.0f);
        for (int t = 0; t < T; t++) off[t] = _mm512_zextps256_ps512(_mm256_mul_ps(a8[t], k));
        return;
    }
    if (IS_HALF16(FMT)) { /* per 16 values: - 32 d s_j (q6_K), - 4 d s_j (q3_K), - dmin m_j,
                             - 128 f d s_j (GRID16) */
        for (int64_t sb = 0; sb < nb / 8; sb++) {
            const __m128i s = _mm_loadu_si128((const __m128i *)(sub + sb * 16));
            __m512 sf = _mm512_cvtepi32_ps(FMT == FMT_Q2_K
                                               ? _mm512_srli_epi32(_mm512_cvtepu8_epi32(s), 4)
                                               : _mm512_cvtepi8_epi32(s));
            const uint16_t h = FMT == FMT_Q2_K ? mn[sb] : d[sb];
            __m512 ds = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(h)), sf);
            for (int t = 0; t < T; t++)
                acc[t] = _mm512_fmadd_ps(ds, _mm512_loadu_ps(xs[t] + Kp / 32 + sb * 16), acc[t]);
        }
        const float k = FMT == FMT_Q2_K ? -1.0f : -(float)half_center(FMT) * grid_f(FMT);
        for (int t = 0; t < T; t++) off[t] = _mm512_mul_ps(acc[t], _mm512_set1_ps(k));
        return;
    }
    /* an f16 scale per block of 32 (NVFP4: per 16 values, with x's 16-value sums after the
       32-value ones), times x's sums */
    const uint16_t *src = FMT == FMT_Q4_1 || FMT == FMT_Q5_1 ? mn : d;
    const int64_t n = FMT == FMT_NVFP4 ? 2 * nb : nb, at = FMT == FMT_NVFP4 ? Kp / 32 : 0;
    const float k = FMT == FMT_Q1_0                 ? -1.0f
                    : FMT == FMT_Q4_0               ? -8.0f
                    : FMT == FMT_Q5_0               ? -16.0f
                    : IS_NL(FMT) || FMT == FMT_NVFP4 ? -128.0f
                                                    : 1.0f;
    for (int64_t b = 0; b < n; b += 16) { /* the last 16 masked */
        const __mmask16 m = MASK(n, b);
        __m512 mv = FMT == FMT_Q1_0 ? q1_scales(src, nb, b)
                                    : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src + b));
        for (int t = 0; t < T; t++)
            acc[t] = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(m, xs[t] + at + b), acc[t]);
    }
    for (int t = 0; t < T; t++)
        off[t] = k == 1.0f ? acc[t] : _mm512_mul_ps(acc[t], _mm512_set1_ps(k));
}

/* one row for T tokens: res[t] = sx[t] (its dot in units of x's scale) + its offsets, as 16
   lanes (EL_TILES sums them, 16 rows at once) */
T_VNNI INLINE void rows_t(const int FMT, const uint8_t *q, const uint16_t *d, const uint16_t *mn,
                          const uint8_t *high, const int8_t *sub, const char *xp,
                          const float *const *xs, const float *sx, int64_t K, int64_t Kp,
                          __m512 *res, const int T, const int LOWP) {
    const int64_t CB = LOWP ? 192 : 256, nb = K / 32;
    /* one accumulator a token: T of them are the independent chains (a second per token, for
       odd groups, was no faster at T = 1 and slower at T = 5). Measured and not taken
       (BENCHMARKS.md, 2026-11-28): two rows at a time sharing x's loads (level), and blocks of
       6 or 8 tokens, which one accumulator would allow (1.1-1.25x the time at 40 tokens). */
    __m512 acc[TMAX];
    for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
    int64_t g = 0;
    const int64_t QB = IS_BITS(FMT) ? 16 : IS_CRUMB(FMT) ? 32 : 64; /* bytes of q a group */
    const int U6 = !IS_GRID(FMT); /* every value below 64 (group_tok) */
    const int HIGH1 = FMT == FMT_Q5_0 || FMT == FMT_Q5_1 || FMT == FMT_Q5_K || FMT == FMT_Q3_K;
    const int64_t HB = FMT == FMT_Q6_K ? 32 : HIGH1 ? 16 : 0; /* and of the high bits' masks */
    /* both streams prefetched PREFETCH_AHEAD on: decode 1.02-1.26x with one thread on the Xeon,
       0.99-1.42x with two (Q6_K, bound by its unpacking, level; BENCHMARKS.md, 2026-12-06) */
    for (; (g + 1) * 4 <= nb; g++) {
        _mm_prefetch((const char *)q + g * QB + PREFETCH_AHEAD, _MM_HINT_T0);
        if (HB) _mm_prefetch((const char *)high + g * HB + PREFETCH_AHEAD, _MM_HINT_T0);
        const group_t G = load_group(FMT, q, d, high, sub, g, 4);
        for (int t = 0; t < T; t++) acc[t] = group_tok(&G, xp + (g * T + t) * CB, acc[t], LOWP, U6);
    }
    if (g * 4 < nb) { /* the last 1-3 blocks (legacy formats: K % 256 may be nonzero) */
        const group_t G = load_group(FMT, q, d, high, sub, g, nb - g * 4);
        for (int t = 0; t < T; t++) acc[t] = group_tok(&G, xp + (g * T + t) * CB, acc[t], LOWP, U6);
    }
    __m512 off[TMAX];
    offset_lanes(FMT, d, mn, sub, xs, nb, Kp, off, T);
    for (int t = 0; t < T; t++)
        res[t] = _mm512_fmadd_ps(acc[t], _mm512_set1_ps(sx[t]), off[t]);
    /* LOWP: sx[t] is 1 (x's scales are in acc already): a multiply by 1 changes no bits */
}

/* one row for the T tokens of a span */
T_VNNI INLINE void row_t(const int FMT, const span_t *sp, int64_t r, const char *wr,
                         const char *xp, const int64_t *v, __m512 *res, const int T,
                         const int LOWP) {
    const int64_t K = sp->K, Kp = sp->P->Kp;
    const wrow_t w = wrow(FMT, sp->w, r, K, wr);
    const float *bsum[TMAX];
    float sx[TMAX];
    for (int t = 0; t < T; t++) {
        bsum[t] = sp->P->xs + v[t] * (Kp / 32 + Kp / 16);
        sx[t] = sp->P->sx[v[t]];
    }
    rows_t(FMT, w.q, w.d, w.mn, w.high, w.sub, xp, bsum, sx, K, Kp, res, T, LOWP);
}

/* the rows of a span for T tokens (a constant: BY_T_LOWP) in format F_, a constant too */
#define ROWS(n, lp) EL_TILES(sp, r0, r1, rb, n, row_t(F_, sp, r, wr, xp, v, lanes, n, lp))
#define SPAN(F)                                                                  \
    T_VNNI static void span_##F(const span_t *sp, int64_t r0, int64_t r1) {      \
        const int F_ = FMT_##F;                                                  \
        const int64_t rb = el_row_bytes(F_, sp->K);                              \
        BY_T_LOWP(sp->T, sp->P->lowp, ROWS)                                      \
    }
NIBBLE_FORMATS(SPAN)

void el_span_nibble(const span_t *sp, int64_t r0, int64_t r1) {
#define SPAN_CASE(F) \
    case FMT_##F: span_##F(sp, r0, r1); break;
    switch ((int)sp->w->fmt) { NIBBLE_FORMATS(SPAN_CASE) }
#undef SPAN_CASE
}

/* ---- for AMX tiles (cpu_amx_blocks.c): a prompt's chunk, a scale per 32 values ----------- */

/* a group's values (lo: its blocks' low-nibble values, hi: their high ones, 16 bytes a block)
   to o in x's nibble order, block by block (a block's 16 low, then its 16 high), n <= 4 blocks */
T_VNNI INLINE void store_x_order(int8_t *o, __m512i lo, __m512i hi, int64_t n) {
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    const __mmask64 all = ~(__mmask64)0, half = ((__mmask64)1 << 32) - 1; /* 2, 1 block */
    _mm512_mask_storeu_epi8(o, n >= 2 ? all : half, _mm512_permutex2var_epi64(lo, first, hi));
    if (n > 2)
        _mm512_mask_storeu_epi8(o + 64, n == 4 ? all : half,
                                _mm512_permutex2var_epi64(lo, second, hi));
}

/* 16 rows from r0 (`rows` of them, the rest zeros) as their values q less the format's centre
   c (el_nibble_center), one signed byte each, block by block in x's nibble order (a block's 16
   low-nibble values, then its 16 high ones), to q (rows of K bytes), and each block's scale d_b
   (the kernels' dv) to sc (rows of K / 32) */
T_VNNI INLINE void decode_tile(const int FMT, const qmat_t *w, int64_t r0, int rows, int64_t K,
                               int8_t *q, float *sc) {
    const __m512i c = _mm512_set1_epi8((char)el_nibble_center(FMT));
    const int64_t nb = K / 32, rb = el_row_bytes(FMT, K);
    memset(q + rows * K, 0, (size_t)((16 - rows) * K));
    memset(sc + rows * nb, 0, sizeof(float) * (size_t)((16 - rows) * nb));
    for (int i = 0; i < rows; i++) {
        const wrow_t wr = wrow(FMT, w, r0 + i, K, (const char *)w->data + (r0 + i) * rb);
        for (int64_t g = 0; g * 4 < nb; g++) {
            const int64_t n = nb - g * 4 < 4 ? nb - g * 4 : 4;
            const group_t G = load_group(FMT, wr.q, wr.d, wr.high, wr.sub, g, n);
            store_x_order(q + i * K + g * 128, _mm512_sub_epi8(G.lo, c),
                          _mm512_sub_epi8(G.hi, c), n);
            const __mmask16 quarters = (__mmask16)(0x1111 & ((1u << (4 * n)) - 1));
            _mm512_mask_compressstoreu_ps(sc + i * nb + g * 4, quarters, G.dv);
        }
    }
}

/* the formats without a centre (mins of their own): each block's min coefficient m_b, the
   row's offset being sum_b m_b (sum of x over block b), for `rows` rows from r0, block-major
   (mt[b 16 + i]; zeros past the last row): Q4_1, Q5_1 an f16 m per block, Q4_K, Q5_K
   - dmin m_j (offset_lanes' terms) */
T_VNNI INLINE void tile_mins(const int FMT, const qmat_t *w, int64_t r0, int rows, int64_t K,
                             float *mt) {
    const int64_t nb = K / 32, rb = el_row_bytes(FMT, K);
    memset(mt, 0, sizeof(float) * (size_t)(16 * nb));
    for (int i = 0; i < rows; i++) {
        const wrow_t wr = wrow(FMT, w, r0 + i, K, (const char *)w->data + (r0 + i) * rb);
        for (int64_t b = 0; b < nb; b++)
            mt[b * 16 + i] = FMT == FMT_Q4_K || FMT == FMT_Q5_K
                                 ? -_cvtsh_ss(wr.mn[b / 8]) *
                                       (float)((const uint8_t *)wr.sub)[(b / 8) * 16 + 8 + b % 8]
                                 : _cvtsh_ss(wr.mn[b]);
    }
}

/* ---- for AMX tiles (cpu_amx_blocks.c): a prompt's chunk, a scale per 16 values ----------- */

/* (q - c) s for one nibble vector of a group: 64 signed bytes times their 16-value scales, exact
   in int16 (|q - c| <= 43, |s| <= 128: at most 4,096), as its low bytes (unsigned) and its high
   ones (signed, w >> 8), so that w = 256 hi + lo */
T_VNNI INLINE void scaled_bytes(__m512i v, __m512i s, __m512i *lo, __m512i *hi) {
    __m256i l[2], h[2];
    for (int i = 0; i < 2; i++) {
        const __m512i w = _mm512_mullo_epi16(
            _mm512_cvtepi8_epi16(i ? _mm512_extracti64x4_epi64(v, 1) : _mm512_castsi512_si256(v)),
            _mm512_cvtepi8_epi16(i ? _mm512_extracti64x4_epi64(s, 1) : _mm512_castsi512_si256(s)));
        l[i] = _mm512_cvtepi16_epi8(w); /* truncation: the low byte */
        h[i] = _mm512_cvtepi16_epi8(_mm512_srai_epi16(w, 8));
    }
    *lo = _mm512_inserti64x4(_mm512_castsi256_si512(l[0]), l[1], 1);
    *hi = _mm512_inserti64x4(_mm512_castsi256_si512(h[0]), h[1], 1);
}

/* 16 rows from r0 (`rows` of them, the rest zeros) of a format with an int8 scale per 16 values
   (IS_HALF16) as w = (q - c) s, the superblock's d aside: its low bytes to wl and high bytes to
   wh (rows of K bytes each), block by block in x's nibble order as decode_tile's; each
   superblock's d (times the codebooks' f) to dsb (rows of K / 256); Q2_K's min coefficients
   - dmin m_j, one per 16 values, to mt (16-value group major: mt[j 16 + i], x's half-block
   sums' order) */
T_VNNI INLINE void decode_half(const int FMT, const qmat_t *w, int64_t r0, int rows, int64_t K,
                               uint8_t *wl, int8_t *wh, float *dsb, float *mt) {
    const __m512i c = _mm512_set1_epi8((char)half_center(FMT));
    const int64_t nsb = K / 256, rb = el_row_bytes(FMT, K);
    /* lane L of a group's vectors holds block L: its bytes 0-7 take scale 2L, 8-15 scale 2L + 1
       (the swapped quarters: a byte's two nibbles share a scale) */
    const __m512i at = _mm512_set_epi64(0x0707070707070707, 0x0606060606060606,
                                        0x0505050505050505, 0x0404040404040404,
                                        0x0303030303030303, 0x0202020202020202,
                                        0x0101010101010101, 0);
    memset(wl + rows * K, 0, (size_t)((16 - rows) * K));
    memset(wh + rows * K, 0, (size_t)((16 - rows) * K));
    memset(dsb + rows * nsb, 0, sizeof(float) * (size_t)((16 - rows) * nsb));
    if (FMT != FMT_Q2_K) mt = NULL; /* mins: Q2_K's alone */
    if (mt) memset(mt, 0, sizeof(float) * (size_t)(K));
    for (int i = 0; i < rows; i++) {
        const wrow_t wr = wrow(FMT, w, r0 + i, K, (const char *)w->data + (r0 + i) * rb);
        const uint8_t *ms = (const uint8_t *)wr.sub; /* Q2_K: per 16 values, min high */
        for (int64_t sb = 0; sb < nsb; sb++) {
            dsb[i * nsb + sb] = _cvtsh_ss(wr.d[sb]) * grid_f(FMT);
            for (int j = 0; mt && j < 16; j++)
                mt[(sb * 16 + j) * 16 + i] = -_cvtsh_ss(wr.mn[sb]) * (float)(ms[sb * 16 + j] >> 4);
        }
        for (int64_t g = 0; g < K / 128; g++) {
            const group_t G = load_group(FMT, wr.q, wr.d, wr.high, wr.sub, g, 4);
            int64_t s8;
            memcpy(&s8, wr.sub + (g / 2) * 16 + (g % 2) * 8, 8);
            __m512i s = _mm512_shuffle_epi8(_mm512_set1_epi64(s8), at); /* in its lane */
            if (FMT == FMT_Q2_K) s = _mm512_and_si512(s, _mm512_set1_epi8(0x0F));
            __m512i ll, lh, hl, hh;
            scaled_bytes(_mm512_sub_epi8(G.lo, c), s, &ll, &lh);
            scaled_bytes(_mm512_sub_epi8(G.hi, c), s, &hl, &hh);
            store_x_order((int8_t *)wl + i * K + g * 128, ll, hl, 4);
            store_x_order(wh + i * K + g * 128, lh, hh, 4);
        }
    }
}

int el_nibble_tiles(int fmt) { return IS_NIBBLE(fmt) && !IS_SWAPPED(fmt); }

/* c where a format's offset is - c d_b (sum of x over block b) with the block's own scale
   d_b (offset_lanes' k), so that the tiles take q - c as signed bytes and need no offset; 0
   where it has mins of its own (Q4_1, Q5_1, Q4_K, Q5_K: q < 32, signed bytes too) */
int el_nibble_center(int fmt) {
    return fmt == FMT_Q4_0 ? 8 : fmt == FMT_Q5_0 ? 16 : fmt == FMT_Q1_0 ? 1
           : IS_GRID(fmt) ? 128 : 0;
}

T_VNNI void el_nibble_decode_tile(const qmat_t *w, int64_t r0, int rows, int64_t K, int8_t *q,
                                  float *sc) {
#define DECODE_CASE(F) \
    case FMT_##F: decode_tile(FMT_##F, w, r0, rows, K, q, sc); break;
    switch ((int)w->fmt) { NIBBLE_FORMATS(DECODE_CASE) }
#undef DECODE_CASE
}

T_VNNI void el_nibble_decode_half(const qmat_t *w, int64_t r0, int rows, int64_t K,
                                 uint8_t *wl, int8_t *wh, float *dsb, float *mt) {
#define HALF_CASE(F) \
    case FMT_##F: decode_half(FMT_##F, w, r0, rows, K, wl, wh, dsb, mt); break;
    switch ((int)w->fmt) { HALF16_FORMATS(HALF_CASE) }
#undef HALF_CASE
}

T_VNNI void el_nibble_tile_mins(const qmat_t *w, int64_t r0, int rows, int64_t K, float *mt) {
    switch ((int)w->fmt) {
    case FMT_Q4_1: tile_mins(FMT_Q4_1, w, r0, rows, K, mt); break;
    case FMT_Q5_1: tile_mins(FMT_Q5_1, w, r0, rows, K, mt); break;
    case FMT_Q4_K: tile_mins(FMT_Q4_K, w, r0, rows, K, mt); break;
    case FMT_Q5_K: tile_mins(FMT_Q5_K, w, r0, rows, K, mt); break;
    }
}
#else
void el_span_nibble(const span_t *sp, int64_t r0, int64_t r1) { (void)sp, (void)r0, (void)r1; }
int el_nibble_tiles(int fmt) { (void)fmt; return 0; }
int el_nibble_center(int fmt) { (void)fmt; return 0; }
#endif
