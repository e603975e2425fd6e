"""Lanes over 2 and 4 gloo processes give one process's tokens and logits (laneformer.md 8).

Each spawned group of ranks runs every case at once (starting processes is the slow part):
Laneformers with delays 1 and 2, shared and per-lane norms, each head type, variants A and B,
use_early_comm off, and a Llama checkpoint (GQA, tied head) under tensor parallelism; 4 ranks
run a covering subset (4 processes on a shared 2-core CPU pay ~8 ms per collective). For each:
gathered logits equal the one-process model's within fp32 tolerance, 64 greedy tokens and 64
seeded temperature-sampled tokens equal the one-process Engine's, each rank loads exactly its
slices' bytes, and consuming DTP messages one layer early is caught by the logits comparison.
The 2-rank group also runs `expresslane run` as torchrun ranks (rank 0 alone prints), a serve-
like lead with a follower (a closed stream and a cancel both stop the follower in step), and the
Llama case with a LoRA adapter merged in each rank's slices (the one-process merge's logits and
tokens). Prefix reuse on 2 ranks (rings with DTP delay 2, and Llama): agent turns equal a cold
one-process engine's, and a rank that lost its cache makes every rank start from 0.
`expresslane bench --devices 2` on a preset decodes the single-device bench's tokens; a bad
--devices is one line and exit code 2 before any process starts."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest
import torch

from expresslane.__main__ import main
from expresslane.checkpoint import load_model, save_model
from expresslane.cli.run import main as run_main
from expresslane.config import ModelConfig
from expresslane.engine import Engine
from expresslane.model import Laneformer, init_weights
from expresslane.parallel import ParallelEngine, load_shard
from expresslane.parallel.exchange import gather_vocab
from expresslane.parallel.launch import _lead_entry, load_lead_engine, spawn
from expresslane.sampling.params import SamplingParams
from expresslane.tokenizer import Tokenizer

BASE = dict(
    model_type="laneformer",
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,  # d=1: layer 1's messages are consumed at layer 2
    num_attention_heads=8,
    num_key_value_heads=4,
    num_lanes=4,
    max_position_embeddings=128,
    eos_token_id=2,
    sliding_window=8,
    sliding_window_n_layers=2,
)
CASES = {
    "d1-shared-replicate": dict(broadcast_delay=1, lm_head_type="replicate"),
    # d=2 needs 5 layers for a real message: layer 2's, consumed at layer 4 (0, 1 are present)
    "d2-perlane-lane": dict(
        broadcast_delay=2, replicated_rmsn_scale=False, lm_head_type="lane", num_hidden_layers=5
    ),
    "d2-shared-vocab": dict(broadcast_delay=2, lm_head_type="vocab_parallel", num_hidden_layers=5),
    "d1-perlane-vocab-B": dict(
        broadcast_delay=1,
        replicated_rmsn_scale=False,
        lm_head_type="vocab_parallel",
        dtp_variant="B",
    ),  # fmt: skip
    "d2-noearly-prenorm": dict(
        broadcast_delay=2,
        use_early_comm=False,
        lm_head_type="replicate",
        pre_norm_lane_agg=True,
        num_hidden_layers=5,
    ),
    "llama": dict(
        model_type="llama",
        num_lanes=1,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        sliding_window=None,
        attention_bias=False,
    ),
}
PROMPT = [1, 17, 40, 5, 88, 23, 9, 61]
GREEDY = SamplingParams(max_tokens=64, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.8, seed=11)
FILTERED = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=5, top_k=9)
LOGITS_TOL = 1e-4
RUN_VOCAB = 320  # the tokenizer trainer needs > 259 entries
# 4 processes on a shared 2-core CPU pay ~8 ms per collective: run a covering subset there
# (delays 1 and 2, both norm kinds, each head type, Llama) and sample on one of them.
AT_4 = ("d1-shared-replicate", "d2-perlane-lane", "d1-perlane-vocab-B", "llama")
SAMPLED_AT_4 = ("d1-perlane-vocab-B",)
REUSE_CASES = ("d2-shared-vocab", "llama")  # rings of 8 slots with DTP delay 2; full attention
TURN = replace(GREEDY, max_tokens=12)


def expected_bytes(cfg: ModelConfig, world: int, itemsize: int = 4) -> tuple[int, int]:
    """(replicated bytes, per-rank share of the split bytes) a rank loads (laneformer.md 8.1)."""
    D, V, L = cfg.hidden_size, cfg.vocab_size, cfg.num_lanes
    rep = V * D  # embedding
    split = 0
    per_layer = 2 * cfg.q_dim * D + 2 * cfg.kv_dim * D + 3 * cfg.intermediate_size * D
    if cfg.attention_bias:
        per_layer += cfg.q_dim + 2 * cfg.kv_dim
    split += cfg.num_layers * per_layer
    norms = 2 * cfg.num_layers + 1
    if cfg.per_lane_norms:
        split += (2 * cfg.num_layers) * L * D + (0 if cfg.final_norm_shared else L * D)
        rep += D if cfg.final_norm_shared else 0
    else:
        rep += norms * D
    if cfg.lm_head_type == "lane":
        split += V * L * D
    elif not cfg.tie_word_embeddings:
        split += V * D
    return rep * itemsize, split * itemsize // world


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny or shared-core work


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (folder, one-process reference results)."""
    out = {}
    for i, (name, extra) in enumerate(CASES.items()):
        cfg = ModelConfig.from_hf_dict({**BASE, **extra})
        model = init_weights(Laneformer(cfg), seed=i, norm_noise=0.2)
        path = tmp_path_factory.mktemp(name)
        save_model(model, path)
        ref = load_model(path, device="cpu", progress=False)
        engine = Engine(ref, max_model_len=96, prefill_chunk=5)
        with torch.no_grad():
            logits = ref(torch.tensor([PROMPT]))[0]
        out[name] = (
            str(path),
            dict(
                logits=logits,
                greedy=list(engine.generate(PROMPT, GREEDY)),
                sampled=list(engine.generate(PROMPT, SAMPLED)),
                filtered=list(engine.generate(PROMPT, FILTERED)),
            ),
        )
    return out


@pytest.fixture(scope="module")
def run_checkpoint(tmp_path_factory):
    """A Laneformer with a tokenizer (for run and lead/follow), and one-process references."""
    from expresslane.train.tokenizer_train import train_tiny_tokenizer

    path = tmp_path_factory.mktemp("run")
    cfg = ModelConfig.from_hf_dict({**BASE, **CASES["d2-shared-vocab"], "vocab_size": RUN_VOCAB})
    save_model(init_weights(Laneformer(cfg), seed=3), path)
    train_tiny_tokenizer(path, vocab_size=RUN_VOCAB)
    model = load_model(path, device="cpu", progress=False)
    engine = Engine(model, max_model_len=64)
    prompt = Tokenizer.from_dir(path).encode("ab")
    with torch.no_grad():
        scores = model(torch.tensor([PROMPT]))[0].argmax(-1).tolist()
    return str(path), dict(
        run=list(engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))),
        greedy=list(engine.generate(PROMPT, replace(GREEDY, max_tokens=16))),
        sampled=list(engine.generate(PROMPT, SAMPLED))[:3],
        scores=scores,
    )


@pytest.fixture(scope="module")
def lora_case(checkpoints, tmp_path_factory):
    """A PEFT adapter on the Llama case, and the one-process engine's logits and tokens with it
    merged (weights/lora.py)."""
    from test_lora import peft_adapter

    path = checkpoints["llama"][0]
    folder = tmp_path_factory.mktemp("lora") / "adapter"
    peft_adapter(folder, load_model(path, device="cpu", progress=False))
    ref = Engine.from_pretrained(path, device="cpu", progress=False, max_model_len=96,
                                 decode="eager", lora=((str(folder), 1.0),))  # fmt: skip
    with torch.no_grad():
        logits = ref.model(torch.tensor([PROMPT]))[0]
    return str(folder), dict(logits=logits, greedy=list(ref.generate(PROMPT, GREEDY)))


def _rank_work(rank: int, world: int, device: str, paths: dict, run_path: str,
               lora: str) -> dict:  # fmt: skip
    """One rank: every case (sampling on fewer of them at 4 ranks), then lead/follow and run,
    and at 2 ranks the Llama case with a LoRA adapter merged into each rank's slices."""
    results = {}
    for name, path in paths.items():
        if world == 4 and name not in AT_4:
            continue
        model = load_shard(path, rank, world, device="cpu")
        engine = ParallelEngine(model, max_model_len=96, prefill_chunk=5)
        with torch.no_grad():
            local = model(torch.tensor([PROMPT]))[0]
            logits = gather_vocab(model.exchange, local, model.place.vocab_sizes)
        res = dict(bytes=model.bytes_loaded, logits=logits)
        res["greedy"] = list(engine.generate(PROMPT, GREEDY))
        if world == 2 or name in SAMPLED_AT_4:
            res["sampled"] = list(engine.generate(PROMPT, SAMPLED))
        if world == 2:
            res["filtered"] = list(engine.generate(PROMPT, FILTERED))
        if world == 2 and name in REUSE_CASES:
            res["reuse"] = _reuse_turns(ParallelEngine(model, max_model_len=96, prefill_chunk=5))
        if model.place.splits_lanes:  # the mutation: consume each message one layer early
            early = load_shard(path, rank, world, device="cpu", receive_skew=1)
            with torch.no_grad():
                local = early(torch.tensor([PROMPT]))[0]
                res["early_logits"] = gather_vocab(early.exchange, local, early.place.vocab_sizes)
        results[name] = res
    if world == 2:
        results["run"] = _run_as_torchrun_rank(rank, world, run_path)
        results["lead"] = _lead_follow(rank, world, run_path)
        model = load_shard(paths["llama"], rank, world, device="cpu", lora=((lora, 1.0),))
        with torch.no_grad():
            local = model(torch.tensor([PROMPT]))[0]
        engine = ParallelEngine(model, max_model_len=96, prefill_chunk=5)
        results["lora"] = dict(
            logits=gather_vocab(model.exchange, local, model.place.vocab_sizes),
            greedy=list(engine.generate(PROMPT, GREEDY)),
        )
    return results


def _reuse_turns(engine: ParallelEngine) -> dict:
    """Three agent turns; before the third, rank 1 alone forgets its cache."""
    out, cached, prompt = [], [], list(PROMPT)
    for k in range(3):
        if k == 2 and engine.ex.rank == 1:
            engine.cache.reset()
        out.append(list(engine.generate(prompt, TURN)))
        cached.append(engine.stats.cached_tokens)
        prompt = prompt + out[-1] + [7, 8]
    return dict(tokens=out, cached=cached)


def _cold_turns(path: str) -> list[list[int]]:
    engine = Engine(load_model(path, device="cpu", progress=False), 96, 5, prefix_reuse=False)
    out, prompt = [], list(PROMPT)
    for _ in range(3):
        out.append(list(engine.generate(prompt, TURN)))
        prompt = prompt + out[-1] + [7, 8]
    return out


def _run_args(path: str, world: int) -> argparse.Namespace:
    return argparse.Namespace(
        model=path, device="cpu", dtype="float32", max_model_len=64, devices=world,
        prompt="ab", chat=None, max_tokens=8, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
        seed=None, stop=[], ignore_eos=True, json=True,
    )  # fmt: skip


def _run_as_torchrun_rank(rank: int, world: int, path: str) -> str:
    """`expresslane run --devices 2` as one torchrun rank: what it prints."""
    import contextlib
    import io
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert run_main(_run_args(path, world)) == 0
    return out.getvalue()


def _lead_follow(rank: int, world: int, path: str) -> list:
    """A serve-like command on rank 0 (launch's lead), the other rank following it."""
    box = []
    _lead_entry(rank, world, "cpu", _run_args(path, world), lambda args: _serve_like(args, box))
    return box


def _serve_like(args, box: list) -> int:
    import threading

    engine, _ = load_lead_engine(args)
    box.append(list(engine.generate(PROMPT, replace(GREEDY, max_tokens=16))))
    steps = engine.generate(PROMPT, SAMPLED)  # the client goes away after 3 tokens
    box.append([next(steps) for _ in range(3)])
    steps.close()
    cancel, got = threading.Event(), []
    for t in engine.generate(PROMPT, GREEDY, cancel):
        got.append(t)
        if len(got) == 5:
            cancel.set()  # a Stop button: the followers hear it before the next step
    box.append(got)
    box.append(engine.prompt_logprobs(PROMPT).argmax(-1).tolist())
    return 0


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_match_one_process(checkpoints, run_checkpoint, lora_case, world):
    paths = {name: p for name, (p, _) in checkpoints.items()}
    ranks = spawn(_rank_work, world, paths, run_checkpoint[0], lora_case[0], device="cpu",
                  threads=1)  # fmt: skip
    for name, (_, ref) in checkpoints.items():
        if name not in ranks[0]:
            continue
        got = ranks[0][name]
        err = (got["logits"] - ref["logits"]).abs().max().item()
        assert err <= LOGITS_TOL, f"{name} on {world} ranks: logits differ by {err}"
        assert got["greedy"] == ref["greedy"], f"{name} on {world} ranks: greedy tokens"
        for key in ("sampled", "filtered"):
            if key in got:
                assert got[key] == ref[key], f"{name} on {world} ranks: {key} tokens"
        assert all(r[name]["greedy"] == got["greedy"] for r in ranks)
        if "early_logits" in got:  # the wiring is really exercised
            early = (got["early_logits"] - ref["logits"]).abs().max().item()
            assert early > 100 * LOGITS_TOL, f"{name}: early consumption went unnoticed"
        cfg = ModelConfig.from_hf_dict({**BASE, **CASES[name]})
        rep, share = expected_bytes(cfg, world)
        assert [r[name]["bytes"] for r in ranks] == [rep + share] * world, name
    for name in REUSE_CASES if world == 2 else ():
        got = [r[name]["reuse"] for r in ranks]
        assert got[0]["tokens"] == _cold_turns(checkpoints[name][0]), name
        assert got[0]["cached"] == [0, len(PROMPT) + TURN.max_tokens - 1, 0], name
        assert got[1] == got[0], name
    if world == 2:
        ref = run_checkpoint[1]
        printed = [x for x in ranks[0]["run"].splitlines() if x.startswith("{")]
        assert len(printed) == 1 and ranks[1]["run"] == ""  # rank 0 prints, the others do not
        assert json.loads(printed[0])["token_ids"] == ref["run"]
        assert json.loads(printed[0])["devices"] == 2
        lead = ranks[0]["lead"]
        assert lead == [ref["greedy"], ref["sampled"], ref["greedy"][:5], ref["scores"]]
        lora, want = ranks[0]["lora"], lora_case[1]  # the adapter merged into each slice
        assert (lora["logits"] - want["logits"]).abs().max().item() <= LOGITS_TOL
        assert lora["greedy"] == want["greedy"] == ranks[1]["lora"]["greedy"]
        assert want["greedy"] != checkpoints["llama"][1]["greedy"]  # the adapter matters


def test_bytes_share_is_the_split_part_only(checkpoints):
    """Replicated bytes + the split bytes / G: 4 ranks together hold far less than 4 copies."""
    cfg = ModelConfig.from_hf_dict({**BASE, **CASES["d2-shared-vocab"]})
    rep, share1 = expected_bytes(cfg, 1)
    _, share4 = expected_bytes(cfg, 4)
    assert share4 * 4 == share1
    whole = load_shard(checkpoints["d2-shared-vocab"][0], 0, 1).bytes_loaded
    assert whole == rep + share1


def test_world_of_one_is_bit_exact(checkpoints):
    for name, (path, ref) in checkpoints.items():
        model = load_shard(path, 0, 1)
        with torch.no_grad():
            assert (model(torch.tensor([PROMPT]))[0] - ref["logits"]).abs().max() <= 1e-6, name


def _bench(capsys, *argv) -> tuple[int, str, str]:
    tiny = ["--preset", "laneformer-tiny", "--contexts", "16", "--decode-tokens", "8"]
    code = main(["bench", *tiny, *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_bench_on_two_devices_decodes_what_one_does(capsys):
    """The preset's random weights reach both ranks through a temporary checkpoint."""
    code, out, _ = _bench(capsys, "--devices", "2")
    assert code == 0
    res = json.loads(out.splitlines()[-1])
    assert res["devices"] == 2
    assert "note: transformers peer skipped" in out  # said, not silently dropped
    [row] = res["rows"]  # no peer row
    assert row["engine"] == "expresslane" and row["devices"] == 2
    assert row["decode_tok_s"] > 0 and row["prefill_tok_s"] > 0 and row["ttft_ms"] > 0
    assert 0 < row["bytes_per_token_per_device"] < row["bytes_per_token"]
    code, out, _ = _bench(capsys, "--no-peer")
    [one] = json.loads(out.splitlines()[-1])["rows"]
    assert code == 0 and one["devices"] == 1
    assert row["token_ids"] == one["token_ids"] and len(one["token_ids"]) == 16  # 8 + warm-up


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--devices", "3"], ["--devices 3", "num_lanes=8"]),
        (["--devices", "0"], ["--devices 0", ">= 1"]),
        (["--devices", "2", "--compile"], ["--compile"]),
        (["--devices", "2", "--kernels", "both"], ["--kernels both", "no fused step"]),
    ],
)
def test_bench_bad_devices_exit_2(capsys, argv, words):
    code, out, err = _bench(capsys, *argv)
    lines = [ln for ln in err.splitlines() if ln.startswith("expresslane bench: error:")]
    assert code == 2 and out == "" and len(lines) == 1
    assert all(w in lines[0] for w in words), lines[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a GPU")
def test_nccl_one_gpu_one_process(checkpoints):
    path, ref = checkpoints["d2-shared-vocab"]
    out = spawn(_nccl_rank, 1, path, device="cuda")
    assert out[0] == ref["greedy"]


def _nccl_rank(rank, world, device, path):
    engine = ParallelEngine(load_shard(path, rank, world, device=device), 96)
    return list(engine.generate(PROMPT, GREEDY))
