"""GGUF checkpoints of small random Llama, Mistral, Qwen2 and Qwen3 models: the engine's logits
equal the original transformers model's, and transformers' own GGUF loading of the same file
agrees."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_kit import hf_to_gguf, llama3_rope_freqs

from expresslane.checkpoint import load_config, load_model
from expresslane.gguf.tensors import GGUFCheckpoint

transformers = pytest.importorskip("transformers")

BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}  # fmt: skip
CASES = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied-llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling=LLAMA3),
    ),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    # a window shorter than TOKENS, so that it masks; llama.cpp writes Mistral 7B as `llama`
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=24)),
    # q/k norms per head; head_dim wider than hidden / heads (128, Qwen3's: transformers' GGUF
    # loader ignores qwen3.attention.key_length and assumes it)
    "qwen3-qk-norm": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=128)),
}
HEAD_DIM = {"qwen3-qk-norm": 128}


def _hf_model(name: str):
    cfg_cls, model_cls, extra = CASES[name]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**{**BASE, **extra})
    cfg._attn_implementation = "eager"
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # HF initialises with std 0.02: widen so logits are not flat
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1)
    return model


def _write(name: str, model, path):
    if name == "llama-tied-llama3-rope":  # llama.cpp stores llama3 scaling as rope_freqs
        return hf_to_gguf(model, path, rope_freqs=llama3_rope_freqs(16, 500000.0, LLAMA3))
    return hf_to_gguf(model, path)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    hf = _hf_model(request.param)
    path = _write(request.param, hf, tmp_path_factory.mktemp(request.param) / "m.gguf")
    return request.param, hf, path


TOKENS = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(1))


def test_logits_equal_the_original_model(case):
    name, hf, path = case
    ours = load_model(path, device="cpu", dtype="float32", progress=False)
    cfg = ours.cfg
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, HEAD_DIM.get(name, 16))
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert cfg.attention_bias == (name == "qwen2-bias")
    assert cfg.qk_norm == (name == "qwen3-qk-norm")
    assert cfg.model_type == hf.config.model_type
    if name == "mistral-window":
        assert cfg.sliding_window == 24 and cfg.window(0) == 24
    if name == "llama-tied-llama3-rope":
        assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == pytest.approx(8.0)
    with torch.no_grad():
        ref, got = hf(TOKENS).logits, ours(TOKENS)
    assert (ref - got).abs().max().item() <= 1e-4


def test_transformers_reads_the_file_as_we_do(case, tmp_path):
    """transformers' GGUF loader (its own un-permutation) gives the same tensors: our writer and
    reader follow llama.cpp's conventions, not merely each other."""
    name, _, path = case
    tf = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    ours = GGUFCheckpoint(path)
    theirs = tf.state_dict()
    for key in ours.keys():
        assert torch.equal(ours.tensor(key), theirs[key]), key


def test_quantized_weights_load_as_their_dequantization(tmp_path):
    hf = _hf_model("llama-gqa")
    path = hf_to_gguf(hf, tmp_path / "q8.gguf", weight_type="Q8_0")
    ours = load_model(path, device="cpu", dtype="float32", progress=False)
    tf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="q8.gguf", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        assert (tf(TOKENS).logits - ours(TOKENS)).abs().max().item() <= 1e-4
    bf16 = load_model(path, device="cpu", dtype="bfloat16", progress=False)
    assert next(bf16.parameters()).dtype == torch.bfloat16


def test_config_from_metadata(tmp_path):
    hf = _hf_model("llama-gqa")
    extra = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0,
             "llama.attention.sliding_window": 24, "tokenizer.ggml.eot_token_id": 7,
             "llama.context_length": 1000}  # fmt: skip
    cfg = load_config(hf_to_gguf(hf, tmp_path / "m.gguf", extra=extra))
    assert cfg.model_type == "mistral" and cfg.sliding_window == 24
    assert cfg.rope_scaling.rope_type == "linear" and cfg.rope_scaling.factor == 2.0
    assert cfg.eos_token_ids == (2, 7) and cfg.bos_token_id == 1
    assert cfg.max_position_embeddings == 1000 and cfg.norm_eps == pytest.approx(1e-6)


def test_a_folder_holding_one_gguf_is_a_model(tmp_path):
    hf = _hf_model("llama-gqa")
    hf_to_gguf(hf, tmp_path / "m.gguf")
    ours = load_model(tmp_path, device="cpu", dtype="float32", progress=False)
    with torch.no_grad():
        assert (hf(TOKENS).logits - ours(TOKENS)).abs().max().item() <= 1e-4


def test_raw_blocks_keep_the_rows_in_transformers_order(tmp_path):
    """What a quantized kernel would read: the stored blocks, rows un-permuted like the weights."""
    hf = _hf_model("llama-gqa")
    path = hf_to_gguf(hf, tmp_path / "q.gguf", weight_type="Q8_0")
    ck = GGUFCheckpoint(path)
    key = "model.layers.1.self_attn.k_proj.weight"
    raw = ck.raw(key)
    assert (raw.ggml_type, raw.shape, raw.data.shape) == ("Q8_0", (32, 64), (32, 2 * 34))
    from expresslane.gguf.quants import dequantize

    assert torch.equal(dequantize(raw.data, raw.ggml_type, raw.shape), ck.tensor(key))
    assert not np.array_equal(raw.data.numpy(), ck.header.raw_bytes("blk.1.attn_k.weight"))


def test_rope_freqs_that_are_not_llama3_are_refused(tmp_path):
    from expresslane.errors import ExpressLaneError

    hf = _hf_model("llama-gqa")
    freqs = np.linspace(1, 3, 8).astype(np.float32)[::-1].copy()  # not llama3's shape
    path = hf_to_gguf(hf, tmp_path / "m.gguf", rope_freqs=freqs)
    with pytest.raises(ExpressLaneError, match="rope_freqs"):
        load_config(path)


def test_every_end_marker_of_the_vocabulary_stops_generation(tmp_path):
    """Issue 28: SmolLM2's GGUF declares only <|im_end|> as EOS, and its <|endoftext|> leaked
    into replies; llama.cpp stops on every token spelled as an end marker, and so do we."""
    from expresslane.engine import Engine
    from expresslane.sampling.params import SamplingParams

    hf = _hf_model("llama-gqa")
    tokens = [f"t{i}" for i in range(BASE["vocab_size"])]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    plain = Engine.from_pretrained(str(hf_to_gguf(hf, tmp_path / "a" / "m.gguf")), device="cpu",
                                   dtype="float32", progress=False)  # fmt: skip
    prompt, params = [5, 9, 3], SamplingParams(max_tokens=4)
    first = next(plain.generate_steps(prompt, params)).token
    assert first != 2  # the declared EOS: the marker below is what must stop it
    tokens[first] = "<|endoftext|>"
    path = hf_to_gguf(hf, tmp_path / "b" / "m.gguf", extra={"tokenizer.ggml.tokens": tokens})
    assert load_config(path).eos_token_ids == (2, first)
    marked = Engine.from_pretrained(str(path), device="cpu", dtype="float32", progress=False)
    steps = list(marked.generate_steps(prompt, params))
    assert [s.token for s in steps] == [first] and steps[-1].finish_reason == "stop"


def test_qwen3_runs_in_the_engine_on_its_stored_blocks(tmp_path):
    """The CLI's path for a quantized qwen3 file: its Q8_0 blocks packed as stored, decoded in the
    packed step's C layers (q/k norms included) and greedy tokens equal to transformers reading
    the same file."""
    from expresslane.engine import Engine
    from expresslane.sampling.params import SamplingParams
    from expresslane.step.packed import PackedDecoder
    from expresslane.weights.packing import load_packed

    path = hf_to_gguf(_hf_model("qwen3-qk-norm"), tmp_path / "q8.gguf", weight_type="Q8_0")
    model = load_packed(path, device="cpu", progress=False)
    assert model.packed.formats == {"q8_0"}
    engine = Engine(model, max_model_len=64)
    assert engine.decode == "graph" and isinstance(engine.step, PackedDecoder)
    assert engine.step.step is not None  # the C layers
    prompt = TOKENS[0, :10].tolist()
    got = list(engine.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True)))
    tf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="q8.gguf", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        ref = tf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0, min_new_tokens=16)  # fmt: skip
    assert got == ref[0, 10:].tolist()
