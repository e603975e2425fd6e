"""Pack a loaded model's weights for the decode step: fewer, larger products, in one format.

Per layer, Q/K/V become one (L, (Hq+2Hkv)*hd/L, D) matrix and gate/up one (L, 2F/L, D) matrix
(lane-major rows, so a lane's outputs stay together), each stored as a `QTensor` of the chosen
format; wo, w2, the embedding and the LM head are stored alone. A tied head is the embedding.

`pack_model(model, fmt)` is applied from outside, once, after loading, and the model then runs
on the packed storage too, so prefill, the eager decode and the packed step share one copy
(`pack_gguf(model, path)` does the same with a GGUF file's own blocks: every block type with a
kernel stays as it was quantized, each matrix in its own format):

- a float format equal to the model's dtype: the parameters become views of the packed tensors
  (same values, nothing else changes; the model can still be trained or saved);
- any other format (int8, or 16-bit weights under an fp32 model): the projections, embedding
  and head are replaced by modules that hold the packed storage and compute in the activation
  dtype from its dequantized values (`PackedProj` ...): the model *is* the quantized model.

The result is kept on the model (`model.packed`), so packing twice returns the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from ..checkpoint import resolve_device
from ..errors import ConfigError
from ..gguf import find_gguf
from ..model import Laneformer
from .gpu_pack import GPU_QUANTIZATIONS
from .hugepages import Placer
from .lora import load_adapter, merge
from .packed_modules import PackedEmbedding, PackedProj
from .quant import (
    FLOAT_FORMATS,
    GGUF_FORMATS,
    QTensor,
    check_format,
    concat_rows,
    from_gguf,
    quantize,
    stack_rows,
)
from .stored import stored_16bit, stored_matrices, stored_only, stored_reader

# --quantization NAME -> the packed format: int8 is GGUF Q8_0's layout and rounding (one f16
# scale per 32 weights: 98% top-1 agreement with fp32 on SmolLM2, against 96% for one scale per
# row, BENCHMARKS.md); "int8-row" (one fp32 scale per output row) is the per-channel variant.
QUANTIZATIONS = {"int8": "q8_0", "int8-row": "int8"}
# --quantization gguf: a GGUF file's own blocks. The CPU keeps them anyway (dtype auto); on a GPU
# they go to the quantized products where a layout holds them (kernels/qlinear.repack_gguf: the
# types of its REPACKED), the rest bf16. Not the GPU's default: a quantized model decodes
# through its forward's graph, not the fused bf16 step, and which is faster at a model's size
# waits for a GPU run to measure it (docs/gpu-session.md).
GGUF_BLOCKS = "gguf"


def packed_format(name: str) -> str:
    """A CLI weight-format name (--quantization / --formats) as a QTensor format."""
    return QUANTIZATIONS.get(name, name)


def load_plan(
    device: str, dtype: str, quantization: str | None, path=None
) -> tuple[str, str | None]:
    """(dtype to load a checkpoint in, packed weight format or None) for the flags given.

    On a CPU the decode step computes in fp32 whatever the weights: `--dtype bfloat16|float16`
    and `--quantization int8` load fp32 and pack the weights in that format; with dtype auto a
    GGUF file keeps its own blocks ("gguf", pack_gguf) and a checkpoint whose matrices are all
    bf16 (or all fp16) keeps that format, as a GGUF BF16 file does: the same weight values (exact
    in fp32), half the bytes; x meets bf16 weights as two bf16 parts (csrc/cpu_matmul.c), within
    ~2^-16 of fp32 (`--dtype float32`: the fp32 packing). Elsewhere `dtype` is the
    model's own; a GPU's `--quantization` (gpu_pack.GPU_QUANTIZATIONS) loads the floats, which
    Engine.from_pretrained then quantizes (kernels/qlinear.py): no packed format here.
    """
    names = {**QUANTIZATIONS, **GPU_QUANTIZATIONS, GGUF_BLOCKS: None}
    if quantization is not None and quantization not in names:
        raise ConfigError(f"--quantization {quantization!r}: expected one of {', '.join(names)}")
    cpu = resolve_device(device).type == "cpu"
    if quantization == GGUF_BLOCKS:
        if path is None or find_gguf(path) is None:
            raise ConfigError("--quantization gguf keeps a GGUF file's own blocks: the model is "
                              "not a GGUF file")  # fmt: skip
        return ("float32", "gguf") if cpu else (dtype, None)
    if quantization is not None:
        if not cpu and quantization not in GPU_QUANTIZATIONS:
            raise ConfigError(f"--quantization {quantization}: runs on a CPU; on a GPU: "
                              f"{', '.join(GPU_QUANTIZATIONS)}")  # fmt: skip
        if not cpu:
            return dtype, None
        if quantization not in QUANTIZATIONS:
            raise ConfigError(f"--quantization {quantization}: the GPU products' format (the CPU "
                              f"packed step has {', '.join(QUANTIZATIONS)})")  # fmt: skip
        return "float32", packed_format(quantization)
    if cpu and dtype in ("bfloat16", "float16"):
        return "float32", dtype
    if cpu and dtype == "auto" and path is not None:
        fmt = "gguf" if find_gguf(path) is not None else stored_16bit(path)
        return ("float32", fmt) if fmt else (dtype, None)
    return dtype, None


def load_packed(
    path, device: str = "auto", dtype: str = "auto", quantization: str | None = None,
    progress: bool = True, lora: tuple[tuple[str, float], ...] = (),
) -> Laneformer:  # fmt: skip
    """A checkpoint loaded and packed as the flags say (load_plan): what `run` decodes with.
    `lora`: (adapter path, scale) pairs merged into the weights first (weights/lora.py)."""
    from ..checkpoint import load_config, load_model, resolve_model_dir

    if device == "auto":  # once, by the model's size: the plan and the load must agree
        device = str(resolve_device(device, load_config(resolve_model_dir(path))))
    load_dtype, fmt = load_plan(device, dtype, quantization, path)
    if lora and quantization == GGUF_BLOCKS and fmt is None:  # a GPU: it repacks the file's
        raise ConfigError("--lora with --quantization gguf on a GPU: the repack takes the file's "
                          "blocks, which the merged adapter changes; quantize the merged floats "
                          "(int8, ...)")  # fmt: skip
    adapters: list = []
    as_stored = fmt in ("bfloat16", "float16") and stored_16bit(path) == fmt

    def unread(cfg) -> set[str]:  # the adapters first: what they change is read as floats
        adapters.extend(load_adapter(p, cfg, s) for p, s in lora)
        adapted = {m for a in adapters for m in a.modules}
        if fmt == "gguf":
            return stored_only(cfg, find_gguf(path), adapted)
        return stored_matrices(cfg, adapted) if as_stored else set()

    model = load_model(path, device=device, dtype=load_dtype, progress=progress, unread=unread)
    adapted = merge(model, adapters) if adapters else set()
    if fmt == "gguf":  # the file's quantized blocks, kept as they are where a kernel reads them
        pack_gguf(model, find_gguf(path), adapted)
    elif as_stored:  # the checkpoint's own 16-bit matrices, read as stored
        pack_stored(model, path, fmt)
    elif fmt is not None:
        pack_model(model, fmt)
    return model


@dataclass
class PackedLayer:
    attention_norm: torch.Tensor  # (D,) or (L, D)
    wqkv: QTensor  # (L, (Hq + 2 Hkv) hd / L, D): per lane its q rows, then k, then v
    bqkv: torch.Tensor | None  # (L, (Hq + 2 Hkv) hd / L) attention biases (qwen2), or None
    wo: QTensor  # (L, D, Hq hd / L)
    ffn_norm: torch.Tensor
    w13: QTensor  # (L, 2 F / L, D): per lane its gate rows, then up
    w2: QTensor  # (L, D, F / L)
    q_norm: torch.Tensor | None = None  # (hd,) qwen3's RMSNorm scale of every query head
    k_norm: torch.Tensor | None = None  # (hd,) and of every key head; None without q/k norms


@dataclass
class PackedWeights:
    fmt: str
    embed: QTensor  # (V, D)
    layers: list[PackedLayer]
    final_norm: torch.Tensor
    head: QTensor  # (V, D) replicate (the embedding itself when tied), (V, L D) lane,
    #                (L, V / L, D) vocab_parallel

    @property
    def matrices(self) -> list[QTensor]:
        """The matrices one decode step streams (layers and head)."""
        return [m for w in self.layers for m in (w.wqkv, w.wo, w.w13, w.w2)] + [self.head]

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.matrices)

    @property
    def formats(self) -> set[str]:
        return {p.fmt for m in [*self.matrices, self.embed] for p in m.pieces}

    @property
    def layers_format(self) -> str:
        """The format holding most of the layers' bytes: a GGUF mix's main type (q4_k in most
        Q4_K_M files; q5_0 in SmolLM2's, whose 576-wide rows K-quants cannot take)."""
        held: dict[str, int] = {}
        for w in self.layers:
            for m in (w.wqkv, w.wo, w.w13, w.w2):
                for p in m.pieces:
                    held[p.fmt] = held.get(p.fmt, 0) + p.nbytes
        return max(held, key=held.get)


def model_dtype_name(model: Laneformer) -> str:
    dt = model.model.layers[0].attention.wq.weight.dtype
    return next((k for k, v in FLOAT_FORMATS.items() if v == dt), "float32")


def pack_model(model: Laneformer, fmt: str | None = None) -> PackedWeights:
    """Pack `model` in format `fmt` (default: its own dtype) and install the packed storage."""
    have = getattr(model, "packed", None)
    if have is not None:
        if fmt is not None and fmt != have.fmt:
            raise ValueError(f"the model is already packed as {have.fmt}, not {fmt}")
        return have
    fmt = fmt or model_dtype_name(model)
    if fmt not in ("q8_0", "q4_1"):  # those two also pack from floats (llama.cpp's rounding)
        check_format(fmt)
    same = fmt in FLOAT_FORMATS and fmt == model_dtype_name(model)
    if not same and model_dtype_name(model) != "float32":
        raise ValueError(f"packing as {fmt} needs an fp32 model (its activations stay fp32)")
    with torch.no_grad():
        packed = _pack(model, fmt)
        return _installed(model, packed, _repoint if same else _swap)


def _pack(model: Laneformer, fmt: str, fused=None, stored=None) -> PackedWeights:
    """Every matrix of `model` in `fmt`, each placed (hugepages.Placer) as soon as it is made, in
    the order a step streams them; `fused(paths, weights)` / `stored(path)` may supply a layer's
    matrices and the embedding / head from elsewhere (a GGUF file's blocks)."""
    keep = Placer()

    def fit(w: torch.Tensor) -> QTensor:  # GGUF blocks need K % 32 == 0: else per-row int8
        assert not w.is_meta, "a weight load_model left unread (weights/stored.py) from floats"
        blocks_fit = fmt not in GGUF_FORMATS or w.shape[-1] % 32 == 0
        return quantize(w, fmt if blocks_fit else "int8")

    def mat(paths: list[str], weights: list[torch.Tensor]) -> QTensor:
        if fused is not None:
            return keep(fused(paths, weights))
        return keep(fit(concat_rows(weights) if len(weights) > 1 else weights[0]))

    layers = []
    for i, b in enumerate(model.model.layers):
        at, ff = b.attention, b.feed_forward
        p = f"model.layers.{i}."
        bias = None
        if at.wq.bias is not None:
            bias = torch.cat([at.wq.bias, at.wk.bias, at.wv.bias], -1).float()
        qkv = [p + "attention.wq", p + "attention.wk", p + "attention.wv"]
        layers.append(
            PackedLayer(
                attention_norm=b.attention_norm.gamma,
                wqkv=mat(qkv, [at.wq.weight, at.wk.weight, at.wv.weight]),
                bqkv=bias,
                wo=mat([p + "attention.wo"], [at.wo.weight]),
                ffn_norm=b.ffn_norm.gamma,
                w13=mat(
                    [p + "feed_forward.w1", p + "feed_forward.w3"], [ff.w1.weight, ff.w3.weight]
                ),
                w2=mat([p + "feed_forward.w2"], [ff.w2.weight]),
                q_norm=at.q_norm.gamma if model.cfg.qk_norm else None,
                k_norm=at.k_norm.gamma if model.cfg.qk_norm else None,
            )
        )
    cfg = model.cfg

    def whole(path: str, w: torch.Tensor) -> QTensor:
        q = stored(path) if stored is not None else None
        return q if q is not None else fit(w)

    embed = whole("model.tok_embeddings", model.model.tok_embeddings.weight)
    if cfg.lm_head_type == "lane":
        head = keep(fit(model.lm_head.linear.weight))
    elif cfg.lm_head_type == "replicate" and cfg.tie_word_embeddings:
        head = embed = keep(embed)
    elif cfg.lm_head_type == "replicate":
        head = keep(whole("lm_head", model.lm_head.weight))
    else:
        head = keep(fit(model.lm_head.weight))
    if head is not embed:  # after the head: the step streams the layers, then the head
        embed = keep(embed)
    return PackedWeights(fmt, embed, layers, model.model.norm.gamma, head)


def pack_gguf(model: Laneformer, path, adapted: set[str] = frozenset()) -> PackedWeights:
    """Pack a model loaded from the GGUF file `path` with that file's own blocks where a kernel
    reads them (F32/F16/BF16 and weights/gguf_blocks.TYPES; a fused matrix whose parts differ is a
    "mixed" stack of them); any other type is packed as fp32 from the loaded (dequantized)
    weights. `adapted`: module paths a LoRA changed (weights/lora.py), packed from the model's
    merged weights instead: fp32 where the file stores floats, Q8_0 where it stores quantized
    blocks. Installs it as pack_model does."""
    from ..checkpoint import hf_name
    from ..gguf.tensors import GGUFCheckpoint

    if getattr(model, "packed", None) is not None:
        return model.packed
    ck, cfg = GGUFCheckpoint(path), model.cfg

    def stored(module_path: str) -> QTensor | None:
        key = hf_name(cfg, module_path + ".weight")
        if key not in ck.keys():
            return None
        raw = ck.raw(key)
        return from_gguf(raw.ggml_type, raw.data, tuple(raw.shape))

    def merged(module_path: str, w: torch.Tensor) -> QTensor:
        kind = ck.raw(hf_name(cfg, module_path + ".weight")).ggml_type
        fmt = "float32" if kind in ("F32", "F16", "BF16") or w.shape[-1] % 32 else "q8_0"
        return quantize(w[0], fmt)  # the lane axis of one lane off, as a file's blocks come

    def fused(paths: list[str], weights: list[torch.Tensor]) -> QTensor:
        parts = [merged(p, w) if p in adapted else stored(p)
                 for p, w in zip(paths, weights, strict=True)]  # fmt: skip
        if all(p is not None for p in parts):  # formats may differ: a "mixed" stack
            q = stack_rows(parts)
            return q.map(lambda t: t.unsqueeze(0))  # one lane
        assert not any(w.is_meta for w in weights), f"{paths}: left unread, not stored"
        return quantize(concat_rows(weights), "float32")

    with torch.no_grad():
        packed = _pack(model, "float32", fused if cfg.num_lanes == 1 else None, stored)
        packed = _installed(model, packed, _swap)
    packed.fmt = "gguf"
    return packed


def pack_stored(model: Laneformer, path, fmt: str) -> PackedWeights:
    """pack_model's packing in `fmt` (bf16, fp16) of a checkpoint stored in it, the matrices
    load_model left unread (stored.stored_matrices) read as stored: no fp32 copy on the way."""
    read = stored_reader(path, model.cfg)

    def real(module_path: str, w: torch.Tensor) -> torch.Tensor:
        return read(module_path, tuple(w.shape)) if w.is_meta else w  # else merged floats

    def fused(paths: list[str], weights: list[torch.Tensor]) -> QTensor:
        return quantize(concat_rows([real(*pw) for pw in zip(paths, weights, strict=True)]), fmt)

    def stored(module_path: str) -> QTensor | None:
        w = model.get_parameter(module_path + ".weight")
        return quantize(real(module_path, w), fmt) if w.is_meta else None

    with torch.no_grad():
        return _installed(model, _pack(model, fmt, fused, stored), _swap)


def _installed(model: Laneformer, packed: PackedWeights, install) -> PackedWeights:
    """Packed (and placed) weights installed in the model (_swap or _repoint), kept on it."""
    install(model, packed)
    model.packed = packed
    return packed


def _splits(total: int, parts: list[int]) -> list[tuple[int, int]]:
    ends = list(accumulate(parts))
    assert ends[-1] == total
    return [(e - n, e) for n, e in zip(parts, ends, strict=True)]


def _parts(model: Laneformer, i: int, w: PackedLayer):
    """(module, packed rows) for every projection of layer i, in packing order."""
    at, ff = model.model.layers[i].attention, model.model.layers[i].feed_forward
    qkv = [at.wq, at.wk, at.wv]
    rows = _splits(w.wqkv.shape[-2], [m.weight.shape[-2] for m in qkv])
    yield from ((m, w.wqkv.rows(a, b), (a, b)) for m, (a, b) in zip(qkv, rows, strict=True))
    gu = [ff.w1, ff.w3]
    rows = _splits(w.w13.shape[-2], [m.weight.shape[-2] for m in gu])
    yield from ((m, w.w13.rows(a, b), None) for m, (a, b) in zip(gu, rows, strict=True))
    yield at.wo, w.wo, None
    yield ff.w2, w.w2, None


def _repoint(model: Laneformer, packed: PackedWeights) -> None:
    """Same dtype: every parameter becomes a view of its packed tensor (no second copy)."""
    for i, w in enumerate(packed.layers):
        for module, q, bias_rows in _parts(model, i, w):
            module.weight.data = q.data
            if bias_rows is not None and module.bias is not None:
                module.bias.data = w.bqkv[..., bias_rows[0] : bias_rows[1]]
    head = getattr(model, "lm_head", None)  # none where tied
    head = getattr(head, "linear", head)  # the lane head's nn.Linear
    pairs = [(model.model.tok_embeddings, packed.embed), (head, packed.head)]
    for p, q in ((m.weight, q) for m, q in pairs if m is not None):
        if q.stack is None and p.shape == q.data.shape and p.dtype == q.data.dtype:
            p.data = q.data  # the same values; placed (hugepages.py) where they were moved


def _swap(model: Laneformer, packed: PackedWeights) -> None:
    """Another format: projections, embedding and head hold the packed storage themselves."""
    for i, w in enumerate(packed.layers):
        at, ff = model.model.layers[i].attention, model.model.layers[i].feed_forward
        names = [(at, "wq"), (at, "wk"), (at, "wv"), (ff, "w1"), (ff, "w3"), (at, "wo"), (ff, "w2")]
        for (owner, name), (module, q, _) in zip(names, _parts(model, i, w), strict=True):
            setattr(owner, name, PackedProj(q, module.bias))
    model.model.tok_embeddings = PackedEmbedding(packed.embed)
    cfg = model.cfg
    if cfg.lm_head_type == "lane":
        model.lm_head.linear = PackedProj(packed.head, None)
    elif cfg.lm_head_type == "vocab_parallel":
        model.lm_head = PackedProj(packed.head, None)
    elif not cfg.tie_word_embeddings:
        model.lm_head = PackedProj(packed.head, None)
