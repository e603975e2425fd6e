/* AMX's tile instructions in plain C, so that the tile kernels (cpu_amx.c, cpu_amx_blocks.c) run
   and are tested on a CPU without AMX: EXPRESSLANE_AMX=emulate (el_features; tests/
   test_amx_emulated.py). The kernels call TILE_*(...): the instruction itself, or its emulation
   where el_amx_emulated is set (one predictable branch beside a 16-cycle tile product).

   Each thread has its 8 tiles and configuration, as the hardware gives each thread its own. The
   emulation checks what the hardware faults on (#UD): a tile used beyond its configuration,
   products whose shapes do not chain (A's rows and C's, A's 4-byte columns and B's rows, B's
   columns and C's), so a configuration error shows here as an abort with the tiles named, not
   first as SIGILL on a Xeon. Sums follow Intel's pseudo-code: int32 sums wrap, bf16 pairs add
   their two products one after the other in fp32 (each product exact). Not emulated: the
   hardware's denormal flushing in bf16 (the kernels' inputs are normal numbers). */
#ifndef EXPRESSLANE_CPU_AMX_EMULATE_H
#define EXPRESSLANE_CPU_AMX_EMULATE_H
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern int el_amx_emulated; /* cpu_amx.c: set once by el_features, before any tile runs */

typedef struct {
    uint8_t rows[8];
    uint16_t colsb[8];
    uint8_t t[8][16][64];
} amx_tiles_t;
extern _Thread_local amx_tiles_t el_amx_tiles; /* cpu_amx.c: one per thread, for every file */
#define amx_ el_amx_tiles

static void amx_fault(const char *what, int a, int b, int c) {
    fprintf(stderr, "expresslane: emulated AMX fault: %s (tiles %d %d %d)\n", what, a, b, c);
    abort();
}

static inline void emu_loadconfig(const void *cfg) {
    const uint8_t *c = (const uint8_t *)cfg; /* tilecfg_t: palette; colsb at 16, rows at 48 */
    if (c[0] != 1) amx_fault("palette", c[0], 0, 0);
    for (int i = 0; i < 8; i++) {
        memcpy(&amx_.colsb[i], c + 16 + 2 * i, 2);
        amx_.rows[i] = c[48 + i];
        if (amx_.rows[i] > 16 || amx_.colsb[i] > 64) amx_fault("configuration", i, 0, 0);
    }
}

static inline void emu_release(void) { memset(&amx_, 0, sizeof amx_); }

static inline void emu_used(int t) {
    if (!amx_.rows[t] || !amx_.colsb[t]) amx_fault("tile not configured", t, 0, 0);
}

static inline void emu_zero(int t) { memset(amx_.t[t], 0, sizeof amx_.t[t]); }

static inline void emu_loadd(int t, const void *p, int64_t stride) {
    emu_used(t);
    emu_zero(t); /* past its rows and columns a loaded tile is zero */
    for (int r = 0; r < amx_.rows[t]; r++)
        memcpy(amx_.t[t][r], (const char *)p + r * stride, amx_.colsb[t]);
}

static inline void emu_stored(int t, void *p, int64_t stride) {
    emu_used(t);
    for (int r = 0; r < amx_.rows[t]; r++)
        memcpy((char *)p + r * stride, amx_.t[t][r], amx_.colsb[t]);
}

static inline void emu_shapes(int c, int a, int b) {
    emu_used(c), emu_used(a), emu_used(b);
    if (amx_.rows[a] != amx_.rows[c] || amx_.colsb[a] / 4 != amx_.rows[b] ||
        amx_.colsb[b] != amx_.colsb[c])
        amx_fault("product shapes", c, a, b);
}

/* C[m][n] += sum_k sum_i A[m][4k + i] B[k][4n + i], bytes signed (sa, sb) or unsigned */
static inline void emu_dpb(int c, int a, int b, int sa, int sb) {
    emu_shapes(c, a, b);
    for (int m = 0; m < amx_.rows[c]; m++)
        for (int n = 0; n < amx_.colsb[c] / 4; n++) {
            uint32_t acc;
            memcpy(&acc, amx_.t[c][m] + 4 * n, 4);
            for (int k = 0; k < amx_.colsb[a] / 4; k++)
                for (int i = 0; i < 4; i++) {
                    const uint8_t x = amx_.t[a][m][4 * k + i], y = amx_.t[b][k][4 * n + i];
                    const int32_t p = (sa ? (int32_t)(int8_t)x : (int32_t)x) *
                                      (sb ? (int32_t)(int8_t)y : (int32_t)y);
                    acc += (uint32_t)p; /* wraps, as the hardware's */
                }
            memcpy(amx_.t[c][m] + 4 * n, &acc, 4);
        }
}

static inline float emu_bf16(const uint8_t *p) {
    uint32_t u = (uint32_t)(p[0] | p[1] << 8) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* C[m][n] += A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1] over k, bf16 pairs, fp32 sums */
static inline void emu_dpbf16(int c, int a, int b) {
    emu_shapes(c, a, b);
    for (int m = 0; m < amx_.rows[c]; m++)
        for (int n = 0; n < amx_.colsb[c] / 4; n++) {
            float acc;
            memcpy(&acc, amx_.t[c][m] + 4 * n, 4);
            for (int k = 0; k < amx_.colsb[a] / 4; k++) {
                acc += emu_bf16(amx_.t[a][m] + 4 * k) * emu_bf16(amx_.t[b][k] + 4 * n);
                acc += emu_bf16(amx_.t[a][m] + 4 * k + 2) * emu_bf16(amx_.t[b][k] + 4 * n + 2);
            }
            memcpy(amx_.t[c][m] + 4 * n, &acc, 4);
        }
}

/* the kernels' tile instructions: tile numbers literals, as the intrinsics paste them into asm */
#define AMX_OR(EMU, HW)          \
    do {                         \
        if (el_amx_emulated)     \
            EMU;                 \
        else                     \
            HW;                  \
    } while (0)
#define TILE_LOADCONFIG(c) AMX_OR(emu_loadconfig(c), _tile_loadconfig(c))
#define TILE_RELEASE() AMX_OR(emu_release(), _tile_release())
#define TILE_ZERO(t) AMX_OR(emu_zero(t), _tile_zero(t))
#define TILE_LOADD(t, p, s) AMX_OR(emu_loadd(t, p, s), _tile_loadd(t, p, s))
#define TILE_STORED(t, p, s) AMX_OR(emu_stored(t, p, s), _tile_stored(t, p, s))
#define TILE_DPBSSD(c, a, b) AMX_OR(emu_dpb(c, a, b, 1, 1), _tile_dpbssd(c, a, b))
#define TILE_DPBSUD(c, a, b) AMX_OR(emu_dpb(c, a, b, 1, 0), _tile_dpbsud(c, a, b))
#define TILE_DPBUSD(c, a, b) AMX_OR(emu_dpb(c, a, b, 0, 1), _tile_dpbusd(c, a, b))
#define TILE_DPBF16PS(c, a, b) AMX_OR(emu_dpbf16(c, a, b), _tile_dpbf16ps(c, a, b))
#endif
