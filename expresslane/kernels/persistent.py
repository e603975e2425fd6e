"""The whole decode step in one launch: the fused kernels' bodies as tasks of resident programs.

The fused step (kernels/decode_step.py) runs five kernels a layer plus the head, and every kernel
boundary drains and refills the HBM pipe (docs/persistent-kernel.md). Here one launch runs them
all. Each kernel's body is a `@triton.jit` task (`norm_qkv_task`, `attention_task`,
`gemv_reduce_task`, `norm_swiglu_task`, the head's tasks): the kernels call it with their
program ids, this kernel with a task's coordinates, so a task computes exactly what the
kernel's program computes, in the same order, and the step keeps its bits.

- **A task list** (int32 (n_tasks, 12), `TASK_COLS` below), built at load in dependency order:
  the embedding rows, then per layer qkv, attention, wo, swiglu, w2, then the head. Each task
  names the counts it waits for and the counts it adds to, so the plan chooses the
  dependencies (step/persistent_plan.py): whole phases, as kernel boundaries give, or each
  lane's own chain, as DTP allows (a lane waits for the other lanes only through the partials
  of layer i - broadcast_delay).
- **A queue, not a static split**: each program takes the next CHUNK tasks with one atomic add
  (and adds a run of tasks with the same counts at once, before any later task may wait). A
  task's inputs come from tasks earlier in the list, all taken by programs that are running, so
  the step makes progress whatever the grid and however many programs are resident; the wait is
  a spin on a count (grid_sync.wait_count), after the task has loaded its first weight tile
  (the weight stream does not wait for the previous phase).
- **Counts reset by the last program out**: a program that finds the queue empty counts itself
  out; the last one zeroes every count, the queue and the exit count for the next replay.
- **Per-layer tensors** are reached through element offsets from layer 0's tensor of the same
  kind (`offs`, int64 (layers, OFFS_COLS)), and the layer's cache capacity, window and past-source
  layer through `ints` (int32 (layers, 4)), so the kernel takes a fixed set of arguments.

Kinds with different compile-time configurations are distinct task kinds: two attention
configurations (the full and the sliding layers' caches) and two for each column projection
(the layers before broadcast_delay and after, whose reduce modes differ). step/persistent.py
builds the list, the buffers and the configurations; it runs a model only when these kinds
cover it. Under the interpreter programs run one after another: program 0 takes every task in
order and the others find the queue empty, so CPU tests may use any grid.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .decode_attention import attention_task
from .gemv_reduce import gemv_reduce_task, split_reduce_task
from .grid_sync import arrive, wait_count
from .lm_head import argmax_combine_task, head_argmax_task, head_logits_task
from .norm_qkv import norm_qkv_task
from .swiglu import norm_swiglu_task

# Task kinds (column 0 of the task list); the kernel reads them as constexprs.
EMBED, QKV, ATTN0, ATTN1, WO0, WO1, SWIGLU, W20, W21, LOGITS, ARGMAX, COMBINE = (
    tl.constexpr(k) for k in range(12)
)
# A task: kind, layer, coordinates a, b, c; the count it waits for (inside its body, after its
# weight prefetch) and its target; a second count and target (0: none) waited for first; the
# count it adds to, and a second one (-1: none); one int32 of padding.
TASK_COLS = tl.constexpr(12)
# Per-layer tensors, in the order of `offs`' columns: qwen2's biases and qwen3's q/k norms last,
# their columns 0 in a model without them (the kernel then never reads them).
LAYER_TENSORS = ("attention_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w3", "w2",
                 "k_cache", "v_cache", "pos_cache",
                 "bq", "bk", "bv", "q_norm", "k_norm")  # fmt: skip
OFFS_COLS = tl.constexpr(len(LAYER_TENSORS))


@triton.jit
def _count(cnt_ptr, slot, total, n):
    """n tasks done: add them to their count and, where it has one, to the second."""
    arrive(cnt_ptr + slot, n)
    if total >= 0:
        tl.atomic_add(cnt_ptr + total, n, sem="release", scope="gpu")


@triton.jit
def _at(base, lw, col):
    """Layer tensor `col` of the layer whose offsets start at lw: 16-byte aligned (the plan
    checks), which the compiler must know to load its weights 16 bytes at a time."""
    return base + tl.multiple_of(tl.load(lw + col), 8)


@triton.jit
def _embed_task(tokens_ptr, embed_ptr, h_ptr, L, D, tok, lane, BLOCK_E: tl.constexpr):
    """h[tok, lane] = embed[tokens[tok]]: every lane starts from the token's embedding."""
    row = tl.load(tokens_ptr + tok)
    for k0 in range(0, D, BLOCK_E):
        offs = k0 + tl.arange(0, BLOCK_E)
        x = tl.load(embed_ptr + row * D + offs, mask=offs < D)
        tl.store(h_ptr + (tok * L + lane) * D + offs, x, mask=offs < D)


@triton.jit
def _project(a, b, c, wait, target, S, L, D, K, sqrt_l, in_ptr, w, h_ptr, past, y, ws,
             arrive, cnt_ptr, max_spin, err_ptr, MODE: tl.constexpr, PAST: tl.constexpr,
             O: tl.constexpr, BK: tl.constexpr, PF: tl.constexpr, SK: tl.constexpr,
             BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr):  # fmt: skip
    """One configuration's task: gemv_reduce's program (a, b), or split c of a split-K one."""
    if SK == 1:
        gemv_reduce_task(in_ptr, w, h_ptr, past, h_ptr, y, S, L, D, K, sqrt_l, a, b,
                         cnt_ptr + wait, target, max_spin, err_ptr, MODE, PAST, BLOCK_S, O, BK,
                         BLOCK_L, PF, False, True)  # fmt: skip
    else:
        split_reduce_task(in_ptr, w, h_ptr, past, h_ptr, y, ws, arrive, S, L, D, K, sqrt_l, a,
                          b, c, cnt_ptr + wait, target, max_spin, err_ptr, MODE, PAST, SK,
                          BLOCK_S, O, BK, BLOCK_L, PF)  # fmt: skip


@triton.jit
def _project_task(kind, layer, a, b, c, wait, target, S, L, D, K, sqrt_l, in_ptr, w_ptr, h_ptr,
                  part_ptr, ws_ptr, arrive_ptr, n_arrive, offs_ptr, ints_ptr, col, slot, cnt_ptr,
                  max_spin, err_ptr, MODE0: tl.constexpr, PAST0: tl.constexpr, O0: tl.constexpr,
                  K0: tl.constexpr, PF0: tl.constexpr, SK0: tl.constexpr, MODE1: tl.constexpr,
                  PAST1: tl.constexpr, O1: tl.constexpr, K1: tl.constexpr, PF1: tl.constexpr,
                  SK1: tl.constexpr, SK_MAX: tl.constexpr, BLOCK_S: tl.constexpr,
                  BLOCK_L: tl.constexpr, FIRST: tl.constexpr):  # fmt: skip
    """wo (col 4, partial slot 0) or w2 (col 8, slot 1) of one layer: kind FIRST for the
    layers before broadcast_delay, FIRST + 1 after; y goes to the layer's partial slot and the
    past partials come from its source layer's. A split-K configuration's partials go to the
    slot's workspace (SK_MAX, S, L, D) and its arrivals to the slot's counts: shared by the
    layers, as a lane's layers run one after another and each leaves its counts at 0."""
    w = _at(w_ptr, offs_ptr + layer * OFFS_COLS, col)
    src = tl.load(ints_ptr + layer * 4 + 2)
    n = S * L * D
    y = part_ptr + (layer * 2 + slot) * n
    past = part_ptr + (tl.maximum(src, 0) * 2 + slot) * n
    ws = ws_ptr + slot * SK_MAX * n
    arrive = arrive_ptr + slot * n_arrive
    if kind == FIRST:
        _project(a, b, c, wait, target, S, L, D, K, sqrt_l, in_ptr, w, h_ptr, past, y, ws,
                 arrive, cnt_ptr, max_spin, err_ptr, MODE0, PAST0, O0, K0, PF0, SK0, BLOCK_S,
                 BLOCK_L)  # fmt: skip
    else:
        _project(a, b, c, wait, target, S, L, D, K, sqrt_l, in_ptr, w, h_ptr, past, y, ws,
                 arrive, cnt_ptr, max_spin, err_ptr, MODE1, PAST1, O1, K1, PF1, SK1, BLOCK_S,
                 BLOCK_L)  # fmt: skip


@triton.jit
def _qkv_task(layer, a, b, wait, target, h_ptr, anw_ptr, wq_ptr, wk_ptr, wv_ptr, cos_ptr, sin_ptr,
              position_ptr, q_ptr, kc_ptr, vc_ptr, pc_ptr, bq_ptr, bk_ptr, bv_ptr, qn_ptr, kn_ptr,
              raw_ptr, qk_cnt_ptr, offs_ptr, ints_ptr, S, L, D, eps, stride_nwl, HQ_LANE,
              HKV_LANE, N_KV, cnt_ptr, max_spin, err_ptr, HEAD_DIM: tl.constexpr,
              INTERLEAVED: tl.constexpr, BLOCK_S: tl.constexpr, QKV_P: tl.constexpr,
              QKV_K: tl.constexpr, QKV_PF: tl.constexpr, HAS_BIAS: tl.constexpr,
              QK_NORM: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
    """Program (lane a, pair block b) of one layer's norm_qkv; a qwen2 layer's biases and a qwen3
    layer's q/k norms through the layer's own offsets (the scratch and its counts are shared:
    a lane's layers run one after another, and each leaves its counts at 0)."""
    lw = offs_ptr + layer * OFFS_COLS
    bq, bk, bv, qn, kn = bq_ptr, bk_ptr, bv_ptr, qn_ptr, kn_ptr  # unread without the extras
    if HAS_BIAS:
        bq, bk, bv = _at(bq_ptr, lw, 12), _at(bk_ptr, lw, 13), _at(bv_ptr, lw, 14)
    if QK_NORM:
        qn, kn = _at(qn_ptr, lw, 15), _at(kn_ptr, lw, 16)
    norm_qkv_task(h_ptr, _at(anw_ptr, lw, 0), _at(wq_ptr, lw, 1), _at(wk_ptr, lw, 2),
                  _at(wv_ptr, lw, 3), cos_ptr, sin_ptr, position_ptr, q_ptr, _at(kc_ptr, lw, 9),
                  _at(vc_ptr, lw, 10), _at(pc_ptr, lw, 11), S, L, D,
                  tl.load(ints_ptr + layer * 4), eps, stride_nwl, HQ_LANE, HKV_LANE, N_KV, a, b,
                  cnt_ptr + wait, target, max_spin, err_ptr, bq, bk, bv, qn, kn, raw_ptr,
                  qk_cnt_ptr, HEAD_DIM, INTERLEAVED, BLOCK_S, QKV_P, QKV_K, QKV_PF, False, True,
                  HAS_BIAS, QK_NORM, BLOCK_H)  # fmt: skip


@triton.jit
def _attention(kind, layer, a, b, c, wait, target, q_ptr, kc_ptr, vc_ptr, pc_ptr, position_ptr,
               m_ptr, l_ptr, acc_ptr, attn_cnt_ptr, o_ptr, offs_ptr, ints_ptr, n_kv, qk_scale,
               cnt_ptr, max_spin, err_ptr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, NS0: tl.constexpr,
               WIN0: tl.constexpr, BN0: tl.constexpr, P20: tl.constexpr, BC0: tl.constexpr,
               PF0: tl.constexpr, NS1: tl.constexpr, WIN1: tl.constexpr, BN1: tl.constexpr,
               P21: tl.constexpr, BC1: tl.constexpr, PF1: tl.constexpr):  # fmt: skip
    """Program (token a, KV head b, split c) of one layer's attention: kind ATTN0 in the first
    configuration (constexprs ...0), ATTN1 in the second."""
    row = offs_ptr + layer * OFFS_COLS
    kc, vc, pc = _at(kc_ptr, row, 9), _at(vc_ptr, row, 10), _at(pc_ptr, row, 11)
    cap, window = tl.load(ints_ptr + layer * 4), tl.load(ints_ptr + layer * 4 + 1)
    dep = cnt_ptr + wait
    if kind == ATTN0:
        attention_task(q_ptr, kc, vc, pc, position_ptr, m_ptr, l_ptr, acc_ptr, attn_cnt_ptr, o_ptr,
                       cap, n_kv, window, qk_scale, a, b, c, dep, target, max_spin, err_ptr, GROUP,
                       HEAD_DIM, NS0, WIN0, BLOCK_G, BN0, BLOCK_D, P20, BC0, PF0, False,
                       True)  # fmt: skip
    else:
        attention_task(q_ptr, kc, vc, pc, position_ptr, m_ptr, l_ptr, acc_ptr, attn_cnt_ptr, o_ptr,
                       cap, n_kv, window, qk_scale, a, b, c, dep, target, max_spin, err_ptr, GROUP,
                       HEAD_DIM, NS1, WIN1, BLOCK_G, BN1, BLOCK_D, P21, BC1, PF1, False,
                       True)  # fmt: skip


@triton.jit
def decode_step_kernel(
    tasks_ptr, n_tasks, cnt_ptr, n_counts, queue_ptr, err_ptr, max_spin,
    tokens_ptr, embed_ptr, position_ptr, cos_ptr, sin_ptr,
    h_ptr, q_ptr, o_ptr, g_ptr, part_ptr, ws_ptr, arrive_ptr, n_arrive,
    m_ptr, l_ptr, acc_ptr, attn_cnt_ptr,
    offs_ptr, ints_ptr, anw_ptr, wq_ptr, wk_ptr, wv_ptr, wo_ptr, fnw_ptr, w1_ptr, w3_ptr, w2_ptr,
    kc_ptr, vc_ptr, pc_ptr, bq_ptr, bk_ptr, bv_ptr, qn_ptr, kn_ptr, raw_ptr, qk_cnt_ptr,
    final_nw_ptr, head_w_ptr, logits_ptr, part_val_ptr, part_idx_ptr, token_ptr,
    S, L, D, FL, V, VL, eps, stride_nwl, stride_final, HQ_LANE, HKV_LANE, N_KV, qk_scale, sqrt_l,
    head_lanes, head_nv, n_parts,
    # one configuration a task kind (see step/persistent.py)
    BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_E: tl.constexpr,
    HEAD_DIM: tl.constexpr, INTERLEAVED: tl.constexpr, QKV_P: tl.constexpr, QKV_K: tl.constexpr,
    QKV_PF: tl.constexpr, HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, BLOCK_H: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    A0_NS: tl.constexpr, A0_WIN: tl.constexpr, A0_BN: tl.constexpr, A0_P2: tl.constexpr,
    A0_BC: tl.constexpr, A0_PF: tl.constexpr,
    A1_NS: tl.constexpr, A1_WIN: tl.constexpr, A1_BN: tl.constexpr, A1_P2: tl.constexpr,
    A1_BC: tl.constexpr, A1_PF: tl.constexpr,
    WO0_MODE: tl.constexpr, WO0_PAST: tl.constexpr, WO0_O: tl.constexpr, WO0_K: tl.constexpr,
    WO0_PF: tl.constexpr, WO0_SK: tl.constexpr, WO1_MODE: tl.constexpr,
    WO1_PAST: tl.constexpr, WO1_O: tl.constexpr, WO1_K: tl.constexpr, WO1_PF: tl.constexpr,
    WO1_SK: tl.constexpr,
    SW_O: tl.constexpr, SW_K: tl.constexpr, SW_PF: tl.constexpr,
    W20_MODE: tl.constexpr, W20_PAST: tl.constexpr, W20_O: tl.constexpr, W20_K: tl.constexpr,
    W20_PF: tl.constexpr, W20_SK: tl.constexpr, W21_MODE: tl.constexpr,
    W21_PAST: tl.constexpr, W21_O: tl.constexpr, W21_K: tl.constexpr, W21_PF: tl.constexpr,
    W21_SK: tl.constexpr, SK_MAX: tl.constexpr,
    HEAD_MODE: tl.constexpr, HEAD_V: tl.constexpr, HEAD_K: tl.constexpr,
    COMBINE_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,  # tasks taken from the queue at once (their counts added at once)
):  # fmt: skip
    t0 = tl.atomic_add(queue_ptr, CHUNK, sem="relaxed", scope="gpu")
    pend_slot = tl.full((), -1, tl.int32)  # the counts of the tasks done but not yet counted
    pend_total = tl.full((), -1, tl.int32)
    pending = tl.full((), 0, tl.int32)
    while t0 < n_tasks:
        for t in range(t0, tl.minimum(t0 + CHUNK, n_tasks)):
            row = tasks_ptr + t * TASK_COLS
            kind = tl.load(row)
            layer = tl.load(row + 1)
            a = tl.load(row + 2)
            b = tl.load(row + 3)
            c = tl.load(row + 4)
            wait = tl.load(row + 5)
            target = tl.load(row + 6)
            slot = tl.load(row + 9)
            total = tl.load(row + 10)
            if (slot != pend_slot) | (total != pend_total):  # count those before a wait on them
                if pending > 0:
                    _count(cnt_ptr, pend_slot, pend_total, pending)
                pend_slot = slot
                pend_total = total
                pending = 0
            target2 = tl.load(row + 8)
            if target2 > 0:  # the other lanes' partials of layer i - d: done long ago, as a rule
                wait_count(cnt_ptr + tl.load(row + 7), target2, max_spin, err_ptr)
            lw = offs_ptr + layer * OFFS_COLS
            if kind == EMBED:  # the first phase: nothing to wait for
                _embed_task(tokens_ptr, embed_ptr, h_ptr, L, D, a, b, BLOCK_E)
            elif kind == QKV:
                _qkv_task(layer, a, b, wait, target, h_ptr, anw_ptr, wq_ptr, wk_ptr, wv_ptr,
                          cos_ptr, sin_ptr, position_ptr, q_ptr, kc_ptr, vc_ptr, pc_ptr, bq_ptr,
                          bk_ptr, bv_ptr, qn_ptr, kn_ptr, raw_ptr, qk_cnt_ptr, offs_ptr, ints_ptr,
                          S, L, D, eps, stride_nwl, HQ_LANE, HKV_LANE, N_KV, cnt_ptr, max_spin,
                          err_ptr, HEAD_DIM, INTERLEAVED, BLOCK_S, QKV_P, QKV_K, QKV_PF, HAS_BIAS,
                          QK_NORM, BLOCK_H)  # fmt: skip
            elif (kind == ATTN0) | (kind == ATTN1):
                _attention(kind, layer, a, b, c, wait, target, q_ptr, kc_ptr, vc_ptr, pc_ptr,
                           position_ptr, m_ptr, l_ptr, acc_ptr, attn_cnt_ptr, o_ptr, offs_ptr,
                           ints_ptr, N_KV, qk_scale, cnt_ptr, max_spin, err_ptr, GROUP, HEAD_DIM,
                           BLOCK_G, BLOCK_D, A0_NS, A0_WIN, A0_BN, A0_P2, A0_BC, A0_PF, A1_NS,
                           A1_WIN, A1_BN, A1_P2, A1_BC, A1_PF)  # fmt: skip
            elif (kind == WO0) | (kind == WO1):
                _project_task(kind, layer, a, b, c, wait, target, S, L, D, HQ_LANE * HEAD_DIM,
                              sqrt_l, o_ptr, wo_ptr, h_ptr, part_ptr, ws_ptr, arrive_ptr,
                              n_arrive, offs_ptr, ints_ptr, 4, 0, cnt_ptr, max_spin, err_ptr,
                              WO0_MODE, WO0_PAST, WO0_O, WO0_K, WO0_PF, WO0_SK, WO1_MODE,
                              WO1_PAST, WO1_O, WO1_K, WO1_PF, WO1_SK, SK_MAX, BLOCK_S, BLOCK_L,
                              WO0)  # fmt: skip
            elif kind == SWIGLU:
                norm_swiglu_task(h_ptr, _at(fnw_ptr, lw, 5), _at(w1_ptr, lw, 6),
                                 _at(w3_ptr, lw, 7), g_ptr, S, L, D, FL, eps, stride_nwl, a, b,
                                 cnt_ptr + wait, target, max_spin, err_ptr, BLOCK_S, SW_O, SW_K,
                                 SW_PF, False, True)  # fmt: skip
            elif (kind == W20) | (kind == W21):
                _project_task(kind, layer, a, b, c, wait, target, S, L, D, FL, sqrt_l, g_ptr,
                              w2_ptr, h_ptr, part_ptr, ws_ptr, arrive_ptr, n_arrive, offs_ptr,
                              ints_ptr, 8, 1, cnt_ptr, max_spin, err_ptr, W20_MODE, W20_PAST,
                              W20_O, W20_K, W20_PF, W20_SK, W21_MODE, W21_PAST, W21_O, W21_K,
                              W21_PF, W21_SK, SK_MAX, BLOCK_S, BLOCK_L, W20)  # fmt: skip
            elif kind == LOGITS:
                head_logits_task(h_ptr, final_nw_ptr, head_w_ptr, logits_ptr, S, L, D, VL, V, eps,
                                 stride_final, a, b, cnt_ptr + wait, target, max_spin, err_ptr,
                                 HEAD_MODE, BLOCK_S, HEAD_V, HEAD_K, BLOCK_L, False,
                                 True)  # fmt: skip
            elif kind == ARGMAX:
                head_argmax_task(h_ptr, final_nw_ptr, head_w_ptr, part_val_ptr, part_idx_ptr, S,
                                 L, D, VL, eps, stride_final, a, b, head_lanes, head_nv,
                                 cnt_ptr + wait, target, max_spin, err_ptr, HEAD_MODE, BLOCK_S,
                                 HEAD_V, HEAD_K, BLOCK_L, False, True)  # fmt: skip
            else:  # COMBINE
                argmax_combine_task(part_val_ptr, part_idx_ptr, token_ptr, n_parts, a,
                                    cnt_ptr + wait, target, max_spin, err_ptr, COMBINE_BLOCK,
                                    False, True)  # fmt: skip
            pending += 1
        if pending > 0:  # the chunk's last tasks, before taking the next chunk
            _count(cnt_ptr, pend_slot, pend_total, pending)
            pending = 0
        t0 = tl.atomic_add(queue_ptr, CHUNK, sem="relaxed", scope="gpu")
    # Out of tasks: the last program out finds every task done and resets the counts.
    G = tl.num_programs(0)
    if tl.atomic_add(queue_ptr + 1, 1, sem="acq_rel", scope="gpu") == G - 1:
        for p in range(n_counts):
            tl.store(cnt_ptr + p, 0)
        tl.store(queue_ptr, 0)
        tl.store(queue_ptr + 1, 0)
