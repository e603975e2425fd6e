"""`--quantization int8|int4` on a GPU: the model's projections on quantized storage.

`quantize_model(model, name)` quantizes every layer projection (wq, wk, wv, wo, w1, w3, w2) and
the LM head of a loaded float model in the GPU layout (weights/gpu_pack.py) and puts a
`QuantProj` in their place; the embedding table stays in the model's dtype (a step reads one
row of it; a tied head gets its own quantized copy). A QuantProj computes

- up to 8 tokens (decode, speculative verify): the Triton product over the quantized blocks
  (kernels/qgemv.py), when `use_triton` says the kernels run on this device;
- anything else (prefill, a CPU): the dequantized matrix in the activation dtype, lane_linear.

The fused bf16 decode step reads plain weight tensors, so a quantized model decodes through the
graph of its own forward (step/fused.supports says no): every product streams the quantized
bytes, the norms, RoPE and attention run as PyTorch ops in the graph. Fusing the quantized
products into norm_qkv / gemv_reduce / norm_swiglu is the next step, once those kernels take
their token axis.

`repack_gguf(model, path)` does the same with a GGUF file's own blocks: each matrix stored as
Q8_0, Q4_1 or Q4_K becomes a QuantProj holding those values (weights/gpu_pack.py's repacks), the
others stay float.

`quantized_reference(model, name)` is the reference path of the same format: each projection's
weight replaced by its dequantized values, the model otherwise untouched, so any decode step
(the CPU's packed step included) computes exactly what the GPU products should, in fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from ..model import Laneformer, lane_linear
from ..weights.gpu_pack import GPUQuant, from_q4_k, from_qtensor, gpu_format, quantize
from ..weights.quant import from_gguf
from . import use_triton

PROJECTIONS = (("attention", "wq"), ("attention", "wk"), ("attention", "wv"),
               ("attention", "wo"), ("feed_forward", "w1"), ("feed_forward", "w3"),
               ("feed_forward", "w2"))  # fmt: skip
MAX_TOKENS = 8  # kernels/qgemv.MAX_TOKENS (that module needs triton to import)


class QuantProj(nn.Module):
    """A lane-major projection (L, O, K) on GPUQuant storage, with an optional bias (L, O);
    `plain`: an nn.Linear's place, x (..., K) with one lane."""

    def __init__(self, q: GPUQuant, bias: torch.Tensor | None, plain: bool = False):
        super().__init__()
        self.fmt, self.group, self.k, self.plain = q.fmt, q.group, q.k, plain
        self.register_buffer("qdata", q.data)
        self.register_buffer("qscale", q.scale)
        self.register_buffer("qmins", q.mins)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @property
    def q(self) -> GPUQuant:
        return GPUQuant(self.fmt, self.group, self.k, self.qdata, self.qscale, self.qmins)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plain:
            return self._lanes(x.unsqueeze(-2)).squeeze(-2)
        return self._lanes(x)

    def _lanes(self, x: torch.Tensor) -> torch.Tensor:
        lead, (L, K) = x.shape[:-2], x.shape[-2:]
        tokens = x[..., 0, 0].numel()
        if tokens <= MAX_TOKENS and use_triton(x):
            from .qgemv import qgemv

            y = qgemv(self.q, x.reshape(tokens, L, K).contiguous())  # (S, L, O)
            y = y.reshape(*lead, L, -1)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        w = self.q.dequantize().to(x.dtype)
        return lane_linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


def _projections(model: Laneformer):
    for block in model.model.layers:
        for part, name in PROJECTIONS:
            owner = getattr(block, part)
            yield owner, name, getattr(owner, name)


def _head(model: Laneformer) -> tuple[nn.Module, str, torch.Tensor]:
    """(owner, attribute, weight) of the LM head: (L, V/L, D), (V, L D) or (V, D)."""
    head = model.cfg.lm_head_type
    if head == "vocab_parallel":
        return model, "lm_head", model.lm_head.weight
    if head == "lane":
        return model.lm_head, "linear", model.lm_head.linear.weight
    tied = model.cfg.tie_word_embeddings
    return model, "lm_head", (model.model.tok_embeddings if tied else model.lm_head).weight


@torch.no_grad()
def place_quantized(model: Laneformer, path, quantization: str) -> Laneformer:
    """`--quantization` on a GPU: a GGUF file's blocks repacked ("gguf"), else a GPU format."""
    if quantization == "gguf":  # the file's blocks (packing.GGUF_BLOCKS)
        from ..gguf import find_gguf

        return repack_gguf(model, find_gguf(path))
    return quantize_model(model, quantization)  # the GPU formats (packing.load_plan)


@torch.no_grad()
def quantize_model(model: Laneformer, name: str) -> Laneformer:
    """Quantize the layer projections and the head in place (`name`: a GPU_QUANTIZATIONS key)."""
    fmt, group = gpu_format(name)
    for owner, attr, proj in list(_projections(model)):
        q = quantize(proj.weight, fmt, group)
        setattr(owner, attr, QuantProj(q, proj.bias))
    owner, attr, w = _head(model)
    setattr(owner, attr, QuantProj(quantize(w, fmt, group), None, plain=w.dim() == 2))
    model.gpu_quantization = name
    return model


# GGUF types with a GPU layout
REPACKED = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K", "Q3_K", "Q1_0", "IQ4_NL", "IQ4_XS",
            "MXFP4", "NVFP4", "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S",
            "IQ1_M")  # fmt: skip


@torch.no_grad()
def repack_gguf(model: Laneformer, path) -> Laneformer:
    """The layer projections and the head of a model loaded from the GGUF file `path` (one
    lane: Llama-family files) on the file's blocks of REPACKED, repacked (gpu_pack.from_qtensor:
    Q4_0, Q4_1 and IQ3_S as int4, Q4_K's as stored, the rest as int8 values, in groups of 32 or,
    for the types with a scale per 16 values, 16)."""
    from ..checkpoint import hf_name
    from ..gguf.tensors import GGUFCheckpoint

    ck, cfg = GGUFCheckpoint(path), model.cfg
    if cfg.num_lanes != 1:
        raise ConfigError("--quantization gguf on a GPU: for one-lane (Llama-family) models; "
                          "a Laneformer GGUF loads as floats there")  # fmt: skip

    def stored(module_path: str, proj: nn.Module) -> QuantProj | None:
        key = hf_name(cfg, module_path + ".weight")
        raw = ck.raw(key) if key in ck.keys() else None
        if raw is None or raw.ggml_type not in REPACKED:
            return None
        n, k = tuple(raw.shape)
        if raw.ggml_type == "Q4_K":
            q = from_q4_k(raw.data.reshape(-1), n, k)
        else:
            blocks = from_gguf(raw.ggml_type, raw.data, (n, k))
            if blocks is None:  # scales no layout holds (MXFP4's outlying e): the floats stay
                return None
            q = from_qtensor(blocks)
        bias = getattr(proj, "bias", None)
        return QuantProj(q.to(proj.weight.device), bias, plain=proj.weight.dim() == 2)

    for i, block in enumerate(model.model.layers):
        for part, name in PROJECTIONS:
            owner = getattr(block, part)
            q = stored(f"model.layers.{i}.{part}.{name}", getattr(owner, name))
            if q is not None:
                setattr(owner, name, q)
    owner, attr, w = _head(model)
    tied = cfg.lm_head_type == "replicate" and cfg.tie_word_embeddings
    head_module = model.model.tok_embeddings if tied else getattr(owner, attr)
    q = stored("model.tok_embeddings" if tied else "lm_head", head_module)
    if q is not None:
        q.plain = True
        setattr(owner, attr, q)
    model.gpu_quantization = "gguf"
    return model


@torch.no_grad()
def quantized_reference(model: Laneformer, name: str) -> Laneformer:
    """Each layer projection's and the head's weight replaced by its dequantized `name` values,
    in place (a tied head gets its own copy: the embedding lookups keep the float table)."""
    fmt, group = gpu_format(name)

    def dequantized(w: torch.Tensor) -> torch.Tensor:
        return quantize(w, fmt, group).dequantize().to(w.dtype).reshape(w.shape)

    for _, _, proj in _projections(model):
        proj.weight.data = dequantized(proj.weight)
    owner, attr, w = _head(model)
    if model.cfg.lm_head_type == "replicate" and model.cfg.tie_word_embeddings:
        V, D = w.shape
        model.lm_head = nn.Linear(D, V, bias=False, device=w.device, dtype=w.dtype)
        model.lm_head.weight.data = dequantized(w)
    else:
        getattr(owner, attr).weight.data = dequantized(w)
    return model


def quantized_bytes(model: Laneformer) -> int:
    """Bytes a decode step streams from the quantized matrices (integers, scales, mins)."""
    return sum(m.q.nbytes for m in model.modules() if isinstance(m, QuantProj))
