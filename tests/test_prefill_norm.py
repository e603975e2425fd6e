"""The prefill's fused residual + norm kernel against the model's math, and FusedPrefill.

`residual_norm` (kernels/prefill_norm.py) against `ref.residual_norm` (model.reduce and
model.rms_norm) on irregular shapes: N tokens in {1, 5, 37}, L in {1, 3, 8} lanes, D in
{40, 96, 200}, every reduce mode, past given and absent, shared / per-lane / no norm scale, both
norm roundings, y and past as lane_linear's transposed views, h broadcast over the lanes (the
first layer). fp32: within 1e-6 relative (only the order of the fp32 sums differs); bf16: every
element within one bf16 ulp of the reference, and nearly all equal (each rounding point copied).
Where CUDA is (the GPU session's `-m gpu` stage): the compiled kernel at the 2B's shape, and a
bf16 prefill of a model with the 2B's lane layout against the eager forward.
FusedPrefill (Triton kernels, in the interpreter without CUDA) against `model.forward` on tiny
Laneformers of every reduce mode and norm kind, a Llama and a Qwen3 (q/k norms), with a cache
across chunks; its reference wiring bit for bit; the engine's prefill through it; the prefill
warm-up at load.
"""

from __future__ import annotations

import pytest
import tiny
import torch
from triton_interp import DEVICE, GPU, triton  # noqa: F401  (first: sets the interpreter)

from expresslane.engine import Engine  # noqa: E402
from expresslane.kernels import ref  # noqa: E402
from expresslane.kernels.prefill_norm import residual_norm, silu_mul  # noqa: E402
from expresslane.sampling.params import SamplingParams
from expresslane.step.prefill import FusedPrefill, supports  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
on_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _force_triton(monkeypatch):
    monkeypatch.setenv("EXPRESSLANE_FORCE_TRITON", "1")
    if GPU:  # the fp32 references must not run in TF32
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


# (N, L, D, mode, past: None / "given", gamma: None / "shared" / "lane", round_before_scale,
#  y: "strided" (lane_linear's bmm view) / "plain" / None (the first layer: h broadcast),
#  BLOCK_D: None (the launcher's: one chunk at these widths) or narrower (several chunks, the
#  last one partial: pass 2 re-reads h_new chunk by chunk))
CASES = [
    (1, 1, 40, "present", None, "shared", True, "plain", None),  # a Llama's one token
    (5, 3, 200, "present", None, "lane", False, "strided", 64),
    (37, 8, 96, "present", None, "shared", False, "strided", None),
    (5, 8, 200, "no_reduce", None, "lane", True, "strided", 32),
    (37, 3, 40, "no_reduce", None, None, False, "plain", 16),  # the last layer: no norm
    (5, 3, 96, "past", "given", "shared", False, "strided", None),
    (37, 8, 200, "past", "given", "lane", True, "strided", None),
    (1, 8, 40, "past", None, "shared", True, "strided", 16),  # option B: nothing arrives yet
    (37, 1, 200, "past", "given", "shared", True, "plain", 64),  # a Llama past layer
    (5, 8, 96, "present", None, "lane", False, None, 32),  # the first layer's attention_norm
    (37, 3, 200, "past", "given", None, False, "strided", None),
]
DTYPES = [torch.float32, torch.bfloat16]


def lane_view(N: int, L: int, D: int, g: torch.Generator, dtype, strided: bool):
    """(N, L, D) random values; strided: (L, N, D) storage seen as (N, L, D), as lane_linear."""
    if strided:
        return torch.randn(L, N, D, generator=g).to(DEVICE, dtype).transpose(0, 1)
    return torch.randn(N, L, D, generator=g).to(DEVICE, dtype)


def make_case(case, dtype):
    N, L, D, mode, past, gamma, rbs, y_kind, _ = case
    g = torch.Generator().manual_seed(N * 1000 + L * 100 + D)
    if y_kind is None:  # the embedding row broadcast over the lanes (lane stride 0)
        h = torch.randn(N, 1, D, generator=g).to(DEVICE, dtype).expand(N, L, D)
        y = None
    else:
        h = torch.randn(N, L, D, generator=g).to(DEVICE, dtype)
        y = lane_view(N, L, D, g, dtype, y_kind == "strided")
    p = lane_view(N, L, D, g, dtype, True) if past else None
    shape = {"shared": (D,), "lane": (L, D)}.get(gamma)
    scale = None if shape is None else (1 + 0.3 * torch.randn(shape, generator=g)).to(DEVICE, dtype)
    kw = dict(mode=mode, past=p, eps=1e-5, round_before_scale=rbs)
    return (h, y, scale), kw


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (8 significant bits)."""
    _, e = torch.frexp(x.float())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), e - 8)


def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    got, want = got.float(), want.float()
    if dtype == torch.float32:
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()
        return
    bound = bf16_ulp(torch.maximum(got.abs(), want.abs()))
    assert ((got - want).abs() <= bound).all(), "a bf16 result more than one ulp off"
    assert (got != want).float().mean() <= 0.01, "more than 1% of the bf16 results differ"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_residual_norm_matches_the_model_math(case, dtype):
    (h, y, scale), kw = make_case(case, dtype)
    h_new, normed = residual_norm(h, y, scale, **kw, block=case[-1])
    want_h, want_normed = ref.residual_norm(h, y, scale, **kw)
    if y is None:
        assert h_new is h  # nothing added: the residual itself
    else:
        assert_matches(h_new, want_h, dtype)
    if scale is None:
        assert normed is None
    else:
        assert_matches(normed, want_normed, dtype)


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("mode, past", [("present", None), ("no_reduce", None), ("past", True)])
def test_residual_norm_compiled_at_the_2b_shape(mode, past):
    """The sm_90 build at the 2B's shape (300 tokens, L = 8, D = 3072, bf16, BLOCK_D 256: 12
    chunks, h_new re-read after the barrier), per-lane and shared scales."""
    g = torch.Generator().manual_seed(7)
    N, L, D = 300, 8, 3072
    h = torch.randn(N, L, D, generator=g).to(DEVICE, torch.bfloat16)
    y = lane_view(N, L, D, g, torch.bfloat16, True)
    p = lane_view(N, L, D, g, torch.bfloat16, True) if past else None
    for scale, rbs in ((torch.rand(L, D, generator=g) + 0.5, True), (torch.rand(D) + 0.5, False)):
        kw = dict(mode=mode, past=p, eps=1e-5, round_before_scale=rbs)
        scale = scale.to(DEVICE, torch.bfloat16)
        got, want = residual_norm(h, y, scale, **kw), ref.residual_norm(h, y, scale, **kw)
        assert_matches(got[0], want[0], torch.bfloat16)
        assert_matches(got[1], want[1], torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 7), (37, 3, 40), (5, 8, 1100)], ids=str)
def test_silu_mul_matches_the_feed_forward(shape, dtype):
    """SiLU(gate) * up in one kernel against FeedForward's two ops, on sizes that leave a
    partial last block (and one of several blocks); up strided as lane_linear returns it."""
    g = torch.Generator().manual_seed(shape[0])
    gate = (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype)
    up = torch.randn(shape[1], shape[0], shape[2], generator=g).to(DEVICE, dtype).transpose(0, 1)
    assert_matches(silu_mul(gate, up), ref.silu_mul(gate, up.contiguous()), dtype)


def test_the_bf16_check_tells_the_two_norm_roundings_apart():
    """The bf16 tolerance is tight enough to see a rounding point moved: the norm scaled in
    fp32 (one rounding) against rounded before the scale fails `assert_matches`."""
    (h, y, scale), kw = make_case(CASES[3], torch.bfloat16)
    _, before = ref.residual_norm(h, y, scale, **kw)
    _, once = ref.residual_norm(h, y, scale, **{**kw, "round_before_scale": False})
    with pytest.raises(AssertionError):
        assert_matches(once, before, torch.bfloat16)


# --- FusedPrefill ---------------------------------------------------------------------------
MODELS = {
    "laneformer": {},  # present, present, past (option A); shared norm scales; two rings
    "lanes-b": dict(replicated_rmsn_scale=False, use_early_comm=False, dtp_variant="B",
                    broadcast_delay=1),  # no_reduce, past None, past
    "llama": dict(model_type="llama", num_lanes=1, sliding_window=None, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, hidden_size=48),
    "qwen3": dict(model_type="qwen3", num_lanes=1, sliding_window=None, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, hidden_size=48,
                  head_dim=16),  # q/k norms: the attention module's own
}  # fmt: skip


@pytest.fixture(scope="module")
def models():
    out = {}
    for i, (name, kw) in enumerate(MODELS.items()):
        out[name] = tiny.laneformer(seed=i, **kw).to(DEVICE)
    return out


def chunked(forward, model, ids: torch.Tensor, cut: int) -> torch.Tensor:
    """Logits of every position, the prompt in two chunks through a fresh cache."""
    from expresslane.cache import KVCache

    cache = KVCache(model.cfg, 96, DEVICE)
    with torch.inference_mode():
        first = forward(ids[:, :cut], cache=cache)
        second = forward(ids[:, cut:], cache=cache)
    assert cache.length == ids.shape[1]
    return torch.cat((first, second), 1)


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 64, (1, n), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("name", MODELS)
def test_fused_prefill_matches_the_forward(models, name):
    """31 tokens as 19 (SDPA's causal form, crossing the 16-slot rings) then 12 (the masked
    path after a cached prefix), every position's logits."""
    model = models[name]
    ids = prompt(31)
    fused = FusedPrefill(model)
    assert fused.kernels
    got = chunked(fused, model, ids, 19)
    want = chunked(model, model, ids, 19)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("name", MODELS)
def test_fused_prefill_wiring_is_the_forward_bit_for_bit(models, name):
    """With the kernels' references the prefill is the model's forward exactly: the same
    modes, past partials, norms and order of operations."""
    if GPU:
        pytest.skip("bit equality is a CPU property (the GPU's kernels may choose by stride)")
    model = models[name]
    ids = prompt(23, seed=1)
    got = chunked(FusedPrefill(model, kernels=False), model, ids, 17)
    assert torch.equal(got, chunked(model, model, ids, 17))


def test_a_hooked_model_runs_its_own_forward(models):
    """Forward hooks on the model would be skipped by the fused path: it defers to the model."""
    model = models["laneformer"]
    seen = []
    hook = model.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[1]))
    try:
        with torch.inference_mode():
            FusedPrefill(model)(prompt(7))
    finally:
        hook.remove()
    assert seen == [7]


def test_supports_only_the_models_own_forward(models):
    class Patched(type(models["laneformer"])):
        def forward(self, *args, **kw):
            return super().forward(*args, **kw)

    model = models["laneformer"]
    assert supports(model)
    odd = Patched(model.cfg)
    assert not supports(odd)
    assert not supports(torch.nn.Linear(2, 2))


def test_engine_prefill_through_the_kernels_gives_the_same_tokens(models):
    """The engine's prefill (chunks of 20, a reused prefix) and prompt logprobs through
    FusedPrefill against the same engine on the model's forward (kernels="off")."""
    model = models["lanes-b"]
    fused = Engine(model, max_model_len=96, prefill_chunk=20, decode="eager")
    plain = Engine(model, max_model_len=96, prefill_chunk=20, decode="eager", kernels="off")
    assert isinstance(fused.prefill_forward, FusedPrefill) and plain.prefill_forward is model
    ids = prompt(29, seed=2)[0].tolist()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for more in ([], [7, 9, 11]):  # the second prompt reuses the first's prefix
        want = list(plain.generate(ids + more, params))
        assert list(fused.generate(ids + more, params)) == want
    assert fused.stats.cached_tokens > 0
    got, want = fused.prompt_logprobs(ids), plain.prompt_logprobs(ids)
    assert (got - want).abs().max() < 1e-4


def test_the_cpu_path_is_the_model(models, monkeypatch):
    monkeypatch.delenv("EXPRESSLANE_FORCE_TRITON")
    if GPU:
        pytest.skip("on CUDA the prefill is fused")
    eng = Engine(models["laneformer"], max_model_len=64, decode="eager")
    assert eng.prefill_forward is models["laneformer"] and eng.warmup_s == 0.0


def test_prefill_warmup_leaves_nothing_behind(models):
    """Turned on explicitly (the default on CUDA with capture): prefills of 5, 17 and 40
    tokens at load, then an empty cache, nothing for prefix reuse, zeroed counters."""
    model = models["laneformer"]
    seen = []
    hook = model.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[1]))
    try:
        eng = Engine(model, max_model_len=64, prefill_chunk=40, decode="eager",
                     kernels="off", prefill_warmup=True)  # fmt: skip
    finally:
        hook.remove()
    assert seen == [5, 17, 40] and eng.warmup_s > 0
    assert eng.cache.length == 0 and eng.cache.tokens == []
    assert all((p == -1).all() for p in eng.cache.pos)
    assert eng.prefix.requests == 0 and eng.prefix.reused_tokens == 0
    assert eng.prefix.snapshot is None or eng.prefix.snapshot.saved is None
    ids = prompt(20, seed=3)[0].tolist()
    list(eng.generate(ids, SamplingParams(max_tokens=2)))
    assert eng.stats.cached_tokens == 0  # nothing of the warm-up's prompts reused


@on_gpu
@pytest.mark.gpu
def test_fused_prefill_in_bf16_on_the_gpu_at_the_2b_lane_layout():
    """8 lanes (the 2B's lane layout: per-lane heads, delay 2), 2 layers, 300 tokens in bf16:
    the fused prefill's logits near the eager forward's, the same greedy tokens nearly
    everywhere (the kernels differ from the eager ops by at most an ulp per rounding)."""
    from expresslane.cache import KVCache

    model = tiny.laneformer(seed=5, num_lanes=8, hidden_size=384, intermediate_size=1024,
                            num_attention_heads=16, num_key_value_heads=8, num_hidden_layers=2,
                            vocab_size=512, max_position_embeddings=512)  # fmt: skip
    model = model.to("cuda", torch.bfloat16)
    ids = torch.randint(3, 512, (1, 300), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.inference_mode():
        got = FusedPrefill(model)(ids, cache=KVCache(model.cfg, 320, "cuda", torch.bfloat16))
        want = model(ids, cache=KVCache(model.cfg, 320, "cuda", torch.bfloat16))
    got, want = got.float(), want.float()
    assert (got - want).abs().max() <= 0.03 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95
