"""The persistent step's plan for S tokens: its buffers, per-kind configurations and task list.

Each task kind is configured by the fused kernel's own configuration function at S tokens
(norm_qkv_config, attention_config, gemv_reduce_config, norm_swiglu_config, the head's blocks),
so the GPU tuning table and the token-axis fitting apply to both steps alike, and the tasks of a
phase are the programs of that kernel's grid. The task list and its waits (whole phases, or
each lane's own chain) are persistent_tasks.py's. The kernel modules (and triton) are imported
when a plan is built, not with this module: the engine imports it on machines without triton.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels import MAX_TOKENS

MAX_SPIN = 1 << 24  # polls before a wait gives up and flags the error count
KINDS_PER_CONFIG = 2  # the kernel's configurations of one kind (kernels/persistent.py)


@dataclass
class Plan:
    """Everything one launch needs for S tokens and one head (logits or argmax)."""

    args: dict  # the kernel's tensor and scalar arguments, by name (all but the tokens)
    consts: dict  # its constexprs
    num_warps: int

    @property
    def tasks(self) -> torch.Tensor:
        """int32 (n_tasks, 12): the task list (persistent_tasks.py)."""
        return self.args["tasks_ptr"]


def attention_keys(cfg, cache) -> list[tuple[int, bool]]:
    """Each layer's attention configuration: its cache's capacity, and whether it slides."""
    return [(cache.k[i].shape[0], cfg.window(i) is not None) for i in range(cfg.num_layers)]


def projection_keys(cfg) -> list[tuple[str, bool]]:
    """Each layer's wo / w2 configuration: its reduce mode, and whether partials reach it."""
    return [(cfg.reduce_mode(i), cfg.past_source(i) is not None) for i in range(cfg.num_layers)]


def _slots(keys: list) -> tuple[list, list[int]]:
    """The distinct keys in order of first use, padded to KINDS_PER_CONFIG with the first (an
    unused kind still needs constexprs), and each layer's slot (persistent.unsupported has
    refused more)."""
    distinct = list(dict.fromkeys(keys))
    slots = [distinct.index(k) for k in keys]
    return distinct + distinct[:1] * (KINDS_PER_CONFIG - len(distinct)), slots


def _configs(dec, S: int, h: torch.Tensor, q: torch.Tensor) -> tuple[dict, dict, dict, tuple]:
    """(constexprs, grids, slots, head): each task kind configured as its fused kernel at S
    tokens; head: lm_head._prepare's (mode, lanes, rows a lane, norm stride, vocabulary)."""
    import triton

    from ..kernels.decode_attention import attention_config
    from ..kernels.gemv_reduce import MODES, gemv_reduce_config
    from ..kernels.lm_head import _blocks, _prepare, combine_block
    from ..kernels.norm_qkv import norm_qkv_config
    from ..kernels.swiglu import norm_swiglu_config
    from ..kernels.tuning import split

    cfg, f = dec.cfg, dec.fused
    L, D, hd, n_kv = cfg.num_lanes, cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads
    QL, FL = f.layers[0]["wq"].shape[1], f.layers[0]["w1"].shape[1]

    def take(c: dict, *names: str) -> list:
        return [split(c)[0][n] for n in names]  # the warps are the step's (persistent.WARPS)

    c = {"BLOCK_S": triton.next_power_of_2(S), "BLOCK_L": triton.next_power_of_2(L),
         "BLOCK_E": min(triton.next_power_of_2(D), 1024), "HEAD_DIM": hd,
         "INTERLEAVED": cfg.rope_style == "interleaved", "GROUP": cfg.num_heads // n_kv,
         "CHUNK": dec.chunk}  # fmt: skip
    qkv = norm_qkv_config(h, S, D, L, QL // hd, n_kv // L, hd)
    c["QKV_P"], c["QKV_K"], c["QKV_PF"] = take(qkv, "BLOCK_P", "BLOCK_K", "PREFETCH")
    c |= {"HAS_BIAS": "bq" in f.layers[0], "QK_NORM": "q_norm" in f.layers[0],
          "BLOCK_H": triton.next_power_of_2(hd // 2)}  # fmt: skip
    grids = {"QKV": (L, (QL // hd + 2 * (n_kv // L)) * (hd // 2 // c["QKV_P"])), "splits": []}
    configs, attn_slot = _slots(attention_keys(cfg, dec.cache))
    for j, (cap, windowed) in enumerate(configs):
        a, _ = attention_config(q, cap, n_kv, c["GROUP"], hd)
        c |= {f"A{j}_NS": a["NUM_SPLITS"], f"A{j}_WIN": windowed, f"A{j}_BN": a["BLOCK_N"],
              f"A{j}_P2": a["SPLITS_P2"], f"A{j}_BC": a["BLOCK_C"], f"A{j}_PF": a["PREFETCH"],
              "BLOCK_G": a["BLOCK_G"], "BLOCK_D": a["BLOCK_D"]}  # fmt: skip
        grids["splits"].append(a["NUM_SPLITS"])
    configs, proj_slot = _slots(projection_keys(cfg))
    for name, K in (("WO", QL), ("W2", FL)):
        for j, (mode, past) in enumerate(configs):
            p = gemv_reduce_config(h, mode, S, L, D, K)
            bo, bk, pf, sk = take(p, "BLOCK_O", "BLOCK_K", "PREFETCH", "SPLIT_K")
            c |= {f"{name}{j}_MODE": MODES[mode], f"{name}{j}_PAST": past, f"{name}{j}_O": bo,
                  f"{name}{j}_K": bk, f"{name}{j}_PF": pf, f"{name}{j}_SK": sk}  # fmt: skip
            # a split-K projection's tasks are lane_gemv's programs (kernels/gemv_reduce.py)
            grids[name, j] = ((triton.cdiv(D, bo), L, sk) if sk > 1 else
                              (triton.cdiv(D, bo), 1 if mode == "present" else L))  # fmt: skip
    c["SK_MAX"] = max(c[f"{n}{j}_SK"] for n in ("WO", "W2") for j in range(KINDS_PER_CONFIG))
    sw = norm_swiglu_config(h, S, L, D, FL)
    c["SW_O"], c["SW_K"], c["SW_PF"] = take(sw, "BLOCK_O", "BLOCK_K", "PREFETCH")
    grids["SWIGLU"] = (L, triton.cdiv(FL, c["SW_O"]))
    head = _prepare(h, f.final_norm, f.head_w, cfg.lm_head_type, cfg.pre_norm_lane_agg)
    mode, lanes, vl = head[:3]
    block_v, block_k = _blocks(h, vl, lanes)
    grids["HEAD"] = (lanes, triton.cdiv(vl, block_v))
    c |= {"HEAD_MODE": mode, "HEAD_V": block_v, "HEAD_K": block_k,
          "COMBINE_BLOCK": combine_block(lanes * grids["HEAD"][1])}  # fmt: skip
    return c, grids, {"attention": attn_slot, "projection": proj_slot}, head


def _extras(w0: dict, L: int, heads_lane: int, hd: int) -> dict:
    """qwen2's biases and qwen3's q/k norms (layer 0's: the offsets reach the others) and the
    q/k norm's scratch (kernels/qk_norm.py); a model without them passes the attention norm in
    their place, never read (the kernel's HAS_BIAS / QK_NORM are off)."""
    from ..kernels.qk_norm import qk_scratch

    stand_in = w0["attention_norm"]
    names = {"bq": "bq", "bk": "bk", "bv": "bv", "qn": "q_norm", "kn": "k_norm"}
    args = {f"{a}_ptr": w0.get(n, stand_in) for a, n in names.items()}
    if "q_norm" in w0:
        args["raw_ptr"], args["qk_cnt_ptr"] = qk_scratch(stand_in.device, L * heads_lane, hd)
    else:
        args["raw_ptr"], args["qk_cnt_ptr"] = stand_in, stand_in
    return args


def build_plan(dec, S: int, argmax: bool) -> Plan:
    """The plan of PersistentDecoder `dec` for S tokens, greedy (argmax) or logits."""
    from ..kernels.decode_attention import LOG2E
    from ..kernels.gemv import assert_norm_weight
    from .persistent_tasks import decode_tasks

    cfg, cache, f = dec.cfg, dec.cache, dec.fused
    assert 1 <= S <= MAX_TOKENS
    L, D, hd, n_q, n_kv = (cfg.num_lanes, cfg.hidden_size, cfg.head_dim, cfg.num_heads,
                           cfg.num_kv_heads)  # fmt: skip
    w0 = f.layers[0]
    QL, FL = w0["wq"].shape[1], w0["w1"].shape[1]
    dev, dt = f.embed.device, f.embed.dtype
    h = torch.empty((S, L, D), device=dev, dtype=dt)
    q = torch.empty((S, n_q, hd), device=dev, dtype=dt)
    consts, grids, slots, (_, head_lanes, vl, stride_final, V) = _configs(dec, S, h, q)
    t = decode_tasks(cfg, S, argmax, dec.deps, grids, slots)
    n_parts = head_lanes * grids["HEAD"][1]
    n_arrive = D * L  # at most one count a column block and lane
    ns = max(grids["splits"])
    ints = [[cache.k[i].shape[0], cfg.window(i) or 0,
             -1 if cfg.past_source(i) is None else cfg.past_source(i), 0]
            for i in range(cfg.num_layers)]  # fmt: skip
    zeros = lambda *shape, dtype=torch.int32: torch.zeros(shape, device=dev, dtype=dtype)  # noqa: E731
    args = {
        "tasks_ptr": torch.tensor(t.rows, dtype=torch.int32, device=dev),
        "n_tasks": len(t.rows), "cnt_ptr": zeros(t.n_counts), "n_counts": t.n_counts,
        "queue_ptr": zeros(2), "err_ptr": zeros(1), "max_spin": MAX_SPIN,
        "embed_ptr": f.embed, "cos_ptr": f.cos, "sin_ptr": f.sin,
        "h_ptr": h, "q_ptr": q, "o_ptr": torch.empty_like(q),
        "g_ptr": torch.empty((S, L, FL), device=dev, dtype=dt),
        "part_ptr": torch.zeros((cfg.num_layers, 2, S, L, D), device=dev, dtype=dt),
        # split-K projections: fp32 partials and arrival counts, one of each for wo and for w2
        "ws_ptr": torch.empty((2, consts["SK_MAX"], S, L, D), device=dev, dtype=torch.float32),
        "arrive_ptr": zeros(2, n_arrive), "n_arrive": n_arrive,
        "m_ptr": zeros(S * n_q, ns, dtype=torch.float32),
        "l_ptr": zeros(S * n_q, ns, dtype=torch.float32),
        "acc_ptr": zeros(S * n_q, ns, hd, dtype=torch.float32),
        "attn_cnt_ptr": zeros(MAX_TOKENS * n_kv),
        "offs_ptr": dec.offsets, "ints_ptr": torch.tensor(ints, dtype=torch.int32, device=dev),
        "anw_ptr": w0["attention_norm"], "wq_ptr": w0["wq"], "wk_ptr": w0["wk"],
        "wv_ptr": w0["wv"], "wo_ptr": w0["wo"], "fnw_ptr": w0["ffn_norm"], "w1_ptr": w0["w1"],
        "w3_ptr": w0["w3"], "w2_ptr": w0["w2"],
        "kc_ptr": cache.k[0], "vc_ptr": cache.v[0], "pc_ptr": cache.pos[0],
        **_extras(w0, L, QL // hd + n_kv // L, hd),
        "final_nw_ptr": f.final_norm, "head_w_ptr": f.head_w,
        "logits_ptr": zeros(S, V, dtype=torch.float32),
        "part_val_ptr": zeros(S, n_parts, dtype=torch.float32),
        "part_idx_ptr": zeros(S, n_parts, dtype=torch.int64),
        "token_ptr": zeros(S, dtype=torch.int64),
        "S": S, "L": L, "D": D, "FL": FL, "V": V, "VL": vl, "eps": cfg.norm_eps,
        "stride_nwl": assert_norm_weight(w0["attention_norm"], L, D, "attention_norm"),
        "stride_final": stride_final, "HQ_LANE": QL // hd, "HKV_LANE": n_kv // L, "N_KV": n_kv,
        "qk_scale": hd**-0.5 * LOG2E, "sqrt_l": math.sqrt(L),
        "head_lanes": head_lanes, "head_nv": grids["HEAD"][1], "n_parts": n_parts,
    }  # fmt: skip
    return Plan(args, consts, dec.warps)
