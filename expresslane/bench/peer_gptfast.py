"""The gpt-fast peer: a checkout of pytorch-labs/gpt-fast that the user provides (never vendored).

`bench --peer-gptfast DIR` imports DIR/model.py (`Transformer`, `ModelArgs`) and DIR/generate.py
(`prefill`, `decode_one_token`), builds the Llama of our model's dims (for a Laneformer, the
equal-byte Llama) with random weights on the device, and times it as gpt-fast's own generate
does: the prefill eager, `decode_one_token` compiled with mode="reduce-overhead" and
fullgraph=True, attention through the math SDPA kernel (gpt-fast's choice for inductor), greedy
(top_k=1). Its rows then say what gpt-fast's recipe reaches on this machine for this shape.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import time
from pathlib import Path

import torch

from ..config import ModelConfig
from .peers import PeerSetup, sync, timed_decode
from .weights import as_llama


def _import_checkout(directory: Path):
    """gpt-fast's generate.py imports `model` and `tokenizer` as top-level modules."""
    for name in ("model.py", "generate.py"):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"--peer-gptfast {directory}: no {name} (a gpt-fast checkout?)")
    sys.path.insert(0, str(directory))
    try:
        for name in ("model", "tokenizer", "generate"):
            sys.modules.pop(name, None)  # never someone else's module of the same name
        return importlib.import_module("model"), importlib.import_module("generate")
    finally:
        sys.path.remove(str(directory))


def _import_module(directory: Path, name: str):
    """DIR/name.py of the checkout (after _import_checkout put its model module in place)."""
    sys.path.insert(0, str(directory))
    try:
        sys.modules.pop(name, None)
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(directory))


def model_args(gf_model, cfg: ModelConfig, max_len: int):
    """gpt-fast's ModelArgs for our config (head_dim = dim / n_head there, as in every preset)."""
    kw = dict(block_size=max_len, vocab_size=cfg.vocab_size, n_layer=cfg.num_layers,
              n_head=cfg.num_heads, dim=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
              n_local_heads=cfg.num_kv_heads, rope_base=cfg.rope_theta,
              norm_eps=cfg.norm_eps)  # fmt: skip
    s = cfg.rope_scaling
    if s is not None and s.rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        kw["rope_scaling"] = {k: getattr(s, k) for k in keys}
    return gf_model.ModelArgs(**kw)


def _math_sdpa():
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.MATH)
    except ImportError:
        return contextlib.nullcontext()


def _quantize(gf_quantize, model, mode: str):
    """gpt-fast's own weight-only quantizers, as its quantize.py applies them: int8 per output
    channel, int4 in groups of 128 (tinygemm's packed layout, CUDA)."""
    if mode == "int8":
        handler = gf_quantize.WeightOnlyInt8QuantHandler(model)
    else:
        handler = gf_quantize.WeightOnlyInt4QuantHandler(model, groupsize=128)
    state = handler.create_quantized_state_dict()
    try:
        model = handler.convert_for_runtime(use_cuda=True)
    except TypeError:  # int8's (and older int4's) take no argument
        model = handler.convert_for_runtime()
    model.load_state_dict(state, assign=True)
    return model


class GptFast:
    name = "gpt-fast"

    def __init__(self, setup: PeerSetup, quantization: str | None = None):
        if not setup.arg:
            raise ValueError("gpt-fast: give the checkout as gpt-fast=DIR (--peer-gptfast DIR)")
        self.setup = setup
        gf_model, self.gen = _import_checkout(Path(setup.arg).expanduser())
        self.cfg = setup.cfg if setup.cfg.family == "llama" else as_llama(setup.cfg)
        self.note = "random weights, same dims"
        args = model_args(gf_model, self.cfg, setup.max_len)
        if args.head_dim != self.cfg.head_dim:
            raise ValueError(f"gpt-fast: head_dim {self.cfg.head_dim} != dim / n_head")
        with torch.device(setup.device):
            self.model = gf_model.Transformer(args).to(setup.dtype).eval()
            if quantization is not None:  # gpt-fast's quantize.py (imports sentencepiece)
                gf_quantize = _import_module(Path(setup.arg).expanduser(), "quantize")
                self.model = _quantize(gf_quantize, self.model, quantization).to(setup.device)
                self.name = f"gpt-fast {quantization}"
            # what one step streams: every weight but the embedding table (one row of it)
            embed = getattr(self.model, "tok_embeddings", None)
            skip = set() if embed is None else {id(t) for t in embed.parameters()}
            tensors = [*self.model.parameters(), *self.model.buffers()]
            self.weight_bytes = sum(t.numel() * t.element_size() for t in tensors
                                    if id(t) not in skip)  # fmt: skip
            self.model.setup_caches(max_batch_size=1, max_seq_length=setup.max_len)
        backend = setup.compile_backend
        mode = "reduce-overhead" if backend == "inductor" and setup.device.type == "cuda" else None
        self.decode = torch.compile(self.gen.decode_one_token, mode=mode, fullgraph=True,
                                    backend=backend)  # fmt: skip

    def _step(self, token, position):
        with _math_sdpa():
            return self.decode(self.model, token.view(1, -1), position, top_k=1)[0]

    @torch.inference_mode()
    def measure(self, context: int) -> dict:
        from .peers import prompt_ids

        dev = self.setup.device
        ids = prompt_ids(self.cfg.vocab_size, context, dev)
        sync(dev)
        t = time.perf_counter()
        token = self.gen.prefill(self.model, ids, torch.arange(context, device=dev), top_k=1)
        sync(dev)
        ttft = time.perf_counter() - t
        position = torch.tensor([context], device=dev)
        row = timed_decode(self._step, token, position, self.setup, context, ttft)
        row.update(cuda_graph=self.setup.device.type == "cuda" and self.setup.compile_backend ==
                   "inductor", fused_kernels=False, pdl=False)  # fmt: skip
        return row

    def close(self) -> None:
        del self.model, self.decode


def gptfast(setup: PeerSetup) -> GptFast:
    return GptFast(setup)
