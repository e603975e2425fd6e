"""Tokenizer layer: byte-fallback round trips, streaming detokenization, chat templates checked
against transformers, stop strings, SentencePiece models and error messages."""

import inspect
import json
import random
import shutil
import textwrap

import pytest

from expresslane.errors import TokenizerError
from expresslane.tokenizer import (
    LANEFORMER_CHAT_TEMPLATE,
    IncrementalDetokenizer,
    Tokenizer,
)
from expresslane.train.tokenizer_train import tiny_corpus, train_tiny_tokenizer, train_tokenizer

# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture(scope="session")
def tok(tiny_dir):
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="session")
def sp_dir(tmp_path_factory):
    spm = pytest.importorskip("sentencepiece")
    folder = tmp_path_factory.mktemp("sp_tokenizer")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(tiny_corpus()), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(folder / "tokenizer"), model_type="bpe",
        vocab_size=400, byte_fallback=True, split_digits=True, character_coverage=1.0,
        # Llama 2's settings: no NFKC, no whitespace folding, so every text round-trips.
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2,
    )  # fmt: skip
    corpus.unlink()
    return folder


def _hf(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _variant(src, dst, config_update=None, files=None):
    """A copy of tokenizer folder `src` with tokenizer_config.json fields and files replaced."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    config.update(config_update or {})
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (dst / name).write_text(text)
    return dst


def _random_texts(seed, count=60):
    rng = random.Random(seed)
    ranges = [(0, 0x80), (0x80, 0x800), (0x4E00, 0xA000), (0x1F300, 0x1F650), (0, 0x20)]
    texts = []
    for _ in range(count):
        chars = [chr(rng.randrange(*rng.choice(ranges))) for _ in range(rng.randrange(0, 40))]
        texts.append("".join(chars).replace("\u2581", "_"))  # "▁" is the space marker itself
        texts.append(rng.randbytes(rng.randrange(0, 40)).decode("utf-8", errors="replace"))
    return texts


PYTHON_SOURCE = inspect.getsource(textwrap)[:4000]

# ---------------------------------------------------------------------------- ids and round trips


def test_llama_layout_and_vocab_size(tok):
    assert (tok.bos_id, tok.eos_ids, tok.add_bos) == (1, (2,), True)
    assert [tok.id_to_piece(i) for i in (0, 1, 2, 3, 13, 258)] == [
        "<unk>", "<s>", "</s>", "<0x00>", "<0x0A>", "<0xFF>"
    ]  # fmt: skip
    assert tok.vocab_size == 512 and tok.vocab_size % 8 == 0
    assert tok.encode("x")[0] == 1 and tok.encode("x", add_special_tokens=False)[0] != 1
    assert tok.encode("7 and 42", add_special_tokens=False)[-2:] == [
        tok.encode("4", add_special_tokens=False)[-1], tok.encode("2", add_special_tokens=False)[-1]
    ]  # fmt: skip


def test_vocab_rounded_and_padded_to_lanes(tmp_path):
    folder = train_tokenizer(tiny_corpus()[:1], 1001, tmp_path / "t", lanes=8)
    tk = Tokenizer.from_dir(folder)
    assert tk.vocab_size == 1008  # the small corpus stops short: padding fills the rest
    assert tk.id_to_piece(1007).startswith("<unused")
    assert len(_hf(folder)) == 1008


def test_round_trip_exact(tok):
    for text in _random_texts(0) + [PYTHON_SOURCE, "", " lead", "trail  ", "a\r\n\tb 123"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


def test_ids_match_transformers(tiny_dir, tok):
    hf = _hf(tiny_dir)
    assert type(hf).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    for text in _random_texts(1, count=10) + [PYTHON_SOURCE, "a</s>b <s>"]:
        ids = tok.encode(text)
        assert ids == hf(text)["input_ids"]
        assert tok.decode(ids) == hf.decode(ids)


def test_special_token_dicts_and_generation_config(tiny_dir, tmp_path):
    bos = {"content": "<s>", "lstrip": False, "normalized": False, "__type": "AddedToken"}
    folder = _variant(tiny_dir, tmp_path / "v", {"bos_token": bos}, {
        "generation_config.json": json.dumps({"eos_token_id": [2, 7, 2]})
    })  # fmt: skip
    tk = Tokenizer.from_dir(folder)
    assert (tk.bos_id, tk.eos_ids) == (1, (2, 7))


# ---------------------------------------------------------------------------- streaming


def _stream(tk, ids, skip=False):
    detok = IncrementalDetokenizer(tk, skip_special_tokens=skip)
    chunks = [detok.push(i) for i in ids]
    return chunks, "".join(chunks) + detok.flush()


@pytest.mark.parametrize("low", [3, 0])
def test_stream_random_ids_equals_decode(tok, low):
    rng = random.Random(low)
    for n in range(80):
        hi = 259 if n % 3 == 0 else tok.vocab_size  # every third: bytes only, mostly invalid UTF-8
        ids = [rng.randrange(low, hi) for _ in range(rng.randrange(1, 30))]
        for skip in (False, True):
            assert _stream(tok, ids, skip)[1] == tok.decode(ids, skip_special_tokens=skip), ids


def test_stream_after_a_prompt_equals_decoding_both(tok):
    """The text generated after a prompt is decode(prompt + output) minus decode(prompt): the
    first token keeps its leading space (a SentencePiece decoder strips it from a lone token)."""
    ids = tok.encode(PYTHON_SOURCE, add_special_tokens=False)
    rng = random.Random(5)
    spaced = 0
    for _ in range(60):
        cut = rng.randrange(1, len(ids) - 1)
        prompt, out = ids[:cut], ids[cut : cut + rng.randrange(1, 20)]
        whole, head = tok.decode(prompt + out), tok.decode(prompt)
        if not whole.startswith(head) or head.endswith("\ufffd"):
            continue  # the cut falls inside a character: no text boundary to compare at
        detok = IncrementalDetokenizer(tok, context=prompt)
        text = "".join(detok.push(t) for t in out) + detok.flush()
        assert text == whole[len(head) :], (prompt[-5:], out)
        spaced += text.startswith(" ")
    assert spaced > 0  # the case the context exists for was met


def test_stream_valid_text_never_emits_partial_characters(tok):
    for text in _random_texts(2, count=30)[::2] + [PYTHON_SOURCE]:
        chunks, joined = _stream(tok, tok.encode(text, add_special_tokens=False))
        assert joined == text
        assert not any("\ufffd" in c for c in chunks) or "\ufffd" in text


def test_stream_byte_level_tokenizer(tmp_path):
    # GPT-2 / Llama 3 style: bytes mapped to printable characters, lossy UTF-8 on decode.
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, show_progress=False)
    hf.train_from_iterator(tiny_corpus(), trainer)
    (tmp_path / "bl").mkdir()
    hf.save(str(tmp_path / "bl" / "tokenizer.json"))
    tk, rng = Tokenizer.from_dir(tmp_path / "bl"), random.Random(6)
    assert not tk.add_bos and tk.decode(tk.encode(PYTHON_SOURCE)) == PYTHON_SOURCE
    for _ in range(60):
        ids = [rng.randrange(0, tk.vocab_size) for _ in range(rng.randrange(1, 25))]
        assert _stream(tk, ids)[1] == tk.decode(ids)
    for text in _random_texts(7, count=20)[::2]:
        chunks, joined = _stream(tk, tk.encode(text))
        assert joined == text and not any("\ufffd" in c for c in chunks)


# ---------------------------------------------------------------------------- chat templates

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  Hi there \n\t"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "\n4 "},
        {"role": "user", "content": "And 3+3?", "name": None},
        {"role": "assistant", "content": "6"},
        {"role": "user", "content": "héllo 😀 <b>&"},
    ],
]

LLAMA3_STYLE = """{{- bos_token }}
{%- if tools %}{{- 'Tools: ' + tools | tojson(indent=2) + '\n' }}{%- endif %}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- generation %}{{- message['content'] | trim }}{%- endgeneration %}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""


def _assert_same_chat(tk, hf, conversation, **kwargs):
    ours = tk.apply_chat_template(conversation, add_generation_prompt=True, **kwargs)
    theirs = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                    **kwargs)  # fmt: skip
    assert ours == theirs
    return ours


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_laneformer_template_matches_transformers(tiny_dir, tok, conversation):
    hf = _hf(tiny_dir)
    text = _assert_same_chat(tok, hf, conversation)
    assert text.startswith("<s><|start_header_id|>user<|end_header_id|>\n\n")
    assert text.endswith("</s><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert "Be brief" not in text
    ids = hf.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
    assert tok.encode_chat(conversation) == list(getattr(ids, "input_ids", ids))
    cont = conversation + [{"role": "assistant", "content": "The answer is "}]
    theirs = hf.apply_chat_template(cont, tokenize=False, continue_final_message=True)
    assert tok.apply_chat_template(cont, continue_final_message=True) == theirs
    assert theirs.endswith("<|end_header_id|>\n\nThe answer is")


def test_laneformer_template_rejects_other_roles(tok):
    with pytest.raises(TokenizerError, match="Only 'user' and 'assistant' roles.*'tool'"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    assert tok.chat_templates == {"default": LANEFORMER_CHAT_TEMPLATE}


def test_config_template_and_jinja_file(tiny_dir, tmp_path):
    tools = [{"type": "function", "function": {"name": "f<&>", "description": "ünï"}}]
    listed = [{"name": "default", "template": LLAMA3_STYLE}, {"name": "tool_use", "template": "T"}]
    cases = [
        (_variant(tiny_dir, tmp_path / "cfg", {"chat_template": LLAMA3_STYLE}), {}),
        (_variant(tiny_dir, tmp_path / "lst", {"chat_template": listed}), {}),
        (_variant(tiny_dir, tmp_path / "jinja", {}, {"chat_template.jinja": LLAMA3_STYLE}), {}),
        (_variant(tiny_dir, tmp_path / "tools", {"chat_template": LLAMA3_STYLE}), {"tools": tools}),
    ]
    for folder, kwargs in cases:
        tk, hf = Tokenizer.from_dir(folder), _hf(folder)
        for conversation in CONVERSATIONS:
            text = _assert_same_chat(tk, hf, conversation, **kwargs)
            assert "<|eot_id|>" in text and ("Tools" in text) == bool(kwargs)
        cont = CONVERSATIONS[2] + [{"role": "assistant", "content": "Sure, "}]
        theirs = hf.apply_chat_template(cont, tokenize=False, continue_final_message=True)
        assert tk.apply_chat_template(cont, continue_final_message=True) == theirs


# ---------------------------------------------------------------------------- bad input


def test_errors_name_the_file(tiny_dir, tmp_path):
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="neither tokenizer.json nor tokenizer.model"):
        Tokenizer.from_dir(tmp_path / "empty")
    bad_json = _variant(tiny_dir, tmp_path / "j", files={"tokenizer.json": "{not json"})
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(bad_json)
    bad_cfg = _variant(tiny_dir, tmp_path / "c", files={"tokenizer_config.json": '{"a": '})
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_dir(bad_cfg)
    bad_tok = _variant(tiny_dir, tmp_path / "t", {"bos_token": "<bos>"})
    with pytest.raises(TokenizerError, match="bos_token '<bos>' is not in the vocabulary"):
        Tokenizer.from_dir(bad_tok)
    bad_gen = _variant(
        tiny_dir, tmp_path / "g", files={"generation_config.json": '{"eos_token_id": "x"}'}
    )  # noqa: E501
    with pytest.raises(TokenizerError, match="generation_config.json.*eos_token_id"):
        Tokenizer.from_dir(bad_gen)


def test_template_errors(tiny_dir, tmp_path):
    raising = "{{ raise_exception('no system prompts, please') }}"
    tk = Tokenizer.from_dir(_variant(tiny_dir, tmp_path / "r", {"chat_template": raising}))
    with pytest.raises(TokenizerError, match="no system prompts, please"):
        tk.apply_chat_template(CONVERSATIONS[0])
    tk = Tokenizer.from_dir(_variant(tiny_dir, tmp_path / "n", {"chat_template": None}))
    with pytest.raises(TokenizerError, match="no chat template"):
        tk.apply_chat_template(CONVERSATIONS[0])
    tk = Tokenizer.from_dir(_variant(tiny_dir, tmp_path / "s", {"chat_template": "{% if %}"}))
    with pytest.raises(TokenizerError, match="chat template"):
        tk.apply_chat_template(CONVERSATIONS[0])


# ---------------------------------------------------------------------------- SentencePiece


def test_sentencepiece_model(sp_dir):
    tk = Tokenizer.from_dir(sp_dir)
    assert (tk.bos_id, tk.eos_ids, tk.add_bos, tk.vocab_size) == (1, (2,), True, 400)
    assert tk.id_to_piece(3) == "<0x00>" and len(tk.byte_ids) == 256
    for text in _random_texts(4, count=30) + [PYTHON_SOURCE, " lead  ", ""]:
        ids = tk.encode(text)
        assert ids[0] == 1 and tk.decode(ids, skip_special_tokens=True) == text
        assert tk.decode(ids[1:]) == text
    assert tk.encode("a</s>b", add_special_tokens=False)[1:-1].count(2) == 1
    rng = random.Random(5)
    for _ in range(40):
        ids = [rng.randrange(0, tk.vocab_size) for _ in range(rng.randrange(1, 25))]
        assert _stream(tk, ids)[1] == tk.decode(ids)


def test_template_raising_any_exception_is_a_tokenizer_error(tiny_dir, tmp_path):
    for i, source in enumerate(["{% for i in range(10**9) %}{% endfor %}", "{{ 1 + 'a' }}"]):
        tk = Tokenizer.from_dir(_variant(tiny_dir, tmp_path / f"x{i}", {"chat_template": source}))
        with pytest.raises(TokenizerError, match="chat template"):
            tk.apply_chat_template(CONVERSATIONS[0])


# ---------------------------------------------------------------------------- length bound


def test_min_tokens_never_exceeds_the_real_count(tok, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    hf.train_from_iterator(tiny_corpus() + [" " * 64, "\n" + " " * 40], trainer)
    (tmp_path / "bl").mkdir()
    hf.save(str(tmp_path / "bl" / "tokenizer.json"))
    rng = random.Random(3)
    pieces = ["a", " ", "    ", "\n", "é", "😀", "#", "0", "<s>", "</s>", "\u2581", "\u0301"]
    texts = _random_texts(9, count=20) + [PYTHON_SOURCE, " " * 500, "<s>" * 50]
    for _ in range(40):
        texts.append("".join(rng.choice(pieces) * rng.randint(1, 80) for _ in range(20)))
    for tk in (tok, Tokenizer.from_dir(tmp_path / "bl")):
        assert tk.min_tokens("x" * 10**6) > 1000  # a bound is given for these pipelines
        for text in texts:
            assert tk.min_tokens(text) <= len(tk.encode(text, add_special_tokens=False)), text
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # drops whitespace: no bound
    (tmp_path / "ws").mkdir()
    hf.save(str(tmp_path / "ws" / "tokenizer.json"))
    assert Tokenizer.from_dir(tmp_path / "ws").min_tokens(" " * 10**5 + "a") == 0
