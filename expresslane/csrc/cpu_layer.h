/* A decoder layer and the head of a one-lane model for S tokens (cpu_layer.c), as the Python
   module (cpu_module.c) calls them. */
#ifndef EXPRESSLANE_CPU_LAYER_H
#define EXPRESSLANE_CPU_LAYER_H
#include <stdint.h>

#include "cpu_kernels.h"

/* the names of a layer descriptor's int64 entries, in order; returns their count */
int el_layer_fields(const char *const **names);

/* bytes of scratch a layer (or the head) needs for S tokens */
int64_t el_layer_scratch(int64_t D, int64_t Hq, int64_t Hkv, int64_t hd, int64_t F,
                         int64_t slots, int64_t S);

/* S tokens through layer d at positions position..: h (S, D) updated; 0, or < 0 refused.
   lowp: products with x in 8 bits where the format takes it (cpu_kernels.h) */
int el_layer(const int64_t *d, float *h, int64_t S, const float *c, const float *s,
             int64_t position, int64_t live, float eps, char *scratch, int threads, int lowp);

/* the final RMSNorm and the head for S tokens: logits (S, V); the first argmax of the last
   token's logits, or -1 (refused) */
int64_t el_head(const qmat_t *w, const float *norm, const float *h, int64_t S, int64_t V,
                int64_t D, float eps, float *logits, char *scratch, int threads);
#endif
