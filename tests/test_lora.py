"""LoRA adapters merged at load (weights/lora.py): PEFT folders and llama.cpp GGUF adapters.

A PEFT adapter on a tiny Llama equals the model with `scale * B @ A` added by hand (rsLoRA and
alpha_pattern's scales too), through the packed step the engine decodes with. A GGUF adapter on
SmolLM2's F32 file gives llama.cpp's own logits with that adapter (`Llama(lora_path=...)`, its
q and k rows permuted as llama.cpp's converter writes them); on the Q4_0 file, where the adapted
matrices are packed as Q8_0 from their merged values, it stays close to llama.cpp's run-time
adapter. Bad adapters are refused by name.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from expresslane.bench.llamacpp import without_extra_buffers
from expresslane.checkpoint import load_model, save_model
from expresslane.config import ModelConfig
from expresslane.engine import Engine
from expresslane.errors import CheckpointError
from expresslane.model import Laneformer, init_weights
from expresslane.sampling.params import SamplingParams
from expresslane.tokenizer import Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
TARGETS = {"self_attn.q_proj": "attention.wq", "self_attn.v_proj": "attention.wv",
           "mlp.down_proj": "feed_forward.w2"}  # fmt: skip
IDS = [1, 5, 9, 33, 2, 17, 40, 8, 21]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    cfg = ModelConfig.from_hf_dict(
        dict(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, eos_token_id=2)
    )  # fmt: skip
    return save_model(init_weights(Laneformer(cfg), seed=4), tmp_path_factory.mktemp("llama"))


def peft_adapter(folder, model, rank=4, alpha=8.0, **conf):
    """A random PEFT adapter on TARGETS of both layers; returns {our module: (A, B)}."""
    g = torch.Generator().manual_seed(rank)
    tensors, pairs = {}, {}
    for i in range(model.cfg.num_layers):
        for hf, ours in TARGETS.items():
            out, inp = model.get_parameter(f"model.layers.{i}.{ours}.weight").shape[-2:]
            a = torch.randn(rank, inp, generator=g) * 0.2
            b = torch.randn(out, rank, generator=g) * 0.2
            key = f"base_model.model.model.layers.{i}.{hf}"
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
            pairs[f"model.layers.{i}.{ours}"] = (a, b)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none",
              "target_modules": ["q_proj", "v_proj", "down_proj"], **conf}  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return pairs


def merged_by_hand(llama_dir, pairs, scale_of) -> Laneformer:
    model = load_model(llama_dir, device="cpu", dtype="float32", progress=False)
    with torch.no_grad():
        for module, (a, b) in pairs.items():
            model.get_parameter(module + ".weight")[0] += scale_of(module, a.shape[0]) * (b @ a)
    return model


def logits(model, ids=IDS) -> torch.Tensor:
    dev = next(model.parameters()).device
    with torch.inference_mode():
        return model(torch.tensor([ids], device=dev))[0].float().cpu()


@pytest.mark.parametrize("decode", ["auto", "eager"])  # the packed C step, the model's forward
def test_peft_adapter_equals_the_merge_by_hand(llama_dir, tmp_path, decode):
    model = load_model(llama_dir, device="cpu", dtype="float32", progress=False)
    pairs = peft_adapter(tmp_path / "ad", model)
    want = merged_by_hand(llama_dir, pairs, lambda m, r: 8.0 / r)
    eng = Engine.from_pretrained(str(llama_dir), device="cpu", progress=False, decode=decode,
                                 lora=((str(tmp_path / "ad"), 1.0),))  # fmt: skip
    assert torch.allclose(logits(eng.model), logits(want), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(logits(model), logits(want), atol=1e-2)  # the adapter matters
    ref = Engine(want, max_model_len=64, decode="eager")
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    assert list(eng.generate(IDS, p)) == list(ref.generate(IDS, p))


def test_rslora_alpha_pattern_and_scale(llama_dir, tmp_path):
    model = load_model(llama_dir, device="cpu", dtype="float32", progress=False)
    pairs = peft_adapter(tmp_path / "ad", model, rank=4, alpha=8.0, use_rslora=True,
                         alpha_pattern={"down_proj": 2.0})  # fmt: skip

    def scale(module: str, r: int) -> float:  # user scale 0.5 on top
        return 0.5 * (2.0 if module.endswith("w2") else 8.0) / math.sqrt(r)

    want = merged_by_hand(llama_dir, pairs, scale)
    eng = Engine.from_pretrained(str(llama_dir), device="cpu", progress=False,
                                 lora=((str(tmp_path / "ad"), 0.5),))  # fmt: skip
    assert torch.allclose(logits(eng.model), logits(want), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "change, says",
    [
        ({"use_dora": True}, "use_dora"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias"),
        ("lm_head", "projections only"),
        ("bin", "pickled"),
        ("rank", "an adapter for another model"),
        ("ranks", "differ in rank"),
        ("layers", "lacks"),
        ("truncated", "not a readable safetensors file"),
        ("list-config", "expected a JSON object"),
    ],
)
def test_bad_adapters_are_refused_by_name(llama_dir, tmp_path, change, says):
    from expresslane.weights.lora import load_adapter, merge

    model = load_model(llama_dir, device="cpu", dtype="float32", progress=False)
    folder = tmp_path / "ad"
    peft_adapter(folder, model, **(change if isinstance(change, dict) else {}))
    weights = folder / "adapter_model.safetensors"
    if change == "bin":
        weights.rename(folder / "adapter_model.bin")
    elif change == "truncated":
        weights.write_bytes(weights.read_bytes()[:100])
    elif change == "list-config":
        (folder / "adapter_config.json").write_text("[1, 2]")
    elif isinstance(change, str):
        from safetensors.torch import load_file

        t = load_file(str(weights))
        key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        if change == "lm_head":
            t["base_model.model.lm_head.lora_A.weight"] = t[key].clone()
            t["base_model.model.lm_head.lora_B.weight"] = torch.zeros(64, 4)
        elif change == "rank":
            t[key] = torch.zeros(4, 7)
        elif change == "ranks":
            t[key] = torch.zeros(3, 64)  # B keeps rank 4
        else:
            far = key.replace("layers.0", "layers.9")
            t[far] = t[key].clone()
            t[far.replace("lora_A", "lora_B")] = t[key.replace("lora_A", "lora_B")].clone()
        save_file(t, str(weights))
    with pytest.raises(CheckpointError) as e:
        merge(model, [load_adapter(folder, model.cfg)])
    assert says in str(e.value), e.value


# --- a GGUF adapter on the real model, against llama.cpp -----------------------------------------
def gguf_adapter(path, cfg, rank=8, alpha=16.0, seed=0) -> None:
    """A random adapter on q, k, v and down of every layer, as llama.cpp writes one."""
    pytest.importorskip("gguf")
    from expresslane.bench.lora import write_adapter

    write_adapter(path, cfg, rank, alpha, ("q", "k", "v", "down"), seed)


def test_gguf_adapter_gives_llama_cpps_logits(smollm2_gguf, tmp_path):
    """F32: llama.cpp applies the adapter at run time, we merged it; the same logits."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from expresslane.gguf import variants

    base = variants.ensure("F32")  # made from the fetched Q4_1 file
    plain = Engine.from_pretrained(str(base), device="cpu", progress=False)
    adapter = tmp_path / "lora.gguf"
    gguf_adapter(adapter, plain.cfg)
    ours = Engine.from_pretrained(str(base), device="cpu", progress=False,
                                  lora=((str(adapter), 1.0),))  # fmt: skip
    with without_extra_buffers():  # an AMX CPU: llama.cpp's AMX buffers crashed it
        llm = llama_cpp.Llama(model_path=str(base), lora_path=str(adapter), n_ctx=64,
                              logits_all=True, verbose=False, n_threads=1)  # fmt: skip
    llm.eval(SMOL_IDS)
    theirs = torch.tensor(llm.scores[: len(SMOL_IDS)])  # (S, V)
    llm.close()
    gap = (logits(ours.model, SMOL_IDS) - theirs).abs().max().item()
    moved = (logits(plain.model, SMOL_IDS) - theirs).abs().max().item()
    print(
        f"\nours against llama.cpp, both with the adapter: {gap:.4f} max; our base model "
        f"against llama.cpp with it: {moved:.3f}"
    )
    assert gap < 0.05 and moved > 20 * gap, (gap, moved)


def test_gguf_adapter_on_quantized_blocks_packs_the_merge_as_q8_0(smollm2_gguf, tmp_path):
    """Q4_0: the adapted matrices packed as Q8_0 from their merged values, the others kept as
    stored; against the exact merge (the file's dequantized weights plus the delta in fp32).
    llama.cpp is no reference here: its 8-bit activations alone move its logits by ~1 (max)."""
    from expresslane.gguf import variants
    from expresslane.weights.lora import load_adapter, merge
    from expresslane.weights.quant import quantize

    if not variants.path("Q4_0").is_file() and not variants.have_llama_cpp():
        pytest.skip("no cached SmolLM2 Q4_0 and no llama_cpp to make it")
    base = variants.ensure("Q4_0")
    adapter = tmp_path / "lora.gguf"
    exact = load_model(base, device="cpu", dtype="float32", progress=False)
    gguf_adapter(adapter, exact.cfg)
    before = logits(exact, SMOL_IDS)
    merge(exact, [load_adapter(adapter, exact.cfg)])
    want = logits(exact, SMOL_IDS)
    ours = Engine.from_pretrained(str(base), device="cpu", progress=False,
                                  lora=((str(adapter), 1.0),))  # fmt: skip
    layer = ours.model.packed.layers[0]
    assert {p.fmt for p in layer.wqkv.pieces} == {"q8_0"} and layer.w2.fmt == "q8_0"
    assert {p.fmt for p in layer.w13.pieces} == {"q4_0"} and layer.wo.fmt == "q4_0"
    # the reference: the exact merge with each adapted matrix rounded through Q8_0 as llama.cpp's
    # reference quantizer rounds (weights/quant.py), computed in fp32
    with torch.no_grad():
        for module in load_adapter(adapter, exact.cfg).modules:
            w = exact.get_parameter(module + ".weight")
            w.copy_(quantize(w[0], "q8_0").dequantize()[None])
    rounded = logits(exact, SMOL_IDS)
    got = logits(ours.model, SMOL_IDS)
    assert (got - rounded).abs().max().item() < 1e-3
    # what the rounding costs against the exact merge, beside what Q8_0 itself costs: every
    # projection of the F32 file rounded through it, against the F32 file
    gap, moved = (got - want).abs().max().item(), (before - want).abs().max().item()
    f32 = load_model(variants.ensure("F32"), device="cpu", dtype="float32", progress=False)
    exact_f32 = logits(f32, SMOL_IDS)
    with torch.no_grad():
        for name, p in f32.named_parameters():
            if ".layers." in name and p.dim() == 3:  # the projections, (1, out, in)
                p.copy_(quantize(p[0], "q8_0").dequantize()[None])
    q8 = (logits(f32, SMOL_IDS) - exact_f32).abs().max().item()
    print(
        f"\nQ8_0 of the merge: {gap:.3f} max from the exact merge (the adapter moved "
        f"{moved:.3f}); Q8_0 of every projection of the F32 file: {q8:.3f}"
    )
    assert gap <= 1.25 * q8  # the merge's rounding costs what Q8_0 costs anywhere
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8


SMOL_IDS = [1, 504, 6064, 314, 7752, 253, 2890, 3116, 288, 260]


# --- the CLI ------------------------------------------------------------------------------------
def _run_json(main, capsys, *args) -> dict:
    assert main(["run", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_lora_and_lora_scaled(smollm2_gguf, tmp_path, capsys):
    from expresslane.__main__ import main
    from expresslane.gguf import variants

    base = str(variants.ensure("F32"))
    adapter = tmp_path / "lora.gguf"
    gguf_adapter(adapter, load_model(base, device="cpu", progress=False).cfg, alpha=64.0)
    common = [base, "--prompt", "The capital of France is", "--max-tokens", "12",
              "--device", "cpu"]  # fmt: skip
    plain = _run_json(main, capsys, *common)
    adapted = _run_json(main, capsys, *common, "--lora", str(adapter))
    zero = _run_json(main, capsys, *common, "--lora-scaled", str(adapter), "0")
    assert zero["token_ids"] == plain["token_ids"]  # scale 0: the base model exactly
    assert adapted["token_ids"] != plain["token_ids"]  # alpha 64, rank 8: it changes the answer
    eng = Engine.from_pretrained(base, device="cpu", progress=False, lora=((str(adapter), 1.0),))
    ids = Tokenizer.from_dir(base).encode("The capital of France is")
    assert list(eng.generate(ids, SamplingParams(max_tokens=12))) == adapted["token_ids"]


@pytest.mark.parametrize("args, says", [
    (["--lora", "/nonexistent/adapter"], "no such adapter"),
    (["--lora-scaled", "x", "nan"], "finite"),
])  # fmt: skip
def test_cli_bad_lora_flags_exit_2(capsys, args, says):
    from expresslane.__main__ import main

    assert main(["run", "--max-tokens", "2", *args]) == 2
    err = capsys.readouterr().err
    assert says in err, err


def test_serve_names_the_adapter_alone():
    import argparse

    from expresslane.cli.serve import _names, add_arguments
    from expresslane.errors import ConfigError

    p = argparse.ArgumentParser()
    add_arguments(p)
    one = p.parse_args(["some/base", "--lora-modules", "sql=ad/sql"])
    assert _names(one) == (["sql"], [])  # the base is not served: its weights were changed
    two = p.parse_args(["some/base", "--lora-modules", "a=x", "b=y"])
    with pytest.raises(ConfigError, match="one adapter per server"):
        _names(two)
    with pytest.raises(SystemExit):
        p.parse_args(["--lora-modules", "no-equals-sign"])
    named = p.parse_args(["b", "--lora-modules", "a=x", "--served-model-name", "base"])
    with pytest.raises(ConfigError, match="only its NAME is served"):
        _names(named)


def test_a_laneformer_takes_no_adapter(tmp_path, capsys):
    from expresslane.__main__ import main

    (tmp_path / "ad").mkdir()
    (tmp_path / "ad" / "adapter_config.json").write_text("{}")
    assert main(["run", "--max-tokens", "2", "--lora", str(tmp_path / "ad")]) == 2
    assert "Llama-family" in capsys.readouterr().err  # the embedded model has lanes


def test_a_gpu_repack_of_the_files_blocks_refuses_a_merged_adapter(tmp_path, monkeypatch):
    """On a GPU, --quantization gguf repacks the file's blocks: the merge would be lost. The
    refusal comes before anything loads."""
    from expresslane.bench.llamacpp import write_gguf
    from expresslane.errors import ConfigError
    from expresslane.weights import packing

    model = init_weights(Laneformer(ModelConfig.from_hf_dict(dict(
        model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=96,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64))), seed=1)  # fmt: skip
    path = write_gguf(model, None, tmp_path / "m.gguf", "Q8_0")
    monkeypatch.setattr(packing, "resolve_device", lambda device, cfg=None: torch.device("cuda"))
    from expresslane import checkpoint

    monkeypatch.setattr(checkpoint, "load_model", lambda *a, **k: pytest.fail("loaded first"))
    with pytest.raises(ConfigError, match="--lora with --quantization gguf on a GPU"):
        packing.load_packed(path, "cuda", "bfloat16", "gguf", lora=(("adapter", 1.0),))


def test_bench_rounds_run_ours_merged_and_llama_cpps_run_time_adapter(smollm2_gguf, tmp_path):
    pytest.importorskip("llama_cpp")
    from expresslane.bench.decode import BenchConfig
    from expresslane.bench.rounds import bench_vs_llamacpp
    from expresslane.gguf import variants

    base = variants.ensure("F32")
    adapter = tmp_path / "lora.gguf"
    cfg = load_model(base, device="cpu", progress=False).cfg
    gguf_adapter(adapter, cfg, alpha=64.0)
    bench = BenchConfig(contexts=(16,), decode_tokens=6, warmup_tokens=2, peers=(),
                        lora=((str(adapter), 1.0),))  # fmt: skip
    rows, _ = bench_vs_llamacpp(cfg, bench, base, ["gguf"], rounds=1)
    names = [(r["engine"], r["model"]) for r in rows]
    assert [n for n, _ in names] == ["expresslane", "expresslane", "llama.cpp"], names
    assert all("LoRA" in m for _, m in names)  # every row runs the adapter
    assert rows[2]["same_tokens"] == rows[2]["tokens"]  # llama.cpp's run-time adapter: our tokens


def test_bench_takes_lora_only_in_the_llama_cpp_rounds(capsys):
    from expresslane.__main__ import main

    assert main(["bench", "--preset", "llama-tiny", "--lora", "x.gguf"]) == 2
    assert "--peer llama.cpp" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_merge_decodes_the_cpu_merges_tokens(llama_dir, tmp_path):
    """On a GPU the merge happens on the device's weights: logits of the CPU's merge, and the
    fused step decodes the merged weights as the model's own forward does (a near tie, top-2
    gap < 1e-5, the one allowed flip)."""
    from test_speculative import assert_identical

    model = load_model(llama_dir, device="cpu", dtype="float32", progress=False)
    pairs = peft_adapter(tmp_path / "ad", model)
    want = merged_by_hand(llama_dir, pairs, lambda m, r: 8.0 / r)
    eng = Engine.from_pretrained(str(llama_dir), device="cuda", dtype="float32", progress=False,
                                 lora=((str(tmp_path / "ad"), 1.0),))  # fmt: skip
    assert torch.allclose(logits(eng.model, IDS), logits(want), atol=1e-4, rtol=1e-4)
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = list(Engine(eng.model, max_model_len=64, decode="eager").generate(IDS, p))
    assert_identical(eng.model, IDS, plain, list(eng.generate(IDS, p)), [])
