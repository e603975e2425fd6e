"""The `expresslane run` CLI: streams text or JSON; bad input is one line and exit code 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from expresslane.__main__ import main
from expresslane.engine import Engine
from expresslane.sampling.params import SamplingParams, bad_word_ids
from expresslane.textgen import generate_text
from expresslane.tokenizer import Tokenizer


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_run_json_logprobs(random_laneformer_dir, capsys):
    """--logprobs N: each token's logprob and its top N in the JSON, greedy's token the top one,
    decoded through the same step as without them (the same tokens)."""
    argv = ["run", str(random_laneformer_dir), "--prompt", "def f(", "--max-tokens", "6",
            "--ignore-eos", "--json"]  # fmt: skip
    code, out, _ = _run(capsys, *argv, "--logprobs", "2")
    assert code == 0
    res = json.loads(out.strip().splitlines()[-1])
    lps = res["logprobs"]
    assert [x["token"] for x in lps] == res["token_ids"] and len(lps) == 6
    for x in lps:
        assert len(x["top_logprobs"]) == 2 and x["top_logprobs"][0] == [x["token"], x["logprob"]]
        assert x["logprob"] <= 0 and x["top_logprobs"][1][1] <= x["logprob"]
    _, plain, _ = _run(capsys, *argv)
    assert json.loads(plain.strip().splitlines()[-1])["token_ids"] == res["token_ids"]
    assert "logprobs" not in json.loads(plain.strip().splitlines()[-1])


def test_run_json_matches_the_engine(random_laneformer_dir, capsys):
    code, out, _ = _run(
        capsys,
        "run",
        str(random_laneformer_dir),
        "--prompt",
        "def add(a, b):",
        "--max-tokens",
        "12",
        "--json",
    )
    assert code == 0
    res = json.loads(out.strip().splitlines()[-1])
    for key in ("text", "token_ids", "prompt_tokens", "ttft_ms", "decode_tokens_per_s"):
        assert key in res
    assert res["cached_tokens"] == 0  # one request: nothing was in the cache before it
    tok = Tokenizer.from_dir(random_laneformer_dir)
    engine = Engine.from_pretrained(str(random_laneformer_dir), device="cpu", progress=False)
    prompt = tok.encode("def add(a, b):")
    assert res["prompt_tokens"] == len(prompt)
    expected = list(engine.generate(prompt, SamplingParams(max_tokens=12)))
    assert res["token_ids"] == expected
    stops = engine.stop_ids(SamplingParams())
    assert res["text"] == tok.decode([t for t in expected if t not in stops])


@pytest.mark.parametrize("command", ["run", "serve"])
def test_no_prefix_reuse_flag_reaches_the_engine(random_laneformer_dir, command):
    from expresslane.__main__ import build_parser
    from expresslane.cli.run import load_engine

    for flags, on in (([], True), (["--no-prefix-reuse"], False)):
        args = build_parser().parse_args([command, str(random_laneformer_dir), *flags])
        assert load_engine(args)[0].prefix.enabled is on


def test_run_streams_text_then_one_line_of_figures(random_laneformer_dir, capsys):
    code, out, _ = _run(
        capsys,
        "run",
        str(random_laneformer_dir),
        "--chat",
        "hi",
        "--max-tokens",
        "5",
        "--temperature",
        "0.7",
        "--seed",
        "1",
    )
    assert code == 0
    last = out.rstrip("\n").splitlines()[-1]
    assert "prompt tokens" in last and "time to first token" in last and "tokens/s" in last


def test_same_seed_same_output(random_laneformer_dir, capsys):
    argv = (
        "run",
        str(random_laneformer_dir),
        "--prompt",
        "x",
        "--max-tokens",
        "8",
        "--temperature",
        "1.0",
        "--seed",
        "42",
        "--json",
    )
    a = json.loads(_run(capsys, *argv)[1].splitlines()[-1])["token_ids"]
    b = json.loads(_run(capsys, *argv)[1].splitlines()[-1])["token_ids"]
    assert a == b


@pytest.fixture()
def broken(random_laneformer_dir, tmp_path):
    def make(kind):
        d = tmp_path / kind
        shutil.copytree(random_laneformer_dir, d)
        cfg = json.loads((d / "config.json").read_text())
        if kind == "bad-field":
            cfg["num_lanes"] = 3  # 16 heads are not divisible by 3 lanes
        elif kind == "unknown-type":
            cfg["model_type"] = "mamba"
        (d / "config.json").write_text(json.dumps(cfg))
        if kind == "truncated":
            f = d / "model.safetensors"
            f.write_bytes(f.read_bytes()[:1000])
        if kind == "pickle":
            (d / "model.safetensors").rename(d / "pytorch_model.bin")
        if kind == "no-tokenizer":
            (d / "tokenizer.json").unlink()
        return d

    return make


@pytest.mark.parametrize(
    "kind,words",
    [
        ("bad-field", ["num_attention_heads", "num_lanes"]),
        ("unknown-type", ["model_type", "mamba"]),
        ("truncated", ["model.safetensors"]),
        ("pickle", ["pytorch_model.bin", "pickle"]),
        ("no-tokenizer", ["tokenizer"]),
    ],
)
def test_bad_checkpoints_exit_2_with_one_line(broken, capsys, kind, words):
    code, _, err = _run(capsys, "run", str(broken(kind)), "--prompt", "x", "--max-tokens", "2")
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.startswith("expresslane")]
    assert len(lines) == 1
    for w in words:
        assert w in lines[0]


@pytest.mark.parametrize(
    "argv,word",
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top-p"),
        (["--dtype", "float8"], "dtype"),
        (["--device", "cuda"], "cuda"),
        (["--max-tokens", "many"], "max-tokens"),
        (["--devices", "3"], "--devices 3: must divide num_lanes=8"),  # before any process starts
        (["--devices", "0"], "--devices 0"),
        (["--logprobs", "21"], "logprobs"),
        (["--kv-cache-dtype", "fp8"], "kv-cache-dtype"),
        (["--frequency-penalty", "3"], "--frequency-penalty=3"),
        (["--logit-bias", '{"x": 1}'], "--logit-bias: key 'x' is not a token id"),
        (["--logit-bias", "{50: 1}"], "--logit-bias: not JSON; expected a JSON object"),
        (["--logit-bias", "[50]"], "--logit-bias: expected an object of token ids"),
        (["--logit-bias", '{"100000": 1}'], "--logit-bias: token id 100000 is outside"),
        (["--min-tokens", "9", "--max-tokens", "4"], "--min-tokens=9"),
        (["--allowed-token-ids", "5,x"], "--allowed-token-ids '5,x': expected token ids"),
        (["--allowed-token-ids", "5,100000"], "--allowed-token-ids: token id 100000 is outside"),
    ],
)
def test_bad_flags_exit_2(random_laneformer_dir, capsys, argv, word):
    try:  # argparse rejects some flags itself (SystemExit 2), the engine the rest (return 2)
        code = main(["run", str(random_laneformer_dir), "--prompt", "x", *argv])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and word in err


def test_chat_template_flag_replaces_the_models(random_laneformer_dir, tmp_path, capsys):
    """vLLM's --chat-template: a file or a one-line template renders every chat in place of
    the model's; one that does not parse, or a path that is not there, exits 2 naming it."""
    from expresslane.__main__ import build_parser
    from expresslane.cli.run import load_engine

    line = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    (tmp_path / "t.jinja").write_text(line)
    chat = [{"role": "user", "content": "hi"}]
    for source in (line, str(tmp_path / "t.jinja")):
        args = build_parser().parse_args(["run", str(random_laneformer_dir), "--chat-template",
                                          source])  # fmt: skip
        tok = load_engine(args)[1]
        assert tok.apply_chat_template(chat, add_generation_prompt=False) == "[user] hi\n"
    for source, words in (("{% if %}", "line 1"), (str(tmp_path / "none.jinja"), "no such")):
        code = main(["run", str(random_laneformer_dir), "--chat", "hi", "--chat-template", source])
        err = capsys.readouterr().err
        assert code == 2 and "--chat-template" in err and words in err, err


def test_interactive_turns_reuse_the_conversation(random_laneformer_dir):
    """run -i: each line a turn; turn 2's prompt is the conversation so far (its first turn
    reused from the cache) and its answer the engine's greedy answer to that prompt; /reset
    starts over; the end of the input ends with 0."""
    import io

    from expresslane.cli.interactive import chat_loop

    path = str(random_laneformer_dir)
    engine = Engine.from_pretrained(path, device="cpu", dtype="float32", progress=False)
    ref = Engine(engine.model)
    tok = Tokenizer.from_dir(random_laneformer_dir)
    params = SamplingParams(max_tokens=6)
    lines, out = iter(["def add", "", "and sub", "/reset", "def add"]), io.StringIO()

    def read(prompt: str) -> str:  # as input() does: the prompt written, EOFError at the end
        out.write(prompt)
        line = next(lines, None)
        if line is None:
            raise EOFError
        return line

    assert chat_loop(engine, tok, params, out, read) == 0
    answers = [a.split("\n[")[0] for a in out.getvalue().split("> ")[1:] if "\n[" in a]
    figures = [line for line in out.getvalue().splitlines() if line.startswith("[")]
    assert len(answers) == 3 and "(a new conversation)" in out.getvalue()

    def greedy(chat: list[dict]) -> str:
        ids = tok.encode(tok.apply_chat_template(chat), add_special_tokens=False)
        return "".join(t for t, _ in generate_text(ref, tok, ids, params))

    first = [{"role": "user", "content": "def add"}]
    assert answers[0] == greedy(first) == answers[2]  # after /reset: the same first turn
    second = [*first, {"role": "assistant", "content": answers[0]},
              {"role": "user", "content": "and sub"}]  # fmt: skip
    assert answers[1] == greedy(second)
    reused = [int(f.split(", ")[1].split()[0]) for f in figures]
    assert reused[1] > 0  # the first turn came from the cache


def test_missing_folder_from_a_real_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "expresslane", "run", str(tmp_path / "absent"), "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert str(tmp_path / "absent") in proc.stderr and "Traceback" not in proc.stderr


def test_run_without_a_model_says_what_the_embedded_model_is(capsys):
    """The first-contact path (`make run`): the first line says what the model is and what to
    expect, then the request and a label before the answer; --json output stays one object."""
    argv = ["run", "--chat", "Write a function.", "--max-tokens", "4", "--temperature", "1.0"]
    code, out, _ = _run(capsys, *argv, "--min-p", "0.2", "--seed", "0")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("embedded model: a 5.6 M-parameter Laneformer")
    assert "not working code" in lines[0]
    assert lines[1] == "chat (temperature 1, min-p 0.2, seed 0): Write a function."
    assert lines[2] == "answer:" and lines[-1].startswith("[prompt tokens: ")
    code, out, _ = _run(capsys, *argv, "--json")
    assert code == 0 and "embedded model" not in out and json.loads(out)["completion_tokens"]


@pytest.mark.parametrize(
    "flags, weights",
    [([], "float32"), (["--dtype", "bfloat16"], "bfloat16"), (["--quantization", "int8"], "q8_0")],
)
def test_run_json_names_the_weight_format(random_laneformer_dir, capsys, flags, weights):
    """Packed CPU weights compute in fp32: `dtype` is the activations', `weights` what is read."""
    argv = ["run", str(random_laneformer_dir), "--prompt", "x", "--max-tokens", "2", "--json"]
    code, out, _ = _run(capsys, *argv, "--device", "cpu", *flags)
    res = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and res["dtype"] == "float32" and res["weights"] == weights


@pytest.mark.parametrize(
    "flags, kv", [([], "float32"), (["--kv-cache-dtype", "bfloat16"], "bfloat16")]
)
def test_run_json_names_the_kv_cache_dtype(random_laneformer_dir, capsys, flags, kv):
    argv = ["run", str(random_laneformer_dir), "--prompt", "x", "--max-tokens", "3", "--json"]
    code, out, _ = _run(capsys, *argv, "--device", "cpu", *flags)
    res = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and res["kv_cache_dtype"] == kv and res["completion_tokens"] == 3


def test_run_takes_the_penalties_and_logit_bias(random_laneformer_dir, capsys):
    """The CLI's flags reach the sampler: run's tokens are the engine's with the same params."""
    argv = ["run", str(random_laneformer_dir), "--prompt", "x y z", "--max-tokens", "12",
            "--json", "--device", "cpu", "--ignore-eos"]  # fmt: skip
    flags = ["--repetition-penalty", "1.4", "--presence-penalty", "0.5", "--logit-bias",
             '{"7": 3.5}']  # fmt: skip
    code, out, _ = _run(capsys, *argv, *flags)
    got = json.loads(out.strip().splitlines()[-1])
    assert code == 0
    engine = Engine.from_pretrained(str(random_laneformer_dir), device="cpu", progress=False)
    ids = Tokenizer.from_dir(random_laneformer_dir).encode("x y z")
    params = SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.4,
                            presence_penalty=0.5, logit_bias=((7, 3.5),))  # fmt: skip
    assert got["token_ids"] == list(engine.generate(ids, params))
    assert got["token_ids"] != list(
        engine.generate(ids, SamplingParams(max_tokens=12, ignore_eos=True))
    )


def test_run_takes_bad_words_and_allowed_token_ids(random_laneformer_dir, capsys):
    """--bad-words (text, tokenized as the server does) and --allowed-token-ids reach the
    sampler: run's tokens are the engine's with the same params, and differ from plain."""
    argv = ["run", str(random_laneformer_dir), "--prompt", "x y z", "--max-tokens", "12",
            "--json", "--device", "cpu", "--ignore-eos"]  # fmt: skip
    engine = Engine.from_pretrained(str(random_laneformer_dir), device="cpu", progress=False)
    tok = Tokenizer.from_dir(random_laneformer_dir)
    ids, base = tok.encode("x y z"), SamplingParams(max_tokens=12, ignore_eos=True)
    plain = list(engine.generate(ids, base))
    word = next(tok.decode([t]) for t in plain if tok.encode(tok.decode([t]), False) == [t])
    allowed = [t for t in range(1, 60) if t != plain[0]]
    words = bad_word_ids([word], lambda w: tok.encode(w, False))
    for flags, kw in (
        (["--bad-words", word], {"bad_words": words}),
        (
            ["--allowed-token-ids", ",".join(map(str, allowed))],
            {"allowed_token_ids": tuple(allowed)},
        ),
    ):
        code, out, _ = _run(capsys, *argv, *flags)
        want = list(engine.generate(ids, SamplingParams(**{**base.__dict__, **kw})))
        assert code == 0 and json.loads(out.strip().splitlines()[-1])["token_ids"] == want != plain
