"""The prefill's fused residual + norm kernel against the model's math.

`residual_norm` (kernels/prefill_norm.py) against `ref.residual_norm` (model.reduce and
model.rms_norm) on irregular shapes: N tokens in {1, 5, 37}, L in {1, 3, 8} lanes, D in
{40, 96, 200}, every reduce mode, past given and absent, shared / per-lane / no norm scale, both
norm roundings, y and past as lane_linear's transposed views, h broadcast over the lanes (the
first layer). fp32: within 1e-6 relative (only the order of the fp32 sums differs); bf16: every
element within one bf16 ulp of the reference, and nearly all equal (each rounding point copied).
"""

from __future__ import annotations

import pytest
import torch
from triton_interp import DEVICE, GPU, triton  # noqa: F401  (first: sets the interpreter)

from expresslane.kernels import ref  # noqa: E402
from expresslane.kernels.prefill_norm import residual_norm  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(autouse=True)
def _force_triton(monkeypatch):
    monkeypatch.setenv("EXPRESSLANE_FORCE_TRITON", "1")
    if GPU:  # the fp32 references must not run in TF32
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


# (N, L, D, mode, past: None / "given", gamma: None / "shared" / "lane", round_before_scale,
#  y: "strided" (lane_linear's bmm view) / "plain" / None (the first layer: h broadcast))
CASES = [
    (1, 1, 40, "present", None, "shared", True, "plain"),  # a Llama's one token
    (5, 3, 200, "present", None, "lane", False, "strided"),
    (37, 8, 96, "present", None, "shared", False, "strided"),
    (5, 8, 200, "no_reduce", None, "lane", True, "strided"),
    (37, 3, 40, "no_reduce", None, None, False, "plain"),  # the last layer: no norm
    (5, 3, 96, "past", "given", "shared", False, "strided"),
    (37, 8, 200, "past", "given", "lane", True, "strided"),
    (1, 8, 40, "past", None, "shared", True, "strided"),  # option B: nothing arrives yet
    (37, 1, 200, "past", "given", "shared", True, "plain"),  # a Llama past layer
    (5, 8, 96, "present", None, "lane", False, None),  # the first layer's attention_norm
    (37, 3, 200, "past", "given", None, False, "strided"),
]
DTYPES = [torch.float32, torch.bfloat16]


def lane_view(N: int, L: int, D: int, g: torch.Generator, dtype, strided: bool):
    """(N, L, D) random values; strided: (L, N, D) storage seen as (N, L, D), as lane_linear."""
    if strided:
        return torch.randn(L, N, D, generator=g).to(DEVICE, dtype).transpose(0, 1)
    return torch.randn(N, L, D, generator=g).to(DEVICE, dtype)


def make_case(case, dtype):
    N, L, D, mode, past, gamma, rbs, y_kind = case
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
    h_new, normed = residual_norm(h, y, scale, **kw)
    want_h, want_normed = ref.residual_norm(h, y, scale, **kw)
    if y is None:
        assert h_new is h  # nothing added: the residual itself
    else:
        assert_matches(h_new, want_h, dtype)
    if scale is None:
        assert normed is None
    else:
        assert_matches(normed, want_normed, dtype)


def test_the_bf16_check_tells_the_two_norm_roundings_apart():
    """The bf16 tolerance is tight enough to see a rounding point moved: the norm scaled in
    fp32 (one rounding) against rounded before the scale fails `assert_matches`."""
    (h, y, scale), kw = make_case(CASES[3], torch.bfloat16)
    _, before = ref.residual_norm(h, y, scale, **kw)
    _, once = ref.residual_norm(h, y, scale, **{**kw, "round_before_scale": False})
    with pytest.raises(AssertionError):
        assert_matches(once, before, torch.bfloat16)
