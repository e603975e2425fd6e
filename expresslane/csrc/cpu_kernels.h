/* Shared between cpu_matvec.c (the products) and cpu_layer.c (a decoder layer, the head, and
   the Python module). See expresslane/cpu_kernels.py for how they are used. */
#ifndef EXPRESSLANE_CPU_KERNELS_H
#define EXPRESSLANE_CPU_KERNELS_H
#include <stdint.h>

enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_F16 = 2, FMT_I8 = 3, FMT_Q8_0 = 4, FMT_Q4_1 = 5 };
enum { HAS_AVX512 = 1, HAS_BF16 = 2, HAS_VNNI = 4 };

/* A weight matrix (lanes, N, K) in one format (expresslane/quant.py's QTensor fields). Five
   8-byte words, so a layer descriptor's five consecutive entries can be read as one. */
typedef struct {
    int64_t fmt;
    const void *data;   /* rows of K values; q4_1: K / 2 bytes of nibbles per row */
    const void *scale;  /* int8: fp32 per row; q8_0, q4_1: f16 per block of 32 values */
    const void *rowsum; /* int8: int32 per row, the sum of its values */
    const void *mins;   /* q4_1: f16 per block of 32 values */
} qmat_t;

/* bit mask of HAS_* for this CPU (0 off x86-64 or without AVX-512) */
int el_features(void);

/* Does this CPU run format fmt? */
int el_supports(int fmt);

/* Bytes of scratch el_matvec needs for K inputs per lane and L lanes (activation parts). */
int64_t el_matvec_scratch(int64_t L, int64_t K);

/* Bytes of one weight row of K values in format fmt. */
int64_t el_row_bytes(int fmt, int64_t K);

/* x (V vectors of K) in the form the integer and bf16 row kernels read (bf16 hi / lo parts, or
   16-bit fixed point as two bytes, q4_1 arranged per nibble group, with their scales), written
   into `work` (el_matvec_scratch(V, K) bytes). fp32 and fp16 read x as it is (NULL parts). */
typedef struct {
    char *a, *b;    /* per vector 2 Kp bytes each: hi / lo parts (q4_1: a_lo a_hi / b_lo b_hi) */
    float *xs, *sx; /* q4_1: per vector Kp / 32 block sums of x; integer formats: x's scale */
    int64_t Kp;     /* K padded to a multiple of 128 */
} xparts_t;
int el_split_x(int fmt, const float *x, int64_t V, int64_t K, void *work, xparts_t *p);

/* y[l, n] = sum_k W[l, n, k] x[l, k]. `work` is el_matvec_scratch(L, K) bytes, 64-aligned, or
   NULL to allocate. Returns 0, or -1 when the CPU lacks the instructions. */
int el_matvec(const qmat_t *w, const float *x, float *y, int64_t L, int64_t N, int64_t K,
              int threads, void *work);

/* The same product for S tokens at once: y[s, l, n] = sum_k W[l, n, k] x[s, l, k], every weight
   row read from memory once for all S (cpu_matmul.c), each (row, token) computed exactly as
   el_matvec computes it (the same bits). `work`: el_matmul_scratch(S, L, K) bytes or NULL. */
int64_t el_matmul_scratch(int64_t S, int64_t L, int64_t K);
int el_matmul(const qmat_t *w, const float *x, float *y, int64_t S, int64_t L, int64_t N,
              int64_t K, int threads, void *work);

#endif
