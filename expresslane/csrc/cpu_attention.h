/* A layer's attention over its KV cache (cpu_attention.c), as cpu_layer.c calls it. */
#ifndef EXPRESSLANE_CPU_ATTENTION_H
#define EXPRESSLANE_CPU_ATTENTION_H
#include <stdint.h>

/* one layer's cache: k and v (cap, Hkv, hd) of type kvt (0 fp32, 1 fp16, 2 bf16: step/native.py's
   KV_DTYPES), pos (cap,) the position each slot holds (-1: empty); window 0: none */
typedef struct {
    int64_t Hq, Hkv, hd, cap, window;
    int kvt;
    char *k, *v;
    int64_t *pos;
} el_kv_t;

/* floats of scratch attention needs over `slots` slots (scores, then the chunks' parts) */
int64_t el_attend_scratch(int64_t Hq, int64_t hd, int64_t slots);

/* slot's keys and values written (rounded to the cache's type) and its position recorded */
void el_kv_write(const el_kv_t *kv, int64_t slot, int64_t position, const float *k,
                 const float *v);

/* o (S, Hq hd) for the S queries of qkv (rows nq floats apart) at position.. over the first n
   slots; sc: el_attend_scratch(Hq, hd, cap) floats */
void el_attend_tokens(const el_kv_t *kv, const float *qkv, int64_t nq, int64_t position,
                      int64_t S, int64_t n, float *sc, float *o, int threads);
#endif
