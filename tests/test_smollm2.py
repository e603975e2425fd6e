"""The real trained model, SmolLM2-135M-Instruct (GGUF Q4_1), against transformers reading the
same file (`gguf_file=`): prompt ids, chat prompt ids, a mixed text's ids and decoding, and 64
greedy tokens on plain and chat prompts, in fp32; and the CLI answers a chat question.

transformers is slow here (~20 s to load the GGUF, ~4 tok/s on two shared cores), so its
results are computed once and cached in $EXPRESSLANE_CACHE/reference/, keyed by the file's
SHA-256, the transformers version and the inputs below; one model load fills the cache.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from expresslane.__main__ import main
from expresslane.engine import Engine
from expresslane.gguf.fetch import cache_root
from expresslane.sampling.params import SamplingParams
from expresslane.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

PLAIN = ["The three primary colors are", "def is_prime(n):\n    "]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = 64
# Code, Unicode, whitespace runs and special tokens. A run of spaces or newlines right before a
# digit is left out: there transformers' GGUF tokenizer ignores the file's `smollm`
# pre-tokenizer (tests/test_gguf_tokenizer.py::test_smollm_pre_tokenizer_isolates_digits).
MIXED = (
    "<|im_start|>user\nfor i in range(10):\n\tprint(f'{i:>3}')  # ✓ naïve café\n"
    "    return {'π': 3.14159, '日本語': [1,2]}\r\n\n\n   trailing   spaces\t\t<|im_end|>"
    "\n<|endoftext|>émoji 🤖 x=12345;y = 678"
)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py: tiny or shared-core work


def _reference(path) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    chat_ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    prompts = [tok(p)["input_ids"] for p in PLAIN] + [list(chat_ids)]
    mixed = tok(MIXED)["input_ids"]
    return {
        "prompts": prompts,
        "greedy": [_greedy(model, ids) for ids in prompts],
        "chat_text": tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
        "mixed_ids": mixed,
        "mixed_decoded": tok.decode(mixed),
        "mixed_decoded_skip": tok.decode(mixed, skip_special_tokens=True),
    }


@torch.inference_mode()
def _greedy(model, ids: list[int]) -> list[int]:
    """GREEDY argmax tokens with the KV cache, EOS ignored (the engine's ignore_eos)."""
    out = model(torch.tensor([ids]), use_cache=True)
    tokens = []
    for _ in range(GREEDY):
        nxt = out.logits[0, -1].argmax().item()
        tokens.append(nxt)
        out = model(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


@pytest.fixture(scope="module")
def reference(smollm2_gguf) -> dict:
    digest = hashlib.sha256(smollm2_gguf.read_bytes()).hexdigest()[:16]
    inputs = hashlib.sha256(json.dumps([PLAIN, CHAT, GREEDY, MIXED]).encode()).hexdigest()[:8]
    cached = (
        cache_root()
        / "reference"
        / (f"smollm2-{digest}-transformers{transformers.__version__}-{inputs}.json")
    )
    if cached.is_file():
        return json.loads(cached.read_text())
    ref = _reference(smollm2_gguf)
    cached.parent.mkdir(parents=True, exist_ok=True)
    part = cached.with_suffix(".part")
    part.write_text(json.dumps(ref))
    part.replace(cached)
    return ref


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_gguf)


def test_prompt_and_chat_ids_equal_transformers(tokenizer, reference):
    ours = [tokenizer.encode(p) for p in PLAIN] + [tokenizer.encode_chat(CHAT)]
    assert ours == reference["prompts"]
    assert tokenizer.apply_chat_template(CHAT) == reference["chat_text"]


def test_mixed_text_encodes_and_decodes_like_transformers(tokenizer, reference):
    ids = tokenizer.encode(MIXED)
    assert ids == reference["mixed_ids"]
    assert tokenizer.decode(ids) == reference["mixed_decoded"] == MIXED
    assert tokenizer.decode(ids, skip_special_tokens=True) == reference["mixed_decoded_skip"]


def test_greedy_tokens_equal_transformers(smollm2_gguf, tokenizer, reference):
    engine = Engine.from_pretrained(
        str(smollm2_gguf), device="cpu", dtype="float32", max_model_len=256, progress=False
    )
    params = SamplingParams(max_tokens=GREEDY, ignore_eos=True)
    for prompt, want in zip(reference["prompts"], reference["greedy"], strict=True):
        assert list(engine.generate(prompt, params)) == want
    answer = reference["greedy"][-1]
    end = answer.index(tokenizer.eos_ids[0]) if tokenizer.eos_ids[0] in answer else len(answer)
    assert "Paris" in tokenizer.decode(answer[:end])


def test_cli_answers_the_chat_question(smollm2_gguf, capsys):
    argv = ["run", str(smollm2_gguf), "--chat", CHAT[0]["content"], "--max-tokens", "24",
            "--max-model-len", "128", "--threads", "1", "--json"]  # fmt: skip
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "Paris" in out["text"] and out["finish_reason"] == "stop"
