"""The persistent decode step: the fused step's kernels as tasks of one launch (issue 23, item 3).

`PersistentDecoder` is a `Step` peer of `FusedDecoder` (fused.py) on the same weights and cache:
for S tokens it runs kernels/persistent.py's one kernel over a task list built here, with every
body configured exactly as the fused step's own launch at S tokens (the same configuration
functions, the same GPU tuning table). Each task computes what the fused kernel's program
computes, in the same order, so where the launch options agree (the warps: one launch has one
count) the two steps give the same bits; the CPU tests check that under the interpreter, and
the GPU stage `persistent` on the real build.

A plan is built per (S, head): the task list and its counts, the buffers (static: a CUDA
graph captures a launch, and its replays reuse them) and the constexprs. The grid is the
resident programs (`programs_per_sm` x SMs; any grid is correct, as tasks are taken from a
queue in dependency order). A model the kinds do not cover (more than two attention or
projection configurations, quantized projections) is refused by `unsupported`. Split-K
projections (a Llama's narrow wo and w2) and qwen's biases and q/k norms are covered.
"""

from __future__ import annotations

import torch

from ..cache import KVCache
from ..model import Laneformer
from ..sampling.params import SamplingParams
from ..sampling.sampler import SamplerKnobs, sample
from .fused import FusedDecoder, check_width
from .fused import supports as fused_supports
from .persistent_plan import KINDS_PER_CONFIG, Plan, attention_keys, build_plan, projection_keys

# Starting points until a GPU measures them (bench/persistent.py sweeps each): every program the
# sm_90 build keeps resident at 2 warps (4 an SM: `aot --persistent`), one task a fetch.
PROGRAMS_PER_SM = 4
TASKS_PER_FETCH = 1
DEPS = "lane"  # persistent_tasks.py
# One launch has one warp count, and a body's reduction order follows it where its tile is
# small: at S = 8 the products' tiles shrink to 2-4 rows (gemv.fit_rows), which 4 warps would
# split along K (another order than S = 1's), so the fused kernels take 2 warps there
# (gemv.fit_warps). 2 warps for every S keeps every row's order independent of S (the sm_90
# builds at S = 1 and 8 reduce with the same layouts: `aot_read.reduce_layouts`), so a verify's rows
# are lone steps and greedy speculation is plain decoding. The price: the attention's sums over
# keys and splits follow the warps too, so the logits are the fused step's to rounding, not
# bitwise, on a GPU; 4 warps give the fused step's bits at S = 1 and no batch invariance.
WARPS = 2


class PersistentDecoder:
    def __init__(self, model: Laneformer, cache: KVCache, programs: int | None = None,
                 chunk: int = TASKS_PER_FETCH, deps: str = DEPS,
                 warps: int = WARPS):  # fmt: skip
        self.fused = FusedDecoder(model, cache, kernels=True)  # the weights, tables and reference
        self.cfg, self.cache = model.cfg, cache
        why = unsupported(model, cache)
        if why:
            raise ValueError(f"the persistent decode step does not cover {why}")
        from ..kernels.gemv import num_sms

        sms = num_sms(self.fused.embed)
        self.programs = programs or (PROGRAMS_PER_SM * sms if sms else 2)
        self.chunk = chunk  # tasks a program takes from the queue at once
        self.deps = deps  # what a task waits for: whole phases, or its lane's chain
        self.warps = warps
        self.plans: dict[tuple[int, bool], Plan] = {}
        self.launched: set[tuple[int, bool]] = set()
        self.offsets = self._layer_offsets()
        self.plan(1, True)  # a model the task kinds do not cover fails here, at load

    def _layer_offsets(self) -> torch.Tensor:
        """int64 (layers, 17): element offsets of each layer's tensors from layer 0's (0 for a
        bias or q/k norm the model does not have)."""
        from ..kernels.persistent import LAYER_TENSORS

        def tensors(i: int) -> dict:
            c = self.cache
            return self.fused.layers[i] | {"k_cache": c.k[i], "v_cache": c.v[i],
                                           "pos_cache": c.pos[i]}  # fmt: skip

        first, rows = tensors(0), []
        for i in range(self.cfg.num_layers):
            row, layer = [], tensors(i)
            for name in LAYER_TENSORS:
                if name not in first:
                    row.append(0)
                    continue
                t = layer[name]
                gap = t.data_ptr() - first[name].data_ptr()
                # 16-byte aligned, as the kernel tells the compiler (kernels/persistent._at)
                assert gap % (8 * t.element_size()) == 0 and t.dtype == first[name].dtype, name
                row.append(gap // t.element_size())
            rows.append(row)
        return torch.tensor(rows, dtype=torch.int64, device=self.fused.embed.device)

    def plan(self, S: int, argmax: bool) -> Plan:
        if (S, argmax) not in self.plans:
            self.plans[S, argmax] = build_plan(self, S, argmax)
        return self.plans[S, argmax]

    def run(self, tokens: torch.Tensor, position: torch.Tensor, argmax: bool) -> Plan:
        """One launch for tokens (S,) from position (1,): the plan whose buffers hold the
        result (logits (S, V) fp32, or tokens (S,) int64)."""
        from ..kernels.persistent import decode_step_kernel

        S = tokens.numel()
        check_width(self.cache, S, "the persistent step")
        first = (S, argmax) not in self.launched
        self.launched.add((S, argmax))
        p = self.plan(S, argmax)
        args = {**p.args, "tokens_ptr": tokens.view(S), "position_ptr": position}
        decode_step_kernel[(self.programs,)](**args, **p.consts, num_warps=p.num_warps)
        err = p.args["err_ptr"]
        if first and not err.is_meta and err.item():  # a plan's first launch: at load (the
            # warm-up), so a broken launch stops the engine there, not decoding garbage later
            raise RuntimeError(
                f"the persistent decode step's waits gave up ({S} tokens, "
                f"{self.programs} programs): decode with kernels='on' instead"
            )
        return p

    def forward(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """The `Step`: fp32 logits (S, V) of tokens (S,) from position (1,)."""
        return self.run(tokens, position, False).args["logits_ptr"].clone()

    def pick(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Greedy token after each of tokens (S,): (S,) int64."""
        return self.run(tokens, position, True).args["token_ptr"].clone()

    def next_token(self, tokens: torch.Tensor, position: torch.Tensor, params: SamplingParams,
                   generator: torch.Generator | None,
                   knobs: SamplerKnobs | None = None) -> torch.Tensor:  # fmt: skip
        if params.greedy:
            return self.pick(tokens, position)[-1]
        return sample(self.forward(tokens, position)[-1], params, generator, knobs)

    def errors(self) -> int:
        """Waits that gave up since load, over every plan (a host sync: for tests and benches)."""
        return sum(int(p.args["err_ptr"].item()) for p in self.plans.values())


def unsupported(model: Laneformer, cache: KVCache) -> str | None:
    """What the persistent step cannot run on this model and cache, or None."""
    if not fused_supports(model):
        return "quantized projections"
    for what, keys in (("attention", attention_keys(model.cfg, cache)),
                       ("reduce", projection_keys(model.cfg))):  # fmt: skip
        if len(set(keys)) > KINDS_PER_CONFIG:
            return f"{len(set(keys))} {what} configurations (at most {KINDS_PER_CONFIG})"
    return None
