"""Speculative decoding with a draft model (vLLM's method "draft_model"): greedy output is plain
greedy's whatever the draft, on the eager and the static step; the model as its own draft keeps
every draft, another model some; sampling keeps the model's distribution (chi-square); the
draft's cache follows the sequence through rejections; bad configurations are refused naming
the field, a draft of another vocabulary too."""

from __future__ import annotations

import shutil

import pytest
import torch
from test_speculative import chi_square, second_token_marginal

from expresslane.assets import build_random_model, default_model_dir
from expresslane.checkpoint import save_model
from expresslane.config import ModelConfig
from expresslane.engine import Engine
from expresslane.errors import ConfigError
from expresslane.model import Laneformer, init_weights
from expresslane.sampling.params import SamplingParams
from expresslane.speculative.draft_model import Draft, DraftModelDrafter
from expresslane.speculative.drafting import SpeculativeConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny models


def draft_config(path, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig.from_json(f'{{"model": "{path}", "num_speculative_tokens": {k}}}')


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """Another random model of the same shape and tokenizer: a draft that is often wrong."""
    return build_random_model(tmp_path_factory.mktemp("other-draft"), seed=7)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory, random_laneformer_dir):
    """A one-layer Llama with the random Laneformer's tokenizer: a draft that costs a fraction
    of the model's step, as a real draft model does."""
    cfg = ModelConfig.from_hf_dict(dict(
        model_type="llama", vocab_size=512, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=1024, bos_token_id=1, eos_token_id=2))  # fmt: skip
    out = tmp_path_factory.mktemp("small-draft")
    save_model(init_weights(Laneformer(cfg), seed=3), out)
    for f in random_laneformer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def _engine(path, **kw) -> Engine:
    return Engine.from_pretrained(str(path), device="cpu", dtype="float32", max_model_len=128,
                                  progress=False, **kw)  # fmt: skip


def _speculating(path, draft, k: int = 4, **kw) -> Engine:
    """An engine with `draft` whose measured cost is set to none: these tests check the
    arithmetic of every verify, not the back-off (a draft as big as the model never pays)."""
    eng = _engine(path, speculative=draft_config(draft, k), **kw)
    eng.speculator.draft.cost = 0.0
    return eng


PROMPT = [1, 12, 40, 7, 99, 3, 18, 5, 61, 22]


@pytest.mark.parametrize("decode", ["eager", "graph"])
def test_greedy_output_is_plain_greedy_whatever_the_draft(random_laneformer_dir, other_dir,
                                                          decode):  # fmt: skip
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = list(_engine(random_laneformer_dir, decode=decode).generate(PROMPT, params))
    same = _speculating(random_laneformer_dir, random_laneformer_dir, decode=decode)
    assert list(same.generate(PROMPT, params)) == want
    fig = same.stats.extra["speculative"]
    assert fig["verify_steps"] > 0 and fig["accepted_tokens"] == fig["draft_tokens"], fig
    other = _speculating(random_laneformer_dir, other_dir, decode=decode)
    assert list(other.generate(PROMPT, params)) == want
    fig = other.stats.extra["speculative"]
    assert fig["draft_tokens"] > fig["accepted_tokens"], fig  # rejections happened, and were
    # cut from the draft's cache: its next proposals still extended the right sequence
    assert list(other.generate(PROMPT[:7], params)) == list(
        _engine(random_laneformer_dir, decode=decode).generate(PROMPT[:7], params)
    )


def test_drafts_are_the_draft_models_greedy_continuation(random_laneformer_dir, other_dir):
    """The drafter's proposals equal the draft model's own greedy tokens, also after the
    sequence left them (a rejected draft) and came back through the cache's common prefix."""
    ref = _engine(other_dir)
    drafter = DraftModelDrafter(Draft(_engine(other_dir), cost=0.0, k=6), PROMPT)
    want = list(ref.generate(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True)))
    assert drafter.propose(6) == want
    drafter.extend([want[0], (want[1] + 1) % 97])  # the target kept one, then chose another
    seq = [*PROMPT, want[0], (want[1] + 1) % 97]
    again = list(ref.generate(seq, SamplingParams(max_tokens=3, ignore_eos=True)))
    assert drafter.propose(3) == again


def test_sampling_follows_the_model_distribution(random_laneformer_dir, other_dir):
    """The 2nd generated token (from a verify step with the other model's draft) over many
    seeds against its exact marginal under the plain sampler's filter (chi-square, p = 0.001)."""
    eng = _speculating(random_laneformer_dir, other_dir, 2, decode="eager")
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=5, ignore_eos=True)
    _, expected = second_token_marginal(eng.model, PROMPT, params)
    counts = torch.zeros(expected.shape[0], dtype=torch.float64)
    verified = 0
    for seed in range(300):
        p = SamplingParams(max_tokens=3, temperature=1.0, top_k=5, ignore_eos=True, seed=seed)
        counts[list(eng.generate(PROMPT, p))[1]] += 1
        verified += eng.stats.extra["speculative"]["verify_steps"]
    assert verified > 270
    stat, crit = chi_square(counts, expected)
    assert stat < crit, (stat, crit)


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ('{"method": "draft_model", "num_speculative_tokens": 4}', "needs `model`"),
        ('{"model": "", "num_speculative_tokens": 4}', "needs `model`"),
        ('{"model": "x", "num_speculative_tokens": 4, "prompt_lookup_max": 3}',
         "prompt_lookup_max is prompt lookup's"),
        ('{"method": "ngram", "model": "x", "num_speculative_tokens": 4}',
         "needs method 'draft_model'"),
        ('{"model": "x"}', "num_speculative_tokens is required"),
    ],
)  # fmt: skip
def test_config_errors_name_the_field(text, names):
    with pytest.raises(ConfigError, match="--speculative-config") as e:
        SpeculativeConfig.from_json(text)
    assert names in str(e.value)


def test_a_draft_that_cannot_pay_leaves_requests_plain(random_laneformer_dir, other_dir, caplog,
                                                        monkeypatch):  # fmt: skip
    """When a draft costs so much (measured at load) that even a verify that keeps every draft
    would not pay, a warning says so and requests decode plain (no verify), same tokens. The
    timing is set here: what tiny models measure is the machine's overhead, not their size."""
    import expresslane.speculative.draft_model as dm

    real = dm.measured_cost
    monkeypatch.setattr(dm, "measured_cost", lambda *a: (real(*a), 0.95)[1])
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    with caplog.at_level("WARNING", logger="expresslane"):
        eng = _engine(random_laneformer_dir, speculative=draft_config(other_dir))
    assert "decode plain" in caplog.text
    assert list(eng.generate(PROMPT, params)) == list(
        _engine(random_laneformer_dir).generate(PROMPT, params)
    )
    assert eng.stats.extra["speculative"]["verify_steps"] == 0


def test_measured_cost_is_a_share_of_a_step(random_laneformer_dir, small_dir):
    """The load-time timing runs and leaves both caches empty; a positive finite cost."""
    import math

    eng = _engine(random_laneformer_dir, speculative=draft_config(small_dir))
    cost = eng.speculator.draft.cost
    assert math.isfinite(cost) and cost > 0
    assert eng.cache.length == 0 and eng.speculator.draft.engine.cache.length == 0


def test_run_with_a_draft_model_and_its_bad_paths(random_laneformer_dir, small_dir, capsys,
                                                  monkeypatch):  # fmt: skip
    """`run --speculative-config '{"model": ...}'`: the plain tokens and the draft's figures in
    --json (the draft's cost set low: tiny models' timing is overhead); a draft path that is no
    model, or of another vocabulary, exits 2 naming it."""
    import json

    import expresslane.speculative.draft_model as dm
    from expresslane.__main__ import main

    monkeypatch.setattr(dm, "measured_cost", lambda *a: 0.1)

    argv = ["run", str(random_laneformer_dir), "--prompt", "hello", "--max-tokens", "24",
            "--ignore-eos", "--json"]  # fmt: skip
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    spec = f'{{"model": "{small_dir}", "num_speculative_tokens": 3}}'
    assert main([*argv, "--speculative-config", spec]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["token_ids"] == plain["token_ids"] and got["speculative"]["verify_steps"] > 0
    for bad, words in ((small_dir / "nope", "nope"), (default_model_dir(), "vocabulary")):
        spec = f'{{"model": "{bad}", "num_speculative_tokens": 3}}'
        assert main([*argv, "--speculative-config", spec]) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1, err


def test_a_draft_of_another_vocabulary_is_refused(random_laneformer_dir):
    with pytest.raises(ConfigError, match="vocabulary"):
        _engine(random_laneformer_dir, speculative=draft_config(default_model_dir()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_draft_model_is_plain_greedy(random_laneformer_dir, other_dir):
    """On a GPU: the target's captured steps, the draft uncaptured in its own engine; greedy
    output equals plain greedy decoding of the same engine's step, the model as its own draft
    keeps every draft, another model's drafts are cut where rejected."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    kw = dict(device="cuda", dtype="bfloat16", max_model_len=128, progress=False)
    want = list(Engine.from_pretrained(str(random_laneformer_dir), **kw).generate(PROMPT, params))
    for draft in (random_laneformer_dir, other_dir):
        eng = Engine.from_pretrained(str(random_laneformer_dir), speculative=draft_config(draft),
                                     **kw)  # fmt: skip
        eng.speculator.draft.cost = 0.0  # the arithmetic, not the back-off
        assert list(eng.generate(PROMPT, params)) == want
        fig = eng.stats.extra["speculative"]
        assert fig["verify_steps"] > 0, fig
        if draft == random_laneformer_dir:
            assert fig["accepted_tokens"] == fig["draft_tokens"], fig
