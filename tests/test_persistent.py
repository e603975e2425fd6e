"""The persistent decode step (one launch, tasks from a queue) against the fused step.

Under the interpreter programs run one after another, so program 0 takes every task and the
others find the queue empty: the tests prove the task bodies, the task list, the per-layer
offsets and the count reset, on any grid; the GPU's `tests` stage proves the same on the real
build, where tasks run concurrently and wait on the counts.
"""

from __future__ import annotations

import pytest
import tiny
import torch
from triton_interp import DEVICE  # noqa: E402, F401  (first: sets the interpreter)

from expresslane.cache import KVCache
from expresslane.sampling.params import SamplingParams
from expresslane.step.fused import FusedDecoder
from expresslane.step.persistent import PersistentDecoder, unsupported

# The GPU session's tests stage (-m gpu) runs the case marked `gpu` compiled: each distinct
# configuration is a compile of the whole kernel (~10 s), so the stage takes the informative one
# (S = 3 on 3 programs, 5 tasks a fetch, lane waits: tasks really concurrent); the `persistent`
# stage checks S = 1 at the 2B's shapes.


def at(p: int) -> torch.Tensor:
    return torch.tensor([p], device=DEVICE)


def _prefilled(model, prompt, headroom=7, dtype=torch.float32):
    cache = KVCache(model.cfg, 24, DEVICE, dtype, headroom=headroom)
    with torch.no_grad():
        model(torch.tensor([prompt], device=DEVICE), cache=cache)
    return cache


MODELS = {
    # sliding and full layers (two attention kinds), delay 2 (two reduce kinds), vocab-parallel
    "laneformer": lambda: tiny.laneformer(
        seed=5, sliding_window=4, num_hidden_layers=3, sliding_window_n_layers=2
    ),  # fmt: skip
    # a Llama: one lane, present reduce everywhere, a replicated head, rotate-half RoPE
    "llama": lambda: tiny.laneformer(
        seed=6,
        model_type="llama",
        num_lanes=1,
        lm_head_type="replicate",
        sliding_window=None,
        sliding_window_n_layers=0,
    ),  # fmt: skip
    # qwen2's attention biases and qwen3's q/k norms (a head over two programs: the scratch's
    # counter), as test_kernels_qwen's fused-step models
    "qwen2": lambda: _qwen("qwen2", attention_bias=True),
    "qwen3": lambda: _qwen("qwen3", head_dim=32),
    # DTP's no_reduce layers before the delay (use_early_comm off), past after
    "no-early-comm": lambda: tiny.laneformer(
        seed=8,
        sliding_window=4,
        num_hidden_layers=3,
        sliding_window_n_layers=2,
        use_early_comm=False,
    ),  # fmt: skip
}


def _qwen(family, **kw):
    return tiny.laneformer(seed=4, model_type=family, num_lanes=1, sliding_window=None,
                           num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                           hidden_size=48, **kw)  # fmt: skip


@pytest.mark.parametrize(
    "name, S, programs, chunk",
    [
        pytest.param("laneformer", 3, 3, 5, marks=pytest.mark.gpu),
        ("llama", 1, 2, 3),
        ("qwen2", 2, 2, 1),
        ("qwen3", 3, 3, 2),
    ],
)
def test_persistent_equals_fused(name, S, programs, chunk):
    """Logits, greedy picks and the cache it leaves: the fused step's, bit for bit, whatever
    the grid and the tasks a program takes at once (a chunk may cross phases)."""
    _equal_steps(MODELS[name]().to(DEVICE), S, programs, chunk)


@pytest.mark.parametrize(
    "name, mode, split, S",
    [("llama", "present", 4, 2), ("qwen3", "present", 2, 1), ("laneformer", "past", 2, 3),
     ("laneformer", "present", 3, 1), ("no-early-comm", "no_reduce", 2, 2)],
)  # fmt: skip
def test_split_k_projections_equal_the_fused_steps(name, mode, split, S):
    """A projection split along K (a Llama's narrow wo and w2 on a GPU; forced here, where the
    interpreter's tiles never split): lane_gemv's programs as tasks, the last to arrive summing
    the partials as the fused step's epilogue kernel does, bit for bit, in each reduce mode
    and over lanes; 3 splits of the laneformer's K = 8 and 16 leave the last one empty."""
    from expresslane.kernels import tuning

    with tuning.forcing(f"gemv_reduce_{mode}", {"SPLIT_K": split, "BLOCK_K": 4}):
        step = _equal_steps(MODELS[name]().to(DEVICE), S, 2, 3)
    plan = step.plan(S, False)
    assert plan.consts["SK_MAX"] == split
    assert plan.args["arrive_ptr"].abs().sum() == 0  # every count left at 0 for the next


def _equal_steps(model, S, programs, chunk):
    """The fused and the persistent step from the same prefilled cache: logits, picks, one
    more step and the caches equal; returns the persistent step."""
    prompt, tokens = [1, 5, 9, 13, 17, 21], torch.tensor([7, 30, 4][:S], device=DEVICE)
    out, caches = {}, {}
    for kind in ("fused", "persistent"):
        cache = _prefilled(model, prompt)
        step = (FusedDecoder(model, cache, kernels=True) if kind == "fused"
                else PersistentDecoder(model, cache, programs=programs, chunk=chunk))  # fmt: skip
        logits = step.forward(tokens, at(len(prompt)))
        picks = step.pick(tokens, at(len(prompt)))  # writes the same KV again
        nxt = step.forward(picks[-1:], at(len(prompt) + S))  # one more step on top
        out[kind] = (logits, picks, nxt)
        caches[kind] = [t.clone() for t in cache.k + cache.v + cache.pos]
        if kind == "persistent":
            assert step.errors() == 0
            for p in step.plans.values():  # every count back at zero for the next launch
                assert p.args["cnt_ptr"].abs().sum() == 0 and p.args["queue_ptr"].sum() == 0
    for a, b, what in zip(*out.values(), ("logits", "picks", "next"), strict=True):
        assert torch.equal(a, b), what
    assert all(torch.equal(a, b) for a, b in zip(*caches.values(), strict=True))
    assert torch.equal(out["persistent"][1], out["persistent"][0].argmax(-1))
    return step


def waits_order(rows: torch.Tensor) -> torch.Tensor:
    """The tasks in another order that their waits allow: the latest ready task first, lane 1's
    last of all, so that lanes run as far apart as the waits let them, which a missing wait
    does not survive."""
    rows = rows.tolist()
    got: dict[int, int] = {}  # count -> tasks added to it so far

    def ready(r):
        return all(t == 0 or got.get(s, 0) >= t for s, t in ((r[5], r[6]), (r[7], r[8])))

    def lagging(r):  # lane 1's tasks (a laned task adds to its lane's count, total + 1 + lane)
        return r[10] >= 0 and r[9] - r[10] - 1 == 1

    left, out = list(range(len(rows))), []
    while left:
        can = [j for j in left if ready(rows[j])]
        j = ([j for j in can if not lagging(rows[j])] or can)[-1]
        left.remove(j)
        out.append(rows[j])
        for slot in (rows[j][9], rows[j][10]):
            if slot >= 0:
                got[slot] = got.get(slot, 0) + 1
    return torch.tensor(out, dtype=torch.int32)


def _deep():  # layers 2-4 past-mode: lane chains meet only through layer i - 2's partials
    return tiny.laneformer(seed=5, sliding_window=4, num_hidden_layers=5,
                           sliding_window_n_layers=3).to(DEVICE)  # fmt: skip


def _lane_run(model, drop=()):
    """The lane-deps step's logits of 3 tokens, its tasks in waits_order's order, with the
    second waits of the `drop` kinds taken away first."""
    prompt, tokens = [1, 5, 9, 13, 17, 21], torch.tensor([7, 30, 4], device=DEVICE)
    step = PersistentDecoder(model, _prefilled(model, prompt), programs=2, deps="lane")
    plan = step.plan(3, False)
    for kind in drop:
        plan.tasks[plan.tasks[:, 0] == int(kind), 8] = 0
    plan.tasks.copy_(waits_order(plan.tasks))
    return step.forward(tokens, at(6)), step.errors()


def test_lane_waits_are_enough_in_an_order_they_allow_and_each_is_needed():
    """Each lane runs its own chain (deps="lane"), meeting the others only through the
    partials of layer i - delay: run in an order that keeps lanes as far apart as those waits
    allow, the fused step's bits. The check can fail: without attention's
    wait on lane 0's qkv (which records the slots' positions), or without wo's and w2's on
    layer i - delay's partials, the lagging order gives other bits."""
    from expresslane.kernels import persistent as pk

    model = _deep()
    cache = _prefilled(model, [1, 5, 9, 13, 17, 21])
    want = FusedDecoder(model, cache, kernels=True).forward(torch.tensor([7, 30, 4]).to(DEVICE),
                                                            at(6))  # fmt: skip
    got, errors = _lane_run(model)
    assert torch.equal(got, want) and errors == 0
    for drop in ((pk.ATTN0, pk.ATTN1), (pk.WO1, pk.W21)):
        got, _ = _lane_run(model, drop)
        assert not torch.equal(got, want), drop


def test_persistent_logits_are_the_models_and_sampling_works():
    """The step's logits are the model's forward (the fused step's bits, and so a verify's rows
    lone steps, are the tests above with test_kernels_tokens'), and a sampled next_token comes
    from them."""
    model = MODELS["laneformer"]().to(DEVICE)
    prompt, tokens = [3, 8, 2, 11], torch.tensor([9, 14, 6], device=DEVICE)
    step = PersistentDecoder(model, _prefilled(model, prompt), programs=2)
    wide = step.forward(tokens, at(len(prompt)))
    with torch.no_grad():
        full = model(torch.tensor([prompt + tokens.tolist()], device=DEVICE))[0, len(prompt) :]
    torch.testing.assert_close(wide, full.float(), rtol=1e-4, atol=1e-4)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    t = step.next_token(
        tokens[-1:], at(len(prompt) + 2), SamplingParams(temperature=0.8, top_p=0.9), g
    )
    assert t.dim() == 0 and 0 <= t.item() < model.cfg.vocab_size


def test_persistent_refuses_what_it_does_not_cover():
    model = MODELS["llama"]().to(DEVICE)
    model.gpu_quantization = "int8"  # kernels/qlinear.py's mark: projections the tasks lack
    assert "quantized" in unsupported(model, KVCache(model.cfg, 8, DEVICE, torch.float32))
    with pytest.raises(ValueError, match="does not cover"):
        PersistentDecoder(model, KVCache(model.cfg, 8, DEVICE, torch.float32))
    llama = MODELS["llama"]().to(DEVICE)
    step = PersistentDecoder(llama, KVCache(llama.cfg, 8, DEVICE, torch.float32))
    with pytest.raises(ValueError, match="at most 8"):
        step.forward(torch.zeros(9, dtype=torch.long, device=DEVICE), at(0))


def test_a_wait_that_cannot_end_is_flagged_and_the_launch_ends():
    """A task waiting for more than its phase can count (a broken plan) gives up after
    max_spin polls, flags the launch, and every other wait then gives up too: no hang; the
    plan's first launch (at load, in the engine's warm-up) says so."""
    model = MODELS["llama"]().to(DEVICE)
    step = PersistentDecoder(model, _prefilled(model, [1, 2, 3]), programs=2)
    plan = step.plan(1, False)
    plan.args["max_spin"] = 2048
    plan.tasks[len(plan.tasks) // 2, 6] += 1000  # one task waits for 1000 tasks too many
    with pytest.raises(RuntimeError, match="waits gave up"):
        step.forward(torch.tensor([4], device=DEVICE), at(3))
    assert step.errors() >= 1


def test_engine_decodes_through_the_persistent_step(monkeypatch):
    """`kernels="persistent"`: the engine's greedy tokens, speculation included, are the
    model's; asked for on a model it does not cover, or without the static step, it says why."""
    from expresslane.engine import Engine
    from expresslane.errors import RequestError
    from expresslane.generation import reference_generate
    from expresslane.speculative.drafting import SpeculativeConfig

    monkeypatch.setenv("EXPRESSLANE_FORCE_TRITON", "1")
    model = tiny.laneformer(seed=2, sliding_window=4, max_position_embeddings=64).to(DEVICE)
    prompt = [1, 5, 9, 1, 5, 9, 1]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    spec = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=1)
    engine = Engine(model, max_model_len=24, decode="graph", kernels="persistent",
                    speculative=spec)  # fmt: skip
    assert engine.step_name == "persistent kernel"
    want = reference_generate(model, prompt, params, stop_ids=set())
    assert list(engine.generate(prompt, params)) == want
    assert engine.stats.extra["speculative"]["verify_steps"] > 0
    with pytest.raises(RequestError, match="decode='eager'"):
        Engine(model, max_model_len=24, decode="eager", kernels="persistent")
    if not torch.cuda.is_available():  # triton's kernels run nowhere else (but the interpreter)
        monkeypatch.delenv("EXPRESSLANE_FORCE_TRITON")
        with pytest.raises(RequestError, match="no triton on this device"):
            Engine(model, max_model_len=24, decode="graph", kernels="persistent")


@pytest.mark.parametrize("args", [["--chunks", "0"], ["--warps", "0"], ["--contexts", "-1"]])
def test_bench_refuses_bad_counts(args, capsys):
    from expresslane.bench import persistent as bench

    assert bench.main(args) == 2
    assert "must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("dry", [[], ["--dry-run"]])
def test_bench_names_an_unknown_preset(dry, capsys):
    """An unknown preset is named, exit 2: also in a dry run, which reads the preset's lanes to
    pick the tiny model it runs, and refuses before it sets the interpreter's environment (set,
    it made every later test of a pytest worker run the fused kernels in the interpreter)."""
    import os

    from expresslane.bench import persistent as bench

    before = os.environ.get("EXPRESSLANE_FORCE_TRITON")
    assert bench.main(["--preset", "no-such-model", *dry]) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert os.environ.get("EXPRESSLANE_FORCE_TRITON") == before
