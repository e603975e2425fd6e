"""The prefill forwards: FusedPrefill (a GPU's, the residual stream fused) and StepPrefill (a
CPU's: short chunks through the packed decode step, long ones through the model's layers on
weights from the C decoder, then the step's head); each called like the model.

Applied to a loaded model from outside (the model stays pure math; its forward is the
reference). A prefill is the model's forward with every `h + reduce(y)` and the RMSNorm after it
replaced by one kernel (kernels/prefill_norm.py): the attention and feed-forward modules, the
embedding and the head are the model's own, so attention biases, q/k norms and quantized
projections come as they are. On a Laneformer the residual stream (S, L, D) is L times a
Llama's, and the eager norm and reduce walk it several times each (issue 24: ~13 ms of a
1,024-token prefill of the 2B on an H200).

Per layer, with the past partials kept exactly as `Laneformer.forward` keeps them:
    a     = attention(x)                     x = attention_norm(h), from the previous kernel
    h, x  = residual_norm(h, a, ffn_norm)    h + reduce(a), then ffn_norm of it
    m     = w2(silu_mul(w1(x), w3(x)))      the feed-forward's projections, one element-wise kernel
    h, x  = residual_norm(h, m, next layer's attention_norm, or none after the last layer)
"""

from __future__ import annotations

import time

import torch

from ..cache import KVCache
from ..generation import Stats
from ..kernels import ref, use_triton
from ..model import Block, FeedForward, Laneformer, Partials, RMSNorm
from ..prefix import PrefixReuse
from ..weights.packed_modules import products_in
from ..weights.quant import GGUF_FORMATS
from .native import FEATURES, HAS_AMX, LOWP_FORMATS, available, native_dequantize
from .packed import PackedDecoder
from .threads import cpu_info

# A prompt up to this many tokens prefills in one pass over the weights (Engine's
# prefill_chunk). A chunk after cached ones attends through SDPA's bottom-right causal bias,
# which a CPU materialises as a mask and computes whole (no causal skipping): on the 2-vCPU VM,
# SmolLM2's shape, 8,000 tokens took 34.9-39.9 s in chunks of 2,048 against 29.1-29.3 s in one
# (transformers: 27.4-27.9 s; BENCHMARKS.md, "One pass for long prompts"). The cost is memory
# for one chunk's activations: an 8B Llama's gate and up products of 8,192 tokens are 470 MB
# each in fp32.
PREFILL_CHUNK = 8192

# The longest chunk of new prompt tokens that prefills through the packed step rather than the
# model's layers, by the layers' products and the weights' formats: where the two crossed in
# `python -m expresslane.bench.cpu_prefill [--prefill-dtype bfloat16]` (the 2-vCPU VM, 2
# threads, SmolLM2-135M as F32, BF16, F16, Q8_0, Q4_0, Q4_K_M and Q6_K; BENCHMARKS.md "Prefill
# on a CPU"). The layers dequantize every block per call (C, ~10 ms for SmolLM2) and run GEMMs,
# bf16 ones 2.2x faster than fp32 ones; the step reads the blocks as stored, ~1-2 ms a token. A
# mix takes its smallest entry. The 4- to 6-bit formats' fp32 bound moved 160 -> 256 with the
# step's tiled row sums (0d7c20a), then with the vectorized split of x, a prompt's attention and
# token work on every thread and Q6_K's re-layout, 256 -> 512 and Q8_0's 384 -> 768, F16's
# 112 -> 160, and the bf16 bounds 40 -> 64 and 56 -> 96 (BENCHMARKS.md, "A prompt's work on
# every thread").
# With x at llama.cpp's precision in the step ("lowp": --prefill-dtype int8, or bfloat16 on bf16
# weights; the layers then bf16 products) the step crossed the bf16 layers at 96-128 tokens on
# Q8_0, Q6_K and BF16 and at 128-192 on the other block formats (BENCHMARKS.md, "8-bit
# activations").
STEP_PREFILL_MAX = {  # by the layers' products (None: fp32) or "lowp", then format
    None: {"float32": 80, "float16": 160, "bfloat16": 192, "q8_0": 768, None: 512},
    torch.bfloat16: {"bfloat16": 80, "float16": 48, "q8_0": 96, "q6_k": 96, None: 64},
    "lowp": {"bfloat16": 112, "q8_0": 96, "q6_k": 96, None: 128},
}
# The same crossings on an Intel Xeon with AMX (the VM, 2026-12-06; BENCHMARKS.md, "Prefill
# crossings on an Intel Xeon"): there MKL's fp32 GEMM and oneDNN's bf16 one overtook the step
# sooner (the 4- to 6-bit formats at 110-180 tokens in fp32, not 512). The entries not measured
# there keep the table above's. Keyed by the vendor: the two tables come from one CPU each.
# F32 and BF16 weights with fp32 products were measured there on 2026-12-07 (BENCHMARKS.md,
# "Short prompts of fp32 and bf16 weights"): the step's fp32 FMA and two-part bf16 products
# run at about half the rate of MKL's fp32 GEMM, so the layers win from 48 and 40 tokens.
INTEL_STEP_PREFILL_MAX = {
    None: {"float32": 48, "bfloat16": 40, "float16": 96, "q8_0": 96, "q6_k": 96, None: 128},
    torch.bfloat16: {"q8_0": 48},
    "lowp": {"bfloat16": 64},
}
# Where the step's bf16 products run in AMX tiles (csrc/cpu_amx.c: up to 16 tokens in one tile
# product), its exact prompt crossed the layers' fp32 GEMMs at 768-1,000 tokens on the Xeon
# (2026-12-07: 684 against 765 ms at 768, 1,003 against 1,005 at 1,000; 179 against 272 at 256), and
# its bf16-rounded one (lowp) the layers' bf16 GEMMs between 256 and 384 (BENCHMARKS.md, "bf16 and
# int8 products in AMX tiles"). int8-row's step ("int8": x in 16 bits, exact integer sums) crossed
# the fp32 layers between 1,000 and 1,500 tokens (746 against 924 ms at 1,000, 1,439 against 1,472
# at 1,500, 2,402 against 2,085 at 2,000; the step's attention grows with the square) and the bf16
# layers at 384 (198 against 207 ms; 123 against 164 at 256). Q8_0's prompt chunks in tiles
# (csrc/cpu_amx_blocks.c, exact x) crossed the fp32 layers at 768 (660 against 667 ms; 178 against
# 234 at 256, where the vpdpbusd step took 340) and the bf16 layers at 128 (91 against 96 ms). The
# nibble formats with a scale per 32 values take a prompt's chunks in tiles too
# (csrc/cpu_amx_blocks.c, their values decoded 16 rows at a time). With tiles a mix takes its main
# format's entry (PackedWeights.layers_format), not its smallest: Q4_K_M's Q6_K matrices, then
# outside the tiles (in them since 8729a76, not yet timed), held SmolLM2's file (mostly q5_0: 576 is
# no multiple of 256) at 96 where its step was the faster to 512. The step against the fp32 layers,
# ms at 256 / 512, by the file's main format: q4_0 213 / 470 against 265 / 527, q5_0 (Q4_K_M) 240 /
# 504 against 276 / 541, q5_0 (Q5_0) 225 / 454 against 282 / 517, iq4_nl (IQ4_XS) 227 / 489 against
# 281 / 530; with mins of their own, level from 256: q4_1 259 / 557 against 272 / 557, q5_1 (Q5_K_M)
# 263 / 560 against 291 / 545 (at 128: 112 and 128 against 168 and 163). Against the bf16 layers
# (--prefill-dtype bfloat16) the step crossed at 96-128 on the same files (at 96: 82 / 88 / 80 / 94
# against 88 / 94 / 89 / 94 ms for Q4_0, Q4_K_M, IQ4_XS, Q4_1; 64 before).
AMX_STEP_PREFILL_MAX = {
    None: {
        "bfloat16": 768,
        "int8": 1000,
        "q8_0": 768,
        "q4_0": 512,
        "q5_0": 512,
        "iq4_nl": 512,
        "q4_1": 256,
        "q5_1": 256,
    },
    torch.bfloat16: {"int8": 384, "q8_0": 128, "q4_0": 96, "q5_0": 96, "iq4_nl": 96, "q4_1": 96},
    "lowp": {"bfloat16": 256},
}


def step_prefill_max(vendor: str, amx: bool = False) -> dict:
    """STEP_PREFILL_MAX for a CPU of this vendor: Intel's measured entries over it on Intel,
    and the AMX ones over those where the bf16 products run in tiles."""
    tables = [INTEL_STEP_PREFILL_MAX] if vendor == "GenuineIntel" else []
    tables += [AMX_STEP_PREFILL_MAX] if amx else []
    out = STEP_PREFILL_MAX
    for over in tables:
        out = {k: {**t, **over.get(k, {})} for k, t in out.items()}
    return out


# The formats whose step products take x at llama.cpp's precision, by --prefill-dtype: bfloat16
# only bf16 weights' (the precision the bf16 layers have), int8 every format that can.
LOWP_BY_DTYPE = {"float32": frozenset(), "bfloat16": frozenset({"bfloat16"}), "int8": LOWP_FORMATS}

# Weight formats whose long prompts multiply in bf16, where the CPU has AVX512_BF16 (oneDNN's
# bf16 GEMM ran 2.2x its fp32 one on the VM's AMD EPYC, SmolLM2's shapes at 1,000 tokens):
# quantized weights (a block's own rounding step is far coarser than bf16's 2^-9), bf16
# weights (exact in bf16) and fp16 weights, asked for bf16 products by name: rounded to bf16
# (SmolLM2's F16 file then prefilled 64-256 tokens in 0.5-0.76x llama.cpp's time, its last
# logits 0.1-0.3 from fp32's against llama.cpp's 0.01-0.02: the speed asked for, at bf16's
# precision). The inputs round to bf16, about as fine as llama.cpp's 8-bit blocks of
# activations. fp32 weights keep fp32 products (a model stored in fp32 asks for fp32).
BF16_PRODUCTS = frozenset({"bfloat16", "float16", "int8", *GGUF_FORMATS})


def warm_up(engine) -> float:
    """Prefill a few prompt lengths once, at load, then forget them: the engine's cache emptied,
    its prefix reuse started afresh and its stats cleared. On the H200 the process's first
    1,024-token prefill of laneformer-2b took 144 ms against 27 ms after: first-use costs in the
    caching allocator and the library kernels (and the fused prefill kernel's Triton compile),
    paid once per process; no request may pay them. Lengths that take each attention form (a
    short chunk's masked path, SDPA's causal one) up to a whole chunk. Returns the seconds."""
    t = time.perf_counter()
    longest = min(engine.prefill_chunk, engine.max_len - 1)
    for n in sorted({n for n in (5, 17, 128, 512) if n < longest} | {longest}):
        engine.cache.reset()  # each one cold, as a new prompt's
        engine.prefill([i % engine.cfg.vocab_size for i in range(n)])
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    engine.cache.reset()
    engine.prefix = PrefixReuse(engine.cache, enabled=engine.prefix.enabled)
    engine.stats = Stats()
    return time.perf_counter() - t


def supports(model) -> bool:
    """A Laneformer whose forward, blocks and norms are the model's own classes' (a subclass
    with its own forward, a parallel shard, a patched block: their forward runs), with norm
    scales in the activation dtype (the kernel rounds to one dtype)."""
    if not isinstance(model, Laneformer) or type(model).forward is not Laneformer.forward:
        return False
    dtype = model.model.tok_embeddings.weight.dtype
    for block in model.model.layers:
        if not isinstance(block, Block) or type(block).forward is not Block.forward:
            return False
        if type(block.feed_forward).forward is not FeedForward.forward:
            return False
        for norm in (block.attention_norm, block.ffn_norm):
            if type(norm).forward is not RMSNorm.forward or norm.gamma.dtype != dtype:
                return False
    return True


def _hooked(model: Laneformer) -> bool:
    """Forward hooks on the model or a block (they would not run here)."""
    mods = (model, *model.model.layers)
    return any(m._forward_hooks or m._forward_pre_hooks for m in mods)


class FusedPrefill:
    """Callable like the model: (tokens (B, S), positions, cache, last_only) -> logits."""

    def __init__(self, model: Laneformer, kernels: bool | None = None):
        if not supports(model):
            raise ValueError("FusedPrefill: the model's forward, blocks or norms are not its own")
        self.model = model
        w0 = model.model.tok_embeddings.weight
        self.kernels = use_triton(w0) if kernels is None else kernels
        if self.kernels:
            from ..kernels.prefill_norm import residual_norm, silu_mul  # imports triton

            self._residual_norm, self._silu_mul = residual_norm, silu_mul
        else:
            self._residual_norm, self._silu_mul = ref.residual_norm, ref.silu_mul

    def _mlp(self, ff: FeedForward, x: torch.Tensor) -> torch.Tensor:
        """FeedForward's forward with SiLU(gate) * up as one kernel; its own projections."""
        return ff.w2(self._silu_mul(ff.w1(x), ff.w3(x)))

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        model = self.model
        if _hooked(model):
            return model(tokens, positions, cache, last_only)
        layers = model.model.layers
        h, positions, cos, sin = model.embed(tokens, positions, cache)
        B, S, L, D = h.shape
        h, x = self._update(h.flatten(0, 1), None, layers[0].attention_norm)  # (B*S, L, D)
        partials = Partials(model.cfg)
        for i, block in enumerate(layers):
            pa, pm = partials.arriving(i)
            a = block.attention(x.view(B, S, L, D), cos, sin, positions, cache).flatten(0, 1)
            h, x = self._update(h, a, block.ffn_norm, block.mode, pa)
            m = self._mlp(block.feed_forward, x.view(B, S, L, D)).flatten(0, 1)
            after = layers[i + 1].attention_norm if i + 1 < len(layers) else None
            h, x = self._update(h, m, after, block.mode, pm)
            partials.keep(i, a, m)
        return model.finish(h.view(B, S, L, D), S, cache, last_only)

    def _update(self, h, y, norm: RMSNorm | None, mode: str = "present", past=None):
        """(h + reduce(y), norm of it) through the kernel, with the norm module's own
        parameters (no norm after the last layer: the head applies its own)."""
        if norm is None:
            return self._residual_norm(h, y, None, mode=mode, past=past)
        return self._residual_norm(h, y, norm.gamma, mode=mode, past=past, eps=norm.eps,
                                   round_before_scale=norm.round_before_scale)  # fmt: skip


class StepPrefill:
    """Callable like the model. A prompt's chunk that wants only its last position's logits, in
    the step's own cache (a prompt, or the new part of one whose prefix the cache holds: an
    agent's next turn), prefills here:

    - at most `max_tokens` new tokens: through the packed decode step (step/packed.py: the C
      layers read the weights as stored, and the cache then holds the bits decode steps write);
    - longer: the model's layers, their products in `products` (bf16 where the weights are
      quantized or bf16 and the CPU multiplies bf16: BF16_PRODUCTS; else None, fp32) with the
      weights from the C decoder (native_dequantize), then the step's own head on the last row
      (the model's head would dequantize the whole vocabulary's matrix on every prompt).

    With `lowp` (LOWP_BY_DTYPE: the formats allowed) the step's products take x at llama.cpp's
    precision (csrc/cpu_kernels.h: 8 bits per block, or bf16): half their dot products, the
    cache then not the bits decode steps would write. Only where every format of the step
    that could is allowed: bf16 matrices beside a Q8_0 one keep exact x under bfloat16.
    Anything else (every row's logits, explicit positions, another cache, hooks) runs the model
    itself, in fp32."""

    def __init__(self, model, step: PackedDecoder, max_tokens: int | None = None,
                 products: torch.dtype = torch.float32, lowp: frozenset = frozenset()):  # fmt: skip
        self.model, self.step = model, step
        fmts = step.weights.formats
        bf16 = products == torch.bfloat16 and fmts <= BF16_PRODUCTS and available("bfloat16")
        self.products = torch.bfloat16 if bf16 else None  # None: the activations' fp32
        takes = fmts & LOWP_FORMATS  # the step's formats that would change
        self.lowp = bool(takes) and takes <= lowp and all(available(f) for f in takes)
        if max_tokens is None:
            amx = bool(FEATURES & HAS_AMX)
            tables = step_prefill_max(cpu_info("vendor_id"), amx)
            table = tables["lowp" if self.lowp else self.products]
            main = {step.weights.layers_format} if amx else fmts  # AMX_STEP_PREFILL_MAX's note
            max_tokens = min(table.get(f, table[None]) for f in main)
        self.max_tokens = max_tokens
        # the layers alone (Laneformer.hidden, then the step's head) only where the model's
        # forward is Laneformer's: hidden then finish
        own = isinstance(model, Laneformer) and type(model).forward is Laneformer.forward
        self.layers_alone = own and type(model).hidden is Laneformer.hidden

    def __call__(self, tokens, positions=None, cache=None, last_only=False) -> torch.Tensor:
        S = tokens.shape[-1]
        mine = cache is self.step.cache and positions is None and not cache.static
        prompt = mine and last_only and tokens.shape[0] == 1 and S > 0
        if not prompt or _hooked(self.model):
            return self.model(tokens, positions, cache, last_only)
        if S <= self.max_tokens:
            logits = self.step.prefill_logits(tokens[0], cache.length, self.lowp)
        elif not self.layers_alone:
            with products_in(self.products, native_dequantize):
                return self.model(tokens, None, cache, True)
        else:
            with products_in(self.products, native_dequantize):
                h = self.model.hidden(tokens, None, cache)  # (1, S, L, D)
            logits = self.step.head_logits(h[0, -1:].float())
        cache.advance(S)
        return logits.view(1, 1, -1)
