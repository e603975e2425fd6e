"""Reading a tokenizer folder: JSON files, special tokens, and the two backends.

`tokenizer.json` goes through the `tokenizers` library, `tokenizer.model` through SentencePiece.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import TokenizerError
from .bounds import max_text_bytes_per_token
from .chat import SPECIAL_TOKEN_KEYS

LONG_TEXT = 4096  # characters: longer texts are encoded with the GIL released

# ---------------------------------------------------------------------------- file reading


def _read_json(path: Path) -> dict:
    """A JSON object from `path`, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: not readable as JSON ({e})") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any, where: str) -> str | None:
    """A special token written as a string or as an AddedToken dict {"content": ...}."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{where}: expected a string or {{'content': str}}, got {value!r}")


def _named_specials(folder: Path, config: dict, token_map: dict, backend) -> dict:
    """Named special tokens: tokenizer_config.json first, special_tokens_map.json fills gaps."""
    specials = {}
    for key in SPECIAL_TOKEN_KEYS:
        src, value = "tokenizer_config.json", config.get(key)
        if value is None:
            src, value = "special_tokens_map.json", token_map.get(key)
        text = _token_text(value, f"{folder / src}: field '{key}'")
        specials[key] = text if text is not None else backend.default_special(key)
    return specials


def _chat_templates(folder: Path, config: dict) -> dict[str, str]:
    """Named templates; chat_template.jinja beats tokenizer_config.json, as in transformers 5."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return {"default": jinja_file.read_text(encoding="utf-8")}
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{jinja_file}: not readable ({e})") from e
    value = config.get("chat_template")
    where = f"{folder / 'tokenizer_config.json'}: field 'chat_template'"
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(
        isinstance(t, dict)
        and isinstance(t.get("name"), str)
        and isinstance(t.get("template"), str)
        for t in value
    ):
        return {t["name"]: t["template"] for t in value}
    raise TokenizerError(f"{where}: expected a string or a list of {{name, template}} objects")


# ---------------------------------------------------------------------------- backends


class _TokenizersBackend:
    """A `tokenizer.json`, run by the `tokenizers` library (the fast path, as in transformers)."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            self.tk = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for any parse error
            raise TokenizerError(f"{path}: cannot load tokenizer ({e})") from e
        # A tokenizer.json may carry truncation or padding settings; transformers drops them too.
        self.tk.no_truncation()
        self.tk.no_padding()
        self.has_post_processor = self.tk.post_processor is not None
        added = self.tk.get_added_tokens_decoder().items()
        self.special_ids = frozenset(i for i, t in added if t.special)

    def encode(self, text: str) -> list[int]:
        if len(text) > LONG_TEXT:  # encode_batch releases the GIL, encode holds it throughout
            return self.tk.encode_batch([text], add_special_tokens=False)[0].ids
        return self.tk.encode(text, add_special_tokens=False).ids

    def max_text_bytes_per_token(self) -> int | None:
        return max_text_bytes_per_token(self.tk)

    def encode_with_post_processor(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def piece(self, token_id: int) -> str | None:
        return self.tk.id_to_token(token_id)

    def token_id(self, piece: str) -> int | None:
        return self.tk.token_to_id(piece)

    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def default_special(self, key: str) -> str | None:
        return None


class _SentencePieceBackend:
    """A SentencePiece `tokenizer.model`. Special tokens in the text are matched, as HF does."""

    def __init__(self, path: Path):
        try:
            import sentencepiece
        except ImportError as e:
            raise TokenizerError(f"{path}: reading it needs `pip install sentencepiece`") from e
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"{path}: cannot load SentencePiece model ({e})") from e
        n = self.sp.get_piece_size()
        self.special_ids = frozenset(
            i for i in range(n) if self.sp.is_control(i) or self.sp.is_unknown(i)
        )
        by_length = sorted((self.sp.id_to_piece(i) for i in self.special_ids), key=len)
        self.split_re = re.compile("(" + "|".join(map(re.escape, reversed(by_length))) + ")")
        self.has_post_processor = False

    def encode(self, text: str) -> list[int]:
        # Each segment between special tokens gets its own dummy prefix ("legacy" behaviour,
        # identical to Llama 2's tokenizer.json normalizer).
        ids: list[int] = []
        for i, part in enumerate(self.split_re.split(text) if self.special_ids else [text]):
            if i % 2:
                ids.append(self.sp.piece_to_id(part))
            elif part:
                ids.extend(self.sp.encode(part))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        # SentencePiece prints control tokens as "", so runs of ordinary ids are decoded
        # between them and the special pieces are written out, as HF's decode does.
        out, run = [], []
        for t in (t for t in ids if 0 <= t < self.sp.get_piece_size()):  # HF drops unknown ids
            if t not in self.special_ids:
                run.append(t)
                continue
            out.append(self.sp.decode(run))
            run = []
            if not skip_special_tokens:
                out.append(self.sp.id_to_piece(t))
        out.append(self.sp.decode(run))
        return "".join(out)

    def piece(self, token_id: int) -> str | None:
        if 0 <= token_id < self.sp.get_piece_size():
            return self.sp.id_to_piece(token_id)
        return None

    def token_id(self, piece: str) -> int | None:
        i = self.sp.piece_to_id(piece)
        return None if i == self.sp.unk_id() and piece != self.sp.id_to_piece(i) else i

    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def max_text_bytes_per_token(self) -> int | None:
        return None  # the model's normalizer may collapse whitespace: no bound from length

    def default_special(self, key: str) -> str | None:
        i = {"bos_token": self.sp.bos_id(), "eos_token": self.sp.eos_id()}.get(key, -1)
        return self.sp.id_to_piece(i) if i >= 0 else None
