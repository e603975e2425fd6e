"""The decode step on packed weights equals the model's forward on the same weights, in every
format; packing keeps the model's own forward right; the static step reads only live slots."""

from __future__ import annotations

import copy

import pytest
import tiny
import torch

from expresslane.cache import KVCache
from expresslane.config import ModelConfig
from expresslane.engine import Engine
from expresslane.generation import reference_generate
from expresslane.model import Laneformer, init_weights
from expresslane.sampling.params import SamplingParams
from expresslane.step.graph import MIN_BUCKET, DecodeGraph, live_bucket
from expresslane.step.packed import PackedDecoder
from expresslane.step.protocol import EagerStep
from expresslane.weights.packing import load_plan, pack_model
from expresslane.weights.quant import FORMATS

PROMPT = [1, 7, 9, 30, 11, 12, 40, 3, 5]


def llama(seed=0, **over) -> Laneformer:
    """A small Llama with GQA and a tied head (SmolLM2's layout), odd sizes."""
    cfg = dict(model_type="llama", vocab_size=67, hidden_size=48, intermediate_size=88,
               num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
               max_position_embeddings=128, tie_word_embeddings=True, eos_token_id=2)  # fmt: skip
    model = Laneformer(ModelConfig.from_hf_dict({**cfg, **over}))
    return init_weights(model, seed=seed, norm_noise=0.1).eval()


MODELS = {
    "laneformer": lambda: tiny.laneformer(seed=3),  # lanes, DTP reduces, rings, vocab-par. head
    "laneformer-lane-head": lambda: tiny.laneformer(seed=4, lm_head_type="lane"),
    "llama-tied": lambda: llama(),
    "qwen2-bias": lambda: llama(model_type="qwen2", tie_word_embeddings=False),
    "qwen3-qk-norm": lambda: llama(model_type="qwen3", head_dim=12),  # wider than hidden / heads
    "mistral-ring": lambda: llama(model_type="mistral", sliding_window=5),  # wraps at 5 slots
}


def _step_logits(model: Laneformer, fmt: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(forward logits of PROMPT, packed-step logits fed token by token) after packing."""
    pack_model(model, fmt)
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        full = model(tokens)[0]
        cache = KVCache(model.cfg, max_len=32)
        cache.static = True
        dec = PackedDecoder(model, cache)
        steps = [dec.forward(tokens[0, i : i + 1], torch.tensor([i])) for i in range(len(PROMPT))]
    return full, torch.cat(steps)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_step_equals_the_forward_on_the_same_weights(name, fmt):
    """fp32 up to summation order; int8's C kernels also round x to 16-bit fixed point (1/65534
    of its largest element: far below the int8 weights' own rounding), bf16's to two bf16 parts
    (16 bits), as test_packed_verify's bound."""
    full, steps = _step_logits(MODELS[name](), fmt)
    scale = full.abs().max().item()
    tol = {"int8": 2e-3 * scale, "bfloat16": 1e-4 * max(scale, 1.0)}.get(fmt, 1e-4)
    torch.testing.assert_close(steps, full, rtol=1e-4, atol=tol)


def test_same_dtype_packing_changes_no_value_and_shares_storage():
    model = tiny.laneformer(seed=3)
    before = copy.deepcopy(model)
    packed = pack_model(model)
    assert packed.fmt == "float32" and pack_model(model) is packed
    wq = model.model.layers[1].attention.wq.weight
    assert isinstance(wq, torch.nn.Parameter)
    assert (
        wq.untyped_storage().data_ptr() == packed.layers[1].wqkv.data.untyped_storage().data_ptr()
    )
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.equal(model(tokens), before(tokens))
    with pytest.raises(ValueError, match="already packed as float32"):
        pack_model(model, "int8")


@pytest.mark.parametrize("fmt", ["int8", "bfloat16"])
def test_quantized_model_is_the_model_with_dequantized_weights(fmt):
    """Packing as int8 / bf16 swaps in modules holding the packed storage; their forward equals a
    plain model loaded with the dequantized values (an independent reference)."""
    model = llama(seed=5, tie_word_embeddings=False)
    ref = copy.deepcopy(model)
    packed = pack_model(model, fmt)
    assert not any(p.dim() == 3 for p in model.parameters())  # fp32 projections are gone
    state = ref.state_dict()
    for i in range(len(packed.layers)):
        for path in ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                     "feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):  # fmt: skip
            swapped = model.get_submodule(f"model.layers.{i}.{path}")
            state[f"model.layers.{i}.{path}.weight"] = swapped.weight  # dequantized
    state["model.tok_embeddings.weight"] = packed.embed.dequantize()
    state["lm_head.weight"] = packed.head.dequantize()
    ref.load_state_dict(state)
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), ref(tokens), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(model(tokens), llama(seed=5, tie_word_embeddings=False)(tokens))


def test_engine_on_a_cpu_takes_the_packed_step_and_kernels_off_the_models_own():
    model = tiny.laneformer(seed=3)
    assert isinstance(Engine(model, max_model_len=32, decode="graph").step, PackedDecoder)
    off = Engine(model, max_model_len=32, decode="graph", kernels="off")
    assert isinstance(off.step, EagerStep) and off.decode == "graph"
    eager = Engine(model, max_model_len=32)  # eager decode: the forward
    assert isinstance(eager.step, EagerStep) and eager.decode == "eager"


def _poisoned(engine: Engine, written: int) -> Engine:
    """Value slots no position below `written` maps to, NaN: a step that reads one of them
    (even masked: 0 * NaN) yields NaN logits. Ring layers use every slot, so only full ones."""
    for v in engine.cache.v:
        if v.shape[0] > written:
            v[written:] = float("nan")
    return engine


@pytest.mark.parametrize("kernels", ["auto", "off"])  # the packed step, the model's forward
def test_static_step_reads_only_live_slots(kernels):
    model = tiny.laneformer(seed=6)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = reference_generate(model, PROMPT, params, stop_ids=set())
    eng = Engine(model, max_model_len=200, decode="graph", kernels=kernels, steps_per_replay=3)
    written = len(PROMPT) + params.max_tokens + 3  # every position the request can write
    assert list(_poisoned(eng, written).generate(PROMPT, params)) == ref


def test_compiled_step_equals_forward_without_the_c_kernels():
    """The portable path: the layer compiled by inductor, products as its multiply-reduce (what
    runs where the C kernels are not built or the CPU lacks AVX-512), lanes and rings."""
    model = tiny.laneformer(seed=8)
    pack_model(model, "int8")
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        full = model(tokens)[0]
        cache = KVCache(model.cfg, max_len=32)
        cache.static = True
        dec = PackedDecoder(model, cache, compile=True, native=False)
        assert dec.compiled and dec.step is None
        steps = [dec.forward(tokens[0, i : i + 1], torch.tensor([i])) for i in range(len(PROMPT))]
    torch.testing.assert_close(torch.cat(steps), full, rtol=1e-4, atol=1e-4)


def test_engine_int8_step_equals_reference_and_reads_only_live_slots():
    """Through the engine (the C layers where built), int8, Llama layout: the greedy tokens of
    the reference on the same weights, over two requests; poisoned slots never read."""
    model = llama(seed=7, num_hidden_layers=3)
    pack_model(model, "int8")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = reference_generate(model, PROMPT, params, stop_ids=set())
    eng = Engine(model, max_model_len=96, compile=True, steps_per_replay=2)
    assert (
        len(eng.captures.graphs) == 1
    )  # the greedy step is built at load, not in the first request
    assert list(_poisoned(eng, len(PROMPT) + 26).generate(PROMPT, params)) == ref
    short = reference_generate(model, PROMPT[:2], params, stop_ids=set())
    assert list(eng.generate(PROMPT[:2], params)) == short
    assert len(eng.captures.graphs) == 1


def test_captured_graphs_bucket_the_live_bound():
    assert live_bucket(1, 8192) == MIN_BUCKET
    assert live_bucket(MIN_BUCKET + 1, 8192) == 2 * MIN_BUCKET
    assert live_bucket(5000, 8192) == 8192 and live_bucket(5000, 6000) == 6000
    model = tiny.laneformer(seed=3)
    cache = KVCache(model.cfg, max_len=1000)
    graph = DecodeGraph(EagerStep(model, cache), SamplingParams(), steps=4, capture=True)
    graph.load(torch.tensor(5), position=300)
    assert graph.live() == 512  # positions 300..303 in the 512 bucket
    eager = DecodeGraph(EagerStep(model, cache), SamplingParams(), steps=4, capture=False)
    eager.load(torch.tensor(5), position=300)
    assert eager.live() == 304


def test_load_plan_maps_flags_to_formats():
    assert load_plan("cpu", "bfloat16", None) == ("float32", "bfloat16")
    assert load_plan("cpu", "auto", "int8") == ("float32", "q8_0")  # Q8_0's layout
    assert load_plan("cpu", "auto", "int8-row") == ("float32", "int8")
    assert load_plan("cpu", "float32", None) == ("float32", None)
    from expresslane.errors import ConfigError

    with pytest.raises(ConfigError, match="--quantization 'int3'"):
        load_plan("cpu", "auto", "int3")
    with pytest.raises(ConfigError, match="--quantization int4: the GPU"):
        load_plan("cpu", "auto", "int4")  # kernels/qlinear.py: GPU only


def test_a_16bit_checkpoint_keeps_its_format_on_a_cpu(tmp_path):
    """dtype auto on a CPU: matrices all stored in bf16 (or fp16) are packed so (the same values
    as fp32, half the bytes), as a GGUF BF16 file is; fp32 or mixed matrices stay fp32. The
    logits are the fp32 packing's within the products' summation order, the greedy tokens the
    same."""
    from safetensors.torch import load_file, save_file

    from expresslane.checkpoint import save_model

    src = llama(seed=13)
    for dt in ("bfloat16", "float16", "float32"):
        save_model(src, tmp_path / dt, dtype=dt)
        fmt = None if dt == "float32" else dt
        assert load_plan("cpu", "auto", None, tmp_path / dt) == ("float32" if fmt else "auto", fmt)
        assert load_plan("cpu", "float32", None, tmp_path / dt) == ("float32", None)
    mixed = load_file(tmp_path / "bfloat16" / "model.safetensors")
    key = next(k for k, t in mixed.items() if t.dim() == 2)
    mixed[key] = mixed[key].float()
    save_file(mixed, tmp_path / "bfloat16" / "model.safetensors")
    assert load_plan("cpu", "auto", None, tmp_path / "bfloat16") == ("auto", None)
    ways = {}
    for dtype in ("auto", "float32"):
        engine = Engine.from_pretrained(tmp_path / "float16", device="cpu", dtype=dtype,
                                         decode="graph", progress=False)  # fmt: skip
        assert engine.model.packed.fmt == ("float16" if dtype == "auto" else "float32")
        tokens = list(engine.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True)))
        with torch.inference_mode():
            ways[dtype] = (tokens, engine.model(torch.tensor([PROMPT]))[0])
    assert ways["auto"][0] == ways["float32"][0]
    torch.testing.assert_close(ways["auto"][1], ways["float32"][1], rtol=1e-5, atol=1e-5)


def test_quantization_gguf_keeps_the_files_blocks_or_names_the_problem(tmp_path, monkeypatch):
    """--quantization gguf: on a CPU the GGUF default (the file's blocks); on a GPU the floats,
    then the file's blocks on the quantized products (qlinear.repack_gguf, whose products
    tests/test_qgemv.py checks); a model that is not a GGUF file is refused, named."""
    from expresslane import engine as engine_mod
    from expresslane.bench.llamacpp import write_gguf
    from expresslane.errors import ConfigError
    from expresslane.kernels import qlinear
    from expresslane.weights import packing

    src = llama(seed=12, hidden_size=64, num_attention_heads=4, intermediate_size=96)
    path = write_gguf(src, None, tmp_path / "m.gguf", "Q8_0")
    assert load_plan("cpu", "auto", "gguf", path) == ("float32", "gguf")
    (tmp_path / "hf").mkdir()  # a folder without a GGUF file
    with pytest.raises(ConfigError, match="not a GGUF file"):
        load_plan("cpu", "auto", "gguf", tmp_path / "hf")
    monkeypatch.setattr(packing, "resolve_device", lambda device, cfg=None: torch.device("cuda"))
    assert load_plan("cuda", "bfloat16", "gguf", path) == ("bfloat16", None)
    monkeypatch.undo()
    repacked = []
    monkeypatch.setattr(engine_mod, "_on_gpu", lambda model: True)
    monkeypatch.setattr(qlinear, "repack_gguf", lambda model, p: repacked.append(p) or model)
    engine_mod.Engine.from_pretrained(str(path), device="cpu", quantization="gguf",
                                      max_model_len=32, progress=False)  # fmt: skip
    assert repacked == [path]


@pytest.mark.parametrize("ggml_type", ["Q8_0", "Q4_1"])
def test_gguf_blocks_stay_quantized_through_the_engine(tmp_path, ggml_type):
    """A GGUF file's Q8_0 / Q4_1 matrices are packed as they were stored (not expanded to fp32);
    the packed step on them gives the reference's greedy tokens on the same (dequantized)
    weights, and the bytes streamed are the file's."""
    from expresslane.bench.llamacpp import write_gguf
    from expresslane.checkpoint import load_model
    from expresslane.weights.packing import pack_gguf

    src = llama(seed=12, hidden_size=64, num_attention_heads=4, intermediate_size=96)
    path = write_gguf(src, None, tmp_path / "m.gguf", ggml_type)
    model = load_model(path, progress=False)
    reference = load_model(path, progress=False)  # the file dequantized to fp32
    packed = pack_gguf(model, path)
    assert packed.formats == {ggml_type.lower()}
    weights = sum(m.dequantize().numel() for m in packed.matrices)
    assert packed.nbytes == weights * {"Q8_0": 34, "Q4_1": 20}[ggml_type] // 32  # GGUF's bytes
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref = reference_generate(reference, PROMPT, params, stop_ids=set())
    eng = Engine(model, max_model_len=64)
    assert eng.decode == "graph"  # quantized weights take the packed step by default
    assert list(eng.generate(PROMPT, params)) == ref


@pytest.mark.parametrize("S", [1, 3])
def test_forward_shared_is_forward_in_the_heads_buffer(S):
    """forward_shared gives forward's logits bit for bit, from the C head's buffer (the next
    call writes the same storage, no copy per token); the split path's forward_logits reads
    it, and a grammar's greedy tokens stay the unconstrained ones (test_auto_tools)."""
    model = llama(seed=2)
    pack_model(model, "float32")
    out = {}
    with torch.no_grad():
        for name in ("forward", "forward_shared"):
            cache = KVCache(model.cfg, max_len=32)
            cache.static = True
            dec = PackedDecoder(model, cache)
            assert dec.step is not None  # the C layers: the buffer this is about
            fn = getattr(dec, name)
            first = fn(torch.tensor(PROMPT[:S]), torch.tensor([0])).clone()
            again = fn(torch.tensor(PROMPT[S : 2 * S]), torch.tensor([S]))
            out[name] = (first, again.clone())
            if name == "forward_shared":
                assert again.data_ptr() == fn(torch.tensor(PROMPT[:1]), torch.tensor([2 * S])
                                              ).data_ptr()  # fmt: skip
    assert all(
        torch.equal(a, b) for a, b in zip(out["forward"], out["forward_shared"], strict=True)
    )
