"""Decode-speed ceilings at batch 1: bytes streamed per token, bandwidth bounds, TP vs DTP latency.

This file owns the arithmetic of laneformer.md 8-9 and of Kog's published figures (9.1):

- `bytes_per_token`: weights and KV read per token, for the whole model and for the busiest device
  when lanes (Laneformer) or heads (Llama-style tensor parallelism) are split over `devices`.
- `GPUS` / `get_gpu`: datasheet HBM bandwidths per device, plus Kog's "effective" node figures.
- `ceiling`: tokens/s = bandwidth / bytes per token, and a latency model that predicts tokens/s
  with an immediate all-reduce after every module versus Delayed Tensor Parallelism.
- `simple_ceiling`, `launch_cap`, `moe_projections`: Kog's back-of-envelope numbers.

Everything is plain integer/float arithmetic on a `ModelConfig`; nothing here touches torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ModelConfig
from ..errors import ConfigError


@dataclass(frozen=True)
class GPU:
    name: str
    bandwidth_tb_s: float  # per device, 1 TB = 1e12 bytes
    note: str = ""


GPUS: dict[str, GPU] = {
    "h100": GPU("H100 SXM", 3.35, "HBM3 datasheet"),
    "h200": GPU("H200", 4.8, "HBM3e datasheet"),
    "mi300x": GPU("MI300X", 5.3, "HBM3 datasheet"),
    "b200": GPU("B200", 8.0, "HBM3e datasheet"),
    # Kog quotes node totals: 30.7 TB/s for 8x H200 and 33.6 TB/s for 8x MI300X,
    # i.e. ~80% of datasheet. Stored per device so that `--count 8` gives the quoted totals.
    "h200-effective": GPU("H200 (Kog effective)", 30.7 / 8, "Kog: 30.7 TB/s per 8x H200 node"),
    "mi300x-effective": GPU("MI300X (Kog effective)", 33.6 / 8, "Kog: 33.6 TB/s per 8x MI300X"),
}


def get_gpu(name: str | GPU) -> GPU:
    if isinstance(name, GPU):
        return name
    gpu = GPUS.get(str(name).lower())
    if gpu is None:
        raise ConfigError(
            f"unknown GPU {name!r}: known GPUs are {', '.join(GPUS)} (or give --bandwidth in TB/s)"
        )
    return gpu


# --- bytes per token ----------------------------------------------------------------------------
@dataclass(frozen=True)
class _Layout:
    """Bytes one device reads per token, by module (with devices=1: the whole model)."""

    attention: int  # one layer's q, k, v, o weights (and biases)
    mlp: int  # one layer's gate, up, down weights
    layer_norm: int  # one attention_norm or ffn_norm
    final_norm: int
    lm_head: int
    embedding_row: int
    kv: tuple[int, ...]  # KV read by each layer at this context

    def module_bytes(self) -> list[int]:
        """Module order A0 M0 A1 M1 ... then the head stage (final norm, head, next embedding)."""
        out = []
        for kv in self.kv:
            out += [self.attention + self.layer_norm + kv, self.mlp + self.layer_norm]
        return out + [self.final_norm + self.lm_head + self.embedding_row]

    def as_dict(self) -> dict:
        n = len(self.kv)
        d = {
            "attention": self.attention * n,
            "mlp": self.mlp * n,
            "lm_head": self.lm_head,
            "norms": 2 * n * self.layer_norm + self.final_norm,
            "embedding_row": self.embedding_row,
        }
        d["weights"] = sum(d.values())
        d["kv"] = sum(self.kv)
        d["total"] = d["weights"] + d["kv"]
        return d


def _layout(cfg: ModelConfig, context: int, dtype_bytes: int, devices: int) -> _Layout:
    """The busiest device's share when the model is split over `devices`.

    Laneformer (lanes > 1): a device holds ceil(L/G) whole lanes (laneformer.md 8.1); a lane is
    the unit of placement, so G may not exceed L. Llama-style (1 lane): Megatron tensor
    parallelism, heads and FFN units split over G, KV heads replicated when there are fewer than
    G. Every head type is split by vocabulary rows (an engine may always do so); norms and the
    embedding table are replicated, and only one embedding row is read per token.
    """
    D, L, V, b = cfg.hidden_size, cfg.num_lanes, cfg.vocab_size, dtype_bytes
    if L > 1:
        if devices > L:
            raise ConfigError(
                f"devices={devices}: a lane is the unit of placement and this "
                f"model has {L} lanes, so it runs on at most {L} devices"
            )
        lanes = math.ceil(L / devices)
        q, kv, ffn = lanes * cfg.lane_q_dim, lanes * cfg.lane_kv_dim, lanes * cfg.lane_ffn_dim
    else:
        lanes = 1
        q = math.ceil(cfg.num_heads / devices) * cfg.head_dim
        kv = math.ceil(cfg.num_kv_heads / devices) * cfg.head_dim
        ffn = math.ceil(cfg.intermediate_size / devices)
    if cfg.lm_head_type == "vocab_parallel":
        head = lanes * (V // L) * D
    elif cfg.lm_head_type == "lane":  # (V, L*D): a device reads its lanes' columns
        head = V * lanes * D
    else:
        head = math.ceil(V / devices) * D
    bias = q + 2 * kv if cfg.attention_bias else 0
    norm_rows = lanes if cfg.per_lane_norms else 1
    positions = [
        min(context, cfg.sliding_window) if cfg.is_sliding(i) else context
        for i in range(cfg.num_layers)
    ]
    return _Layout(
        attention=(2 * D * q + 2 * D * kv + bias) * b,
        mlp=3 * D * ffn * b,
        layer_norm=norm_rows * D * b,
        final_norm=(1 if cfg.final_norm_shared else lanes) * D * b,
        lm_head=head * b,
        # Tied: the head *is* the embedding table and is already streamed in full; count it once.
        embedding_row=0 if cfg.tie_word_embeddings else D * b,
        kv=tuple(2 * kv * b * p for p in positions),
    )


def _check_context(cfg: ModelConfig, context: int) -> None:
    if not isinstance(context, int) or context < 1:
        raise ConfigError(f"context={context!r}: must be a positive number of tokens")
    if context > cfg.max_position_embeddings:
        raise ConfigError(
            f"context={context}: beyond the model's max_position_embeddings="
            f"{cfg.max_position_embeddings}"
        )


def bytes_per_token(cfg: ModelConfig, context: int, dtype_bytes: int = 2, devices: int = 1) -> dict:
    """Bytes read from HBM to decode one token at context T (T counts the current token).

    Assumptions (laneformer.md 9): batch 1, every weight used is read exactly once,
    `dtype_bytes` per weight and KV element; sliding layers read min(T, window) positions and
    full layers T; activations and the KV write of the new token are negligible and left out.
    The embedding table is resident but only one row is read (none when tied: the head streams
    the table).

    Returns the whole-model breakdown (attention, mlp, lm_head, norms, embedding_row, weights,
    kv, total) and `per_device`: the same for the busiest of `devices` devices, plus `shard`
    (its per-lane tensors and head slice, i.e. without the replicated norms and embedding row).
    """
    _check_context(cfg, context)
    if devices < 1:
        raise ConfigError(f"devices={devices}: must be >= 1")
    whole = _layout(cfg, context, dtype_bytes, 1)
    dev = _layout(cfg, context, dtype_bytes, devices).as_dict()
    dev["shard"] = dev["attention"] + dev["mlp"] + dev["lm_head"]
    full = sum(kv for i, kv in enumerate(whole.kv) if not cfg.is_sliding(i))
    out = {"context": context, "dtype_bytes": dtype_bytes, "devices": devices}
    out.update(whole.as_dict())
    out.update(kv_full_layers=full, kv_sliding_layers=out["kv"] - full, per_device=dev)
    return out


# --- ceilings and the latency model ---------------------------------------------------------------
def _token_us(
    cfg: ModelConfig, module_us: list[float], latency_us: float, dtp: bool
) -> tuple[float, float]:
    """Simulated time of one token on one device, and the part spent stalled on delayed messages.

    Modules run back to back. Immediate TP: every module ends with a blocking all-reduce. DTP:
    only `present` modules block; a `past` module's residual add waits for the partials its
    source module (2d modules earlier) broadcast, which left when that module's compute ended.
    Sources that were themselves all-reduced (`present`) need no message (laneformer.md 8.2).
    The head stage ends with the sampling exchange, which always blocks.
    """
    t, stall, sent = 0.0, 0.0, {}
    for k, dur in enumerate(module_us[:-1]):
        layer, kind = divmod(k, 2)
        t += dur
        sent[k] = t
        mode = cfg.reduce_mode(layer) if dtp else "present"
        src = cfg.past_source(layer) if mode == "past" else None
        if mode == "present":
            t += latency_us
        elif src is not None and cfg.reduce_mode(src) != "present":
            arrival = sent[2 * src + kind] + latency_us
            stall += max(0.0, arrival - t)
            t = max(t, arrival)
    return t + module_us[-1] + latency_us, stall


def _prediction(token_us: float, stream_us: float, kernel_us: float, stall_us: float) -> dict:
    return {
        "token_us": token_us,
        "tok_s": 1e6 / token_us,
        "exposed_comm_us": max(0.0, token_us - stream_us - kernel_us),  # float noise
        "delayed_stall_us": stall_us,
        "kernel_us": kernel_us,
    }


def ceiling(
    cfg: ModelConfig,
    gpu: str | GPU = "h100",
    count: int = 1,
    bandwidth: float | None = None,
    context: int = 1024,
    dtype_bytes: int = 2,
    message_latency_us: float = 3.0,
    kernel_overhead_us: float = 0.0,
    kernels_per_layer: int = 10,
) -> dict:
    """Bandwidth ceiling and predicted tokens/s for `count` GPUs decoding one request.

    `bandwidth` (TB/s) overrides the node's *aggregate* bandwidth (e.g. Kog's 30.7 for 8x H200);
    otherwise it is the GPU's datasheet figure times `count`.

    - `ceiling_tok_s` = aggregate bandwidth / whole-model bytes per token (laneformer.md 9's table).
    - `device_ceiling_tok_s` = per-device bandwidth / the busiest device's bytes; slightly lower,
      since norms and the embedding row are read on every device.

    Latency model (per token, on the busiest device; all devices run in lock-step):
    - Each module's stream time = its bytes / per-device bandwidth (attention modules include
      their KV read); weights are assumed streamed at full bandwidth, compute is free.
    - `kernel_overhead_us` x `kernels_per_layer` is a dead gap per layer, split over its two
      modules (0 models a persistent monokernel; 4.5 us x 10 is Kog's launch example).
    - A message (all-reduce, broadcast or sampling exchange) costs `message_latency_us` from
      send to use, independent of size (6 KB payloads are latency-bound, laneformer.md 8.2).
    - `tp`: an immediate all-reduce after every module plus the sampling exchange:
      stream + (2 N + 1) x latency + kernel gaps.
    - `dtp` (Laneformer with lanes > 1 only, else None): the 2d `present` modules and the
      sampling exchange block; a delayed message is free when it arrives within the 2d modules
      of work between send and use (laneformer.md 8.3), else only the excess is exposed, simulated
      module by module from the per-module stream times. The stalled device is assumed idle.
    - With count = 1 there is no communication, so both predictions are the streaming time plus
      kernel gaps.
    """
    gpu = get_gpu(gpu)
    if not isinstance(count, int) or count < 1:
        raise ConfigError(f"count={count!r}: must be a positive number of GPUs")
    for name, v in (
        ("message_latency_us", message_latency_us),
        ("kernel_overhead_us", kernel_overhead_us),
        ("kernels_per_layer", kernels_per_layer),
    ):
        if v < 0:
            raise ConfigError(f"{name}={v}: must be >= 0")
    if bandwidth is not None and not bandwidth > 0:
        raise ConfigError(f"bandwidth={bandwidth}: must be > 0 TB/s")
    total_tb_s = bandwidth if bandwidth is not None else gpu.bandwidth_tb_s * count
    dev_bw = total_tb_s * 1e12 / count  # bytes/s per device
    nbytes = bytes_per_token(cfg, context, dtype_bytes, count)
    layout = _layout(cfg, context, dtype_bytes, count)

    gap_us = kernel_overhead_us * kernels_per_layer / 2
    module_us = [b / dev_bw * 1e6 + gap_us for b in layout.module_bytes()]
    module_us[-1] -= gap_us  # the head stage has no per-layer kernels
    kernel_us = gap_us * 2 * cfg.num_layers
    stream_us = nbytes["per_device"]["total"] / dev_bw * 1e6
    latency = message_latency_us if count > 1 else 0.0
    tp_token, _ = _token_us(cfg, module_us, latency, dtp=False)
    tp = _prediction(tp_token, stream_us, kernel_us, 0.0)
    dtp = None
    if cfg.family == "laneformer" and cfg.num_lanes > 1:
        token, stall = _token_us(cfg, module_us, latency, dtp=True)
        dtp = _prediction(token, stream_us, kernel_us, stall)
    return {
        "gpu": gpu.name,
        "count": count,
        "bandwidth_tb_s": total_tb_s,
        "device_bandwidth_tb_s": total_tb_s / count,
        "context": context,
        "bytes": nbytes,
        "ceiling_tok_s": total_tb_s * 1e12 / nbytes["total"],
        "device_ceiling_tok_s": dev_bw / nbytes["per_device"]["total"],
        "stream_us": stream_us,
        "latency_model": {
            "message_latency_us": latency,
            "kernel_overhead_us": kernel_overhead_us,
            "kernels_per_layer": kernels_per_layer,
        },
        "tp": tp,
        "dtp": dtp,
    }


# --- Kog's published back-of-envelope figures (laneformer.md 9.1) ---------------------------------
def simple_ceiling(model_bytes: float, bandwidth: float) -> float:
    """Tokens/s when each token streams `model_bytes` at `bandwidth` TB/s (Kog's figures).

    4e9 B at 30.7 TB/s gives 7,675 (quoted as ~7,700); at 33.6 TB/s exactly 8,400.
    """
    return bandwidth * 1e12 / model_bytes


def launch_cap(
    num_layers: int = 25, kernels_per_layer: int = 10, overhead_us: float = 4.5
) -> float:
    """Tokens/s if kernel launches were the only cost (Kog's example: 25 x 10 x 4.5 us -> ~890)."""
    return 1e6 / (num_layers * kernels_per_layer * overhead_us)


@dataclass(frozen=True)
class MoEModel:
    name: str
    active_params_b: float  # billions of parameters used per token
    precision: str  # as Kog's table labels it
    nominal_bytes_per_param: float  # the label's width alone
    active_gb: float  # bytes streamed per token, 1e9 B; see the notes in MOE_MODELS
    published: tuple[int, int]  # Kog's table: (8x H200, 8x MI300X) tokens/s


# Both published columns imply the same bytes per token only with Kog's effective 30.7 TB/s and
# 33.6 TB/s (the ratio of each row's two figures is 0.913-0.917, 30.7/33.6 = 0.914; the table
# header's "~30"/"~33" would give 0.909), so the table is computed with those two figures.
# `active_gb` is what each row's published figures imply, checked against the architecture:
MOE_MODELS = (
    # 3B x 1 B (FP8) = 3.0 GB; the published 3,650/4,000 imply 3.03 GB.
    MoEModel("Qwen3-Coder-Next", 3.0, "FP8", 1.0, 3.0, (3650, 4000)),
    # MXFP4 experts + BF16 attention/embeddings average ~1 B/param; Kog's founder (HN) uses
    # "5.1B active in FP8 = 5.1 GB". The published figures imply 5.03 GB.
    MoEModel("GPT-OSS-120B", 5.1, "FP4/BF16", 1.0, 5.1, (2200, 2400)),
    # Labelled FP8, but 13 GB would give only ~850/930 tok/s. The figures imply 9.5 GB
    # (0.73 B/param), i.e. the "mixed FP4/FP8" weights the founder describes on HN.
    MoEModel("DeepSeek-V4-Flash", 13.0, "FP8", 1.0, 9.5, (1160, 1270)),
    # Labelled INT4, but 16 GB would give ~690/756 tok/s. The figures imply 34 GB: in Kimi K2's
    # layout only the routed experts (~21B active) are INT4 (~11 GB); attention, shared expert
    # and dense layer (~11B) stay BF16 (~22 GB), ~33 GB in all.
    MoEModel("Kimi-K2.6", 32.0, "INT4", 0.5, 34.0, (325, 355)),
)


def moe_projections(
    mbu: float = 0.36, h200_tb_s: float = 30.7, mi300x_tb_s: float = 33.6
) -> list[dict]:
    """Seed 002's MoE table: mbu x node bandwidth / active bytes, next to the published figures.

    `computed` uses each model's `active_gb`; `nominal` uses active params x the label's width,
    which shows where the label alone does not explain the published number.
    """
    if not 0 < mbu <= 1:
        raise ConfigError(f"mbu={mbu}: must be in (0, 1]")

    def tok_s(gb: float) -> list[float]:
        return [mbu * bw * 1e12 / (gb * 1e9) for bw in (h200_tb_s, mi300x_tb_s)]

    rows = []
    for m in MOE_MODELS:
        rows.append(
            {
                "model": m.name,
                "active_params_b": m.active_params_b,
                "precision": m.precision,
                "active_gb": m.active_gb,
                "published": list(m.published),
                "computed": tok_s(m.active_gb),
                "nominal": tok_s(m.active_params_b * m.nominal_bytes_per_param),
            }
        )
    return rows
