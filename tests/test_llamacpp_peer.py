"""The llama.cpp peer's GGUF: our tensors in llama.cpp's layout, read back by gguf's reader; and,
where llama-cpp-python is installed, llama.cpp's greedy tokens on the F32 file are ours."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from expresslane.bench import llamacpp
from expresslane.config import ModelConfig
from expresslane.engine import Engine
from expresslane.model import Laneformer, init_weights
from expresslane.sampling.params import SamplingParams

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def model():
    cfg = dict(model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=96,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=128, tie_word_embeddings=True, eos_token_id=2)  # fmt: skip
    return init_weights(Laneformer(ModelConfig.from_hf_dict(cfg)), seed=1, norm_noise=0.1).eval()


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    """A byte-level BPE vocabulary of 96 entries (3 special), as transformers writes it."""
    vocab = {f"t{i}": i for i in range(3, 96)}
    added = [{"id": i, "content": f"<s{i}>", "special": True} for i in range(3)]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    bpe = {"type": "BPE", "vocab": vocab, "merges": [["t", "3"]]}
    path.write_text(json.dumps({"added_tokens": added, "model": bpe}))
    return path


def test_permutation_is_llamacpps_and_invertible():
    w = torch.arange(2 * 8 * 3).reshape(16, 3)  # 2 heads of head_dim 8
    p = llamacpp.permute_for_llamacpp(w, 2)
    # head 0's rotate-half pairs (0, 4), (1, 5), ... become adjacent rows
    assert p[:, 0].tolist()[:8] == [0, 12, 3, 15, 6, 18, 9, 21]
    half = torch.cat([torch.arange(0, 8, 2), torch.arange(1, 8, 2)])  # interleaved -> half
    assert torch.equal(p.reshape(2, 8, 3)[:, half].reshape(16, 3), w)


@pytest.mark.parametrize("ggml_type", ["F32", "F16", "Q8_0"])
def test_gguf_holds_our_tensors(model, tokenizer_json, tmp_path, ggml_type):
    path = llamacpp.write_gguf(model, tokenizer_json, tmp_path / "m.gguf", ggml_type)
    reader = gguf.GGUFReader(str(path))
    fields = {f.name: f for f in reader.fields.values()}
    assert bytes(fields["general.architecture"].parts[-1]).decode() == "llama"
    assert int(fields["llama.attention.head_count_kv"].parts[-1][0]) == 2
    tensors = {t.name: t for t in reader.tensors}
    ours = llamacpp.gguf_tensors(model)
    assert set(tensors) == set(ours)  # tied head: no output.weight
    for name, want in ours.items():
        t = tensors[name]
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(want.shape)
        ref = want.numpy()
        if ggml_type == "F32" or want.dim() == 1:
            assert np.array_equal(got, ref), name  # bit-identical (norms always F32)
        elif ggml_type == "F16":
            assert np.array_equal(got, ref.astype(np.float16).astype(np.float32)), name
        else:  # Q8_0: 32-value blocks, absmax / 127 scales rounded to f16 (2^-11 relative)
            step = np.abs(ref).reshape(-1, 32).max(-1, keepdims=True) / 127
            bound = step * (0.5 + 127 * 2.0**-11) + 1e-6
            assert (np.abs(got - ref).reshape(-1, 32) <= bound).all(), name


NO_LLAMACPP = "llama-cpp-python is not installed (optional benchmark peer; ~18 min to build)"


@pytest.mark.skipif(not llamacpp.available(), reason=NO_LLAMACPP)
def test_llamacpp_decodes_our_f32_weights_to_our_tokens(model, tokenizer_json, tmp_path):
    path = llamacpp.write_gguf(model, tokenizer_json, tmp_path / "m.gguf", "F32")
    peer = llamacpp.LlamaCppPeer(path, threads=1, n_ctx=64)
    try:
        got = peer.generate([1, 7, 9, 30, 11], n=20, warmup=0)["token_ids"]
    finally:
        peer.close()
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ours = list(Engine(model, max_model_len=64).generate([1, 7, 9, 30, 11], params))
    assert got == ours


@pytest.mark.skipif(not llamacpp.available(), reason=NO_LLAMACPP)
def test_llamacpps_sampler_chain_draws_by_its_seed(model, tokenizer_json, tmp_path):
    """`bench --peer llama.cpp --temperature T`'s peer: llama.cpp's chain reproduces a seed,
    another seed draws other tokens, and top-k 1 (top-p, min-p that keep one token) is greedy."""
    path = llamacpp.write_gguf(model, tokenizer_json, tmp_path / "m.gguf", "F32")
    prompt = [1, 7, 9, 30, 11]

    def tokens(**draw) -> list[int]:
        peer = llamacpp.LlamaCppPeer(path, threads=1, n_ctx=64, draw=draw or None)
        try:
            return peer.generate(prompt, n=24, warmup=0)["token_ids"]
        finally:
            peer.close()

    hot = {"temperature": 20.0}  # the tiny model is peaked (0.98 at T = 3), no truncation
    assert tokens(**hot, seed=3) == tokens(**hot, seed=3) != tokens(**hot, seed=4)
    assert tokens(temperature=0.8, top_k=1, seed=5) == tokens()
    # top-p and min-p cut before llama.cpp's temperature: only the 0.98 token stays, so even
    # at 20 they draw the greedy tokens (without them in the chain, the draws above)
    assert tokens(temperature=20.0, top_p=0.5, seed=3) == tokens()
    assert tokens(temperature=20.0, min_p=0.5, seed=3) == tokens()
