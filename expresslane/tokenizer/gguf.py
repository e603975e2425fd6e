"""The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata, as a `tokenizers` one.

Two vocabulary models, as llama.cpp names them:

- `gpt2`: byte-level BPE. Tokens are stored in GPT-2's byte alphabet, merges as "a b" strings;
  the text is split first by the regexes llama.cpp uses for `tokenizer.ggml.pre` (GPT-2's,
  Llama 3's, Qwen2's, or single digits then GPT-2's for SmolLM/StarCoder).
- `llama`: SentencePiece BPE with byte fallback (`<0x0A>` tokens). Merges are taken from the file
  or rebuilt from the scores (a pair ranks by its merged piece's score, as SentencePiece merges),
  and `add_space_prefix` decides the leading "▁", as transformers' LlamaTokenizer does.

Token types mark the added tokens: CONTROL (and UNKNOWN) become special tokens matched whole in
the text, USER_DEFINED plain added tokens. BOS/EOS/UNK/PAD come from their ids, add-BOS from
`tokenizer.ggml.add_bos_token` (default: yes for `llama`, no for `gpt2`), the chat template from
`tokenizer.chat_template` (and `tokenizer.chat_template.NAME`). Ids are the file's.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ..errors import CheckpointError, TokenizerError
from ..gguf.reader import GGUFHeader, read_header
from .backends import _TokenizersBackend

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (regexes applied in turn before GPT-2's own, or None for none of them;
# whether the final byte-level step also applies GPT-2's regex), as in llama.cpp's llama-vocab.
_PRE = {
    **dict.fromkeys(("default", "gpt2", "gpt-2", "mpt", "olmo", "jais"), ((), True)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
        ((r"\p{N}",), True),
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "smaug-bpe", "dbrx"),
        ((_LLAMA3,), False),
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), ((_QWEN2,), False)),
}
_IGNORE_MERGES = ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "smaug-bpe", "dbrx")


class _GGUFBackend(_TokenizersBackend):
    """The tokenizers backend over a tokenizer built in memory instead of read from a file."""

    def __init__(self, tk: HFTokenizer):
        self.tk = tk
        self.has_post_processor = False  # BOS/EOS are added from the config's add_*_token
        added = tk.get_added_tokens_decoder().items()
        self.special_ids = frozenset(i for i, t in added if t.special)


def tokenizer_parts(path: Path) -> tuple:
    """What Tokenizer(...) takes: (backend, folder, config, named specials, extra stop ids)."""
    try:
        header = read_header(path)
    except CheckpointError as e:
        raise TokenizerError(str(e)) from None
    g = header.get
    tokens = g("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise TokenizerError(
            f"{path}: no tokenizer.ggml.tokens in the metadata; put the model's tokenizer files "
            "beside the GGUF"
        )
    kind = g("tokenizer.ggml.model")
    types = g("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise TokenizerError(
            f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    if kind == "gpt2":
        tk = _byte_level(header, tokens)
    elif kind == "llama":
        tk = _sentencepiece(header, tokens)
    else:
        raise TokenizerError(
            f"{path}: tokenizer.ggml.model={kind!r} is not supported (gpt2 or llama); put the "
            "model's tokenizer.json beside the GGUF"
        )
    _add_tokens(tk, tokens, types)
    specials = {
        name: _token(tokens, g(f"tokenizer.ggml.{key}_token_id"))
        for name, key in (
            ("bos_token", "bos"),
            ("eos_token", "eos"),
            ("unk_token", "unknown"),
            ("pad_token", "padding"),
        )  # fmt: skip
    }
    config = {
        "add_bos_token": bool(g("tokenizer.ggml.add_bos_token", kind == "llama")),
        "add_eos_token": bool(g("tokenizer.ggml.add_eos_token", False)),
        **_chat_template(header),
    }
    stop = header.end_of_generation_ids()  # EOS comes first in eos_ids all the same
    return _GGUFBackend(tk), header.path, config, specials, stop


def _token(tokens: list[str], token_id) -> str | None:
    return tokens[token_id] if isinstance(token_id, int) and 0 <= token_id < len(tokens) else None


def _byte_level(header: GGUFHeader, tokens: list[str]) -> HFTokenizer:
    pre = header.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE:
        raise TokenizerError(
            f"{header.path}: tokenizer.ggml.pre={pre!r} is not a pre-tokenizer ExpressLane knows "
            f"({', '.join(sorted(_PRE))}); put the model's tokenizer.json beside the GGUF"
        )
    regexes, gpt2_regex = _PRE[pre]
    merges = [tuple(m.split(" ", 1)) for m in header.get("tokenizer.ggml.merges") or []]
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES))
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=gpt2_regex))
    tk.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tk.decoder = decoders.ByteLevel()
    return tk


def _sentencepiece(header: GGUFHeader, tokens: list[str]) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = header.get("tokenizer.ggml.merges")
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        scores = header.get("tokenizer.ggml.scores") or [-float(i) for i in range(len(tokens))]
        pairs = merges_from_scores(tokens, scores)
    unk = _token(tokens, header.get("tokenizer.ggml.unknown_token_id"))
    tk = HFTokenizer(
        models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    prefix = bool(header.get("tokenizer.ggml.add_space_prefix", True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tk.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tk


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a piece into two pieces,
    best merged-piece score first; ties: longer left part first, then vocabulary order."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for piece, i in ids.items():
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        local = sorted((p for p in local if p[0] in ids and p[1] in ids),
                       key=lambda p: (ids[p[0]], ids[p[1]]))  # fmt: skip
        found += [(-scores[i], -len(left), -len(right), left, right) for left, right in local]
    found.sort(key=lambda m: m[:3])  # stable: equal keys keep vocabulary order
    return [(left, right) for *_, left, right in found]


def _add_tokens(tk: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """CONTROL and UNKNOWN tokens as special tokens, USER_DEFINED ones as plain added tokens."""
    special = [t for t, k in zip(tokens, types, strict=True) if k in (CONTROL, UNKNOWN)]
    user = [t for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED]
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _chat_template(header: GGUFHeader) -> dict:
    named = {
        k.removeprefix("tokenizer.chat_template."): v
        for k, v in header.metadata.items()
        if k.startswith("tokenizer.chat_template.") and isinstance(v, str)
    }
    default = header.get("tokenizer.chat_template")
    if not named:
        return {"chat_template": default} if isinstance(default, str) else {}
    if isinstance(default, str):
        named = {"default": default, **named}
    return {"chat_template": [{"name": n, "template": t} for n, t in named.items()]}
