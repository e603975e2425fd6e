"""A request's logits adjustments (sampler.Penalties): logit_bias, min_tokens, and the
repetition, frequency and presence penalties, against references written apart.

- One adjustment at a time and all together, on random logits: the formulas of the OpenAI and
  vLLM docs written element by element, and transformers' RepetitionPenaltyLogitsProcessor.
- Through the engine (the C step, the Python layers with lanes, the eager forward): greedy
  tokens equal a cache-free loop over the model's forward with the reference adjustments; so do
  a speculating engine's and a predicted output's (each verify row adjusted as a plain step
  there would be), and sampled speculation keeps the penalized distribution (chi-square).
- min_tokens holds off the end of text; a bias of -100 keeps a token out of sampled text.
- What cannot work is refused naming the field: out-of-range values, an id outside the
  vocabulary, min_tokens with structured output, any on an engine without them.
"""

from __future__ import annotations

import random

import pytest
import tiny
import torch
from test_packed_step import llama

from expresslane.engine import Engine
from expresslane.errors import RequestError
from expresslane.sampling.params import SamplingParams
from expresslane.sampling.sampler import Penalties
from expresslane.speculative.drafting import SpeculativeConfig
from expresslane.textgen import stream_text
from expresslane.tokenizer import StopStringMatcher, Tokenizer
from expresslane.weights.packing import pack_model

PROMPT = [1, 7, 9, 30, 11, 12, 40, 3, 5]


def reference(logits: list[float], prompt, output, p: SamplingParams, stops) -> list[float]:
    """The adjustments as the docs state them, one logit at a time (vLLM's order)."""
    bias = dict(p.logit_bias)
    out = []
    for j, x in enumerate(logits):
        if p.allowed_token_ids and j not in p.allowed_token_ids:
            x = float("-inf")
        for w in p.bad_words:  # the word's last token where the output ends with the rest
            if j == w[-1] and len(output) >= len(w) - 1 and output[len(output) - len(w) + 1 :] \
                    == list(w[:-1]):  # fmt: skip
                x = float("-inf")
        x += bias.get(j, 0.0)
        if len(output) < p.min_tokens and j in stops:
            x = float("-inf")
        if p.repetition_penalty != 1.0 and (j in prompt or j in output):
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        c = output.count(j)
        x -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
        out.append(x)
    return out


ADJUSTED = {
    "logit_bias": SamplingParams(logit_bias=((3, 5.5), (17, -100.0), (40, 0.25))),
    "min_tokens": SamplingParams(min_tokens=6),
    "repetition": SamplingParams(repetition_penalty=1.7),
    "repetition<1": SamplingParams(repetition_penalty=0.6),
    "frequency": SamplingParams(frequency_penalty=0.9),
    "presence": SamplingParams(presence_penalty=-1.25),
    "allowed": SamplingParams(allowed_token_ids=(1, 3, 9, 30, 44, 45)),
    "bad_words": SamplingParams(bad_words=((9,), (7, 30), (3, 9, 44), (44, 3))),
    "all": SamplingParams(
        allowed_token_ids=tuple(range(0, 50, 2)) + (3, 7, 9, 15),
        bad_words=((9, 9), (2,)),
        logit_bias=((2, 3.0), (9, -2.0)),
        min_tokens=3,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.7,
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(ADJUSTED))
def test_each_adjustment_is_the_documented_formula(name):
    p, V, stops = ADJUSTED[name], 50, {2, 9}
    rng = random.Random(name)
    pen = Penalties(p, PROMPT, V, stops, torch.device("cpu"))
    output = []
    for _ in range(8):  # a sequence with repeats: counts above 1
        logits = [rng.uniform(-6, 6) for _ in range(V)]
        got = pen.apply(torch.tensor(logits)).tolist()
        want = reference(logits, PROMPT, output, p, stops)
        assert got == pytest.approx(want, rel=1e-6, abs=1e-5)
        tok = rng.choice([3, 7, 9, 9, 30, 44])
        pen.advance(torch.tensor(tok))
        output.append(tok)


def test_the_repetition_penalty_is_transformers_processors():
    from transformers import RepetitionPenaltyLogitsProcessor

    p = SamplingParams(repetition_penalty=1.45)
    pen = Penalties(p, PROMPT, 64, set(), torch.device("cpu"))
    for t in (5, 60, 5):
        pen.advance(t)
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(0)) * 4
    seen = torch.tensor([[*PROMPT, 5, 60, 5]])
    want = RepetitionPenaltyLogitsProcessor(1.45)(seen, logits.clone())
    torch.testing.assert_close(pen.apply(logits[0]), want[0])


def untied_llama():
    """One lane, varied greedy text with repeats (the penalties change it), C-packed."""
    model = llama(seed=4, tie_word_embeddings=False)
    pack_model(model, "float32")
    return model


MODELS = {"c-step": untied_llama, "lanes": lambda: tiny.laneformer(seed=3)}


def reference_greedy(model, p: SamplingParams, n: int) -> list[int]:
    seq, out = list(PROMPT), []
    stops = set() if p.ignore_eos else set(model.cfg.eos_token_ids)  # as vLLM's min_tokens
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq]))[0, -1].tolist()
            adj = reference(logits, PROMPT, out, p, stops)
            tok = max(range(len(adj)), key=adj.__getitem__)
            seq.append(tok)
            out.append(tok)
    return out


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("name", ["repetition", "frequency", "presence", "all"])
def test_greedy_tokens_are_the_reference_loops(model_name, name):
    model = MODELS[model_name]()
    p = ADJUSTED[name]
    params = SamplingParams(max_tokens=20, ignore_eos=True, logit_bias=p.logit_bias,
                            min_tokens=p.min_tokens, repetition_penalty=p.repetition_penalty,
                            frequency_penalty=p.frequency_penalty,
                            presence_penalty=p.presence_penalty)  # fmt: skip
    want = reference_greedy(model, params, 20)
    plain = list(
        Engine(model, max_model_len=64).generate(
            PROMPT, SamplingParams(max_tokens=20, ignore_eos=True)
        )
    )
    assert want != plain  # the adjustment changes this text
    for decode in ("graph", "eager"):  # graph: the CLI's CPU default, the packed step
        engine = Engine(model, max_model_len=64, decode=decode)
        assert list(engine.generate(PROMPT, params)) == want, (decode, engine.step_name)
    spec = Engine(model, max_model_len=64, decode="graph", speculative=SpeculativeConfig(4, 3, 1))
    assert list(spec.generate(PROMPT, params)) == want
    plain_engine = Engine(model, max_model_len=64, decode="graph")
    for pred in (want, plain):  # a prediction that is right, and one the adjustment turns from
        predicted = SamplingParams(**{**params.__dict__, "prediction": tuple(pred)})
        assert list(plain_engine.generate(PROMPT, predicted)) == want
        assert plain_engine.stats.extra["speculative"]["verify_steps"] > 0  # rows adjusted


@pytest.mark.parametrize("model_name", list(MODELS))
def test_bad_words_and_allowed_ids_through_the_engine_are_the_reference_loops(model_name):
    """Words taken from the plain greedy text (a single token and pairs) and an allowed set
    without its first token: each changes the text; the engine's tokens equal the reference
    loop's on every path, and no bad word is ever completed."""
    model = MODELS[model_name]()
    base = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = list(Engine(model, max_model_len=64).generate(PROMPT, base))
    words = ((plain[2], plain[3]), (plain[6],), (plain[10], plain[11], plain[12]))
    allowed = tuple(t for t in range(model.cfg.vocab_size) if t % 3 and t != plain[0])
    for kw in ({"bad_words": words}, {"allowed_token_ids": allowed}):
        params = SamplingParams(**{**base.__dict__, **kw})
        want = reference_greedy(model, params, 20)
        assert want != plain
        for decode in ("graph", "eager"):
            engine = Engine(model, max_model_len=64, decode=decode)
            assert list(engine.generate(PROMPT, params)) == want, (decode, kw.keys())
        spec = Engine(model, max_model_len=64, speculative=SpeculativeConfig(4, 3, 1))
        assert list(spec.generate(PROMPT, params)) == want
        predicted = SamplingParams(**{**params.__dict__, "prediction": tuple(plain)})
        assert list(Engine(model, max_model_len=64).generate(PROMPT, predicted)) == want
        assert set(want) <= set(params.allowed_token_ids or want)
        for w in words if "bad_words" in kw else ():
            assert not any(tuple(want[i : i + len(w)]) == w for i in range(len(want)))


def test_sampled_speculation_keeps_the_penalized_distribution():
    """The 2nd token, from a verify step whose draft row is penalized as a plain step would be,
    over many seeds against its exact marginal sum_t1 p(t1) p(t2 | t1) with the presence
    penalty written out (chi-square, p = 0.001)."""
    from test_speculative import chi_square, second_token_marginal

    lane = tiny.laneformer(seed=5)
    prompt = [1, *range(3, 64)]  # every first token has a draft after it (prompt lookup)
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=6, ignore_eos=True,
                            presence_penalty=1.5)  # fmt: skip

    def presence(logits, t1):  # the presence penalty of the one output token so far
        logits[t1] -= 1.5

    _, expected = second_token_marginal(lane, prompt, params, presence)
    eng = Engine(lane, max_model_len=80, speculative=SpeculativeConfig(3, 2, 1))
    counts = torch.zeros(64, dtype=torch.float64)
    verified = 0
    for seed in range(300):
        counts[
            list(eng.generate(prompt, SamplingParams(**{**params.__dict__, "seed": seed})))[1]
        ] += 1
        verified += eng.stats.extra["speculative"]["verify_steps"]
    assert verified > 270
    stat, crit = chi_square(counts, expected)
    assert stat < crit, (stat, crit)


def test_min_tokens_holds_off_the_end_of_text():
    model = untied_llama()
    eos = model.cfg.eos_token_ids[0]
    engine = Engine(model, max_model_len=64, decode="graph")
    rush = ((eos, 100.0),)  # the end of text is the argmax at every step
    assert list(engine.generate(PROMPT, SamplingParams(max_tokens=9, logit_bias=rush))) == [eos]
    held = list(engine.generate(PROMPT, SamplingParams(max_tokens=9, logit_bias=rush,
                                                       min_tokens=5)))  # fmt: skip
    assert len(held) == 6 and held[-1] == eos and eos not in held[:5]
    assert engine.stats.finish_reason == "stop"


def test_a_bias_of_minus_100_keeps_a_token_out_of_sampled_text():
    model = tiny.laneformer(seed=3)
    engine = Engine(model, max_model_len=96)
    base = SamplingParams(max_tokens=80, temperature=1.5, seed=11, ignore_eos=True)
    free = list(engine.generate(PROMPT, base))
    banned = max(set(free), key=free.count)  # the free text's most frequent token
    kw = {**base.__dict__, "logit_bias": ((banned, -100.0),)}
    biased = list(engine.generate(PROMPT, SamplingParams(**kw)))
    assert banned not in biased and biased == list(engine.generate(PROMPT, SamplingParams(**kw)))


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(frequency_penalty=2.5), "frequency_penalty"),
        (dict(presence_penalty=float("nan")), "presence_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_tokens=30, max_tokens=20), "min_tokens"),
        (dict(logit_bias=((4, 100.5),)), "logit_bias"),
        (dict(logit_bias=((67, 1.0),)), "logit_bias"),  # the vocabulary is [0, 67)
        (dict(allowed_token_ids=(3, 67)), "allowed_token_ids"),
        (dict(allowed_token_ids=(3, -1)), "allowed_token_ids"),
        (dict(bad_words=((5, 80),)), "bad_words"),
        (dict(bad_words=((),)), "bad_words"),
        (dict(bad_words=(tuple(range(65)),)), "bad_words"),
        (dict(allowed_token_ids=(5, 6), bad_words=((5,), (9, 6))), "allowed_token_ids"),
    ],
)
def test_values_out_of_range_are_refused_naming_the_field(kw, field):
    engine = Engine(untied_llama(), max_model_len=64)
    with pytest.raises(RequestError) as err:
        list(engine.generate(PROMPT, SamplingParams(**kw)))
    assert err.value.param == field and field in str(err.value)


def test_min_tokens_with_structured_output_or_any_without_support_is_refused(monkeypatch):
    engine = Engine(untied_llama(), max_model_len=64)
    engine.check_sampling(SamplingParams(presence_penalty=0.5, grammar=object()))  # taken
    with pytest.raises(RequestError, match="min_tokens: not supported with structured output"):
        engine.check_sampling(SamplingParams(min_tokens=2, grammar=object()))
    for kw in ({"allowed_token_ids": (3,)}, {"bad_words": ((3,),)}):
        with pytest.raises(RequestError, match="not supported with structured output"):
            engine.check_sampling(SamplingParams(grammar=object(), **kw))
    eos = engine.cfg.eos_token_ids[0]
    with pytest.raises(RequestError, match="leave no token"):  # min_tokens holds the eos back
        engine.check_sampling(SamplingParams(allowed_token_ids=(eos,), min_tokens=1))
    monkeypatch.setattr(engine, "adjusts_logits", False)
    with pytest.raises(RequestError, match="min_tokens: not supported by this engine"):
        engine.check_sampling(SamplingParams(min_tokens=2))


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")])],
)  # fmt: skip
def test_the_steps_pick_with_penalties_is_the_forwards_on_each_device(device):
    """The decode path of the device (on a GPU the fused step, its forward captured) and the
    model's own forward give the same adjusted tokens, greedy and seeded."""
    model = tiny.laneformer(seed=3).to(device)
    p = ADJUSTED["all"]
    for temperature in (0.0, 0.9):
        params = SamplingParams(max_tokens=16, temperature=temperature, seed=5, ignore_eos=True,
                                logit_bias=p.logit_bias, min_tokens=p.min_tokens,
                                repetition_penalty=p.repetition_penalty,
                                frequency_penalty=p.frequency_penalty,
                                presence_penalty=p.presence_penalty)  # fmt: skip
        step = Engine(model, max_model_len=64, decode="graph")
        eager = Engine(model, max_model_len=64, decode="eager")
        assert list(step.generate(PROMPT, params)) == list(eager.generate(PROMPT, params))


def test_stop_strings_wait_for_min_tokens_as_in_vllm(random_laneformer_dir):
    """Before min_tokens a stop string does not stop (its first character is still held back);
    one completed after them stops, cut where it began; through the engine, the same."""
    m = StopStringMatcher(["ab"])
    assert m.push("xxa", armed=False) == ("xx", False)
    assert m.push("b", armed=False) == ("ab", False)  # inside min_tokens: text
    assert m.push("xa", armed=False) == ("x", False)
    assert m.push("bq", armed=True) == ("", True)  # straddles the bound: stops at its start
    engine = Engine.from_pretrained(str(random_laneformer_dir), device="cpu", progress=False)
    tok = Tokenizer.from_dir(random_laneformer_dir)
    free = SamplingParams(max_tokens=12, ignore_eos=True)
    pieces = [t for t, _ in stream_text(engine, tok, PROMPT, free)]  # each token's text
    text = "".join(pieces)
    stop = next(p for p in pieces[:4] if p and text.count(p) == 1)  # once, in the 4 first
    cut = "".join(t for t, _ in stream_text(engine, tok, PROMPT, free, [stop]))
    assert cut == text[: text.index(stop)] != text
    held = SamplingParams(max_tokens=12, ignore_eos=True, min_tokens=4)
    assert "".join(t for t, _ in stream_text(engine, tok, PROMPT, held, [stop])) == text
