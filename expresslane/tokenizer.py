"""The text side: tokenizer files -> ids, chat templates, UTF-8-safe streaming, stop strings.

The engine deals only in token ids (ARCHITECTURE.md, decision 6). This file owns everything
between text and ids: loading a Hugging Face tokenizer folder (`tokenizer.json` through the
`tokenizers` library, or a SentencePiece `tokenizer.model`), rendering chat templates the way
transformers does, turning a stream of ids back into text without ever emitting half a
character, and cutting generated text at stop strings.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import TokenizerError

# Laneformer-IT chat format (laneformer-spec.md 12.2; the real file was never seen, so this is
# the spec's inferred form). BOS choice: the template prints {{ bos_token }}, as the Llama 2 and
# Llama 3 chat templates do. Llama-2-style models see <s> at the start of every training
# sequence, and transformers' apply_chat_template(tokenize=True) encodes the rendered text with
# add_special_tokens=False, so a template without it would give chat prompts no BOS at all.
# The price: a rendered prompt must be encoded with add_special_tokens=False
# (Tokenizer.encode_chat does), or BOS appears twice.
LANEFORMER_CHAT_TEMPLATE = r"""{{- bos_token }}
{%- for message in messages %}
{%- set role = message['role'] %}
{%- if role == 'user' or role == 'assistant' %}
{{- '<|start_header_id|>' + role + '<|end_header_id|>\n\n' + message['content'] | trim + '</s>' }}
{%- elif role != 'system' %}
{{- raise_exception("Only 'user' and 'assistant' roles are supported, got '" + role + "'") }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# The named special tokens transformers passes to every chat template (special_tokens_map).
SPECIAL_TOKEN_KEYS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"
)  # fmt: skip
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # the marker transformers uses, same handling
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


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
        return self.tk.encode(text, add_special_tokens=False).ids

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

    def default_special(self, key: str) -> str | None:
        i = {"bos_token": self.sp.bos_id(), "eos_token": self.sp.eos_id()}.get(key, -1)
        return self.sp.id_to_piece(i) if i >= 0 else None


# ---------------------------------------------------------------------------- chat templates


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    transformers; for rendering a prompt its body is output unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override: jinja's own tojson escapes HTML characters, this one does not.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)  # fmt: skip


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    """Compile like transformers: sandboxed, trim_blocks, lstrip_blocks, same globals."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _plain_messages(messages: Iterable[dict]) -> list[dict]:
    """Fresh plain copies, None values dropped, reasoning aliased: what transformers renders."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise TokenizerError(f"chat messages must be dicts, got {message!r}")
        plain = {k: v for k, v in message.items() if v is not None}
        # Objects that are not JSON (images, arrays) become inert "<TypeName>" placeholders.
        message = json.loads(json.dumps(plain, default=lambda o: f"<{type(o).__name__}>"))
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tag_final_message(messages: list[dict], template: str) -> str:
    """Append the continue marker to the last message's text; return that text."""
    if not messages:
        raise TokenizerError("continue_final_message needs a non-empty conversation")
    if "content" not in template:
        raise TokenizerError("continue_final_message: the chat template never reads 'content'")
    final = messages[-1].get("content")
    if isinstance(final, str):
        messages[-1]["content"] = final + _CONTINUE_TAG
        return final
    for block in reversed(final if isinstance(final, list) else []):
        if isinstance(block, dict) and isinstance(block.get("text"), str):
            text, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
            return text
    raise TokenizerError("continue_final_message: the final message has no text to continue")


def _cut_after_final_message(rendered: str, final: str) -> str:
    """Drop what the template put after the final message, keeping the open turn."""
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or tag not in rendered:
        raise TokenizerError(
            "continue_final_message: the chat template does not render the final message verbatim"
        )
    loc = rendered.rindex(tag)
    if rendered[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:loc]
    return rendered[:loc].rstrip()  # the template trimmed the text, so trim our cut too


# ---------------------------------------------------------------------------- the tokenizer


class Tokenizer:
    """Text <-> ids for one tokenizer folder, plus its chat template and stop token ids."""

    def __init__(self, backend, folder: Path, config: dict, specials: dict, eos_extra: list):
        self._backend = backend
        self.folder = folder
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

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
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
        return rendered if final is None else _cut_after_final_message(rendered, final)

    def encode_chat(self, messages: Sequence[dict], **kwargs: Any) -> list[int]:
        """Prompt ids for a chat; special tokens come only from the template, as in HF."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


def _generation_eos_ids(path: Path) -> list[int]:
    """Extra stop ids from generation_config.json's eos_token_id (an int or a list of ints)."""
    value = _read_json(path).get("eos_token_id")
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TokenizerError(f"{path}: field 'eos_token_id' must be an int or a list of ints")
    return values


# ---------------------------------------------------------------------------- streaming


class IncrementalDetokenizer:
    """Ids in, text out, one token at a time; all outputs joined equal decode(all ids).

    vLLM's scheme: decode the window ids[prefix:] and emit what it adds to ids[prefix:read],
    so decoders that look at neighbours (the leading-space strip, byte fallback) agree with a
    full decode. Text is held back while it ends in U+FFFD (a character still incomplete), and,
    for ByteFallback decoders, while the last token is a byte token, since a later byte can
    still turn the whole run into replacement characters.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._held_bytes = tokenizer.byte_ids if tokenizer.atomic_byte_runs() else frozenset()
        self._dropped = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._ids: list[int] = []
        self._prefix = 0  # window start: tokens already emitted, kept as decoding context
        self._read = 0  # end of the emitted tokens

    def push(self, token_id: int) -> str:
        # Skipped specials vanish before decoding, so the bytes on both sides of one join up.
        if token_id in self._dropped:
            return ""
        self._ids.append(token_id)
        if token_id in self._held_bytes:
            return ""
        return self._emit(final=False)

    def flush(self) -> str:
        """Everything still held back, at the end of generation."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self._tokenizer.decode
        seen = decode(self._ids[self._prefix : self._read], self._skip)
        text = decode(self._ids[self._prefix :], self._skip)
        if not final and text.endswith("\ufffd"):
            return ""
        new = text[len(seen) :]
        # Moving on after an empty step would leave a window whose context decodes to "",
        # and the decoder's leading-space strip would then eat a real space.
        if new:
            self._prefix, self._read = self._read, len(self._ids)
        return new


class StopStringMatcher:
    """Cuts streamed text at the first stop string; never emits a stop string or what follows.

    A suffix of the text that could still grow into a stop string is held back until the next
    push shows whether it does.
    """

    def __init__(self, stops: Iterable[str]):
        self.stops = [s for s in stops if s]  # an empty stop string would stop before any text
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return buf[: min(hits)], True
        keep = self._partial_stop_length(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def _partial_stop_length(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def flush(self) -> str:
        """Held text, released when generation ends without a stop string."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
