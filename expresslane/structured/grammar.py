"""Grammars for constrained decoding: what a request asks for, compiled once, matched per request.

A `GrammarSpec` is the request's side (a JSON schema, any JSON object, a regex, a list of
choices, a Lark or GBNF grammar) as text; `GrammarCompiler.compile` turns it into a `Grammar`
for one tokenizer, cached by the spec's hash (SHA-256 of kind and text), and refuses what the
engine cannot compile with a 400 naming it. A `Grammar` gives each request its own `Matcher`:
the grammar's state after the tokens so far, its next token mask as a packed bitmask (32 tokens
per int32 word), the tokens it forces (jump-forward) and the drafts it allows.

The engine is llguidance, chosen over xgrammar by measurement (docs/structured-output.md:
schema compile in under a millisecond, no dependency). It is imported here only, and only when
a request carries a grammar: the GPU image has neither engine, and nothing the engine or the
step imports at load needs one.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ExpressLaneError, RequestError
from .closed import closed_objects
from .closing import Closing
from .reasoning import END, START

KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "gbnf")
# Compact JSON (no whitespace between tokens): fewer tokens, and no whitespace runs for a small
# model to loop in. A schema's own "x-guidance" settings take precedence.
COMPACT = {"whitespace_flexible": False}
CACHE_SIZE = 256  # compiled grammars kept per tokenizer


class GrammarError(RequestError):
    """A grammar the engine cannot compile, or one that left no token to pick (a dead end)."""


class GrammarUnavailable(ExpressLaneError):
    """Constrained decoding was asked for where the grammar engine is not installed."""

    status_code = 400


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # one of KINDS
    source: str  # the schema as JSON text, the regex, the choices as a JSON list, the grammar
    param: str = "response_format"  # the request field it came from (named in errors)
    think: str = ""  # a reasoning parser (structured/reasoning.py): the model may think first
    # a grammar of free text that may open a call at this marker (`tool_choice: auto`,
    # serve/tools.py): picks are checked, not masked, and the JSON steering starts after it
    trigger: str = ""

    @property
    def key(self) -> str:
        text = f"{self.kind}\0{self.source}\0{self.think}\0{self.trigger}"
        return hashlib.sha256(text.encode()).hexdigest()

    @classmethod
    def json_schema(cls, schema: Any, param: str = "response_format") -> GrammarSpec:
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"{param}: a JSON schema must be an object", param=param)
        return cls("json_schema", json.dumps(schema, sort_keys=True), param)


JSON_KINDS = ("json_schema", "json_object")


def _llguidance():
    try:
        import llguidance  # not llguidance.torch: it scripts kernels at import (seconds)
    except ImportError as e:
        raise GrammarUnavailable(
            "structured output needs the grammar engine: pip install llguidance"
        ) from e
    return llguidance


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for a spec (its JSON form); a GrammarError names a bad one."""
    text = _answer_text(spec)
    return _thinking_first(text, spec.think) if spec.think else text


def _thinking_first(answer: str, parser: str) -> str:
    """`answer`'s grammar after a thought, as structured/reasoning.py splits one: any text up to the
    first </think> (lazy), opened by `<think>` (qwen3) or not necessarily (deepseek_r1), then
    whitespace, then the answer as a sub-grammar.

    qwen3's thought is not optional here, though `split` takes an answer without one: llguidance
    picks the top grammar's lexemes where a sub-grammar could also begin, so `(thought)? @answer`
    refuses an answer's first token. A request that turns thinking off
    (`chat_template_kwargs.enable_thinking: false`) gets the answer's grammar alone (prepare.py).
    """
    top = json.loads(answer)
    body = dict(top["grammars"][0])
    name = body.setdefault("name", "answer")
    # whitespace as split() strips it, a little: a small model may loop in a run of it
    opener = f"GAP? {json.dumps(START)}"
    head = opener if parser == "qwen3" else f"({opener})?"
    end = END.replace("/", r"\/")  # a "/" would close the /regex/
    rules = [f"start: {head} thought GAP? @{name}", rf"thought[lazy]: /(?s:.*){end}/",
             r"GAP: /[ \t\r\n]{1,4}/"]  # fmt: skip
    lark = "\n".join(rules) + "\n"
    top["grammars"] = [{"lark_grammar": lark}, body, *top["grammars"][1:]]
    return json.dumps(top)


def _answer_text(spec: GrammarSpec) -> str:
    llg = _llguidance()
    M, src, param = llg.LLMatcher, spec.source, spec.param
    try:
        if spec.kind == "json_schema":
            return M.grammar_from_json_schema(closed_objects(json.loads(src)), defaults=COMPACT)
        if spec.kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"}, defaults=COMPACT)
        if spec.kind == "regex":
            return M.grammar_from_regex(src)
        if spec.kind == "choice":
            choices = json.loads(src)
            if not choices or not all(isinstance(c, str) for c in choices):
                raise GrammarError(f"{param}: choices must be a non-empty list of strings", param)
            return M.grammar_from_lark("start: " + " | ".join(map(json.dumps, choices)))
        if spec.kind == "lark":
            return M.grammar_from_lark(src)
        if spec.kind == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            return M.grammar_from_lark(gbnf_to_lark(src))
    except GrammarError:
        raise
    except Exception as e:  # llguidance raises ValueError / RuntimeError with its reason
        raise GrammarError(f"{param}: cannot compile the {spec.kind} ({e})", param) from None
    raise GrammarError(f"{param}: unknown grammar kind {spec.kind!r}", param)


class GrammarCompiler:
    """Compiles specs for one tokenizer (a `tokenizers` tokenizer.json) and model vocabulary."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lltok = None
        self._closing: Closing | None = None
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def lltokenizer(self):
        """llguidance's view of the tokenizer (built once: ~1 s for a 49k vocabulary)."""
        with self._lock:
            if self._lltok is None:
                llg = _llguidance()
                backend = getattr(self.tokenizer._backend, "tk", None)
                if backend is None:
                    raise GrammarError(
                        "structured output needs a tokenizer.json (or GGUF) tokenizer; this "
                        "model's is a SentencePiece model", param=None,
                    )  # fmt: skip
                eos = list(self.tokenizer.eos_ids)
                self._lltok = llg.LLTokenizer(
                    backend.to_str(), n_vocab=self.vocab_size, eos_token=eos[0] if eos else None
                )
            return self._lltok

    def closing(self) -> Closing:
        """The token classes a JSON grammar prefers in the last tokens of max_tokens (built
        once per tokenizer: every token decoded, ~0.1 s for 49k)."""
        with self._lock:
            if self._closing is None:
                n = min(self.vocab_size, self.tokenizer.vocab_size)
                texts = [self.tokenizer.decode([i]) for i in range(n)]
                self._closing = Closing(texts, self.vocab_size, self.tokenizer.eos_ids)
            return self._closing

    def compile(self, spec: GrammarSpec) -> Grammar:
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        lltok = self.lltokenizer()
        text = grammar_text(spec)
        llg = _llguidance()
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, lltok)
        if is_error:
            why = "; ".join(messages)
            raise GrammarError(f"{spec.param}: unsupported {spec.kind}: {why}", spec.param)
        # JSON grammars, and the tool calls' (JSON inside the template's wrapper: serve/tools.py)
        json_like = spec.kind in JSON_KINDS or spec.param == "tools"
        closing = self.closing() if json_like or spec.think or spec.trigger else None
        end = tuple(self.tokenizer.encode(END + "\n\n", False)) if spec.think else ()
        grammar = Grammar(lltok, text, self.vocab_size, spec, closing if json_like else None,
                          closing.texts if spec.think or spec.trigger else None, end)  # fmt: skip
        grammar.matcher()  # compiles the lexer now, before the request's clock starts
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar


class Grammar:
    """A compiled grammar for one tokenizer; `matcher()` starts one request's state."""

    def __init__(self, lltok, text: str, vocab_size: int, spec: GrammarSpec,
                 closing: Closing | None = None, texts: list[str] | None = None,
                 thought_end: tuple[int, ...] = ()):  # fmt: skip
        self.lltok, self.text, self.vocab_size, self.spec = lltok, text, vocab_size, spec
        self.closing = closing  # JSON grammars: the tokens that end it soonest
        # after a thought (spec.think): every token's text, to see the thought end, and the
        # tokens that end one (decoding.py closes a thought that would leave no room)
        self.texts, self.thought_end = texts, thought_end

    def matcher(self) -> Matcher:
        return Matcher(self)


_NEVER = object()  # a wait that never ends: a free grammar's answer is text (Matcher._passed)


class Matcher:
    """One request's grammar state and its next-token bitmask (host, int32 words)."""

    def __init__(self, grammar: Grammar):
        llg = _llguidance()
        self.grammar = grammar
        self.m = llg.LLMatcher(grammar.lltok, grammar.text)
        words = -(-grammar.vocab_size // 32)
        self.words = torch.zeros((1, words), dtype=torch.int32)  # (1, W): 32 tokens a word
        self._lexer = (False, False, 0, 0, "", 0)  # Closing.advance's state of the JSON so far
        # the markers still to come before the JSON (the thought's end, a free grammar's
        # trigger), and the text since the last one
        spec = grammar.spec
        self._waits = ([END] if spec.think else []) + ([spec.trigger] if spec.trigger else [])
        self._tail = ""
        self._check()

    @property
    def thinking(self) -> bool:
        """In the thought (before its </think>)."""
        return bool(self._waits) and self._waits[0] == END

    @property
    def waiting(self) -> bool:
        """Before the JSON: in the thought, or in a free grammar's text."""
        return bool(self._waits)

    def _check(self) -> None:
        if self.m.is_error():
            raise GrammarError(f"structured output: {self._reason()}", param=None)

    def _reason(self) -> str:
        """llguidance's error without its parser dump."""
        return (self.m.get_error() or "").split("\n<state>")[0].strip()

    def fill(self, closing: bool = False) -> torch.Tensor:
        """The mask of the tokens allowed next, (1, W) int32; a dead end raises. `closing`
        (the last tokens of max_tokens, JSON grammars): the allowed tokens of the first class
        of Closing.tiers that has any, so that the JSON ends inside the budget."""
        w = self.words
        self.m.unsafe_compute_mask_ptr(w.data_ptr(), w.numel() * w.element_size())  # no GIL
        self._check()
        if not self.words.any():
            raise GrammarError("structured output: the grammar allows no token here", None)
        if closing and self.grammar.closing is not None and not self.waiting:
            for tier in self.grammar.closing.tiers(self._lexer):
                close = w & tier
                if close.any():
                    w.copy_(close)
                    break
        return self.words

    def masks(self, drafts: list[int]) -> torch.Tensor:
        """The masks before each draft and after the last, (k + 1, W); the state is unchanged."""
        rows = [self.fill().clone()]
        state = self._lexer, list(self._waits), self._tail
        for d in drafts:
            self.consume(d)
            rows.append(self.fill().clone())
        if drafts:
            self.m.rollback(len(drafts))
        self._lexer, self._waits, self._tail = state
        return torch.cat(rows)

    def consume(self, token: int) -> None:
        if not self.m.consume_token(token) or self.m.is_error():
            why = self._reason()
            raise GrammarError(f"structured output: token {token} is not allowed here ({why})")
        if self._waits:  # the JSON lexer starts after the markers, whatever tokens spell them
            texts = self.grammar.texts
            self._tail = (self._tail + (texts[token] if token < len(texts) else ""))[-32:]
            while self._waits and self._passed(self._waits[0]):
                self._waits.pop(0)
            if not self._waits and self.grammar.closing is not None:  # the JSON's first text
                self._lexer = Closing.advance_text(self._lexer, self._tail)
        elif self.grammar.closing is not None:
            self._lexer = self.grammar.closing.advance(self._lexer, token)

    def _passed(self, marker) -> bool:
        """Has the text since the last marker passed `marker`? If so the tail keeps what
        follows it. A lead marker ("^T", a Llama 3 call): the answer begins, after whitespace,
        with `{` (kept: it is the JSON's) or T; an answer that begins otherwise is text, and
        the wait never ends."""
        if marker is _NEVER:
            return False
        if not marker.startswith("^"):
            if marker not in self._tail:
                return False
            self._tail = self._tail.split(marker, 1)[1]
            return True
        head, tag = self._tail.lstrip(), marker[1:]
        if head.startswith("{") or head.startswith(tag):
            self._tail = head.removeprefix(tag)
            return True
        if head and not tag.startswith(head):
            self._waits[0] = _NEVER
        return False

    @property
    def in_string(self) -> bool:
        return self._lexer[0]

    @property
    def depth(self) -> int:
        """Objects and arrays open at this point of the JSON text."""
        return self._lexer[2]

    @property
    def runaway(self) -> bool:
        """A number, or one character in a string, has run past any sensible length (a model
        repeating itself)."""
        return Closing.runaway(self._lexer)

    def forced(self) -> list[int]:
        """Tokens the grammar allows as the only continuation (jump-forward)."""
        return list(self.m.compute_ff_tokens())

    def allowed_prefix(self, drafts: list[int]) -> int:
        """How many of `drafts` (from the start) the grammar accepts."""
        return self.m.validate_tokens(drafts) if drafts else 0

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more than the end of text."""
        return self.m.is_stopped()
