/* Shared between cpu_matvec.c (the products) and cpu_layer.c (a decoder layer, the head, and
   the Python module). See expresslane/cpu_kernels.py for how they are used. */
#ifndef EXPRESSLANE_CPU_KERNELS_H
#define EXPRESSLANE_CPU_KERNELS_H
#include <stdint.h>

enum { FMT_F32 = 0, FMT_BF16 = 1, FMT_F16 = 2, FMT_I8 = 3 };
enum { HAS_AVX512 = 1, HAS_BF16 = 2, HAS_VNNI = 4 };

/* bit mask of HAS_* for this CPU (0 off x86-64 or without AVX-512) */
int el_features(void);

/* Does this CPU run format fmt? */
int el_supports(int fmt);

/* Bytes of scratch el_matvec needs for K inputs per lane and L lanes (activation parts). */
int64_t el_matvec_scratch(int64_t L, int64_t K);

/* y[l, n] = sum_k W[l, n, k] x[l, k]; W stored as fmt (int8: w = data * scale[n], rowsum[n] =
   sum_k data). `work` is el_matvec_scratch(L, K) bytes, 64-aligned, or NULL to allocate.
   Returns 0, or -1 when the CPU lacks the instructions. */
int el_matvec(int fmt, const void *w, const float *scale, const int32_t *rowsum, const float *x,
              float *y, int64_t L, int64_t N, int64_t K, int threads, void *work);

#endif
