"""The persistent step's plan for S tokens: its buffers, per-kind configurations and task list.

Each task kind is configured by the fused kernel's own configuration function at S tokens
(norm_qkv_config, attention_config, gemv_reduce_config, norm_swiglu_config, the head's blocks),
so the GPU tuning table and the token-axis fitting apply to both steps alike, and the tasks of a
phase are the programs of that kernel's grid. The task list and its waits (whole phases, or
each lane's own chain) are persistent_tasks.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from ..kernels import MAX_TOKENS
from ..kernels.decode_attention import LOG2E, attention_config
from ..kernels.gemv import assert_norm_weight
from ..kernels.gemv_reduce import MODES, gemv_reduce_config
from ..kernels.lm_head import _blocks, _prepare
from ..kernels.norm_qkv import norm_qkv_config
from ..kernels.swiglu import norm_swiglu_config
from ..kernels.tuning import split
from .persistent_tasks import decode_tasks

MAX_SPIN = 1 << 24  # polls before a wait gives up and flags the error count


@dataclass
class Plan:
    """Everything one launch needs for S tokens and one head (logits or argmax)."""

    S: int
    argmax: bool
    tasks: torch.Tensor  # int32 (n_tasks, 12): persistent_tasks.py
    n_counts: int
    args: dict  # the kernel's tensor and scalar arguments, by name (all but the tokens)
    consts: dict  # its constexprs
    num_warps: int


def _slots(keys: list) -> tuple[list, list[int]]:
    """The distinct keys in order of first use (at most 2), and each layer's slot."""
    distinct = list(dict.fromkeys(keys))
    if len(distinct) > 2:
        raise ValueError(f"{len(distinct)} configurations of one kind (the kernel has 2)")
    return distinct, [distinct.index(k) for k in keys]


def build_plan(dec, S: int, argmax: bool):
    cfg, cache, f = dec.cfg, dec.cache, dec.fused
    assert 1 <= S <= MAX_TOKENS
    L, D, hd = cfg.num_lanes, cfg.hidden_size, cfg.head_dim
    n_q, n_kv = cfg.num_heads, cfg.num_kv_heads
    w0 = f.layers[0]
    QL, FL = w0["wq"].shape[1], w0["w1"].shape[1]
    dev, dt = f.embed.device, f.embed.dtype
    h = torch.empty((S, L, D), device=dev, dtype=dt)
    q = torch.empty((S, n_q, hd), device=dev, dtype=dt)
    o = torch.empty_like(q)
    g = torch.empty((S, L, FL), device=dev, dtype=dt)

    def take(c: dict, *names: str) -> list:
        return [split(c)[0][n] for n in names]  # the warps are the step's (persistent.WARPS)

    consts = {"BLOCK_S": triton.next_power_of_2(S), "BLOCK_L": triton.next_power_of_2(L),
              "BLOCK_E": min(triton.next_power_of_2(D), 1024), "HEAD_DIM": hd,
              "INTERLEAVED": cfg.rope_style == "interleaved"}  # fmt: skip
    hq_lane, hkv_lane = QL // hd, n_kv // L
    qkv = norm_qkv_config(h, S, D, L, hq_lane, hkv_lane, hd)
    consts["QKV_P"], consts["QKV_K"], consts["QKV_PF"] = take(qkv, "BLOCK_P", "BLOCK_K",
                                                              "PREFETCH")  # fmt: skip
    qkv_grid = (L, (hq_lane + 2 * hkv_lane) * (hd // 2 // consts["QKV_P"]))

    # attention: a configuration per distinct (capacity, window) of the layers' caches
    keys = [(cache.k[i].shape[0], cfg.window(i) is not None) for i in range(cfg.num_layers)]
    distinct, attn_slot = _slots(keys)
    consts |= {"GROUP": n_q // n_kv}
    n_splits = []
    for j, (cap, windowed) in enumerate(distinct + distinct[:1] * (2 - len(distinct))):
        c, _ = attention_config(q, cap, n_kv, n_q // n_kv, hd)
        consts |= {f"A{j}_NS": c["NUM_SPLITS"], f"A{j}_WIN": windowed, f"A{j}_BN": c["BLOCK_N"],
                   f"A{j}_P2": c["SPLITS_P2"], f"A{j}_BC": c["BLOCK_C"],
                   f"A{j}_PF": c["PREFETCH"], "BLOCK_G": c["BLOCK_G"],
                   "BLOCK_D": c["BLOCK_D"]}  # fmt: skip
        n_splits.append(c["NUM_SPLITS"])

    # column projections: a configuration per distinct (reduce mode, has past) of the layers
    keys = [(cfg.reduce_mode(i), cfg.past_source(i) is not None) for i in range(cfg.num_layers)]
    distinct, proj_slot = _slots(keys)
    grids = {}
    for name, K in (("WO", QL), ("W2", FL)):
        for j, (mode, past) in enumerate(distinct + distinct[:1] * (2 - len(distinct))):
            c = gemv_reduce_config(h, mode, S, L, D, K)
            if c["SPLIT_K"] != 1:
                raise ValueError(f"{name.lower()} splits K ({c['SPLIT_K']}): not a task kind")
            bo, bk, pf = take(c, "BLOCK_O", "BLOCK_K", "PREFETCH")
            consts |= {f"{name}{j}_MODE": MODES[mode], f"{name}{j}_PAST": past,
                       f"{name}{j}_O": bo, f"{name}{j}_K": bk, f"{name}{j}_PF": pf}  # fmt: skip
            lanes = 1 if mode == "present" else L
            grids[name, j] = (triton.cdiv(D, bo), lanes)
    sw = norm_swiglu_config(h, S, L, D, FL)
    consts["SW_O"], consts["SW_K"], consts["SW_PF"] = take(sw, "BLOCK_O", "BLOCK_K", "PREFETCH")

    mode, head_lanes, vl, stride_final, V = _prepare(
        h, f.final_norm, f.head_w, cfg.lm_head_type, cfg.pre_norm_lane_agg
    )
    block_v, block_k = _blocks(h, vl, head_lanes)
    head_nv = triton.cdiv(vl, block_v)
    n_parts = head_lanes * head_nv
    consts |= {"HEAD_MODE": mode, "HEAD_V": block_v, "HEAD_K": block_k,
               "COMBINE_BLOCK": triton.next_power_of_2(n_parts), "CHUNK": dec.chunk}  # fmt: skip

    grids["QKV"], grids["splits"] = qkv_grid, n_splits
    grids["SWIGLU"] = (L, triton.cdiv(FL, consts["SW_O"]))
    grids["HEAD"] = (head_lanes, head_nv)
    slots = {"attention": attn_slot, "projection": proj_slot}
    t = decode_tasks(cfg, S, argmax, dec.deps, grids, slots)

    ns = max(n_splits)
    ints = [[cache.k[i].shape[0], cfg.window(i) or 0,
             -1 if cfg.past_source(i) is None else cfg.past_source(i), 0]
            for i in range(cfg.num_layers)]  # fmt: skip
    zeros = lambda *shape, dtype=torch.int32: torch.zeros(shape, device=dev, dtype=dtype)  # noqa: E731
    args = {
        "tasks_ptr": torch.tensor(t.rows, dtype=torch.int32, device=dev),
        "n_tasks": len(t.rows), "cnt_ptr": zeros(t.n_counts), "n_counts": t.n_counts,
        "queue_ptr": zeros(2), "err_ptr": zeros(1), "max_spin": MAX_SPIN,
        "embed_ptr": f.embed, "cos_ptr": f.cos, "sin_ptr": f.sin,
        "h_ptr": h, "q_ptr": q, "o_ptr": o, "g_ptr": g,
        "part_ptr": torch.zeros((cfg.num_layers, 2, S, L, D), device=dev, dtype=dt),
        "m_ptr": zeros(S * n_q, ns, dtype=torch.float32),
        "l_ptr": zeros(S * n_q, ns, dtype=torch.float32),
        "acc_ptr": zeros(S * n_q, ns, hd, dtype=torch.float32),
        "attn_cnt_ptr": zeros(MAX_TOKENS * n_kv),
        "offs_ptr": dec.offsets, "ints_ptr": torch.tensor(ints, dtype=torch.int32, device=dev),
        "anw_ptr": w0["attention_norm"], "wq_ptr": w0["wq"], "wk_ptr": w0["wk"],
        "wv_ptr": w0["wv"], "wo_ptr": w0["wo"], "fnw_ptr": w0["ffn_norm"], "w1_ptr": w0["w1"],
        "w3_ptr": w0["w3"], "w2_ptr": w0["w2"],
        "kc_ptr": cache.k[0], "vc_ptr": cache.v[0], "pc_ptr": cache.pos[0],
        "final_nw_ptr": f.final_norm, "head_w_ptr": f.head_w,
        "logits_ptr": zeros(S, V, dtype=torch.float32),
        "part_val_ptr": zeros(S, n_parts, dtype=torch.float32),
        "part_idx_ptr": zeros(S, n_parts, dtype=torch.int64),
        "token_ptr": zeros(S, dtype=torch.int64),
        "S": S, "L": L, "D": D, "FL": FL, "V": V, "VL": vl, "eps": cfg.norm_eps,
        "stride_nwl": assert_norm_weight(w0["attention_norm"], L, D, "attention_norm"),
        "stride_final": stride_final, "HQ_LANE": hq_lane, "HKV_LANE": hkv_lane, "N_KV": n_kv,
        "qk_scale": hd**-0.5 * LOG2E, "sqrt_l": math.sqrt(L),
        "head_lanes": head_lanes, "head_nv": head_nv, "n_parts": n_parts,
    }  # fmt: skip
    return Plan(S, argmax, args["tasks_ptr"], t.n_counts, args, consts, dec.warps)
