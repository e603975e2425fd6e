/* bf16 and int8 weights through AMX tiles (Intel Sapphire Rapids on): el_matmul's product for
   those two formats where the CPU has AMX-BF16 and AMX-INT8 and Linux grants the tile state
   (el_features' HAS_AMX).

   The weights stay as they are stored, rows of K values (the model's own forward shares them):
   16 rows by 64 bytes are a tile as they lie, loaded with the row stride. x takes the tile
   product's other side, its 4-byte words of up to 16 tokens side by side (word w of token t at
   w Tw + t), in the two parts the dot-product kernels take: bf16 x = hi + lo, each rounded to
   bf16 (lowp: the hi part alone), 2 values a word; int8 x in 16-bit fixed point, 256 a + b, as
   two bytes, 4 values a word. Each 64-byte step of K adds W x_hi, then W x_lo: bf16 into one
   fp32 tile of 16 rows by Tw tokens, int8 into two int32 ones (exact, so int8 has the bits of
   cpu_matmul.c's vpdpbusd kernel). A (row, token)'s sum is built the same way whatever the
   block's width or the other tokens in it, so a row's bits do not depend on S (greedy
   speculative output equals plain greedy; tests/test_packed_verify.py checks it on every CPU
   that has AMX). bf16's are not the vdpbf16ps kernel's bits (another order of sums): a machine
   uses one of the two for every product.

   Why: a tile product does 16 rows x 64 bytes x Tw tokens in one instruction, where vdpbf16ps
   and vpdpbusd do 64 bytes of one row and token. A decode step is bound by the weight stream
   either way, but a verify's rows and a short prompt's tokens are bound by the dot products in
   those kernels (a bf16 verify of 6 rows cost 2.32 plain steps on the Xeon); here they ride the
   same stream (1.26-1.31; BENCHMARKS.md, "bf16 and int8 products in AMX tiles").

   Q8_0 and the nibble formats (but NVFP4, whose 16-value scales are f16) only for a prompt's
   chunks (cpu_amx_blocks.c): their blocks each need their integer dot apart, scaled by their own
   scale, and a tile product per block of 32, stored and scaled, made a plain Q8_0 step's
   products 1.5-1.7x slower than the vpdpbusd kernel's (measured: same section), while a chunk of
   40 tokens took 0.43x its time. The formats with 16-value int8 scales fold them into the
   weights instead (el_amx_half_tile; not yet timed on a CPU with AMX). */

#include <stdlib.h>
#include <string.h>

#include "cpu_amx.h"

#ifdef EL_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

int el_amx_emulated;
_Thread_local amx_tiles_t el_amx_tiles;
int el_amx_emulate(void) { return el_amx_emulated = 1; }

/* AMX-BF16, AMX-TILE and AMX-INT8 (CPUID 7.0 EDX bits 22, 24, 25), and Linux's leave to use
   the tile data (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA: a process asks once) */
int el_amx_usable(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const unsigned need = 1u << 22 | 1u << 24 | 1u << 25;
    if ((d & need) != need) return 0;
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

/* bf16: tiles 0-2 the blocks' sums, 16 rows x Tw fp32; 3: 16 weight rows x 32 values; 4, 5: x's
   hi and lo pairs of one block, 16 pairs x Tw. int8: tiles 0-5 the blocks' hi and lo sums, 16
   rows x Tw int32; 6: 16 weight rows x 64 values; 7: x's hi quads of one block, and its lo
   quads in a free tile (2 for one block, 4 for two) or in 7 again (three). Q8_0 and the nibble
   formats (cpu_amx_blocks.c) as int8 but a block of 32 values: 16 x 32 bytes of weights, 8
   words of x, lo in 4 or 7. The formats with 16-value scales: tiles 0-2 the sums, 3, 4 the
   weights' low and high bytes (16 x 64), 5, 6 x's hi and lo quads. */
T_AMX static void configure(int fmt, int Tw, int nb) {
    tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    const int a = fmt == FMT_BF16 ? 3 : 6;
    for (int i = 0; i < 8; i++) c.rows[i] = 16, c.colsb[i] = (uint16_t)(i == a ? 64 : 4 * Tw);
    if (IS_HALF16(fmt)) c.colsb[3] = c.colsb[4] = 64, c.colsb[6] = (uint16_t)(4 * Tw);
    if (fmt == FMT_Q8_0) { /* a block of 32 values: weights 16 x 32 bytes, x 8 words x Tw */
        c.colsb[6] = 32, c.rows[7] = 8;
        if (nb < 3) c.rows[4] = 8; /* x's lo words (tiles 4, 5 hold sums for three blocks) */
    }
    TILE_LOADCONFIG(&c);
}

/* one tile of bf16 rows (w: its first, `rows` <= 16 of them) for NB blocks of Tw tokens: c gets
   NB x 16 x Tw sums. xb: the lane's blocks, each a hi then a lo plane of PB bytes. */
#define DP_BF16(C)                                                                           \
    do {                                                                                     \
        const char *xk = xb + (int64_t)(C) * 2 * PB + kb * 16 * Tw * 4;                        \
        TILE_LOADD(4, xk, 4 * Tw);                                                           \
        TILE_DPBF16PS(C, 3, 4);                                                              \
        if (!LOWP) {                                                                         \
            TILE_LOADD(5, xk + PB, 4 * Tw);                                                  \
            TILE_DPBF16PS(C, 3, 5);                                                          \
        }                                                                                    \
    } while (0)
T_AMX INLINE void tile_bf16(const char *w, int64_t K, int rows, const char *xb, int64_t PB,
                            int Tw, float *c, const int NB, const int LOWP) {
    char buf[16 * 64];
    TILE_ZERO(0);
    if (NB > 1) TILE_ZERO(1);
    if (NB > 2) TILE_ZERO(2);
    for (int64_t kb = 0; kb * 32 < K; kb++) {
        PREFETCH_NEXT(w, 2 * K, kb, 16);
        int64_t stride; /* set by weight_tile, before the load reads it */
        const char *wt = weight_tile(w, 2 * K, rows, kb * 64, 64, buf, &stride);
        TILE_LOADD(3, wt, stride);
        DP_BF16(0);
        if (NB > 1) DP_BF16(1);
        if (NB > 2) DP_BF16(2);
    }
    TILE_STORED(0, c, 4 * Tw);
    if (NB > 1) TILE_STORED(1, c + 16 * Tw, 4 * Tw);
    if (NB > 2) TILE_STORED(2, c + 32 * Tw, 4 * Tw);
}

/* the same for int8 rows: for block b, tile 2b the sums of w (a + 128), tile 2b + 1 of w b
   (x = 256 a + b, cpu_activations.c's two bytes), each exact in int32 */
#define DP_I8(B, HI, LO, X2) /* tile numbers as literals: the intrinsics paste them into asm */ \
    do {                                                                                     \
        const char *xk = xb + (int64_t)(B) * 2 * PB + kb * 16 * Tw * 4;                        \
        TILE_LOADD(7, xk, 4 * Tw);                                                           \
        TILE_DPBSUD(HI, 6, 7);                                                               \
        TILE_LOADD(X2, xk + PB, 4 * Tw);                                                     \
        TILE_DPBSUD(LO, 6, X2);                                                              \
    } while (0)
T_AMX INLINE void tile_i8(const char *w, int64_t K, int rows, const char *xb, int64_t PB,
                          int Tw, int32_t *c, const int NB) {
    char buf[16 * 64];
    TILE_ZERO(0);
    TILE_ZERO(1);
    if (NB > 1) {
        TILE_ZERO(2);
        TILE_ZERO(3);
    }
    if (NB > 2) {
        TILE_ZERO(4);
        TILE_ZERO(5);
    }
    for (int64_t kb = 0; kb * 64 < K; kb++) {
        PREFETCH_NEXT(w, K, kb, 16);
        int64_t stride; /* set by weight_tile, before the load reads it */
        const char *wt = weight_tile(w, K, rows, kb * 64, 64, buf, &stride);
        TILE_LOADD(6, wt, stride);
        /* x's lo part in a tile of its own where one is free (tile 7 again for three blocks:
           its load then waits for the hi part's product) */
        if (NB == 1) DP_I8(0, 0, 1, 2);
        if (NB == 2) {
            DP_I8(0, 0, 1, 4);
            DP_I8(1, 2, 3, 4);
        }
        if (NB == 3) {
            DP_I8(0, 0, 1, 7);
            DP_I8(1, 2, 3, 7);
            DP_I8(2, 4, 5, 7);
        }
    }
    TILE_STORED(0, c, 4 * Tw);
    TILE_STORED(1, c + 16 * Tw, 4 * Tw);
    if (NB > 1) {
        TILE_STORED(2, c + 32 * Tw, 4 * Tw);
        TILE_STORED(3, c + 48 * Tw, 4 * Tw);
    }
    if (NB > 2) {
        TILE_STORED(4, c + 64 * Tw, 4 * Tw);
        TILE_STORED(5, c + 80 * Tw, 4 * Tw);
    }
}

/* token t's x (K values) as the hi and lo planes of its block, 4 bytes a word: word w at w Tw +
   t. bf16: values 2w, 2w + 1 of x = hi + lo, each rounded to bf16; a padding token (x NULL)
   zeros. */
T_AMX static void pack_bf16(const float *x, int64_t K, int64_t Kw, int Tw, int t, uint32_t *hi,
                            uint32_t *lo) {
    const __m256i at = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                          _mm256_set1_epi32(Tw));
    for (int64_t k = 0; k < Kw; k += 16) {
        const __m512 v = x ? _mm512_maskz_loadu_ps(MASK_PAD(K, k), x + k) : _mm512_setzero_ps();
        const __m256bh h = _mm512_cvtneps_pbh(v); /* round to nearest even */
        const __m512 hf =
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
        const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, hf)); /* v - hf is exact */
        _mm512_mask_i32scatter_epi32(hi + k / 2 * Tw + t, 0xFF, _mm512_castsi256_si512(at),
                                     _mm512_castsi256_si512((__m256i)h), 4);
        _mm512_mask_i32scatter_epi32(lo + k / 2 * Tw + t, 0xFF, _mm512_castsi256_si512(at),
                                     _mm512_castsi256_si512((__m256i)l), 4);
    }
}
/* int8: values 4w .. 4w + 3 of the two bytes el_split_x wrote (hi: a + 128, lo: b); with
   flip, hi as the signed a (Q8_0's tiles take it so) */
T_AMX static void pack_i8(const uint8_t *a, const uint8_t *b, int64_t Kw, int Tw, int t,
                          uint32_t *hi, uint32_t *lo, int flip) {
    const __m512i f = _mm512_set1_epi8(flip ? (char)0x80 : 0);
    const __m512i at = row_starts(Tw);
    for (int64_t k = 0; k < Kw; k += 64) {
        const __m512i va =
            a ? _mm512_xor_si512(_mm512_loadu_si512(a + k), f) : _mm512_setzero_si512();
        const __m512i vb = b ? _mm512_loadu_si512(b + k) : _mm512_setzero_si512();
        _mm512_i32scatter_epi32(hi + k / 4 * Tw + t, at, va, 4);
        _mm512_i32scatter_epi32(lo + k / 4 * Tw + t, at, vb, 4);
    }
}

/* a nibble format's x (el_split_x's: per vector its a and b parts, each Kp / 2 bytes of the
   low-nibble places then Kp / 2 of the high ones) as pack_i8 takes x: block j's 32 values as
   the weights' bytes lie (cpu_nibble.c's decode), its 16 low-nibble places, then its 16 high */
T_AMX static void pack_nibble(const xparts_t *P, int64_t v, int64_t Kw, int Tw, int t,
                              uint32_t *hi, uint32_t *lo) {
    int8_t a[AMX_Q8_BLOCKS * 32], b[AMX_Q8_BLOCKS * 32];
    if (P) {
        const int64_t Kp = P->Kp;
        const char *pa = P->a + v * Kp * 2, *pb = P->b + v * Kp * 2;
        for (int64_t j = 0; j < Kw / 32; j++) {
            memcpy(a + 32 * j, pa + 16 * j, 16), memcpy(a + 32 * j + 16, pa + Kp / 2 + 16 * j, 16);
            memcpy(b + 32 * j, pb + 16 * j, 16), memcpy(b + 32 * j + 16, pb + Kp / 2 + 16 * j, 16);
        }
    }
    pack_i8(P ? (const uint8_t *)a : NULL, P ? (const uint8_t *)b : NULL, Kw, Tw, t, hi, lo, 0);
}

/* Up to 16 tokens a block; 17-40 in 2-3 blocks of one width, the last padded with zero tokens
   (a tile product's width is its configuration's). */
INLINE void blocks_of(int64_t S, int64_t *nb, int64_t *Tw) {
    *nb = (S + AMX_TOKENS - 1) / AMX_TOKENS;
    *Tw = (S + *nb - 1) / *nb;
}

int64_t el_amx_scratch(int64_t S, int64_t L, int64_t K) {
    int64_t nb, Tw;
    blocks_of(S, &nb, &Tw); /* the planes; int8 also el_split_x's parts, bf16 wider planes */
    return el_split_scratch(S * L, K) + L * nb * Tw * ((K + 127) / 128 * 128) * 4 + 128;
}

/* the outputs of one tile: row n0 + r of lane l for each token s */
INLINE void put_bf16(const float *c, int64_t S, int64_t Tw, int rows, float *y, int64_t L,
                     int64_t l, int64_t ldy, int64_t n0) {
    for (int64_t s = 0; s < S; s++) { /* block s / Tw, its column s % Tw */
        const float *cs = c + (s / Tw) * 16 * Tw + s % Tw;
        float *ys = y + (s * L + l) * ldy + n0;
        for (int r = 0; r < rows; r++) ys[r] = cs[r * Tw];
    }
}
/* int8: y = sx scale (256 (sum w (a + 128) - 128 sum w) + sum w b) for 16 rows at once, in
   double as cpu_matmul.c's row_i8 (256 t is exact, so its fused add rounds as the sum does) */
T_AMX INLINE void put_i8(const int32_t *c, const qmat_t *w, const float *sx, int64_t S,
                         int64_t Tw, int rows, float *y, int64_t L, int64_t l, int64_t ldy,
                         int64_t N, int64_t n0) {
    const int64_t g = l * N + n0; /* the tile's first row in the matrix */
    const __mmask16 m = rows == 16 ? (__mmask16)0xFFFF : MASK16(rows);
    const __m512i at = row_starts(Tw);
    const int32_t *rowsum = (const int32_t *)w->rowsum + g; /* 128 sum w: exact in int32 */
    const __m512i rs = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(m, rowsum), 7);
    const __m512 sc = _mm512_maskz_loadu_ps(m, (const float *)w->scale + g);
    const __m512d sc0 = _mm512_cvtps_pd(_mm512_castps512_ps256(sc)),
                  sc1 = _mm512_cvtps_pd(_mm512_extractf32x8_ps(sc, 1));
    for (int64_t s = 0; s < S; s++) {
        const int32_t *cs = c + (s / Tw) * 32 * Tw + s % Tw; /* block s / Tw: hi, then lo */
        const __m512i hi = _mm512_sub_epi32(_mm512_i32gather_epi32(at, cs, 4), rs);
        const __m512i lo = _mm512_i32gather_epi32(at, cs + 16 * Tw, 4);
        const __m512d x = _mm512_set1_pd((double)sx[s * L + l]), k = _mm512_set1_pd(256.0);
        __m512d v0 = _mm512_fmadd_pd(k, _mm512_cvtepi32_pd(_mm512_castsi512_si256(hi)),
                                     _mm512_cvtepi32_pd(_mm512_castsi512_si256(lo)));
        __m512d v1 = _mm512_fmadd_pd(k, _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(hi, 1)),
                                     _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(lo, 1)));
        v0 = _mm512_mul_pd(_mm512_mul_pd(x, sc0), v0);
        v1 = _mm512_mul_pd(_mm512_mul_pd(x, sc1), v1);
        const __m512 out = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(v0)),
                                              _mm512_cvtpd_ps(v1), 1);
        _mm512_mask_storeu_ps(y + (s * L + l) * ldy + n0, m, out);
    }
}

#define BY_NB(nb, CALL) \
    if ((nb) == 1)      \
        CALL(1);        \
    else if ((nb) == 2) \
        CALL(2);        \
    else                \
        CALL(3)

/* the fewest tokens of a prompt's chunk whose blocks go in tiles: below, the vpdpbusd kernels
   were faster or level (SmolLM2's shapes, 1 thread: Q8_0 from 8 tokens, Q4_0 and IQ4_XS from 16,
   the formats with mins, decoded with them, from 24; BENCHMARKS.md, "The nibble formats' prompts
   in AMX tiles too", `bench.cpu_products --prompt`) */
static int64_t prompt_min(int fmt) {
    return fmt == FMT_Q8_0 ? 8 : IS_HALF16(fmt) ? 16 : el_nibble_center(fmt) ? 16 : 24;
}

int el_amx_takes(int fmt, int64_t K, int64_t S, int flags) {
    if (!(el_features() & HAS_AMX)) return 0;
    return fmt == FMT_BF16 || fmt == FMT_I8 ||
           ((fmt == FMT_Q8_0 || el_nibble_tiles(fmt) || IS_HALF16(fmt)) && flags == EL_PROMPT &&
            S >= prompt_min(fmt) && K % 32 == 0 && K <= 32 * AMX_Q8_BLOCKS);
}

/* el_matmul for bf16 and int8 weights, and a prompt's Q8_0 and nibble ones, S <= 40 (the caller
   splits longer runs) */
T_AMX int el_matmul_amx(const qmat_t *w, const float *x, float *y, int64_t ldy, int64_t S,
                        int64_t L, int64_t N, int64_t K, int threads, void *work, int lowp) {
    const int fmt = (int)w->fmt, bf16 = fmt == FMT_BF16;
    int64_t nb, Tw;
    blocks_of(S, &nb, &Tw);
    const int nib = el_nibble_tiles(fmt), half = IS_HALF16(fmt);
    const int blocks = fmt == FMT_Q8_0 || nib || half;
    if (nb > AMX_BLOCKS || (fmt != FMT_BF16 && fmt != FMT_I8 && (!blocks || lowp))) return -2;
    /* bytes of a block's plane: a 32-bit word per 2 values (bf16) or 4 (int8) per token */
    const int64_t Kw = (K + 127) / 128 * 128, PB = Kw / (bf16 ? 2 : 4) * Tw * 4;
    void *own = NULL;
    if (!work) {
        work = own = aligned_alloc(64, (size_t)el_amx_scratch(S, L, K));
        if (!work) return -3;
    }
    xparts_t P = {0};
    if (!bf16) el_split_x(fmt, x, S * L, K, work, &P, threads, 0); /* two bytes a value */
    /* lane l's block b at (l nb + b) 2 PB: hi plane, lo plane */
    char *xb = (char *)work + (bf16 ? 0 : (el_split_scratch(S * L, K) + 63) / 64 * 64);
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && S * L >= PARALLEL_MIN)
    for (int64_t lb = 0; lb < L * nb; lb++) {
        const int64_t l = lb / nb, b = lb % nb;
        uint32_t *hi = (uint32_t *)(xb + lb * 2 * PB), *lo = (uint32_t *)(xb + lb * 2 * PB + PB);
        for (int t = 0; t < Tw; t++) {
            const int64_t s = b * Tw + t, v = s * L + l;
            if (bf16)
                pack_bf16(s < S ? x + v * K : NULL, K, Kw, (int)Tw, t, hi, lo);
            else if (nib || half)
                pack_nibble(s < S ? &P : NULL, v, Kw, (int)Tw, t, hi, lo);
            else
                pack_i8(s < S ? (const uint8_t *)P.a + v * Kw * 2 : NULL,
                        s < S ? (const uint8_t *)P.b + v * Kw * 2 : NULL, Kw, (int)Tw, t, hi, lo,
                        fmt == FMT_Q8_0);
        }
    }
    const int64_t per_lane = (N + 15) / 16, tiles = L * per_lane;
    int failed = 0; /* a thread without its buffer for the nibbles' decoded rows */
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        configure(nib ? FMT_Q8_0 : fmt, (int)Tw, (int)nb);
        /* each thread allocates its own: one buffer for all, split by thread, ran 1.3x slower */
        const int64_t own = nib ? AMX_NIBBLE_WORK(K, S) : half ? AMX_HALF_WORK(K, S) : 0;
        char *mine = own ? aligned_alloc(64, (size_t)(own + 63) / 64 * 64) : NULL;
        failed = own && !mine;
        union {
            float f[AMX_BLOCKS * 16 * AMX_TOKENS];
            int32_t i[2 * AMX_BLOCKS * 16 * AMX_TOKENS];
        } c;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < tiles; i++) {
            const int64_t l = i / per_lane, n0 = (i % per_lane) * 16;
            const int rows = (int)(N - n0 < 16 ? N - n0 : 16);
            const char *xl = xb + l * nb * 2 * PB;
            if (bf16) {
                const char *wt = (const char *)w->data + (l * N + n0) * K * 2;
#define TILES_BF16(n) lowp ? tile_bf16(wt, K, rows, xl, PB, (int)Tw, c.f, n, 1) \
                   : tile_bf16(wt, K, rows, xl, PB, (int)Tw, c.f, n, 0)
                BY_NB(nb, TILES_BF16);
#undef TILES_BF16
                put_bf16(c.f, S, Tw, rows, y, L, l, ldy, n0);
            } else if (half) {
                if (!mine) continue;
                el_amx_half_tile(w, l * N + n0, K, rows, &P, xl, PB, (int)Tw, (int)nb, S, L, l,
                                 y, ldy, n0, mine);
            } else if (nib) {
                if (!mine) continue;
                el_amx_nibble_tile(w, l * N + n0, K, rows, &P, xl, PB, (int)Tw, (int)nb, S, L,
                                   l, y, ldy, n0, mine);
            } else if (fmt == FMT_Q8_0) {
                const char *wt = (const char *)w->data + (l * N + n0) * K;
                el_amx_q8_0_tile(w, wt, K, rows, l * N + n0, xl, PB, (int)Tw, (int)nb, P.sx, S,
                                 L, l, y, ldy, n0);
            } else {
                const char *wt = (const char *)w->data + (l * N + n0) * K;
#define TILES_I8(n) tile_i8(wt, K, rows, xl, PB, (int)Tw, c.i, n)
                BY_NB(nb, TILES_I8);
#undef TILES_I8
                put_i8(c.i, w, P.sx, S, Tw, rows, y, L, l, ldy, N, n0);
            }
        }
        TILE_RELEASE();
        free(mine);
    }
    free(own);
    return failed ? -3 : 0;
}
#else
int el_amx_usable(void) { return 0; }
int el_amx_emulate(void) { return 0; }
int el_amx_takes(int fmt, int64_t K, int64_t S, int flags) {
    (void)fmt, (void)K, (void)S, (void)flags;
    return 0;
}
int64_t el_amx_scratch(int64_t S, int64_t L, int64_t K) { (void)S, (void)L, (void)K; return 0; }
int el_matmul_amx(const qmat_t *w, const float *x, float *y, int64_t ldy, int64_t S, int64_t L,
                  int64_t N, int64_t K, int threads, void *work, int lowp) {
    (void)w, (void)x, (void)y, (void)ldy, (void)S, (void)L, (void)N, (void)K, (void)threads;
    (void)work, (void)lowp;
    return -1;
}
#endif
