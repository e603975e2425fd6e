"""`expresslane train`: corpus -> tokenizer -> pretraining -> chat tuning -> a model folder.

Every TrainConfig field is a flag (--seq-len, --lr, --time-budget-min, ...). The corpus, the
tokenizer and the token streams are cached under --data-dir; the run's checkpoint and log.jsonl
under --run-dir, from which an interrupted command resumes. --out receives the engine-loadable
folder in bf16 with TRAINING.md and the data manifest. Data parallel:
`torchrun --nproc-per-node 2 -m expresslane train ...` (gloo on CPU, nccl on GPUs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import ConfigError

HELP = "train a Laneformer on Python source (the embedded model, the DTP ablation, your own)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..train.trainer import MODEL_PRESETS, TrainConfig

    p.add_argument(
        "--preset",
        default="embedded",
        choices=sorted(MODEL_PRESETS),
        help="model shape (see trainer.MODEL_PRESETS)",
    )
    p.add_argument("--model-config", help="a config.json to train instead of a preset")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config.json field (JSON value), e.g. --set use_comm=false",
    )
    p.add_argument("--data-dir", default="runs/corpus", help="corpus, tokenizer, token cache")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument(
        "--extra-package",
        action="append",
        default=[],
        help="an installed, permissively licensed PyPI package to add to the corpus",
    )
    p.add_argument("--sft-steps", type=int, default=0, help="chat-tuning steps after pretraining")
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("--out", help="write the final model here (bf16), with TRAINING.md")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    for f in dataclasses.fields(TrainConfig):
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.name == "betas":
            p.add_argument(flag, type=float, nargs=2, default=f.default)
        else:
            kind = {"int": int, "float": float, "str": str, "float | None": float}[f.type]
            p.add_argument(flag, type=kind, default=f.default)


def model_config(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    from ..train.trainer import MODEL_PRESETS

    if args.model_config:
        try:
            raw = json.loads(Path(args.model_config).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"--model-config {args.model_config}: {e}") from None
    else:
        raw = dict(MODEL_PRESETS[args.preset])
    raw["vocab_size"] = vocab_size
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        try:
            raw[key] = json.loads(value)
        except json.JSONDecodeError:
            raw[key] = value
    return ModelConfig.from_hf_dict(raw)


def main(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from ..tokenizer import Tokenizer
    from ..train import data, sft
    from ..train.trainer import TrainConfig, dist_info, export, train

    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    cfg = TrainConfig(
        **{
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(TrainConfig)
            if f.name != "extra"
        }
    )
    cfg.betas = tuple(cfg.betas)
    rank, world = dist_info()
    prep_args = (args.data_dir, args.vocab_size, 8, args.val_fraction, tuple(args.extra_package))
    if rank == 0:
        prep = data.prepare(*prep_args)
    if world > 1:
        dist.barrier()
    if rank != 0:
        prep = data.prepare(*prep_args)
    tok = Tokenizer.from_dir(prep.tokenizer_dir)
    mcfg = model_config(args, tok.vocab_size)
    nbytes = torch.from_numpy(prep.nbytes)
    val = data.TokenStream(prep.val, cfg.seq_len).eval_windows(cfg.eval_windows)
    cfg.extra = {"manifest_sha256": prep.manifest["manifest_sha256"]}
    model, state = train(
        mcfg, data.TokenStream(prep.train, cfg.seq_len), cfg, val, nbytes, prep.tokenizer_dir
    )
    summary = {"pretrain": _phase_summary(state)}
    if args.sft_steps:
        pairs = sft.mine_pairs(
            data.corpus_texts(prep.manifest, "train"),
            seed=cfg.seed,
            limit=4 * args.sft_steps * cfg.micro_batch * world,
        )
        examples = sft.encode_pairs(pairs, tok, cfg.seq_len)
        scfg = dataclasses.replace(
            cfg,
            run_dir=str(Path(cfg.run_dir) / "sft"),
            lr=args.sft_lr,
            max_steps=args.sft_steps,
            time_budget_min=None,
            warmup_steps=min(10, args.sft_steps),
            decay_frac=0.5,
            eval_every=args.sft_steps,
            ckpt_every=args.sft_steps,
        )
        model, sstate = train(
            mcfg, examples, scfg, val, nbytes, prep.tokenizer_dir, init_from=model
        )
        summary["sft"] = {**_phase_summary(sstate), "pairs": len(examples.inputs)}
    summary["wall_s"] = round(time.time() - t0, 1)
    summary["train_s"] = sum(v["elapsed_s"] for v in summary.values() if isinstance(v, dict))
    if rank == 0:
        print(json.dumps(summary), file=sys.stderr)
        if args.out:
            out = export(model, Path(args.out), prep.tokenizer_dir, dtype="bfloat16")
            write_training_md(out, args, summary, prep.manifest)
            print(f"wrote {out}", file=sys.stderr)
    return 0


def _phase_summary(state: dict) -> dict:
    last = state.get("last", {})
    return {
        "steps": state["step"],
        "tokens": state["tokens"],
        "elapsed_s": round(state["elapsed_s"], 1),
        "val_loss": last.get("val_loss"),
        "val_bpb": last.get("val_bpb"),
        "train_loss": last.get("train_loss"),
    }


def write_training_md(out: Path, args: argparse.Namespace, summary: dict, manifest: dict) -> None:
    """TRAINING.md (how the folder was made) and data-manifest.json (what it was trained on)."""
    files = [{k: f[k] for k in ("source", "path", "sha256", "split")} for f in manifest["files"]]
    compact = {k: v for k, v in manifest.items() if k != "files"} | {"files": files}
    (out / "data-manifest.json").write_text(json.dumps(compact, separators=(",", ":")) + "\n")
    cmd = "python -m expresslane " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    pre, s = summary["pretrain"], summary.get("sft")
    lines = [
        "# How this model was trained",
        "",
        f"Command (from the repository root): `{cmd}`",
        "",
        f"- Data: Python {manifest['python_version']} standard library (PSF-2.0), "
        f"{manifest['train_files']} train / {manifest['val_files']} validation files, "
        f"manifest sha256 `{manifest['manifest_sha256']}` (data-manifest.json lists every file).",
        f"- Pretraining: {pre['steps']} steps, {pre['tokens']:,} tokens, "
        f"{pre['elapsed_s'] / 60:.1f} min; validation loss {pre['val_loss']:.4f} nats/token, "
        f"{pre['val_bpb']:.4f} bits per byte.",
    ]
    if s:
        lines.append(
            f"- Chat tuning: {s['steps']} steps on {s['pairs']:,} docstring/signature -> "
            f"function pairs, {s['tokens']:,} answer tokens; validation (raw source) "
            f"loss after it {s['val_loss']:.4f}, {s['val_bpb']:.4f} bits per byte."
        )
    lines += [
        f"- Wall time: {summary['train_s'] / 60:.1f} min in the training loops (all "
        f"invocations, if resumed); this invocation took {summary['wall_s'] / 60:.1f} min.",
        "- Weights: bfloat16 (trained in fp32 with bf16 autocast where supported).",
        "",
    ]
    (out / "TRAINING.md").write_text("\n".join(lines))
