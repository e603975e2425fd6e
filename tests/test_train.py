"""Training: loss goes down, checkpoints load in the engine, resume and 2-process DDP are exact.

Tiny configs on a synthetic repeating token stream, so the whole file runs in well under a
minute on two CPU cores. The shipped-model test runs once the embedded model exists.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from expresslane.config import ModelConfig
from expresslane.train.data import TokenStream, build_corpus
from expresslane.train.trainer import MODEL_PRESETS, TrainConfig, train, wsd_lr

TINY = ModelConfig.from_hf_dict(MODEL_PRESETS["tiny"])
ASSET = Path(__file__).parents[1] / "expresslane" / "assets" / "laneformer-py"


def _stream(seq_len: int = 16) -> TokenStream:
    rng = np.random.default_rng(0)
    phrase = rng.integers(3, TINY.vocab_size, 40)
    return TokenStream(np.tile(phrase, 50).astype(np.uint16), seq_len)


def _cfg(tmp_path: Path, **kw) -> TrainConfig:
    base = dict(
        run_dir=str(tmp_path / "run"),
        seq_len=16,
        micro_batch=4,
        max_steps=6,
        warmup_steps=1,
        lr=1e-2,
        eval_every=100,
        ckpt_every=100,
        autocast="off",
        device="cpu",
        progress=False,
    )
    return TrainConfig(**{**base, **kw})


def _params(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_wsd_schedule_shape():
    cfg = TrainConfig(lr=1.0, warmup_steps=10, decay_frac=0.2)
    lrs = [wsd_lr(s, 100, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == 1.0 and lrs[50] == 1.0
    assert lrs[79] == 1.0 and lrs[80] < 1.0 and lrs[-1] == pytest.approx(0.0)


def test_few_steps_lower_the_loss(tmp_path):
    stream = _stream()
    val = stream.eval_windows(4)
    _, state = train(TINY, stream, _cfg(tmp_path, max_steps=12), val)
    recs = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert recs[-1]["train_loss"] < recs[0]["train_loss"] - 1.0
    assert state["step"] == 12 and state["tokens"] == 12 * 4 * 16


def test_checkpoint_loads_in_engine_with_same_logits(tmp_path):
    from expresslane.cache import KVCache
    from expresslane.checkpoint import load_model

    model, _ = train(TINY, _stream(), _cfg(tmp_path, max_steps=3))
    ckpt = tmp_path / "run" / "checkpoint"
    assert {"config.json", "model.safetensors", "generation_config.json"} <= {
        p.name for p in ckpt.iterdir()
    }
    loaded = load_model(ckpt, device="cpu", dtype="float32", progress=False)
    tokens = torch.randint(0, TINY.vocab_size, (1, 20))
    model.eval()
    with torch.no_grad():
        want = model(tokens)
        got = loaded(tokens, cache=KVCache(loaded.cfg, 32, "cpu", torch.float32))
    assert (got - want).abs().max() <= 1e-5


class _Interrupt:
    """The stream, but the batch of step `stop` raises (a killed job)."""

    def __init__(self, stream, stop):
        self.stream, self.stop = stream, stop

    def batch(self, step, rows, seed):
        if step == self.stop:
            raise KeyboardInterrupt
        return self.stream.batch(step, rows, seed)


def test_resume_continues_from_the_same_step(tmp_path):
    stream = _stream()
    straight, _ = train(TINY, stream, _cfg(tmp_path / "a"))
    cfg = _cfg(tmp_path / "b", ckpt_every=1)
    with pytest.raises(KeyboardInterrupt):
        train(TINY, _Interrupt(stream, 3), cfg)
    state = json.loads((Path(cfg.run_dir) / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == 3
    resumed, state = train(TINY, stream, cfg)
    assert state["step"] == 6
    a, b = _params(straight), _params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, run_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    cfg = TrainConfig(
        run_dir=run_dir,
        seq_len=16,
        micro_batch=2,
        max_steps=4,
        warmup_steps=1,
        lr=1e-3,
        eval_every=100,
        ckpt_every=100,
        autocast="off",
        device="cpu",
        progress=False,
    )
    try:
        train(TINY, _stream(), cfg)
    finally:
        dist.destroy_process_group()


def test_ddp_two_gloo_processes_match_single_process(tmp_path):
    from safetensors.torch import load_file

    single, _ = train(
        TINY, _stream(), _cfg(tmp_path / "single", max_steps=4, micro_batch=4, lr=1e-3)
    )
    run_dir = str(tmp_path / "ddp")
    torch.multiprocessing.spawn(_ddp_worker, args=(2, _free_port(), run_dir), nprocs=2)
    ddp = load_file(str(Path(run_dir) / "checkpoint" / "model.safetensors"))
    want = _params(single)
    worst = max((ddp[k] - want[k]).abs().max().item() for k in want)
    assert worst <= 1e-5, worst
    logs = [
        [json.loads(x)["train_loss"] for x in (Path(d) / "log.jsonl").read_text().splitlines()]
        for d in (tmp_path / "single" / "run", run_dir)
    ]
    assert np.allclose(logs[0], logs[1], rtol=0, atol=1e-5)


def test_corpus_manifest_is_deterministic_and_split_by_file(tmp_path):
    m1 = build_corpus(tmp_path / "a")
    m2 = build_corpus(tmp_path / "b")
    assert m1["manifest_sha256"] == m2["manifest_sha256"]
    files = m1["files"]
    assert m1["train_files"] > 100 and m1["val_files"] > 5
    assert len({f["sha256"] for f in files}) == len(files)  # deduplicated
    assert [(f["source"], f["path"]) for f in files] == sorted(
        (f["source"], f["path"]) for f in files
    )
    assert not any("/test/" in f"/{f['path']}" for f in files)
    assert m1["python_version"] and (tmp_path / "a" / "manifest.json").is_file()


@pytest.mark.skipif(
    not (ASSET / "model.safetensors").is_file(),
    reason="the embedded model has not been trained yet",
)
def test_shipped_model_loads_generates_and_matches_readme():
    from expresslane.engine import Engine
    from expresslane.sampling.params import SamplingParams
    from expresslane.tokenizer import Tokenizer

    names = {p.name for p in ASSET.iterdir()}
    readme = (ASSET / "README.md").read_text()
    assert all(f"`{n}`" in readme for n in names - {"README.md"})  # the README lists every file
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "TRAINING.md",
        "data-manifest.json",
        "README.md",
    } <= names
    assert sum(p.stat().st_size for p in ASSET.iterdir()) <= 25 * 2**20
    engine = Engine.from_pretrained(str(ASSET), device="cpu", progress=False)
    cfg = engine.cfg
    assert cfg.num_lanes == 8 and cfg.broadcast_delay == 2 and cfg.lm_head_type == "vocab_parallel"
    assert cfg.num_kv_heads // cfg.num_lanes == 2 and cfg.num_heads > cfg.num_kv_heads
    assert {"sliding_attention", "full_attention"} == set(cfg.layer_types)
    assert cfg.vocab_size % cfg.num_lanes == 0
    tok = Tokenizer.from_dir(ASSET)
    out = list(
        engine.generate(tok.encode("def add(a, b):"), SamplingParams(max_tokens=8, ignore_eos=True))
    )
    assert len(out) == 8
