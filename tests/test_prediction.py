"""Predicted Outputs (speculative/prediction.py): a request's `prediction` changes the speed,
never the tokens.

The drafter against hand-made alignments (from the first token, after an edit, forward first,
the fallback); greedy output with a prediction (exact, off by an edit, unrelated) equals plain
greedy decoding token for token on the engine's paths (eager forward, static verify step, the
packed C step), with and without prompt lookup beside it, and under a grammar; sampled output
keeps the model's distribution (chi-square) and its seed; the counts OpenAI reports; refusals.
"""

from __future__ import annotations

import pytest
import tiny
import torch
from test_speculative import chi_square, second_token_marginal, spec

from expresslane.engine import Engine
from expresslane.errors import RequestError
from expresslane.sampling.params import SamplingParams
from expresslane.speculative.decoder import PREDICTION_TOKENS
from expresslane.speculative.drafting import NgramDrafter, SpecStats, combine
from expresslane.speculative.prediction import PredictionDrafter, drafter_for

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny or shared-core work


@pytest.fixture(scope="module")
def lane():
    return tiny.laneformer(seed=5)


# --- the drafter ------------------------------------------------------------------------------
def test_drafts_start_at_the_first_token_and_follow():
    d = PredictionDrafter([*range(10, 22)])
    assert d.propose(3) == [10, 11, 12] and d.from_prediction and not d.strong
    d.extend([10, 11])
    assert d.propose(3) == [12, 13, 14] and not d.strong
    d.extend([*range(12, 18)])  # 8 tokens followed: strong (a back-off pause lets it draft)
    assert d.propose(3) == [18, 19, 20] and d.strong
    d.extend([*range(18, 22)])
    assert d.propose(3) == [] and not d.from_prediction  # the prediction is used up


def test_an_edit_realigns_forward_after_two_tokens():
    pred = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 20, 21]
    d = PredictionDrafter(pred)
    d.extend([5, 6, 7, 8, 9, 5])  # follows the prediction to index 6
    d.extend([30])  # the edit: the output leaves it at index 6
    assert d.at is None and d.propose(4) == []  # one token after: nothing to align on
    d.extend([6, 7])  # "6 7" occurs at ends 3 and 8: the one at or after index 6 wins
    assert d.propose(4) == [8, 9, 20, 21] and d.from_prediction


def test_realignment_takes_the_longest_match_else_the_latest_before():
    pred = [1, 2, 3, 4, 9, 2, 3, 7]
    d = PredictionDrafter(pred)
    d.extend([1, 2, 3, 4, 9, 2, 3, 7])
    d.extend([40, 1, 2, 3])  # used up, then "1 2 3" (longer than "2 3" at end 7): end 3
    assert d.propose(2) == [4, 9]


def test_the_fallback_drafts_where_the_prediction_has_nothing():
    lookup = NgramDrafter(spec(3, 2, 2), [50, 51, 52, 53])
    d = PredictionDrafter([1, 2], fallback=lookup)
    d.extend([60, 50, 51])  # left the prediction at once; "50 51" is in the prompt
    assert d.propose(2) == [52, 53] and not d.from_prediction
    assert drafter_for(None, [1, 2], ()) is None
    assert isinstance(drafter_for(spec(2), [1, 2], ()), NgramDrafter)
    both = drafter_for(spec(2), [1, 2], (7,))
    assert isinstance(both, PredictionDrafter) and isinstance(both.fallback, NgramDrafter)


def test_prediction_counts_as_openai_reports_them():
    s = SpecStats()
    s.add(5, 3, predicted=True)
    s.add(4, 4)  # a prompt-lookup draft: in neither prediction count
    s.add(2, 0, predicted=True)
    f = s.as_dict()
    assert (f["accepted_prediction_tokens"], f["rejected_prediction_tokens"]) == (3, 4)
    assert (f["draft_tokens"], f["accepted_tokens"]) == (11, 7)
    both = combine(f, f, None)
    assert (both["accepted_prediction_tokens"], both["rejected_prediction_tokens"]) == (6, 8)


# --- the engine ---------------------------------------------------------------------------------
PROMPT = [1, 9, 33, 4, 17, 60, 5, 21]


def predictions(plain: list[int]) -> dict[str, tuple[int, ...]]:
    """Exact; an edit (two tokens changed, one dropped) mid-way; unrelated tokens."""
    edit = [*plain[:10], 63 - plain[10], 62 - plain[11], *plain[13:]]
    return {"exact": tuple(plain), "edit": tuple(edit), "unrelated": tuple(range(3, 40))}


ENGINES = {  # (decode, kernels): the eager forward, the static verify step, the packed C step
    "eager": ("eager", "off"),
    "graph": ("graph", "off"),
    "packed": ("auto", "auto"),
}


@pytest.mark.parametrize("path", ENGINES)
@pytest.mark.parametrize("lookup", [False, True])
def test_greedy_output_is_plain_greedy_whatever_the_prediction(lane, path, lookup):
    decode, kernels = ENGINES[path]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = list(Engine(lane, max_model_len=128, decode=decode, kernels=kernels)
                 .generate(PROMPT, params))  # fmt: skip
    eng = Engine(lane, max_model_len=128, decode=decode, kernels=kernels,
                 speculative=spec(5) if lookup else None)  # fmt: skip
    figures = {}
    for name, pred in predictions(plain).items():
        got = list(eng.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True,
                                                       prediction=pred)))  # fmt: skip
        assert got == plain, name
        figures[name] = eng.stats.extra["speculative"]
    exact, edit = figures["exact"], figures["edit"]
    k = 5 if lookup else PREDICTION_TOKENS
    assert exact["rejected_prediction_tokens"] == 0
    assert exact["verify_steps"] == -(-39 // (k + 1))  # k drafts and the model's own a step
    assert exact["accepted_prediction_tokens"] == 39 - exact["verify_steps"]  # all but those
    assert edit["accepted_prediction_tokens"] > 20 and edit["rejected_prediction_tokens"] > 0
    assert figures["unrelated"]["accepted_prediction_tokens"] < 5


def test_a_prediction_without_lookup_leaves_plain_requests_plain(lane):
    eng = Engine(lane, max_model_len=128)
    assert eng.speculator is None and eng.predictor is not None
    list(eng.generate(PROMPT, SamplingParams(max_tokens=8)))
    assert "speculative" not in eng.stats.extra  # no drafts without a prediction


@pytest.mark.parametrize("decode", ["eager", "graph"])
def test_sampled_output_keeps_its_seed(lane, decode):
    eng = Engine(lane, max_model_len=128, decode=decode)
    kept = 0
    for seed in range(4):  # a draft is kept with its probability: over seeds, some are
        p = SamplingParams(max_tokens=30, temperature=0.3, top_p=0.9, seed=seed, ignore_eos=True)
        first = list(eng.generate(PROMPT, p))
        pred = SamplingParams(**{**p.__dict__, "prediction": tuple(first)})
        assert list(eng.generate(PROMPT, pred)) == list(eng.generate(PROMPT, pred))
        kept += eng.stats.extra["speculative"]["accepted_prediction_tokens"]
    assert kept > 0


def test_sampled_tokens_follow_the_model_distribution(lane):
    """The 2nd token (verified as a draft from the prediction) over many seeds against its exact
    marginal sum_t1 p(t1) p(t2 | t1) (chi-square, p = 0.001)."""
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=6, ignore_eos=True)
    p1, expected = second_token_marginal(lane, PROMPT, params)
    likely = p1.argmax().item()  # a prediction the first draw often follows
    second = int(expected.argmax())
    eng = Engine(lane, max_model_len=80)
    counts = torch.zeros(64, dtype=torch.float64)
    verified = kept = 0
    for seed in range(300):
        p = SamplingParams(max_tokens=3, temperature=1.0, top_k=6, ignore_eos=True, seed=seed,
                           prediction=(likely, second, 7))  # fmt: skip
        counts[list(eng.generate(PROMPT, p))[1]] += 1
        verified += eng.stats.extra["speculative"]["verify_steps"]
        kept += eng.stats.extra["speculative"]["accepted_prediction_tokens"]
    assert verified > 40 and kept > 0  # the 1st token followed the prediction, then a draft
    stat, crit = chi_square(counts, expected)
    assert stat < crit, (stat, crit)


def test_refusals_name_the_field(lane):
    eng = Engine(lane, max_model_len=64)
    bad = [
        SamplingParams(prediction=(1, -2)),
        SamplingParams(prediction=(1, 64)),  # the vocabulary is 64
    ]
    for p in bad:
        with pytest.raises(RequestError) as e:
            list(eng.generate(PROMPT, p))
        assert e.value.param == "prediction" and "prediction" in str(e.value)


def test_no_room_for_drafts_means_plain_decoding(lane):
    """Rings with no headroom (window 16 < context) leave a forward one row: no predictor, and
    a prediction is then only a hint that nothing uses."""
    eng = Engine(lane, max_model_len=64, ring_headroom=0)
    assert eng.predictor is None
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = list(eng.generate(PROMPT, params))
    pred = SamplingParams(max_tokens=20, ignore_eos=True, prediction=tuple(plain))
    assert list(eng.generate(PROMPT, pred)) == plain


# --- on a GPU ---------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_prediction_is_plain_greedy_and_captured_only_while_idle(lane):
    """The fused step: a prediction's first request verifies uncaptured (no capture inside it),
    the engine captures its verify graph once idle, and the captured one gives the same tokens,
    all equal to plain greedy decoding of the same step."""
    import copy

    m = copy.deepcopy(lane).to("cuda")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    eng = Engine(m, max_model_len=128, decode="graph")
    plain = list(eng.generate(PROMPT, params))
    pred = SamplingParams(max_tokens=40, ignore_eos=True, prediction=tuple(plain[:12] + plain[14:]))
    before = eng.capture_s
    assert list(eng.generate(PROMPT, pred)) == plain
    assert eng.capture_s == before  # nothing captured inside the request
    assert eng.captures.pending()  # its verify graph waits for an idle engine
    while eng.captures.pending():
        eng.idle()
    assert list(eng.generate(PROMPT, pred)) == plain
    assert all(not g.missing for g in eng.predictor.graphs.values())
    assert eng.stats.extra["speculative"]["accepted_prediction_tokens"] > 20


# --- the CLI ------------------------------------------------------------------------------------
def test_cli_prediction_keeps_the_text(tmp_path, capsys):
    import json

    from expresslane.__main__ import main

    args = ["run", "--prompt", "import os\n", "--max-tokens", "40", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (tmp_path / "p.txt").write_text(plain["text"])
    assert main([*args, "--prediction", str(tmp_path / "p.txt")]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert got["token_ids"] == plain["token_ids"]
    assert got["speculative"]["accepted_prediction_tokens"] > 0


@pytest.mark.parametrize("extra, says", [
    ([], "cannot read it"),
    (["--devices", "2"], "parallel engine"),
])  # fmt: skip
def test_cli_refusals_exit_2_naming_the_flag(tmp_path, capsys, extra, says):
    from expresslane.__main__ import main

    path = tmp_path / ("missing.txt" if not extra else "p.txt")
    if extra:
        path.write_text("x = 1\n")
    assert main(["run", "--prediction", str(path), "--max-tokens", "4", *extra]) == 2
    err = capsys.readouterr().err
    assert "--prediction" in err and says in err, err
