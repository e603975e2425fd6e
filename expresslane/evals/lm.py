"""lm-eval's `local-completions` against the server: ARC-Easy / ARC-Challenge as the card ran them.

A thin wrapper. It runs lm-eval in this process with the arguments the serving-conventions
doc (section 1.9) says a server like ours needs:

- `base_url` = the full `/v1/completions` URL (lm-eval POSTs straight to it);
- `tokenizer_backend=remote`: lm-eval tokenizes through the server's /tokenize, /detokenize
  and /tokenizer_info, so it needs neither `transformers` nor the Hub;
- `tokenized_requests=True` (token-id prompts: the server adds no BOS), `batch_size=1`;
- `max_length` = the model's context as the server reports it (lm-eval's default is 2048 and
  it left-truncates to that).

Data: the stock `arc_easy` / `arc_challenge` tasks load `allenai/ai2_arc` from the HF Hub or
its local caches (used by default when they hold it). `--data arc_easy=FILE` (or `--arc-dir`
holding AI2's ARC-*-Test.jsonl) uses local JSONL instead, rows in the HF shape
`{id, question, choices: {text, label}, answerKey}` or in AI2's original shape
`{id, question: {stem, choices: [{text, label}]}, answerKey}`. With no ARC data at all, the
bundled `arc_sample` (25 questions in the same format, written for this project) runs offline.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from . import EvalError

DATA = Path(__file__).parent / "data"
TITLES = {"arc_easy": "ARC-Easy", "arc_challenge": "ARC-Challenge", "arc_sample": "ARC sample"}
SETTING = "0-shot multiple-choice logprobs, lm_eval"


def find_arc_files(arc_dir: str) -> dict[str, str]:
    """AI2's release files (ARC-Easy-Test.jsonl, ARC-Challenge-Test.jsonl) under a folder."""
    found = {}
    for task, name in (
        ("arc_easy", "ARC-Easy-Test.jsonl"),
        ("arc_challenge", "ARC-Challenge-Test.jsonl"),
    ):
        hits = sorted(Path(arc_dir).rglob(name))
        if hits:
            found[task] = str(hits[0])
    if not found:
        raise EvalError(f"--arc-dir {arc_dir}: no ARC-Easy-Test.jsonl or ARC-Challenge-Test.jsonl")
    return found


def hub_arc_cached() -> bool:
    """Whether the HF caches hold allenai/ai2_arc, so the stock tasks can run offline."""
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    hub = Path(os.environ.get("HF_HUB_CACHE", home / "hub"))
    data = Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets"))
    return (hub / "datasets--allenai--ai2_arc").is_dir() or (data / "allenai___ai2_arc").is_dir()


def _hf_row(row: dict) -> dict:
    """One ARC row in the HF datasets shape lm-eval's ARC YAML expects."""
    q = row.get("question")
    if isinstance(q, dict):  # AI2's release format
        choices = q.get("choices", [])
        row = {
            "id": row.get("id"),
            "question": q.get("stem", ""),
            "answerKey": row["answerKey"],
            "choices": {
                "text": [c["text"] for c in choices],
                "label": [c["label"] for c in choices],
            },
        }
    if not {"question", "choices", "answerKey"} <= row.keys():
        raise EvalError(f"ARC row {row.get('id')}: needs question, choices and answerKey")
    if row["answerKey"] not in row["choices"]["label"]:
        raise EvalError(
            f"ARC row {row.get('id')}: answerKey {row['answerKey']!r} is not "
            "one of its choice labels"
        )
    return row


def task_yaml(task: str, data_file: Path) -> str:
    """The bundled task YAML, renamed and pointed at `data_file`."""
    text = (DATA / "arc_sample.yaml").read_text()
    text = text.replace("task: arc_sample", f"task: {task}")
    return text.replace(
        "test: expresslane/evals/data/arc_sample.jsonl", f"test: {json.dumps(str(data_file))}"
    )


def prepare(data: dict[str, str], tasks: list[str], workdir: Path) -> list[str]:
    """Write task YAMLs (and converted data) into `workdir`; the lm-eval task names to run."""
    names = []
    for task in tasks:
        if task in data:
            src = Path(data[task])
            if not src.is_file():
                raise EvalError(f"--data {task}={src}: no such file")
            rows = [_hf_row(json.loads(x)) for x in src.read_text().splitlines() if x.strip()]
            dst = workdir / f"{task}.jsonl"
            dst.write_text("".join(json.dumps(r) + "\n" for r in rows))
            names.append(f"{task}_local")
            (workdir / f"{task}_local.yaml").write_text(task_yaml(f"{task}_local", dst))
        elif task == "arc_sample":
            names.append(task)
            (workdir / "arc_sample.yaml").write_text(task_yaml(task, DATA / "arc_sample.jsonl"))
        else:
            names.append(task)  # a stock lm-eval task: its data must be reachable
    for task in data:
        if task not in tasks:
            raise EvalError(f"--data {task}=...: {task} is not among --tasks {','.join(tasks)}")
    return names


def model_args(ep, max_length: int | None) -> dict:
    args = {
        "model": ep.model,
        "base_url": f"{ep.base_url}/completions",
        "tokenizer_backend": "remote",
        "tokenized_requests": True,
        "max_length": max_length or ep.max_len or 2048,
        "num_concurrent": 1,
        "max_retries": 3,
        "timeout": 600,
    }
    if ep.api_key:
        args["auth_token"] = ep.api_key
    return args


def run(
    ep,
    tasks: list[str],
    data: dict[str, str],
    *,
    limit: int | None = None,
    max_length: int | None = None,
    verbose: bool = False,
) -> dict:
    """Run the tasks; returns {task: {acc, acc_norm, acc_stderr, acc_norm_stderr, samples}}."""
    local = all(t in data or t == "arc_sample" for t in tasks)
    if local:  # nothing to fetch from the Hub
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    if not verbose:
        for name in ("lm-eval", "lm_eval", "httpx"):
            logging.getLogger(name).setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="el-lm-") as tmp:
        names = prepare(data, tasks, Path(tmp))
        manager = TaskManager(include_path=tmp, include_defaults=not local)
        try:
            res = simple_evaluate(
                model="local-completions",
                model_args=model_args(ep, max_length),
                tasks=names,
                num_fewshot=0,
                batch_size=1,
                limit=limit,
                task_manager=manager,
                log_samples=False,
                verbosity="INFO" if verbose else "WARNING",
            )
        except (KeyError, ValueError, FileNotFoundError, ConnectionError) as e:
            raise EvalError(f"lm-eval could not run {', '.join(names)}: {e}") from e
    out = {}
    for task, name in zip(tasks, names, strict=True):
        r = res["results"][name]
        n = res.get("n-samples", {}).get(name, {}).get("effective")
        out[task] = {
            "acc": r.get("acc,none"),
            "acc_stderr": r.get("acc_stderr,none"),
            "acc_norm": r.get("acc_norm,none"),
            "acc_norm_stderr": r.get("acc_norm_stderr,none"),
            "samples": n,
            "lm_eval_task": name,
        }
    return out


def table_rows(results: dict) -> list[list]:
    rows = []
    for task, r in results.items():
        title = TITLES.get(task, task)
        for metric, key in (("Normalized accuracy", "acc_norm"), ("Accuracy", "acc")):
            if r.get(key) is not None:
                rows.append([title, metric, f"{100 * r[key]:.2f}", r["samples"], SETTING])
    return rows
