"""Engine: owns one model, its static KV cache and the sampler; generate() streams token ids.

One request at a time (batch 1). Prefill runs in chunks, then one decode step per token. The
prefill starts where the cache already holds the prompt (prefix reuse, prefix.py): the cache
records the token behind every position a completed forward wrote (`cache.commit`).
Cancellation is checked between prefill chunks, after the last one and between decode steps: set
the `cancel` event or simply stop iterating. `generate_steps` is the one generation loop: the
parallel engine changes it through small hooks (request start, go on?, token pick, early end).
Its slow reference is generation.py's `reference_generate`. With a `SpeculativeConfig` the
tokens after the first come from speculative/decoder.py (drafts of prompt lookup or of a draft
model, verified in one call), through the same loop. A request with a grammar
(`SamplingParams.grammar`) takes its tokens from structured/decoding.py, on graphs of their own
where the engine captures (step/split.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence

import torch

from .cache import KVCache, cache_dtype
from .config import ModelConfig
from .errors import RequestError
from .generation import Stats, Step
from .model import Laneformer
from .prefix import PrefixReuse
from .sampling.params import SamplingParams
from .sampling.sampler import Penalties, check_adjustments, make_generator, sample
from .speculative.decoder import SpeculativeDecoder
from .speculative.draft_model import load_draft
from .speculative.drafting import SpeculativeConfig
from .speculative.prediction import check_prediction
from .step.captures import Captures
from .step.choose import check_prefill_dtype, choose_prefill, choose_step
from .step.fused import MAX_OVERRUN
from .step.graph import committed_tokens
from .step.prefill import PREFILL_CHUNK, warm_up
from .step.split import STEP_TOKENS, SplitSteps, forward_logits
from .structured.decoding import constrained_steps
from .weights.packing import load_packed

# The sampler structures captured at load on a GPU: greedy, plain sampling and top-p (what chat
# UIs send). Others (top-k, min-p) run uncaptured until the engine is idle (`idle`).
PREPARED = (SamplingParams(), SamplingParams(temperature=1.0),
            SamplingParams(temperature=1.0, top_p=0.9))  # fmt: skip


class Engine:
    grammars = True  # constrained decoding (structured.py) runs on this engine
    adjusts_logits = True  # penalties, logit_bias and min_tokens (sampler.Penalties)
    predicts = True  # a request's predicted output is verified as drafts (speculative/)

    def __init__(
        self,
        model: Laneformer,
        max_model_len: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,  # a whole prompt up to here: one pass
        decode: str = "auto",
        steps_per_replay: int = 1,
        kernels: str = "auto",
        compile: bool = False,
        prefix_reuse: bool = True,
        speculative: SpeculativeConfig | None = None,
        capture: bool | None = None,
        prefill_warmup: bool | None = None,
        ring_headroom: int | None = None,
        grammar_graphs: bool = True,
        prefill_dtype: str = "float32",
        kv_cache_dtype: str = "auto",
    ):
        """`capture`: CUDA graphs for the static step (default: on CUDA), all captured at load.
        `prefill_warmup`: a few prefills at load (`warm_up_prefill`; default: with capture on
        CUDA). `ring_headroom`: slots each sliding layer's ring keeps beyond its window
        (default: what a forward of the most tokens needs; below). `grammar_graphs`: capture
        constrained decoding's graphs at load too (step/split.py; benches that send no grammar
        leave them out of their load time). `prefill_dtype` "bfloat16": a CPU prefills long
        prompts with bf16 products where the weights are quantized, bf16 or fp16 (step/prefill.py:
        faster, the logits within bf16's rounding of fp32's); "int8": that, and the C step's
        GGUF block-format products with 8-bit activations for shorter prompts, as llama.cpp's;
        "float32" (default): exact. Decode steps are exact whatever it is. `kv_cache_dtype`:
        vLLM's flag (cache.py)."""
        self.model = model
        self.cfg: ModelConfig = model.cfg
        self.max_len = max_model_len or self.cfg.max_position_embeddings
        if self.max_len < 2:
            raise RequestError(
                f"max_model_len={self.max_len}: must be at least 2", param="max_model_len"
            )
        self.prefill_chunk = prefill_chunk
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # A forward of S tokens writes S - 1 positions ahead of its first token's window: rings
        # get that headroom (cache.py) for speculation's k drafts and for a grammar's forced
        # tokens, which go in up to STEP_TOKENS a forward (jump-forward, step/split.py). Seven
        # slots a ring: 0.3% of the 2B's 2,048-slot window, and once a context passes the
        # window, one more (partial) block in the attention's scan of a ring.
        spec_k = speculative.num_speculative_tokens if speculative else 0
        headroom = max(spec_k, STEP_TOKENS - 1) if ring_headroom is None else ring_headroom
        if headroom < spec_k:
            why = f"ring_headroom={headroom}: speculation writes {spec_k} drafts ahead"
            raise RequestError(why, "ring_headroom")
        kv_dtype = cache_dtype(kv_cache_dtype, self.dtype, self.device)
        self.cache = KVCache(self.cfg, self.max_len, self.device, kv_dtype, headroom=headroom)
        self.prefix = PrefixReuse(self.cache, enabled=prefix_reuse)
        self.stats = Stats()
        if not 1 <= steps_per_replay <= MAX_OVERRUN:
            why = f"steps_per_replay={steps_per_replay}: expected 1..{MAX_OVERRUN}"
            raise RequestError(why, "steps_per_replay")
        self.steps_per_replay = steps_per_replay
        # the step (step/choose.py): eager forward, packed CPU (C layers) or fused GPU kernels
        choice = choose_step(model, self.cache, decode, kernels, compile)
        self.step, self.decode, self.step_name = choice.step, choice.decode, choice.name
        # the prefill's forward: the fused residual + norm kernels on CUDA, else the model
        prefill_dtype = check_prefill_dtype(prefill_dtype)
        self._prefill = choose_prefill(model, kernels, self.step, prefill_dtype)
        self.compile = compile
        self.capture = self.device.type == "cuda" if capture is None else capture
        verify = (self.step, self.cache, self.capture and self.decode == "graph")
        self.speculator = SpeculativeDecoder(*verify, speculative) if speculative else None
        if speculative is not None and speculative.model is not None:  # vLLM's draft_model
            self.speculator.draft = load_draft(Engine, speculative.model, self)
        self.predictor = self.speculator  # what verifies a request's predicted output
        if self.predictor is None and self.predicts:  # else a verifier of its own drafts
            self.predictor = SpeculativeDecoder.for_predictions(*verify)
        split = None  # constrained decoding's forward and pick on graphs (step/split.py)
        if self.capture and self.decode == "graph" and grammar_graphs:
            split = SplitSteps(self.step, self.cfg.vocab_size, capture=True)
        self.captures = Captures(self.step, steps_per_replay, self.capture, compile,
                                 choice.compile_graph, self.speculator, split,
                                 self.predictor)  # fmt: skip
        if compile and self.decode == "graph":
            self.captures.graph_for(SamplingParams())  # the greedy step; others at first use
        if self.capture and self.decode == "graph":
            self.captures.capture(PREPARED)
        self.warmup_s = 0.0  # seconds spent in prefill warm-up at load
        if prefill_warmup is None:
            prefill_warmup = self.capture and self.device.type == "cuda"
        if prefill_warmup:
            self.warm_up_prefill()

    @property
    def prefill_forward(self):
        """What prefills: the choice made at load, unless `model` was replaced since (a wrapper
        around it, as tests and tools install), whose own forward then runs."""
        chosen = self._prefill
        return chosen if getattr(chosen, "model", chosen) is self.model else self.model

    # compile_s: seconds spent compiling decode steps (at load, not in requests); capture_s:
    # capturing graphs (at load or between requests); split_steps: constrained decoding's
    # graphs (step/split.py) or None: the captures' (step/captures.py).
    compile_s = property(lambda self: self.captures.compile_s)
    capture_s = property(lambda self: self.captures.capture_s)

    @property
    def split_steps(self):
        return self.captures.split_steps

    @split_steps.setter
    def split_steps(self, split) -> None:
        self.captures.split_steps = split

    def warm_up_prefill(self) -> float:
        """A few prefills at load, then forgotten (step/prefill.py warm_up); the seconds spent
        (also added to `warmup_s`)."""
        spent = warm_up(self)
        self.warmup_s += spent
        return spent

    # the server's engine thread calls idle() every idle_interval seconds while it has no job
    @property
    def idle_interval(self) -> float | None:
        return 0.01 if self.captures.pending() else None

    def idle(self) -> None:
        """Capture one bucket a request ran uncaptured: a request arriving meanwhile waits for
        one capture at most."""
        self.captures.capture_pending()

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        device: str = "auto",
        dtype: str = "auto",
        max_model_len: int | None = None,
        progress: bool = True,
        quantization: str | None = None,
        lora: tuple[tuple[str, float], ...] = (),
        **engine_kw,
    ) -> Engine:
        """On a CPU, 16-bit `dtype` and `quantization` choose the packed weights' format
        (computed in fp32), and a GGUF file keeps its blocks; elsewhere `dtype` is the model's
        (packing.load_plan). `lora`: (adapter, scale) pairs merged at load (weights/lora.py)."""
        model = load_packed(path, device, dtype, quantization, progress, lora)
        if quantization is not None and _on_gpu(model):
            from .kernels.qlinear import place_quantized  # imports triton

            place_quantized(model, path, quantization)
        return cls(model, max_model_len=max_model_len, **engine_kw)

    # --- request checks -----------------------------------------------------------------------
    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        if len(prompt_ids) == 0:
            raise RequestError("prompt: must contain at least one token", param="prompt")
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < self.cfg.vocab_size)]
        if bad:
            raise RequestError(f"prompt: token id {bad[0]!r} is outside the vocabulary "
                               f"[0, {self.cfg.vocab_size})", param="prompt")  # fmt: skip
        if len(prompt_ids) >= self.max_len:
            raise RequestError(f"prompt: {len(prompt_ids)} tokens leave no room to generate in "
                               f"the context of {self.max_len} tokens", param="prompt")  # fmt: skip

    def check_sampling(self, params: SamplingParams) -> None:  # what validate() cannot know
        check_adjustments(params, self.cfg.vocab_size, self.adjusts_logits, self.stop_ids(params))
        check_prediction(params, self.cfg.vocab_size, self.predicts)

    def speculator_for(self, params: SamplingParams) -> SpeculativeDecoder | None:
        """Whose drafts a request's tokens come through: the predictor when it brings a
        prediction, else the speculator (None: plain decoding)."""
        return self.predictor if params.prediction else self.speculator

    def stop_ids(self, params: SamplingParams) -> set[int]:
        eos = set() if params.ignore_eos else set(self.cfg.eos_token_ids)
        return eos | set(params.stop_token_ids)

    # --- generation ---------------------------------------------------------------------------
    # The one generation loop is generate_steps; an engine over other hardware (ParallelEngine)
    # changes it only through the hooks _begin, _go_on, _pick and _left_early.
    def _begin(self, prompt_ids: Sequence[int], params: SamplingParams) -> SamplingParams:
        """A checked request is about to run: the params it runs with."""
        return params

    def _go_on(self, cancel: threading.Event | None) -> bool:
        """May the request go on? Asked before every prefill chunk, when the prompt is in and
        before every decode step: the one place where cancellation is seen."""
        return cancel is None or not cancel.is_set()

    def _pick(
        self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the next token, the logits its logprobs come from when they were asked for)."""
        return sample(logits, params, generator), logits if params.logprobs is not None else None

    def _left_early(self) -> None:
        """The consumer stopped iterating (or an error ended the loop) mid-request."""

    def _agree_starts(self, valid: torch.Tensor) -> torch.Tensor:
        """Where the prefill may start, (S,) bool: here, what this cache allows."""
        return valid

    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int], cancel: threading.Event | None = None):
        """Fill the cache with the prompt, from the longest prefix it still holds; returns the
        last position's logits (V,) or None. Each completed chunk is committed to the cache."""
        first = self.prefix.start(prompt_ids, agree=self._agree_starts)
        self.stats.cached_tokens = first
        ids = torch.tensor(prompt_ids[first:], device=self.device, dtype=torch.long)[None]
        logits = None
        for start in range(0, ids.shape[1], self.prefill_chunk):
            if not self._go_on(cancel):
                return None
            chunk = ids[:, start : start + self.prefill_chunk]
            logits = self.prefill_forward(chunk, cache=self.cache, last_only=True)
            self.cache.commit(prompt_ids[first + start : first + start + chunk.shape[1]])
        self.prefix.prefilled()
        return logits[0, -1] if self._go_on(cancel) else None  # a cancel during the last chunk

    @torch.inference_mode()
    def generate_steps(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        cancel: threading.Event | None = None,
    ) -> Iterator[Step]:
        params.validate()
        self.check_prompt(prompt_ids)
        self.check_sampling(params)
        if params.grammar is not None and not self.grammars:
            msg = "structured output: not supported by this engine (several devices) yet"
            raise RequestError(msg, param="response_format")
        params = self._begin(prompt_ids, params)
        budget = min(params.max_tokens, self.max_len - len(prompt_ids))
        stops = self.stop_ids(params)
        gen = make_generator(params, self.device)
        self.stats = st = Stats(prompt_tokens=len(prompt_ids))
        # penalties: picks from the forward's logits (a verify's rows adjusted one by one)
        pen = Penalties.of(params, prompt_ids, self.cfg.vocab_size, stops, self.device)
        spec = self.speculator_for(params)
        if spec is not None:
            spec.begin(st.extra)
        if budget == 0:
            st.finish_reason = "length"
            return
        use_graph = self.decode == "graph" and (params.logprobs, params.grammar, pen) == (None,) * 3
        graph = self.captures.graph_for(params) if use_graph else None  # may compile: no clock yet
        # logprobs on the split graphs (step/split.py): the forward, then a pick that computes
        # the logprobs in the same replay (the first token's come from the prefill's logits)
        lp_pick = None
        if (params.logprobs is not None and params.grammar is None and spec is None
                and self.split_steps is not None and pen is None):  # fmt: skip
            lp_pick = self.split_steps.pick_graph(params, masked=False)
        t0 = time.perf_counter()
        if graph is not None:
            gen = graph.generator
        if lp_pick is not None:
            gen = lp_pick.generator  # one stream of draws for the request
        logits = self.prefill(prompt_ids, cancel)
        if logits is None:
            st.finish_reason = "abort"
            return
        stream = None  # with a grammar, its tokens from the first on (structured.py)
        if params.grammar is not None:
            stream = constrained_steps(self, prompt_ids, logits, params, gen, budget, pen)
        # Over for every rank too: a stop or length token (all pick the same), an agreed abort.
        # A local, as a consumer may rewrite the step's and the stats' finish_reason (stop text).
        over, step = False, None
        try:
            for i in range(budget):
                lps = None
                if stream is not None:
                    tok, lp_logits = next(stream)  # the stream commits what it fed
                elif lp_pick is not None and i > 0:  # after the split graphs' forward
                    lp_pick.launch()
                    tok, lp_logits = lp_pick.token(), None
                    lps = lp_pick.logprobs()
                elif pen is not None:  # logprobs from the model's logits, as vLLM's default
                    tok, _ = self._pick(pen.apply(logits), params, gen)
                    lp_logits = logits if params.logprobs is not None else None
                    pen.advance(tok)
                else:
                    tok, lp_logits = self._pick(logits, params, gen)
                step = self.make_step(tok, lp_logits, params, stops, i == budget - 1, t0, lps)
                over = step.finish_reason is not None
                yield step
                if over:
                    return
                if not self._go_on(cancel):
                    st.finish_reason, over = "abort", True
                    return
                if graph is not None or spec is not None or stream is not None:
                    if stream is None:
                        stream = self._stream(
                            spec, prompt_ids, step.token, params, gen, budget - 1, graph, pen
                        )
                    continue
                if self.decode == "graph":  # logprobs: the step, captured where we capture
                    pos = len(prompt_ids) + i
                    logits = forward_logits(self.step, self.split_steps, [step.token], pos)
                else:
                    logits = self.model(tok.view(1, 1), cache=self.cache)[0, -1]
                self.cache.commit([step.token])
        finally:
            if not over:
                self._left_early()

    def _stream(self, spec, prompt_ids, token: int, params, gen, n: int, graph, pen=None):
        """The `n` tokens after the first (`token`), with the logits of their logprobs or None;
        the cache commits each token once the forward it fed has produced the next."""
        if spec is not None:
            return spec.steps(prompt_ids, token, params, gen, n, graph, pen)
        graph.load(torch.tensor(token, device=self.device), position=len(prompt_ids))
        return ((t, None) for t in committed_tokens(graph, self.cache, token, n))

    def make_step(self, tok, logits, params, stops, last, t0, lps=None) -> Step:
        """A sampled token as a Step, counted in self.stats (Stats.record: the arguments)."""
        return self.stats.record(tok, logits, params, stops, last, t0, lps)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 cancel: threading.Event | None = None) -> Iterator[int]:  # fmt: skip
        for step in self.generate_steps(prompt_ids, params, cancel):
            yield step.token

    @torch.inference_mode()
    def prompt_logprobs(
        self, prompt_ids: Sequence[int], cancel: threading.Event | None = None
    ) -> torch.Tensor | None:
        """log-softmax of the logits at every prompt position: (S, V) fp32 (for echo scoring).

        Returns None when `cancel` is set between prefill chunks. Every position is computed
        (nothing reused); the cache keeps the prompt for the generation that may follow.
        """
        self.check_prompt(prompt_ids)
        self.cache.reset()
        ids = torch.tensor(prompt_ids, device=self.device, dtype=torch.long)[None]
        out = []
        for s in range(0, ids.shape[1], self.prefill_chunk):
            if cancel is not None and cancel.is_set():
                return None
            chunk = ids[:, s : s + self.prefill_chunk]
            out.append(self.prefill_forward(chunk, cache=self.cache)[0])
            self.cache.commit(prompt_ids[s : s + self.prefill_chunk])
        return torch.cat(out).float().log_softmax(-1)


def _on_gpu(model) -> bool:
    return next(model.parameters()).device.type != "cpu"
