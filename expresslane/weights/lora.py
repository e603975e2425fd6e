"""LoRA adapters: read from a PEFT folder or a llama.cpp GGUF adapter, merged into the weights
at load.

A LoRA adapter adds `scale * B @ A` to a projection's (out, in) weight: A (r, in), B (out, r).
PEFT's scale is `lora_alpha / r` (`alpha / sqrt(r)` with `use_rslora`, per-module `rank_pattern`
and `alpha_pattern` honoured); llama.cpp's is `alpha / r` times the user's scale, or the user's
scale alone where the file's `adapter.lora.alpha` is 0 (as llama-adapter.cpp reads it). Several
adapters add up, as llama.cpp's repeated `--lora` does.

Decided: adapters are **merged** into the weights once, at load, not applied per token as vLLM
and llama.cpp do. At batch 1 every product streams its weight anyway, and a merged adapter costs
nothing per token. Applying it at run time would cost two thin products per adapted matrix in
every step. The price: one set of adapters per engine, chosen at load (a server serves one
adapter, under its name). The merge is done in fp32 (`base + delta`, then rounded once to the
weights' dtype). On a GGUF file whose blocks are kept, an adapted matrix cannot stay in those
blocks: it is packed from its merged values, in fp32 where the file stores floats and as Q8_0
where it stores quantized blocks (weights/packing.py pack_gguf). Unadapted matrices keep their
blocks.

Llama-family models (one lane) only: the projections PEFT and llama.cpp name (q, k, v, o, gate,
up, down). Anything else an adapter holds (embeddings, the head, DoRA magnitudes, trained
biases, `modules_to_save`) is refused by name rather than left out, since leaving it out would
answer with a model the adapter's author never trained.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import CheckpointError

# transformers' projection names (inside model.layers.{i}.) -> ours
PROJECTIONS = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(\w+\.\w+)")


@dataclass(frozen=True)
class LoraDelta:
    """One adapted projection: our module path, A (r, in), B (out, r) in fp32, and the scale."""

    module: str
    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass(frozen=True)
class LoraAdapter:
    path: str
    deltas: tuple[LoraDelta, ...]

    @property
    def modules(self) -> set[str]:
        return {d.module for d in self.deltas}


def our_module(hf_module: str, where: str) -> str:
    """`model.layers.3.self_attn.q_proj` -> `model.layers.3.attention.wq`, or a refusal."""
    m = _LAYER.fullmatch(hf_module)
    if m is None or m[2] not in PROJECTIONS:
        raise CheckpointError(f"{where}: adapts {hf_module}; LoRA is merged into the layers' "
                              "projections only (q, k, v, o, gate, up, down)")  # fmt: skip
    return f"model.layers.{m[1]}.{PROJECTIONS[m[2]]}"


def load_adapter(path: str | Path, cfg: ModelConfig, scale: float = 1.0) -> LoraAdapter:
    """A PEFT folder (adapter_config.json and adapter_model.safetensors) or a GGUF adapter."""
    from ..gguf import find_gguf

    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{path}: no such adapter file or folder")
    if cfg.num_lanes != 1:
        raise CheckpointError(f"{path}: LoRA adapters are read for Llama-family models (one "
                              "lane); this model has lanes")  # fmt: skip
    if p.is_dir() and (p / "adapter_config.json").exists():
        return read_peft(p, scale)
    gguf = find_gguf(p)
    if gguf is not None:
        return read_gguf_adapter(gguf, cfg, scale)
    raise CheckpointError(f"{path}: not a LoRA adapter (a PEFT folder with adapter_config.json, "
                          "or a GGUF adapter file)")  # fmt: skip


def read_peft(folder: Path, scale: float = 1.0) -> LoraAdapter:
    """PEFT's saved adapter: keys `base_model.model.<module>.lora_A.weight` and `lora_B`."""
    from safetensors.torch import load_file

    conf = _peft_config(folder)
    weights = folder / "adapter_model.safetensors"
    if not weights.exists():
        raise CheckpointError(f"{folder}: no adapter_model.safetensors (pickled adapter_model.bin "
                              "files are refused: they can run code)")  # fmt: skip
    try:
        tensors = load_file(str(weights))
    except Exception as e:  # safetensors raises its own error types for bad files
        raise CheckpointError(f"{weights}: not a readable safetensors file ({e})") from None
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])(?:\.\w+)?\.weight", key)
        if m is None:
            why = "is not a LoRA A or B matrix (DoRA, embeddings and saved modules are refused)"
            raise CheckpointError(f"{weights}: tensor {key} {why}")
        pairs.setdefault(m[1], {})[m[2]] = t.float()
    deltas = []
    for hf_module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise CheckpointError(f"{weights}: {hf_module} has lora_{next(iter(ab))} alone")
        rank = ab["A"].shape[0]
        alpha = _pattern(conf.get("alpha_pattern"), hf_module, conf.get("lora_alpha", 8))
        s = alpha / (math.sqrt(rank) if conf.get("use_rslora") else rank)
        deltas.append(LoraDelta(our_module(hf_module, str(weights)), ab["A"], ab["B"], s * scale))
    return LoraAdapter(str(folder), tuple(deltas))


def _peft_config(folder: Path) -> dict:
    where = folder / "adapter_config.json"
    try:
        conf = json.loads(where.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{where}: not readable JSON ({e})") from None
    if not isinstance(conf, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {type(conf).__name__}")
    refused = {
        "peft_type": conf.get("peft_type", "LORA") != "LORA",
        "use_dora": bool(conf.get("use_dora")),
        "modules_to_save": bool(conf.get("modules_to_save")),
        "bias": conf.get("bias", "none") != "none",
        "fan_in_fan_out": bool(conf.get("fan_in_fan_out")),
    }
    bad = [k for k, v in refused.items() if v]
    if bad:
        raise CheckpointError(f"{where}: {bad[0]}={conf.get(bad[0])!r} is not supported (a plain "
                              "LoRA of the layers' projections is)")  # fmt: skip
    return conf


def _pattern(patterns: dict | None, module: str, default: float) -> float:
    """PEFT's per-module override: a key matching the module's name or its tail."""
    for key, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def read_gguf_adapter(path: Path, cfg: ModelConfig, scale: float = 1.0) -> LoraAdapter:
    """llama.cpp's adapter GGUF: `<base tensor>.lora_a` (r, in) and `.lora_b` (out, r), the
    rows of q and k's B permuted as the base file's are (un-permuted here for llama files)."""
    from ..gguf.quants import raw_to_float
    from ..gguf.reader import read_header
    from ..gguf.tensors import PERMUTED_ARCHS, hf_key, unpermute_rows

    header = read_header(path)
    if header.get("general.type") != "adapter" or header.get("adapter.type") != "lora":
        raise CheckpointError(f"{path}: a GGUF model, not a LoRA adapter (general.type "
                              f"{header.get('general.type')!r})")  # fmt: skip
    alpha = float(header.get("adapter.lora.alpha", 0.0) or 0.0)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name in header.tensors:
        m = re.fullmatch(r"(.+\.weight)\.lora_([ab])", name)
        if m is None:
            raise CheckpointError(f"{path}: tensor {name} is not a lora_a or lora_b matrix")
        pairs.setdefault(hf_key(m[1]).removesuffix(".weight"), {})[m[2]] = raw_to_float(
            header, name
        )
    heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}
    deltas = []
    for hf_module, ab in sorted(pairs.items()):
        if set(ab) != {"a", "b"}:
            raise CheckpointError(f"{path}: {hf_module} has lora_{next(iter(ab))} alone")
        b = ab["b"]
        proj = hf_module.rsplit(".", 1)[-1]
        if header.architecture in PERMUTED_ARCHS and proj in heads:
            b = unpermute_rows(b, heads[proj])
        rank = ab["a"].shape[0]
        s = scale * alpha / rank if alpha else scale
        deltas.append(LoraDelta(our_module(hf_module, str(path)), ab["a"], b, s))
    return LoraAdapter(str(path), tuple(deltas))


def summed(adapters: list[LoraAdapter]) -> dict[str, torch.Tensor]:
    """Each adapted module's whole delta, every adapter's `scale * B @ A` added, (out, in) fp32:
    what merge adds to a weight once, and what a rank adds before it takes its slice
    (parallel/shard.py)."""
    out: dict[str, torch.Tensor] = {}
    for adapter in adapters:
        for d in adapter.deltas:
            if d.a.shape[0] != d.b.shape[1]:
                raise CheckpointError(f"{adapter.path}: {d.module}: A {list(d.a.shape)} and B "
                                      f"{list(d.b.shape)} differ in rank")  # fmt: skip
            delta = (d.b @ d.a) * d.scale
            out[d.module] = out[d.module] + delta if d.module in out else delta
    return out


def check_fits(module: str, delta: torch.Tensor, weight_shape) -> None:
    """A delta (out, in) against its weight's last two dimensions, or a refusal naming both."""
    if tuple(delta.shape) != tuple(weight_shape[-2:]):
        raise CheckpointError(f"a LoRA adapter's delta for {module} is {list(delta.shape)}; its "
                              f"weight is {list(weight_shape[-2:])}: an adapter for another "
                              "model?")  # fmt: skip


@torch.no_grad()
def merge(model, adapters: list[LoraAdapter]) -> set[str]:
    """Add the adapters' deltas to `model`'s weights (summed in fp32, then one rounding to the
    weights' dtype); returns the adapted module paths."""
    deltas = summed(adapters)
    for module, delta in deltas.items():
        try:
            w = model.get_parameter(module + ".weight")  # (1, out, in): one lane
        except AttributeError:
            raise CheckpointError(f"a LoRA adapter adapts {module}, which this model lacks (more "
                                  "layers than it has?)") from None  # fmt: skip
        check_fits(module, delta, w.shape)
        w.copy_((w.float() + delta.to(w.device)).to(w.dtype))
    return set(deltas)
