"""The Tokenizer: a Hugging Face tokenizer folder -> ids and back, and chat prompts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2

from ..errors import CheckpointError, TokenizerError
from .backends import (
    _chat_templates,
    _named_specials,
    _read_json,
    _SentencePieceBackend,
    _TokenizersBackend,
)
from .bounds import text_bytes
from .chat import (
    _compile_template,
    _cut_after_final_message,
    _plain_messages,
    _tag_final_message,
)

# ---------------------------------------------------------------------------- the tokenizer


class Tokenizer:
    """Text <-> ids for one tokenizer folder, plus its chat template and stop token ids."""

    def __init__(self, backend, folder: Path, config: dict, specials: dict, eos_extra: list):
        self._backend = backend
        self.folder = folder
        self.source: Path | None = None  # the path from_dir read (None: built in code)
        self.special_tokens = {k: v for k, v in specials.items() if v is not None}
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.bos_id = self._special_id("bos_token")
        eos_id = self._special_id("eos_token")
        first = [eos_id] if eos_id is not None else []
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(first + eos_extra))
        self.chat_templates = _chat_templates(folder, config)
        self._prefix_ids, self._suffix_ids = self._special_affixes(config)
        self.byte_ids = frozenset(
            i for i in map(backend.token_id, (f"<0x{b:02X}>" for b in range(256))) if i is not None
        )
        self.special_ids: frozenset[int] = backend.special_ids
        self._atomic_byte_runs: bool | None = None
        self._max_token_bytes: int | None = None  # min_tokens' bound, computed on first use

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """A tokenizer folder, or a GGUF file (or a folder holding one) whose metadata describes
        the tokenizer; tokenizer files beside a GGUF take precedence over its metadata."""
        tok = cls._from_dir(Path(path))
        tok.source = Path(path)  # what another process loads the same tokenizer from
        return tok

    @classmethod
    def _from_dir(cls, folder: Path) -> Tokenizer:
        gguf = gguf_file(folder)
        if gguf is not None:
            if not _has_tokenizer_files(gguf.parent):
                from .gguf import tokenizer_parts

                return cls(*tokenizer_parts(gguf))
            folder = gguf.parent
        if not folder.is_dir():
            raise TokenizerError(f"tokenizer folder {folder} does not exist or is not a folder")
        if (folder / "tokenizer.json").is_file():
            backend = _TokenizersBackend(folder / "tokenizer.json")
        elif (folder / "tokenizer.model").is_file():
            backend = _SentencePieceBackend(folder / "tokenizer.model")
        else:
            raise TokenizerError(f"{folder}: has neither tokenizer.json nor tokenizer.model")
        config = _read_json(folder / "tokenizer_config.json")
        token_map = _read_json(folder / "special_tokens_map.json")
        specials = _named_specials(folder, config, token_map, backend)
        eos_extra = _generation_eos_ids(folder / "generation_config.json")
        return cls(backend, folder, config, specials, eos_extra)

    # ---- ids

    def _special_id(self, key: str) -> int | None:
        text = self.special_tokens.get(key)
        if text is None:
            return None
        token_id = self._backend.token_id(text)
        if token_id is None:
            raise TokenizerError(f"{self.folder}: {key} {text!r} is not in the vocabulary")
        return token_id

    def _special_affixes(self, config: dict) -> tuple[list[int], list[int]]:
        """The ids `encode(text)` puts around the text when add_special_tokens is true."""
        if self._backend.has_post_processor:
            # transformers 5 lets tokenizer.json's post-processor decide; find what it adds.
            plain = self._backend.encode("a")
            full = self._backend.encode_with_post_processor("a")
            for k in range(len(full) - len(plain) + 1):
                if full[k : k + len(plain)] == plain:
                    return full[:k], full[k + len(plain) :]
            raise TokenizerError(f"{self.folder / 'tokenizer.json'}: unsupported post_processor")
        # No post-processor: tokenizer_config.json says. Defaults follow transformers: a
        # SentencePiece model is read as LlamaTokenizer (BOS yes), a tokenizer.json adds nothing.
        default_bos = isinstance(self._backend, _SentencePieceBackend)
        add_bos = config.get("add_bos_token", default_bos)
        bos = [self.bos_id] if add_bos and self.bos_id is not None else []
        eos = self._special_id("eos_token") if config.get("add_eos_token", False) else None
        return bos, [eos] if eos is not None else []

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included (HF's len(tokenizer))."""
        return self._backend.vocab_size()

    @property
    def add_bos(self) -> bool:
        """Whether encode(text) starts with BOS (HF's tokenizer(text) behaviour)."""
        return self.bos_id is not None and self._prefix_ids[:1] == [self.bos_id]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._backend.encode(text)
        if add_special_tokens:
            ids = self._prefix_ids + ids + self._suffix_ids
        return ids

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)) from the text's length alone (bounds.py); 0 when
        the tokenizer gives no such bound. Cheap: a prompt it proves too long is never encoded."""
        if self._max_token_bytes is None:
            bound = getattr(self._backend, "max_text_bytes_per_token", lambda: None)()
            self._max_token_bytes = bound or 0
        if not self._max_token_bytes:
            return 0
        return -(-text_bytes(text) // self._max_token_bytes)

    @property
    def special_affixes(self) -> tuple[list[int], list[int]]:
        """The ids encode(text, add_special_tokens=True) puts before and after the text."""
        return list(self._prefix_ids), list(self._suffix_ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(ids, skip_special_tokens)

    def id_to_piece(self, token_id: int) -> str:
        piece = self._backend.piece(token_id)
        if piece is None:
            raise TokenizerError(
                f"token id {token_id} is outside the vocabulary ({self.vocab_size})"
            )
        return piece

    def atomic_byte_runs(self) -> bool:
        """True if one invalid byte turns a whole run of byte tokens into U+FFFD characters.

        tokenizers' ByteFallback decoder does that ("é" + 0xFF decodes to three U+FFFD),
        SentencePiece does not; a streaming detokenizer must then hold a run until it ends.
        """
        if self._atomic_byte_runs is None:
            ids = [self._backend.token_id(f"<0x{b:02X}>") for b in (0xC3, 0xA9, 0xFF)]
            self._atomic_byte_runs = None not in ids and self.decode(ids) != "é\ufffd"
        return self._atomic_byte_runs

    # ---- chat

    def _template(self, tools: Any) -> str:
        templates = self.chat_templates
        if not templates:
            raise TokenizerError(
                f"{self.folder}: no chat template (no chat_template.jinja and no 'chat_template' "
                "in tokenizer_config.json)"
            )
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise TokenizerError(f"{self.folder}: several chat templates, none named 'default'")

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """Render `messages` exactly as transformers' apply_chat_template(tokenize=False) does.

        With continue_final_message the text ends inside the final message, ready to be
        continued, and no generation prompt is added (transformers forbids both together).
        """
        template = self._template(kwargs.get("tools"))
        chat = _plain_messages(messages)
        final = _tag_final_message(chat, template) if continue_final_message else None
        variables = {"tools": None, "documents": None, **self.special_tokens, **kwargs}
        try:
            rendered = _compile_template(template).render(
                messages=chat,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template of {self.folder}: {e.message or e}") from e
        except Exception as e:  # an operator's template may raise anything (the sandbox's
            # range limit is an OverflowError, '+' on mixed types a TypeError): still its error
            raise TokenizerError(f"chat template of {self.folder}: {e}") from e
        _check_text(rendered, f"chat template of {self.folder}")
        return rendered if final is None else _cut_after_final_message(rendered, final)

    def encode_chat(self, messages: Sequence[dict], **kwargs: Any) -> list[int]:
        """Prompt ids for a chat; special tokens come only from the template, as in HF."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


def _check_text(text: str, what: str) -> None:
    """Refuse a str that is no text (a lone surrogate has no UTF-8): the tokenizer would fail."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = f"U+{ord(text[e.start]):04X}"
        raise TokenizerError(
            f"{what}: its output is not valid text ({bad} at character {e.start}: {e.reason})"
        ) from None


def gguf_file(path: Path) -> Path | None:
    """The GGUF file a model path stands for (expresslane.gguf.find_gguf), errors as ours."""
    from ..gguf import find_gguf

    try:
        return find_gguf(path)
    except CheckpointError as e:
        raise TokenizerError(str(e)) from None


def _has_tokenizer_files(folder: Path) -> bool:
    return any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))


def _generation_eos_ids(path: Path) -> list[int]:
    """Extra stop ids from generation_config.json's eos_token_id (an int or a list of ints)."""
    value = _read_json(path).get("eos_token_id")
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TokenizerError(f"{path}: field 'eos_token_id' must be an int or a list of ints")
    return values
