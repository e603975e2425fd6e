"""Training loop: TrainConfig, warmup-stable-decay schedule, eval, checkpoints, resume, DDP.

The model is the engine's own `Laneformer` called with no cache (`model(tokens)` -> logits), so a
checkpoint written here (config.json + model.safetensors + tokenizer + generation_config.json)
loads in the engine unchanged. Batches are a pure function of (seed, step): a resumed run and a
`torchrun` data-parallel run see the same global batches as one uninterrupted process. Each rank
takes its rows of the global batch and scales its loss so that DDP's gradient mean equals the
single-process gradient of the global batch's mean token loss.

The schedule is WSD: linear warmup, constant, then linear decay over the last `decay_frac` of
the steps. With a time budget the total step count is fixed when the decay starts, from the
measured step time, so training ends on time with a fully decayed learning rate.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from ..checkpoint import resolve_device, save_model
from ..config import ModelConfig
from ..model import Laneformer, init_weights
from ..step.threads import cpu_info
from .data import IGNORE

# The embedded model: every feature of the 2B (8 lanes, delay 2, GQA with 2 KV heads per lane,
# sliding-window then full-attention layers, vocab-parallel head) at a size that trains on 2 CPU
# cores in under an hour. The ablation model is smaller still (laneformer.md 5.3 variants differ
# only in broadcast_delay / use_comm / replicated_rmsn_scale).
_COMMON = {
    "model_type": "laneformer",
    "num_lanes": 8,
    "lm_head_type": "vocab_parallel",
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
MODEL_PRESETS = {
    "embedded": {**_COMMON, "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
                 "num_hidden_layers": 6, "num_attention_heads": 32, "num_key_value_heads": 16,
                 "broadcast_delay": 2, "sliding_window": 128, "sliding_window_n_layers": 3},
    "ablation": {**_COMMON, "vocab_size": 4096, "hidden_size": 128, "intermediate_size": 256,
                 "num_hidden_layers": 6, "num_attention_heads": 16, "num_key_value_heads": 8,
                 "broadcast_delay": 2},
    "tiny": {**_COMMON, "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64,  # tests
             "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4,
             "num_lanes": 2, "broadcast_delay": 1, "sliding_window": 8,
             "sliding_window_n_layers": 1, "max_position_embeddings": 128},
}  # fmt: skip


@dataclass
class TrainConfig:
    run_dir: str = "runs/embedded"  # checkpoint/, log.jsonl
    seq_len: int = 256
    micro_batch: int = 8  # rows per forward on each rank
    grad_accum: int = 1  # global batch = micro_batch * grad_accum * world size
    max_steps: int = 1000
    time_budget_min: float | None = None  # end earlier, with a full decay, to fit this budget
    warmup_steps: int = 50
    decay_frac: float = 0.2
    lr: float = 3e-3
    min_lr_frac: float = 0.0
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_windows: int = 32
    ckpt_every: int = 200
    autocast: str = "auto"  # auto: bf16 where the device has it natively; on; off
    device: str = "auto"
    seed: int = 0
    resume: bool = True
    progress: bool = True
    extra: dict = field(default_factory=dict)  # copied into trainer_state.json (provenance)

    @property
    def ckpt_dir(self) -> Path:
        return Path(self.run_dir) / "checkpoint"


# --- schedule ----------------------------------------------------------------------------------
def wsd_lr(step: int, total: int, cfg: TrainConfig, decay_start: int | None = None) -> float:
    """Learning rate at `step` (0-based) of `total`; decay from decay_start (default: by frac)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    start = decay_start if decay_start is not None else int(total * (1 - cfg.decay_frac))
    if step < start:
        return cfg.lr
    frac = (step - start + 1) / max(1, total - start)
    return cfg.lr * (1 - (1 - cfg.min_lr_frac) * min(1.0, frac))


# --- distributed -------------------------------------------------------------------------------
def dist_info() -> tuple[int, int]:
    """(rank, world size), starting the process group when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def use_autocast(mode: str, device: torch.device) -> bool:
    if mode in ("on", "off"):
        return mode == "on"
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    flags = cpu_info("flags").split()  # bf16 autocast on a CPU pays off only with bf16 dots
    return "avx512_bf16" in flags or "amx_bf16" in flags


# --- loss and eval -----------------------------------------------------------------------------
def token_losses(model, x: torch.Tensor, y: torch.Tensor, autocast: bool) -> torch.Tensor:
    """Per-position cross-entropy in nats, (B, S); 0 where y == IGNORE."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(x)
    return F.cross_entropy(
        logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="none"
    ).view_as(y)


@torch.no_grad()
def evaluate(model, windows, nbytes: torch.Tensor | None, autocast: bool, rows: int = 8) -> dict:
    """Mean validation loss (nats/token) and bits per byte over fixed windows."""
    was = model.training
    model.eval()
    x_all, y_all = windows
    dev = next(model.parameters()).device
    nats, count, nb = 0.0, 0, 0
    for i in range(0, len(x_all), rows):
        x, y = x_all[i : i + rows].to(dev), y_all[i : i + rows].to(dev)
        loss = token_losses(model, x, y, autocast)
        nats += loss.sum().item()
        count += int((y != IGNORE).sum())
        if nbytes is not None:
            nb += int(nbytes[y.clamp(min=0).cpu()].masked_fill(y.cpu() == IGNORE, 0).sum())
    model.train(was)
    out = {"val_loss": nats / max(1, count)}
    if nbytes is not None and nb:
        out["val_bpb"] = nats / math.log(2) / nb
    return out


# --- checkpoints -------------------------------------------------------------------------------
def save_checkpoint(
    model: Laneformer,
    opt: torch.optim.Optimizer,
    state: dict,
    ckpt: Path,
    tokenizer_dir: Path | None,
) -> None:
    """fp32 weights + optimizer moments + state; written beside, then swapped in."""
    tmp = ckpt.with_name(ckpt.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    export(model, tmp, tokenizer_dir, dtype="float32")
    names = {id(p): n for n, p in model.named_parameters()}
    moments = {}
    for group in opt.param_groups:
        for p in group["params"]:
            for k, v in opt.state.get(p, {}).items():
                moments[f"{names[id(p)]}::{k}"] = (
                    v.detach().float().reshape(-1).cpu()
                    if k == "step"
                    else v.detach().cpu().contiguous()
                )
    save_file(moments, str(tmp / "optimizer.safetensors"))
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1) + "\n")
    old = ckpt.with_name(ckpt.name + ".old")
    if ckpt.exists():
        ckpt.rename(old)
    tmp.rename(ckpt)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(model: Laneformer, opt: torch.optim.Optimizer, ckpt: Path) -> dict:
    """Restore weights and optimizer moments in place; return the trainer state."""
    dev = next(model.parameters()).device
    weights = load_file(str(ckpt / "model.safetensors"))
    model.load_state_dict({k: v.to(dev) for k, v in weights.items()}, strict=True)
    moments = load_file(str(ckpt / "optimizer.safetensors"))
    for n, p in model.named_parameters():
        st = {k.split("::")[1]: v for k, v in moments.items() if k.split("::")[0] == n}
        if st:
            st["step"] = st["step"].reshape(())
            opt.state[p] = {k: v.to(dev) if k != "step" else v for k, v in st.items()}
    return json.loads((ckpt / "trainer_state.json").read_text())


def export(
    model: Laneformer, out: Path, tokenizer_dir: Path | None, dtype: str = "bfloat16"
) -> Path:
    """An engine-loadable folder: config, weights, tokenizer files, generation_config.json."""
    save_model(model, out, dtype=dtype)
    cfg = model.cfg
    gen = {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids)[0],
        "do_sample": False,
        "max_new_tokens": 256,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer_dir is not None:
        for f in sorted(Path(tokenizer_dir).iterdir()):
            if f.is_file() and f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, out / f.name)
    return out


# --- the loop ----------------------------------------------------------------------------------
def build_model(model_cfg: ModelConfig, seed: int, device: torch.device) -> Laneformer:
    model = init_weights(Laneformer(model_cfg), seed=seed)
    # Residual-branch outputs start small (GPT-2 style) so that deep lane stacks train stably.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("wo.weight", "w2.weight")):
                p.mul_(1 / math.sqrt(2 * model_cfg.num_layers))
            elif "tok_embeddings" in name:
                p.mul_(0.5)
    return model.to(device)


def train(
    model_cfg: ModelConfig,
    data,
    cfg: TrainConfig,
    val_windows=None,
    nbytes: torch.Tensor | None = None,
    tokenizer_dir: Path | None = None,
    init_from: Laneformer | None = None,
) -> tuple[Laneformer, dict]:
    """Train on `data` (anything with .batch(step, rows, seed) -> (x, y)); return model, summary.

    Resumes from cfg.ckpt_dir when it holds a checkpoint and cfg.resume is set.
    """
    rank, world = dist_info()
    device = resolve_device(cfg.device)
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    amp = use_autocast(cfg.autocast, device)
    model = build_model(model_cfg, cfg.seed, device)
    if init_from is not None:
        model.load_state_dict(init_from.state_dict())
    model.train()
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in n else decay).append(p)
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=cfg.betas,
        fused=False,
        foreach=False,
    )
    state = {
        "step": 0,
        "tokens": 0,
        "elapsed_s": 0.0,
        "total_steps": cfg.max_steps,
        "decay_start": None,
        "config": {**asdict(cfg), "world_size": world},
    }
    if cfg.resume and (cfg.ckpt_dir / "trainer_state.json").is_file():
        state = load_checkpoint(model, opt, cfg.ckpt_dir)
        if rank == 0:
            print(f"resumed from {cfg.ckpt_dir} at step {state['step']}", file=sys.stderr)
    ddp = model
    if world > 1:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    log = Path(cfg.run_dir) / "log.jsonl"
    if rank == 0:
        log.parent.mkdir(parents=True, exist_ok=True)
    rows = cfg.micro_batch * cfg.grad_accum * world
    bar = tqdm(
        total=state["total_steps"],
        initial=state["step"],
        desc="train",
        unit="step",
        file=sys.stderr,
        disable=rank != 0 or not cfg.progress,
        dynamic_ncols=True,
    )
    t_start, t_last = time.time() - state["elapsed_s"], time.time()
    recent: list[float] = []
    while state["step"] < state["total_steps"]:
        step = state["step"]
        lr = wsd_lr(step, state["total_steps"], cfg, state["decay_start"])
        for g in opt.param_groups:
            g["lr"] = lr
        x_all, y_all = data.batch(step, rows, cfg.seed)
        n_valid = int((y_all != IGNORE).sum())
        loss_sum = torch.zeros((), device=device)
        for k in range(cfg.grad_accum):
            lo = (rank * cfg.grad_accum + k) * cfg.micro_batch
            x = x_all[lo : lo + cfg.micro_batch].to(device)
            y = y_all[lo : lo + cfg.micro_batch].to(device)
            sync = k == cfg.grad_accum - 1 or world == 1
            ctx = ddp.no_sync() if not sync else _null()
            with ctx:
                s = token_losses(ddp, x, y, amp).sum()
                (s * world / max(1, n_valid)).backward()
            loss_sum += s.detach()
        if world > 1:
            dist.all_reduce(loss_sum)
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] += 1
        state["tokens"] += n_valid
        now = time.time()
        recent = (recent + [now - t_last])[-20:]
        t_last = now
        state["elapsed_s"] = now - t_start
        _fit_budget(state, cfg, recent, bar)
        train_loss = loss_sum.item() / max(1, n_valid)
        rec = {
            "step": state["step"],
            "tokens": state["tokens"],
            "lr": lr,
            "train_loss": train_loss,
            "grad_norm": float(gnorm),
            "elapsed_s": round(state["elapsed_s"], 2),
        }
        last = state["step"] >= state["total_steps"]
        if val_windows is not None and (state["step"] % cfg.eval_every == 0 or last):
            rec.update(evaluate(model, val_windows, nbytes, amp))
        if rank == 0:
            with log.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            bar.update(1)
            bar.set_postfix(
                loss=f"{train_loss:.3f}",
                lr=f"{lr:.2e}",
                tok_s=f"{state['tokens'] / max(1e-9, state['elapsed_s']):.0f}",
                **({"val": f"{rec['val_loss']:.3f}"} if "val_loss" in rec else {}),
            )
        if state["step"] % cfg.ckpt_every == 0 or last:
            state["last"] = rec
            if rank == 0:
                save_checkpoint(model, opt, state, cfg.ckpt_dir, tokenizer_dir)
            if world > 1:
                dist.barrier()
    bar.close()
    return model, state


def _fit_budget(state: dict, cfg: TrainConfig, recent: list[float], bar) -> None:
    """With a time budget, fix the total step count when the decay phase begins (rank 0 rules)."""
    if cfg.time_budget_min is None or state["decay_start"] is not None:
        return
    budget = cfg.time_budget_min * 60
    if state["elapsed_s"] >= (1 - cfg.decay_frac) * budget or state["step"] >= int(
        state["total_steps"] * (1 - cfg.decay_frac)
    ):
        per_step = sorted(recent)[len(recent) // 2]
        left = max(1, int((budget - state["elapsed_s"]) / per_step))
        decision = [
            state["step"],
            max(state["step"] + 1, min(state["total_steps"], state["step"] + left)),
        ]
    else:
        decision = [-1, state["total_steps"]]
    if dist.is_initialized():  # every rank must switch and stop at the same step
        t = torch.tensor(decision)
        dist.broadcast(t, 0)
        decision = t.tolist()
    if decision[0] >= 0:
        state["decay_start"], state["total_steps"] = decision
        bar.total = state["total_steps"]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
