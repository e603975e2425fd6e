/* The values themselves (fp32 or bf16) of a matrix in one of GGUF's block formats, for a long
   prefill's GEMM (step/prefill.py), decoded by the products' own group loader (cpu_nibble.h):
   weights/blocks.py's `dequantize` is its reference, bit for bit. Q8_0's is here too, as the
   one other block format. */

#include "cpu_nibble.h"

#ifdef EL_X86

/* 16 values to out at i: fp32, or bf16 rounded to nearest even (finite values: torch's
   rounding, without needing AVX512_BF16) */
T_VNNI INLINE void put16(void *out, int64_t i, __m512 v, int bf16) {
    if (!bf16) {
        _mm512_storeu_ps((float *)out + i, v);
        return;
    }
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + i),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}

T_VNNI INLINE __m512 u8_ps(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* block blk (32 values, q: its 16 low- and 16 high-nibble values) with weights/blocks.py's
   operations in its order: w = d (q - 8), d q + m, (d s) q - (dmin m), (d s) (q - 32), ... */
T_VNNI INLINE void deq_block(const int FMT, const uint8_t *ql, const uint8_t *qh,
                             const uint16_t *d, const uint16_t *mn, const int8_t *sub,
                             int64_t blk, void *out, int bf16) {
    __m512 q0 = u8_ps(ql), q1 = u8_ps(qh);
    const int64_t sb = blk / 8, j = blk % 8;
    __m512 w0, w1;
    if (IS_SWAPPED(FMT)) { /* quarters swapped: values 0-15 are the low nibbles' 0-7, then the
                              high ones' 0-7 */
        const __m512 v0 = _mm512_shuffle_f32x4(q0, q1, 0x44);
        q1 = _mm512_shuffle_f32x4(q0, q1, 0xEE);
        q0 = v0;
    }
    if (FMT == FMT_Q4_0 || FMT == FMT_Q5_0 || FMT == FMT_Q1_0) {
        const __m512 dv = _mm512_set1_ps(_cvtsh_ss(d[FMT == FMT_Q1_0 ? blk / 4 : blk]));
        const __m512 off = _mm512_set1_ps(FMT == FMT_Q4_0 ? 8.0f : FMT == FMT_Q5_0 ? 16.0f : 1.0f);
        w0 = _mm512_mul_ps(dv, _mm512_sub_ps(q0, off));
        w1 = _mm512_mul_ps(dv, _mm512_sub_ps(q1, off));
    } else if (FMT == FMT_Q4_1 || FMT == FMT_Q5_1) {
        const __m512 dv = _mm512_set1_ps(_cvtsh_ss(d[blk])), m = _mm512_set1_ps(_cvtsh_ss(mn[blk]));
        w0 = _mm512_add_ps(_mm512_mul_ps(dv, q0), m);
        w1 = _mm512_add_ps(_mm512_mul_ps(dv, q1), m);
    } else if (FMT == FMT_NVFP4) { /* the grid, a d per 16 values */
        const __m512 c = _mm512_set1_ps(128.0f);
        w0 = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(d[2 * blk])), _mm512_sub_ps(q0, c));
        w1 = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(d[2 * blk + 1])), _mm512_sub_ps(q1, c));
    } else if (IS_GRID(FMT) && !IS_GRID16(FMT)) { /* the grid: u - 128 */
        const __m512 c = _mm512_set1_ps(128.0f);
        const __m512 dv = _mm512_set1_ps(
            IS_NL(FMT) ? _cvtsh_ss(d[blk]) : _cvtsh_ss(d[sb]) * (float)sub[blk] * grid_f(FMT));
        w0 = _mm512_mul_ps(dv, _mm512_sub_ps(q0, c));
        w1 = _mm512_mul_ps(dv, _mm512_sub_ps(q1, c));
    } else if (FMT == FMT_Q2_K) { /* per 16 values a scale (low 4 bits) and a min (high 4) */
        const uint8_t *s = (const uint8_t *)sub + sb * 16 + 2 * j;
        const float dd = _cvtsh_ss(d[sb]), dm = _cvtsh_ss(mn[sb]);
        w0 = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(dd * (float)(s[0] & 15)), q0),
                           _mm512_set1_ps(dm * (float)(s[0] >> 4)));
        w1 = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(dd * (float)(s[1] & 15)), q1),
                           _mm512_set1_ps(dm * (float)(s[1] >> 4)));
    } else if (IS_HALF16(FMT)) { /* q6_K, q3_K, GRID16: an int8 scale per 16 values */
        const float dd = _cvtsh_ss(d[sb]), f = grid_f(FMT);
        const float c = FMT == FMT_Q6_K ? 32.0f : FMT == FMT_Q3_K ? 4.0f : 128.0f;
        const __m512 lo = _mm512_set1_ps(dd * (float)sub[sb * 16 + 2 * j] * f);
        const __m512 hi = _mm512_set1_ps(dd * (float)sub[sb * 16 + 2 * j + 1] * f);
        w0 = _mm512_mul_ps(lo, _mm512_sub_ps(q0, _mm512_set1_ps(c)));
        w1 = _mm512_mul_ps(hi, _mm512_sub_ps(q1, _mm512_set1_ps(c)));
    } else { /* q4_K, q5_K */
        const uint8_t *s = (const uint8_t *)sub + sb * 16;
        const __m512 ds = _mm512_set1_ps(_cvtsh_ss(d[sb]) * (float)s[j]);
        const __m512 dm = _mm512_set1_ps(_cvtsh_ss(mn[sb]) * (float)s[8 + j]);
        w0 = _mm512_sub_ps(_mm512_mul_ps(ds, q0), dm);
        w1 = _mm512_sub_ps(_mm512_mul_ps(ds, q1), dm);
    }
    put16(out, blk * 32, w0, bf16);
    put16(out, blk * 32 + 16, w1, bf16);
}

/* row r (K values) of a nibble-format matrix: its groups' values as the products read them */
T_VNNI INLINE void deq_row(const int FMT, const qmat_t *w, int64_t r, int64_t K, void *out,
                           int bf16) {
    const int64_t nb = K / 32;
    const wrow_t f = wrow(FMT, w, r, K, (const char *)w->data + r * el_row_bytes(FMT, K));
    uint8_t lo[64] __attribute__((aligned(64))), hi[64] __attribute__((aligned(64)));
    for (int64_t g = 0; g * 4 < nb; g++) {
        const int64_t n = nb - g * 4 >= 4 ? 4 : nb - g * 4;
        const group_t G = load_group(FMT, f.q, f.d, f.high, f.sub, g, n);
        _mm512_store_si512(lo, G.lo);
        _mm512_store_si512(hi, G.hi);
        for (int64_t b = 0; b < n; b++)
            deq_block(FMT, lo + 16 * b, hi + 16 * b, f.d, f.mn, f.sub, g * 4 + b, out, bf16);
    }
}

T_VNNI static void deq_q8_0_row(const qmat_t *w, int64_t r, int64_t K, void *out, int bf16) {
    const int8_t *q = (const int8_t *)w->data + r * K;
    const uint16_t *d = (const uint16_t *)w->scale + r * (K / 32);
    for (int64_t b = 0; b < K / 32; b++) {
        const __m512 dv = _mm512_set1_ps(_cvtsh_ss(d[b]));
        for (int h = 0; h < 2; h++) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(q + b * 32 + h * 16));
            put16(out, b * 32 + h * 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), dv),
                  bf16);
        }
    }
}

#define DEQ(F)                                                                                 \
    T_VNNI static void deq_##F(const qmat_t *w, int64_t r, int64_t K, void *out, int bf16) {   \
        deq_row(FMT_##F, w, r, K, out, bf16);                                                  \
    }
NIBBLE_FORMATS(DEQ)

int el_dequant(const qmat_t *w, int64_t N, int64_t K, void *out, int bf16, int threads) {
    void (*row)(const qmat_t *, int64_t, int64_t, void *, int);
    switch ((int)w->fmt) {
    case FMT_Q8_0: row = deq_q8_0_row; break;
#define DEQ_CASE(F) \
    case FMT_##F: row = deq_##F; break;
        NIBBLE_FORMATS(DEQ_CASE)
#undef DEQ_CASE
    default: return -1;
    }
    if (!(el_features() & HAS_VNNI) || K % BLOCK_VALUES(w->fmt)) return -1;
    const int64_t rb = K * (bf16 ? 2 : 4);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < N; r++) row(w, r, K, (char *)out + r * rb, bf16);
    return 0;
}
#else
int el_dequant(const qmat_t *w, int64_t N, int64_t K, void *out, int bf16, int threads) {
    (void)w, (void)N, (void)K, (void)out, (void)bf16, (void)threads;
    return -1;
}
#endif
