"""kernels/interpreter.py: the Triton interpreter without its repeated patches gives the kernels'
bits as shipped, and patches less."""

from __future__ import annotations

import contextlib

import pytest
import torch
from triton_interp import GPU, triton  # noqa: F401  (first: sets the interpreter)

from expresslane.kernels import interpreter

pytestmark = pytest.mark.skipif(GPU, reason="the kernels run compiled where CUDA is")


def _decode(model, drafts):
    from expresslane.cache import KVCache
    from expresslane.step.fused import FusedDecoder

    prompt = torch.tensor([[1, 5, 9, 13, 17]])
    cache = KVCache(model.cfg, 16, "cpu", torch.float32, headroom=len(drafts) - 1)
    with torch.no_grad():
        model(prompt, cache=cache)
    return FusedDecoder(model, cache, kernels=True).forward(drafts, torch.tensor([5]))


def test_quick_interpreter_gives_the_shipped_bits_with_fewer_patches(monkeypatch):
    """A laneformer decoder's verify rows (every decode kernel, their jit helpers nested, a
    sliding layer) equal bit for bit under both; the quick one patches the language once a
    launch (and a module), the shipped one at every helper call too."""
    import tiny
    from triton.runtime import interpreter as ti

    monkeypatch.setenv("EXPRESSLANE_FORCE_TRITON", "1")
    assert interpreter.quicken(), "this triton's interpreter is not the one quicken() knows"
    model = tiny.laneformer(seed=5, sliding_window=3, num_hidden_layers=2,
                            sliding_window_n_layers=1)  # fmt: skip
    drafts = torch.tensor([7, 30, 4])
    walk, calls = ti._patch_builtin, {"n": 0}

    def counted(*args):  # the module walk that each patch of the language makes
        calls["n"] += 1
        return walk(*args)

    monkeypatch.setattr(ti, "_patch_builtin", counted)
    counts, logits = {}, {}
    for name in ("quick", "shipped"):
        calls["n"] = 0
        with interpreter.as_shipped() if name == "shipped" else contextlib.nullcontext():
            logits[name] = _decode(model, drafts)
        counts[name] = calls["n"]
    assert logits["quick"].shape == (3, model.cfg.vocab_size)
    assert torch.equal(logits["quick"], logits["shipped"])
    assert 0 < 2 * counts["quick"] < counts["shipped"], counts
