"""GGUF files written by llama.cpp's own quantizer (expresslane/gguf/variants.py: the real SmolLM2
in every type of TYPES, from llama-cpp-python's `llama_model_quantize`), checked three ways:

- every GGML type each file holds dequantizes bit for bit as gguf-py dequantizes it (random
  valid blocks of each type: tests/test_gguf_quants.py, which needs no llama.cpp);
- our logits on a prompt, loaded as `run` loads the file (its blocks packed as stored where a
  kernel reads them), against llama.cpp's on the very same file (`Llama(logits_all=True)`);
- greedy tokens of the engine on the file's fp32 dequantization (the weights transformers uses)
  against transformers reading the same file (`gguf_file=`), for the types the issue targets;
  transformers' results are cached in $EXPRESSLANE_CACHE/reference/ keyed by the file's SHA-256,
  as tests/test_smollm2.py does.

A type whose file is not cached is made first, which needs llama_cpp; without it those tests are
skipped, saying so (CI's fresh machine may lack it).
"""

from __future__ import annotations

import functools
import hashlib
import json

import gguf
import numpy as np
import pytest
import torch

from expresslane.checkpoint import load_model
from expresslane.config import SamplingParams
from expresslane.engine import Engine
from expresslane.gguf import variants
from expresslane.gguf.fetch import cache_root
from expresslane.gguf.quants import raw_to_float
from expresslane.gguf.reader import read_header
from expresslane.weights.packing import load_packed

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: shared-core work

PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
GREEDY = 24
TRANSFORMERS_TYPES = ("Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")  # the speed targets
# llama.cpp's matrix products quantize the activations (to Q8_0/Q8_K blocks) and we do not, so
# logits agree to a fraction of their spread, not bit for bit; measured max |diff| / max |logit|:
LOGIT_RTOL = 0.05


def _file(type_name: str, smollm2_gguf):
    """The cached file of `type_name`, made now if llama_cpp can; else the test is skipped."""
    if not variants.path(type_name).is_file() and not variants.have_llama_cpp():
        pytest.skip(f"no cached SmolLM2 {type_name} and no llama_cpp to make it "
                    "(pip install llama-cpp-python)")  # fmt: skip
    return variants.ensure(type_name)


def _need_llama_cpp():
    if not variants.have_llama_cpp():
        pytest.skip("llama_cpp is not installed (pip install llama-cpp-python)")


@pytest.mark.parametrize("type_name", variants.TYPES)
def test_every_type_in_the_file_dequantizes_like_gguf_py(type_name, smollm2_gguf):
    header = read_header(_file(type_name, smollm2_gguf))
    by_type: dict[str, list[str]] = {}
    for name, info in header.tensors.items():
        by_type.setdefault(info.type_name, []).append(name)
    main = type_name.removesuffix("_M")  # Q4_K_M: mostly Q4_K, with Q6_K and fallbacks
    assert main in by_type, sorted(by_type)
    for kind, names in by_type.items():
        for name in {names[0], names[-1], *(n for n in names if n == "token_embd.weight")}:
            info = header.tensors[name]
            ours = raw_to_float(header, name).numpy()
            raw = header.raw_bytes(name)
            ref = raw.view(np.float32) if kind == "F32" else gguf.quants.dequantize(raw, kind)
            assert np.array_equal(ours, ref.reshape(info.shape)), (kind, name)


@functools.lru_cache(maxsize=1)
def _ours(path):
    """The model as `run` loads it: the file's blocks packed where a kernel reads them."""
    return load_packed(path, device="cpu", progress=False)


@functools.lru_cache(maxsize=1)
def _dequantized(path):
    return load_model(path, device="cpu", dtype="float32", progress=False)


def _prompt_ids(path) -> list[int]:
    from expresslane.tokenizer import Tokenizer

    return Tokenizer.from_dir(path).encode(PROMPT)


@pytest.mark.parametrize("type_name", variants.TYPES)
def test_logits_match_llama_cpp_on_the_same_file(type_name, smollm2_gguf):
    _need_llama_cpp()
    import llama_cpp

    path = _file(type_name, smollm2_gguf)
    ids = _prompt_ids(path)
    llm = llama_cpp.Llama(str(path), n_ctx=64, n_threads=1, logits_all=True, verbose=False)
    llm.eval(ids)
    theirs = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))  # (S, V)
    with torch.no_grad():
        ours = _ours(path)(torch.tensor([ids]))[0]  # (S, V)
    spread = theirs.abs().max().item()
    assert (ours - theirs).abs().max().item() <= LOGIT_RTOL * spread
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


def _transformers_greedy(path, ids: list[int]) -> list[int]:
    """transformers reading the same GGUF, greedy, cached by file digest and inputs."""
    transformers = pytest.importorskip("transformers")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    inputs = hashlib.sha256(json.dumps([ids, GREEDY]).encode()).hexdigest()[:8]
    name = f"smollm2-{digest}-transformers{transformers.__version__}-greedy-{inputs}.json"
    cached = cache_root() / "reference" / name
    if cached.is_file():
        return json.loads(cached.read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY, do_sample=False,
                             eos_token_id=None, pad_token_id=0, min_new_tokens=GREEDY)  # fmt: skip
    tokens = out[0, len(ids) :].tolist()
    cached.parent.mkdir(parents=True, exist_ok=True)
    part = cached.with_suffix(".part")
    part.write_text(json.dumps(tokens))
    part.replace(cached)
    return tokens


@pytest.mark.parametrize("type_name", TRANSFORMERS_TYPES)
def test_greedy_tokens_equal_transformers_on_the_same_file(type_name, smollm2_gguf):
    path = _file(type_name, smollm2_gguf)
    ids = _prompt_ids(path)
    want = _transformers_greedy(path, ids)
    engine = Engine(_dequantized(path), max_model_len=128)
    params = SamplingParams(max_tokens=GREEDY, ignore_eos=True)
    assert list(engine.generate(ids, params)) == want
