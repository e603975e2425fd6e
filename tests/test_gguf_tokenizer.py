"""Tokenizers from GGUF metadata equal transformers' GGUF tokenizers: SentencePiece-style
(`llama`) and byte-level BPE (`gpt2`) with each pre-tokenizer, ids, text, specials, templates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from gguf_kit import write_gguf
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, trainers

from expresslane.assets import TRAINED
from expresslane.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

MIXED = [
    "def f(x):\n    return x**2  # 123 ✓ café 日本語\t\t  spaces   <|im_end|> hi<|im_start|>x",
    " leading space, then  two and\n\n\nlines",
    "  42 it's I'LL   \n",
    "<s>[INST] hi </s>",
    "",
]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = [{"role": "user", "content": "hi there ✓"}]


def _spm_meta(merges: bool, prefix: bool | None) -> dict:
    """The embedded model's byte-fallback BPE vocabulary, written as llama.cpp writes a
    SentencePiece one (scores by rank, token types), merges optional."""
    d = json.loads((TRAINED / "tokenizer.json").read_text())
    tokens = sorted(d["model"]["vocab"], key=d["model"]["vocab"].get)
    types = [2 if i == 0 else 3 if i in (1, 2) else 6 if t.startswith("<0x") else 1
             for i, t in enumerate(tokens)]  # fmt: skip
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [-float(i) if k == 1 else 0.0 for i, k in enumerate(types)],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.chat_template": TEMPLATE,
    }
    if merges:
        meta["tokenizer.ggml.merges"] = [" ".join(m) for m in d["model"]["merges"]]
    if prefix is not None:
        meta["tokenizer.ggml.add_space_prefix"] = prefix
    return meta


@pytest.fixture(scope="module")
def bpe_vocab():
    """A small byte-level BPE trained here on the json package's source, with three specials
    and one user-defined token."""
    corpus = [p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py"))]
    tk = HFTokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
    tk.train_from_iterator(
        corpus + ["héllo wörld 日本語 ✓ 12345 café"] * 5,
        trainers.BpeTrainer(
            vocab_size=600,
            special_tokens=specials,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),  # fmt: skip
    )
    model = json.loads(tk.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def _bpe_meta(vocab, pre: str) -> dict:
    tokens, merges = vocab
    types = [4 if t == "<think>" else 3 if t.startswith("<|") else 1 for t in tokens]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.eot_token_id": 0,
        "tokenizer.chat_template": TEMPLATE,
    }


def _pair(tmp_path, meta):
    write_gguf(tmp_path / "t.gguf", "llama", meta, {})
    ours = Tokenizer.from_dir(tmp_path / "t.gguf")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    return ours, theirs


def _same(ours, theirs, texts=MIXED):
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs(text)["input_ids"], text
        assert ours.encode(text, add_special_tokens=False) == theirs.encode(
            text, add_special_tokens=False
        )
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True
        )
    rendered = theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CHAT) == rendered
    assert ours.encode_chat(CHAT) == theirs.encode(rendered, add_special_tokens=False)


@pytest.mark.parametrize("merges", [False, True], ids=["merges-from-scores", "merges-in-file"])
def test_sentencepiece_vocabulary_equals_transformers(tmp_path, merges):
    ours, theirs = _pair(tmp_path, _spm_meta(merges, None))
    _same(ours, theirs)
    assert ours.add_bos and ours.bos_id == 1 and ours.eos_ids == (2,)
    assert ours.decode(ours.encode("naïve ✓")).endswith("naïve ✓")  # byte fallback round trip


def test_sentencepiece_without_space_prefix(tmp_path):
    """add_space_prefix=false: no "▁" before the text, as llama.cpp tokenizes it (transformers'
    GGUF loader ignores the flag, so it is no reference here)."""
    write_gguf(tmp_path / "p.gguf", "llama", _spm_meta(True, True), {})
    write_gguf(tmp_path / "n.gguf", "llama", _spm_meta(True, False), {})
    with_prefix, without = (Tokenizer.from_dir(tmp_path / f) for f in ("p.gguf", "n.gguf"))
    a, b = with_prefix.encode("def f", False), without.encode("def f", False)
    assert with_prefix.id_to_piece(a[0]).startswith("▁")
    assert not without.id_to_piece(b[0]).startswith("▁") and a[1:] == b[1:]
    assert without.decode(b) == "def f" == with_prefix.decode(a)


@pytest.mark.parametrize("pre", ["gpt2", "llama-bpe", "qwen2"])
def test_byte_level_bpe_equals_transformers(tmp_path, bpe_vocab, pre):
    ours, theirs = _pair(tmp_path, _bpe_meta(bpe_vocab, pre))
    _same(ours, theirs)
    for text in MIXED:
        assert ours.decode(ours.encode(text)) == text
    assert not ours.add_bos and ours.eos_ids == (2, 0)  # EOS, then EOT
    think = ours.encode("a<think>b", add_special_tokens=False)
    assert bpe_vocab[0].index("<think>") in think  # a user-defined token stays whole
    assert ours.special_ids == {0, 1, 2}


def test_smollm_pre_tokenizer_isolates_digits(tmp_path, bpe_vocab):
    """llama.cpp's `smollm` (and `starcoder`...) pre-tokenizer splits every digit off before
    GPT-2's regex, as SmolLM's own tokenizer.json does with Digits(individual_digits=True).
    transformers' GGUF loader does not know `smollm` and skips that step, so the reference here
    is that tokenizer.json pipeline, built directly."""
    write_gguf(tmp_path / "t.gguf", "llama", _bpe_meta(bpe_vocab, "smollm"), {})
    ours = Tokenizer.from_dir(tmp_path / "t.gguf")
    tokens, merges = bpe_vocab
    ref = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)},
                                 [tuple(m.split(" ")) for m in merges]))  # fmt: skip
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(False)]
    )
    for text in ("x = 12345", "\n  42 and 7.5", "a1b22c333", "no digits here"):
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text).ids, text


def test_a_tokenizer_folder_beside_the_gguf_wins(tmp_path, bpe_vocab):
    write_gguf(tmp_path / "t.gguf", "llama", _bpe_meta(bpe_vocab, "gpt2"), {})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TRAINED / f, tmp_path / f)
    tok = Tokenizer.from_dir(tmp_path / "t.gguf")
    assert tok.folder == tmp_path and tok.vocab_size == 4096  # the embedded model's tokenizer
    assert Tokenizer.from_dir(tmp_path).vocab_size == 4096


def test_named_chat_templates_and_unknown_models(tmp_path, bpe_vocab):
    from expresslane.errors import TokenizerError

    meta = {**_bpe_meta(bpe_vocab, "gpt2"), "tokenizer.chat_template.tool_use": "{{ 'tools' }}"}
    write_gguf(tmp_path / "t.gguf", "llama", meta, {})
    tok = Tokenizer.from_dir(tmp_path / "t.gguf")
    assert tok.apply_chat_template(CHAT, tools=[{"name": "f"}]) == "tools"
    assert tok.apply_chat_template(CHAT).startswith("<|im_start|>user")
    for key, value, word in (("tokenizer.ggml.model", "bert", "bert"),
                             ("tokenizer.ggml.pre", "mystery", "mystery")):  # fmt: skip
        write_gguf(tmp_path / "b.gguf", "llama", {**meta, key: value}, {})
        with pytest.raises(TokenizerError, match=word):
            Tokenizer.from_dir(tmp_path / "b.gguf")
