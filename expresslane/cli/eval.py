"""`expresslane eval code|lm|ruler`: the model card's evaluations, against the OpenAI API.

Each suite talks to a running server (`--base-url http://HOST:PORT/v1`) or loads MODEL (default:
the embedded model) and serves it in-process on a free loopback port. Results print as a table
shaped like the card's; `--json` prints one JSON object instead. Files go to --output-dir.

  expresslane eval code [MODEL] --dataset humaneval --limit 20
  expresslane eval code --base-url URL --dataset humaneval+ --dataset-file humaneval+=FILE
  expresslane eval lm [MODEL] --tasks arc_easy,arc_challenge --data arc_easy=ARC-Easy.jsonl
  expresslane eval ruler [MODEL] --lengths 2048 4096 --limit 50
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
from pathlib import Path

from ..evals import EvalError, format_table, open_endpoint, write_json, write_jsonl

HELP = "evaluate a model through the OpenAI API: code (HumanEval/EvalPlus), lm (ARC), ruler"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="checkpoint folder to serve in-process (default: the embedded model); "
        "with --base-url, only its tokenizer is used",
    )
    p.add_argument(
        "--base-url", default=None, help="a running server, e.g. http://127.0.0.1:8000/v1"
    )
    p.add_argument("--api-key", default=os.environ.get("EXPRESSLANE_API_KEY"))
    p.add_argument(
        "--model-name",
        default=None,
        help="model name sent in requests (default: the server's first model)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--limit", type=int, default=None, help="first N tasks (samples) only")
    p.add_argument(
        "--output-dir",
        default=None,
        help="where results go (default: expresslane-evals/SUITE-MODEL-TIME)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object, no table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="suite", required=True, metavar="{code,lm,ruler}")
    code = sub.add_parser("code", help="HumanEval / HumanEval+ / MBPP+ pass@1, sandboxed")
    _common(code)
    code.add_argument(
        "--dataset",
        action="append",
        default=None,
        help="humaneval (bundled), humaneval+ or mbpp+ (EvalPlus release files); "
        "repeatable or comma-separated (default: humaneval)",
    )
    code.add_argument(
        "--dataset-file",
        action="append",
        default=[],
        help="NAME=PATH (or PATH with one --dataset): a dataset's JSONL(.gz) file",
    )
    code.add_argument("--max-tokens", type=int, default=768, help="as EvalPlus (768)")
    code.add_argument("--timeout", type=float, default=10.0, help="seconds per sample run")
    code.add_argument("--memory-mb", type=int, default=2048, help="address-space limit")
    code.add_argument("--jobs", type=int, default=1, help="sandbox runs in parallel")
    code.add_argument(
        "--no-prompt-imports",
        action="store_true",
        help="do not prepend the task prompt's import lines (stock EvalPlus)",
    )
    lm = sub.add_parser("lm", help="lm-eval local-completions (ARC) against the server")
    _common(lm)
    lm.add_argument(
        "--tasks",
        default=None,
        help="comma-separated lm-eval tasks (default: those of --data/--arc-dir, else "
        "arc_easy,arc_challenge if the HF cache holds them, else the bundled arc_sample)",
    )
    lm.add_argument(
        "--data",
        action="append",
        default=[],
        help="TASK=FILE: local ARC JSONL for arc_easy / arc_challenge",
    )
    lm.add_argument("--arc-dir", help="folder holding AI2's ARC-Easy/Challenge-Test.jsonl")
    lm.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="lm-eval max_length (default: the model's context)",
    )
    lm.add_argument("--verbose", action="store_true", help="lm-eval's own logging")
    ruler = sub.add_parser("ruler", help="RULER-style synthetic long-context tasks")
    _common(ruler)
    ruler.add_argument("--tasks", default="all", help="comma-separated, or all")
    ruler.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=None,
        help="target lengths in tokens (default: 2048 4096, those that fit)",
    )
    ruler.add_argument("--seed", type=int, default=0)


def _out_dir(args: argparse.Namespace, label: str) -> Path:
    if args.output_dir:
        return Path(args.output_dir)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("expresslane-evals") / f"{args.suite}-{label}-{stamp}"


def _meta(args: argparse.Namespace, ep) -> dict:
    from .. import __version__

    return {
        "suite": args.suite,
        "model": ep.model,
        "model_path": args.model,
        "base_url": args.base_url or "in-process",
        "context": ep.max_len,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} {platform.processor()}".strip(),
        "expresslane": __version__,
    }


def _split(values: list[str] | None) -> list[str]:
    return [v.strip() for x in values or [] for v in x.split(",") if v.strip()]


def _code_datasets(args) -> dict[str, Path]:
    """--dataset and --dataset-file -> {name: data file}, checked before any model loads."""
    from ..evals import code

    names = []
    for d in _split(args.dataset) or ["humaneval"]:
        if d.lower() not in code.NAMES:
            raise EvalError(f"--dataset {d}: expected one of humaneval, humaneval+, mbpp+")
        names.append(code.NAMES[d.lower()])
    files = {}
    for item in args.dataset_file:
        name, sep, path = item.partition("=")
        if not sep and len(names) == 1:
            name, path = names[0], item
        if code.NAMES.get(name.lower()) not in names:
            raise EvalError(f"--dataset-file {item}: expected NAME=PATH with NAME in --dataset")
        files[code.NAMES[name.lower()]] = path
    paths = {n: code.dataset_path(n, files.get(n)) for n in names}
    for n, path in paths.items():
        if not path.is_file():
            raise EvalError(f"{code.TITLES[n]} data file {path}: no such file")
    return paths


def _code(args, ep, out: Path) -> tuple[dict, str]:
    from ..evals import code, sandbox

    limits = sandbox.Limits(args.timeout, args.memory_mb)
    summaries = [
        code.run_dataset(
            ep,
            n,
            path,
            limit=args.limit,
            max_tokens=args.max_tokens,
            limits=limits,
            out_dir=out,
            jobs=args.jobs,
            progress=not args.no_progress,
            prompt_imports=not args.no_prompt_imports,
        )
        for n, path in args.datasets.items()
    ]
    result = {
        "datasets": summaries,
        "decoding": {"temperature": 0.0, "top_p": 0.95, "max_tokens": args.max_tokens, "n": 1},
        "postprocessing": {
            "selection": "target_function (expresslane.evals.blocks)",
            "prompt_imports": not args.no_prompt_imports,
        },
        "sandbox": {**sandbox.isolation(), **limits.__dict__},
    }
    headers = ["Benchmark", "Metric", "Value", "Samples", "Decoding", "Scoring", "Postprocessing"]
    return result, format_table(headers, code.table_rows(summaries))


def _lm(args, ep, out: Path) -> tuple[dict, str]:
    from ..evals import lm

    data = {}
    for item in args.data:
        task, sep, path = item.partition("=")
        if not sep:
            raise EvalError(f"--data {item}: expected TASK=FILE, e.g. arc_easy=ARC-Easy.jsonl")
        data[task] = path
    if args.arc_dir:
        data = {**lm.find_arc_files(args.arc_dir), **data}
    tasks = _split([args.tasks]) if args.tasks else list(data)
    if not tasks and lm.hub_arc_cached():  # the real ARC, from the local HF cache
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
        tasks = ["arc_easy", "arc_challenge"]
    tasks = tasks or ["arc_sample"]
    results = lm.run(
        ep, tasks, data, limit=args.limit, max_length=args.max_length, verbose=args.verbose
    )
    headers = ["Benchmark", "Metric", "Value", "Samples", "Setting"]
    return {"tasks": results, "model_args": lm.model_args(ep, args.max_length)}, format_table(
        headers, lm.table_rows(results)
    )


def _ruler(args, ep, out: Path) -> tuple[dict, str]:
    from ..evals import ruler

    tasks = ruler.TASKS if args.tasks == "all" else _split([args.tasks])
    bad = [t for t in tasks if t not in ruler.TASKS]
    if bad:
        raise EvalError(f"--tasks {bad[0]}: expected all or some of {', '.join(ruler.TASKS)}")
    lengths = args.lengths or [n for n in (2048, 4096) if not ep.max_len or n <= ep.max_len]
    if not lengths:
        lengths = [ep.max_len]
    limit = 500 if args.limit is None else args.limit
    results, rows = ruler.run(
        ep, tasks, lengths, limit=limit, seed=args.seed, progress=not args.no_progress
    )
    write_jsonl(out / "ruler.samples.jsonl", rows)
    headers, table_rows = ruler.table(results, lengths)
    return {
        "tasks": results,
        "lengths": lengths,
        "samples_per_task": limit,
        "seed": args.seed,
        "decoding": {"temperature": 0.0},
    }, format_table(headers, table_rows)


def main(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise EvalError(f"--limit {args.limit}: must be at least 1")
    run = {"code": _code, "lm": _lm, "ruler": _ruler}[args.suite]
    if args.suite == "code":
        args.datasets = _code_datasets(args)
    with open_endpoint(
        args.base_url,
        args.model,
        api_key=args.api_key,
        model_name=args.model_name,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
    ) as ep:
        out = _out_dir(args, ep.model.replace("/", "--"))
        result, table = run(args, ep, out)
        result = {**_meta(args, ep), **result, "output_dir": str(out)}
    write_json(out / "summary.json", result)
    if args.json:
        print(json.dumps(result))
    else:
        print(table)
        print(f"\nresults: {out / 'summary.json'}")
    return 0
