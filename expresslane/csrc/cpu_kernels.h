/* The products of the CPU decode step, shared by the kernel files and cpu_layer.c (a decoder
   layer, the head, and the Python module). See expresslane/step/native.py for their use.

     cpu_activations.c  the CPU's features, and x in the form each format's kernels read
     cpu_matmul.c       el_matmul: the float, int8 and Q8_0 kernels and the driver
     cpu_amx.c          el_matmul for bf16 and int8 weights in AMX tiles, where the CPU has them
     cpu_nibble.c       the 1- to 6-bit GGUF formats (Q4_0 ... Q6_K, Q3_K, Q2_K, IQ4_NL, IQ4_XS,
                        MXFP4, NVFP4, Q1_0) and the codebook types re-laid as nibbles (IQ3_S ...
                        IQ1_M)

   There is one product, for S tokens; one token is its S = 1 case (the same kernels). */
#ifndef EXPRESSLANE_CPU_KERNELS_H
#define EXPRESSLANE_CPU_KERNELS_H
#include <stdint.h>

enum {
    FMT_F32 = 0, FMT_BF16 = 1, FMT_F16 = 2, FMT_I8 = 3, FMT_Q8_0 = 4, FMT_Q4_1 = 5,
    FMT_Q4_0 = 6, FMT_Q5_0 = 7, FMT_Q5_1 = 8, FMT_Q4_K = 9, FMT_Q5_K = 10, FMT_Q6_K = 11,
    FMT_IQ4_NL = 12, FMT_IQ4_XS = 13, FMT_Q3_K = 14, FMT_Q2_K = 15, FMT_IQ3_S = 16,
    FMT_IQ3_XXS = 17, FMT_IQ2_XXS = 18, FMT_IQ1_S = 19, FMT_IQ2_XS = 20, FMT_IQ2_S = 21,
    FMT_IQ1_M = 22, FMT_MXFP4 = 23, FMT_NVFP4 = 24, FMT_Q1_0 = 25,
    FMT_COUNT
};
/* HAS_AMX: AMX-BF16 and AMX-INT8 tiles granted by the OS, and not turned off
   (EXPRESSLANE_AMX=0), or emulated (EXPRESSLANE_AMX=emulate, any CPU with AVX512_BF16): the bf16
   and int8 products then run in tiles (cpu_amx.c) */
enum { HAS_AVX512 = 1, HAS_BF16 = 2, HAS_VNNI = 4, HAS_AMX = 8 };

/* The nibble formats: 4 low bits of every value as nibbles (in each 32-value block, byte j holds
   value j low and value j + 16 high), 0-2 high bits as byte masks, and the block scales. The
   crumb formats among them hold 2 low bits a value (four a byte, weights/blocks.py's order);
   those with a scale per 16 values take their blocks with the middle quarters swapped. */
#define IS_NIBBLE(fmt) ((fmt) == FMT_Q4_1 || (fmt) >= FMT_Q4_0)
#define IS_CRUMB(fmt) ((fmt) == FMT_Q3_K || (fmt) == FMT_Q2_K)
/* Q1_0: a bit a value, as the high bits' masks (no nibbles) */
#define IS_BITS(fmt) ((fmt) == FMT_Q1_0)
/* the codebook types (weights/grids.py), nibbles indexing a grid of 16 values, with an int8
   scale per 16 values (GRID16) or per 32 (XS, with IQ4_XS) and a d per 256 */
#define IS_GRID16(fmt) ((fmt) == FMT_IQ2_XS || (fmt) == FMT_IQ2_S || (fmt) == FMT_IQ1_M)
#define IS_XS(fmt)                                                                      \
    ((fmt) == FMT_IQ4_XS || (fmt) == FMT_IQ3_S || (fmt) == FMT_IQ3_XXS || (fmt) == FMT_IQ2_XXS || \
     (fmt) == FMT_IQ1_S)
#define IS_HALF16(fmt) ((fmt) == FMT_Q6_K || IS_CRUMB(fmt) || IS_GRID16(fmt))
/* a scale per 16 values (an int8 one, or NVFP4's f16): blocks with their middle quarters swapped,
   and x in that order too */
#define IS_SWAPPED(fmt) (IS_HALF16(fmt) || (fmt) == FMT_NVFP4)
/* The nibble formats whose values reach 64 (the grids': u = grid + 128) take x in the AVX2
   build as x16 = 256 a + b itself, per 256-bit half of a chunk's nibbles x16 of the even bytes
   then of the odd ones (el_pack_block), for one vpmaddwd per 16 values (simd_avx2_ops.h
   el_dot_x16): AVX2's u8 x s8 product (vpmaddubsw) saturates there, and widening both operands
   to 16 bits cost three times the instructions. The others' values, below 64, fit vpmaddubsw's
   sums (DPBUSD2_U6), which take the bytes a and b as the AVX-512 build does. Q8_0 too: its
   weights are the signed operand and x, as a + 128 and b, the unsigned one, which took three
   widened dot products per 64 values; with q itself it takes one vpmaddwd per 16 (its chunk:
   per 32 values q of the even bytes, then of the odd). */
#define IS_NL(F) ((F) == FMT_IQ4_NL || (F) == FMT_MXFP4) /* a grid, an f16 d per 32 */
#define IS_GRID(F) (IS_NL(F) || IS_XS(F) || IS_GRID16(F) || (F) == FMT_NVFP4)
#ifdef EL_AVX2 /* cpu_nibble.c's group_tok takes the grids' x16 where U6 (= !IS_GRID) is off */
#define X16(fmt) (IS_GRID(fmt) || (fmt) == FMT_Q8_0)
#else
#define X16(fmt) 0
#endif
/* a d per superblock of 256 values (K a multiple of 256), else per block of 32 */
#define IS_SUPER(fmt) ((fmt) == FMT_Q4_K || (fmt) == FMT_Q5_K || IS_XS(fmt) || IS_HALF16(fmt))
/* K is a multiple of this: a superblock of 256, Q1_0's block of 128, else a block of 32 */
#define BLOCK_VALUES(fmt) (IS_SUPER(fmt) ? 256 : (fmt) == FMT_Q1_0 ? 128 : 32)
/* f16 scales in a row of K values: one a block, NVFP4's per 16 */
#define SCALES_PER_ROW(fmt, K) ((fmt) == FMT_NVFP4 ? (K) / 16 : (K) / BLOCK_VALUES(fmt))

/* A weight matrix (lanes, N, K) in one format (expresslane/weights/quant.py's QTensor fields).
   Seven 8-byte words, so a layer descriptor's seven consecutive entries can be read as one. */
typedef struct {
    int64_t fmt;
    const void *data;   /* rows of K values; nibble formats: K / 2 bytes of nibbles per row,
                           crumb formats K / 4, q1_0 K / 8 (masks) */
    const void *scale;  /* int8: fp32 per row; q8_0, q4_*, q5_*, iq4_nl, mxfp4: f16 per block
                           of 32 values; nvfp4: f16 per 16; q1_0 per 128; K-quants, iq4_xs,
                           codebooks: f16 d per 256 */
    const void *rowsum; /* int8: int32 per row, the sum of its values */
    const void *mins;   /* q4_1, q5_1: f16 per block of 32; q4_K, q5_K, q2_K: f16 dmin per 256 */
    const void *high;   /* q5_*, q3_K: K / 8 bytes per row, q6_K: K / 4 (the bit masks) */
    const void *sub;    /* q4_K, q5_K: per 256 eight 6-bit scales then eight mins, a byte each;
                           q6_K, q3_K: an int8 scale per 16 values; q2_K: per 16 a byte, scale
                           low and min high; iq4_xs and XS codebooks: an int8 scale per
                           32, GRID16 codebooks per 16 */
} qmat_t;

/* bit mask of HAS_* for this CPU (0 off x86-64 or without AVX-512) */
int el_features(void);

/* Does this CPU run format fmt? */
int el_supports(int fmt);

/* Bytes of one weight row's data (K values) in format fmt. */
int64_t el_row_bytes(int fmt, int64_t K);

/* x (V vectors of K) in the form the row kernels read (bf16 hi / lo parts, or 16-bit fixed
   point as two bytes, for the nibble formats arranged per nibble group, with their scales),
   written into `work`. fp32 and fp16 read x as it is (NULL parts).

   lowp: x at llama.cpp's precision for its activations, half the dot products; a prompt's
   opt-in (--prefill-dtype). The q8_0 and nibble formats take x in 8 bits with a scale per
   32-value block (cpu_activations.c), bf16 weights x's bf16 round (the hi part alone); fp32,
   fp16 and int8 ignore it. A row's bits still do not depend on S, but they are not the ones a
   decode step computes. */
typedef struct {
    char *a, *b;    /* per vector 2 Kp bytes each: hi / lo parts (nibble: a_lo a_hi / b_lo b_hi;
                       lowp 8-bit: b holds the block scales as lanes, cpu_activations.c) */
    float *xs;      /* nibble formats: per vector Kp / 32 block sums of the rounded x, then
                       Kp / 16 half-block sums */
    float *sx;      /* integer formats: x's scale per vector (lowp 8-bit: 1, the scales per block) */
    int64_t Kp;     /* K padded to a multiple of 128 */
    int lowp;       /* x at llama.cpp's precision (above) */
} xparts_t;
int64_t el_split_scratch(int64_t V, int64_t K);
void el_split_x(int fmt, const float *x, int64_t V, int64_t K, void *work, xparts_t *p,
                int threads, int lowp);
/* vectors (a prompt's tokens) from which their own work runs on every thread: the split and
   interleaving of x here, each token's norms, RoPE, SiLU and attention in cpu_layer.c (fewer:
   the first thread alone, a fork costing more than a decode step's few vectors) */
#define PARALLEL_MIN 4

/* The tokens of a block side by side (cpu_activations.c): chunk c of token t of the block at
   (c T + t) chunk_bytes (bf16: two planes, the hi halves at (c T + t) 64, the lo halves after
   all of them). The kernels address every token from one pointer. */
int64_t el_chunk_bytes(int fmt, int lowp);
int64_t el_chunks(int fmt, int64_t K, int64_t Kp);
void el_pack_block(int fmt, const xparts_t *P, const float *x, int64_t K, const int64_t *v, int T,
                   char *dst);

/* the products prefetch their weights this many bytes ahead (cpu_matmul.c, cpu_nibble.c): on an
   Intel Xeon with AMX (2026-12-06) the hardware prefetcher alone left SmolLM2's bf16 decode at
   0.79x llama.cpp's F16 with one thread (short rows: a few hundred bytes to 3 KB) */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 1024
#endif
#define TMAX 8 /* tokens of a block at most (the per-block arrays), and blocks of one call */

/* One call's work for a block of T <= TMAX tokens (tokens s0 .. s0 + T - 1): what a family of
   kernels needs to run rows r0 .. r1 - 1 (el_span_nibble: cpu_nibble.c). */
typedef struct {
    const qmat_t *w;
    const xparts_t *P;    /* the split x: vector s L + l is token s of lane l */
    const float *x;       /* x itself (fp32, fp16) */
    const char *pk;       /* the interleaved blocks: lane l's tokens from l S per_token on */
    float *y;             /* y[(s L + l) ldy + n] */
    int64_t S, L, N, K, ldy, per_token, s0;
    int T;
} span_t;

/* for each row r of r0 .. r1 - 1: l its lane, wr its data, xp its tokens' chunks, v[t] their
   vectors; BODY sets res[t], which goes to y */
#define EL_ROWS(sp, r0, r1, rb, T, BODY)                                                    \
    for (int64_t r = (r0); r < (r1); r++) {                                                \
        const int64_t l = r / (sp)->N;                                                     \
        const char *wr = (const char *)(sp)->w->data + r * (rb);                           \
        const char *xp = (sp)->pk + (l * (sp)->S + (sp)->s0) * (sp)->per_token;            \
        int64_t v[TMAX];                                                                   \
        float res[TMAX];                                                                      \
        for (int t = 0; t < (T); t++) v[t] = ((sp)->s0 + t) * (sp)->L + l;                 \
        BODY;                                                                              \
        for (int t = 0; t < (T); t++) (sp)->y[v[t] * (sp)->ldy + (r - l * (sp)->N)] = res[t]; \
    }

/* the same in tiles of up to 16 rows of one lane, for kernels that leave each (row, token) as 16
   lanes to be summed: BODY sets lanes[t], and the tile's rows are summed at once (simd.h's
   sums16: one order for every row, so its bits depend neither on its place in a tile nor on S)
   and stored together. A lane sum of its own per row, a chain of dependent instructions, was
   a large part of the time of SmolLM2's 576-wide rows (BENCHMARKS.md, 2026-11-27). */
#define TILE_ROWS 16 /* rows of a tile: sums16's; a thread's share where one block of tokens
                        reads them (matmul) is a whole tile */
#define EL_TILES(sp, r0, r1, rb, T, BODY)                                                  \
    for (int64_t r_ = (r0); r_ < (r1);) {                                                 \
        const int64_t l = r_ / (sp)->N, lim = (l + 1) * (sp)->N;                          \
        const int64_t e_ = r_ + TILE_ROWS < (r1) ? r_ + TILE_ROWS : (r1);                 \
        const int64_t end = e_ < lim ? e_ : lim;                                          \
        const char *xp = (sp)->pk + (l * (sp)->S + (sp)->s0) * (sp)->per_token;           \
        int64_t v[TMAX];                                                                  \
        __m512 tile[TMAX][TILE_ROWS];                                                     \
        for (int t = 0; t < (T); t++) v[t] = ((sp)->s0 + t) * (sp)->L + l;                \
        for (int64_t r = r_; r < end; r++) {                                              \
            const char *wr = (const char *)(sp)->w->data + r * (rb);                      \
            __m512 lanes[TMAX];                                                           \
            BODY;                                                                         \
            for (int t = 0; t < (T); t++) tile[t][r - r_] = lanes[t];                     \
        }                                                                                 \
        for (int t = 0; t < (T); t++) {                                                   \
            for (int64_t i = end - r_; i < TILE_ROWS; i++) tile[t][i] = _mm512_setzero_ps(); \
            _mm512_mask_storeu_ps((sp)->y + v[t] * (sp)->ldy + (r_ - l * (sp)->N),         \
                                  MASK16(end - r_), sums16(tile[t]));                     \
        }                                                                                 \
        r_ = end;                                                                         \
    }

/* a switch over T = 1..TMAX calling CALL(T) with T a constant (the kernels' accumulators then
   stay in registers) */
#define BY_T(T, CALL)        \
    switch (T) {             \
    case 1: CALL(1); break;  \
    case 2: CALL(2); break;  \
    case 3: CALL(3); break;  \
    case 4: CALL(4); break;  \
    case 5: CALL(5); break;  \
    case 6: CALL(6); break;  \
    case 7: CALL(7); break;  \
    default: CALL(8); break; \
    }
/* the same for kernels with a low-precision variant: CALL(T, LOWP), both constants (lowp: the
   span's xparts_t flag) */
#define BY_T_ARG(T, CALL, A)    \
    switch (T) {                \
    case 1: CALL(1, A); break;  \
    case 2: CALL(2, A); break;  \
    case 3: CALL(3, A); break;  \
    case 4: CALL(4, A); break;  \
    case 5: CALL(5, A); break;  \
    case 6: CALL(6, A); break;  \
    case 7: CALL(7, A); break;  \
    default: CALL(8, A); break; \
    }
#define BY_T_LOWP(T, lowp, CALL)   \
    if (lowp) {                    \
        BY_T_ARG(T, CALL, 1)       \
    } else {                       \
        BY_T_ARG(T, CALL, 0)       \
    }

void el_span_nibble(const span_t *sp, int64_t r0, int64_t r1);
/* for a prompt's chunk in AMX tiles (cpu_amx_blocks.c), the nibble formats with a scale per
   32 values (not IS_SWAPPED's): 16 rows' values less their centre, a signed byte each, block by
   block in x's nibble order, and their blocks' scales; and the min coefficients of those without
   a centre, block-major (cpu_nibble.c) */
int el_nibble_tiles(int fmt);
int el_nibble_center(int fmt);
void el_nibble_decode_tile(const qmat_t *w, int64_t r0, int rows, int64_t K, int8_t *q,
                           float *sc);
void el_nibble_tile_mins(const qmat_t *w, int64_t r0, int rows, int64_t K, float *mt);
/* and those with an int8 scale per 16 values (IS_HALF16): 16 rows' w = (q - c) s as low and high
   bytes, each superblock's d, Q2_K's min coefficients per 16 values (cpu_nibble.c) */
void el_nibble_decode_half(const qmat_t *w, int64_t r0, int rows, int64_t K, uint8_t *wl,
                           int8_t *wh, float *dsb, float *mt);

/* cpu_amx.c: may this process use AMX tiles (asks Linux once)? el_matmul's bf16 and int8
   products there for S <= 40 tokens, Q8_0's and the nibble formats' (el_nibble_tiles and
   IS_HALF16) for a prompt's chunks (EL_PROMPT), and the scratch they need (el_matmul_scratch
   covers it) */
int el_amx_usable(void);
/* AMX's tile instructions emulated in C from now on (cpu_amx_emulate.h: tests on CPUs without
   AMX); 0 where the compiler lacks the AMX intrinsics */
int el_amx_emulate(void);
/* does el_matmul_amx take this product (the format, K, S tokens, the EL_* flags) on this CPU? */
int el_amx_takes(int fmt, int64_t K, int64_t S, int flags);
int64_t el_amx_scratch(int64_t S, int64_t L, int64_t K);
int el_matmul_amx(const qmat_t *w, const float *x, float *y, int64_t ldy, int64_t S, int64_t L,
                  int64_t N, int64_t K, int threads, void *work, int lowp);

/* The N rows of a q8_0 or nibble-format matrix (K values each) as values: fp32, or with bf16
   their round to nearest even, N K of them to out. Returns 0, or -1 for another format, a K the
   format's blocks do not divide, or a CPU without AVX512_VNNI. */
int el_dequant(const qmat_t *w, int64_t N, int64_t K, void *out, int bf16, int threads);

/* y[s, l, n] = sum_k W[l, n, k] x[s, l, k] for S tokens: every weight row read from memory once
   for all S, and each (row, token) computed by the same instructions in the same order whatever
   S is (one token is S = 1), so a row's bits do not depend on S. `work`:
   el_matmul_scratch(S, L, K) bytes, 64-aligned, or NULL to allocate; lowp: x at llama.cpp's
   precision where the format takes it (xparts_t). Returns 0, -1 when the CPU lacks the
   instructions, or -2 for a K that a block format's blocks do not divide. */
int64_t el_matmul_scratch(int64_t S, int64_t L, int64_t K);
/* el_matmul's and el_layer's last argument, `lowp`, is a word of flags: EL_LOWP, x at
   llama.cpp's precision (above); EL_PROMPT, the tokens are a prompt's chunk, whose bits need not
   be a decode step's: there Q8_0 and the nibble formats but NVFP4 run in AMX tiles
   (cpu_amx_blocks.c), their sums in another order than the vpdpbusd kernels', as the layers'
   GEMMs take longer prompts in theirs. */
#define EL_LOWP 1
#define EL_PROMPT 2
int el_matmul(const qmat_t *w, const float *x, float *y, int64_t S, int64_t L, int64_t N,
              int64_t K, int threads, void *work, int lowp);
/* the same for one lane, token s's outputs at y + s ldy (rows of a wider output) */
int el_matmul_into(const qmat_t *w, const float *x, float *y, int64_t ldy, int64_t S, int64_t N,
                   int64_t K, int threads, void *work, int lowp);

#endif
