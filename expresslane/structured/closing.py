"""A JSON grammar's way out of a budget: the token classes that end JSON soonest (`Closing`).

In the last tokens of max_tokens, a JSON grammar allows only the tokens of the first class here
that it allows any of (structured/decoding.py), so that an answer ends valid inside its budget.
The classes are bitmasks over the vocabulary, built once per tokenizer from every token's text;
the state that picks among them is a tiny JSON lexer over the tokens written.
"""

from __future__ import annotations

import torch

NUMBER_CHARS = set("0123456789+-.eE")
RUNAWAY_NUMBER = 24  # characters: a JSON number this long is a model repeating itself
# inside a string, a run this long of digits, of letters, or of one other character: the same
RUNAWAY_RUN = {"digit": 32, "alpha": 64}
RUNAWAY_REPEAT = 16


def _kind(ch: str) -> str:
    return "digit" if ch.isdigit() else "alpha" if ch.isalpha() else ch


def _runaway(ch: str) -> int:
    return RUNAWAY_RUN.get(_kind(ch), RUNAWAY_REPEAT) if ch else 1 << 30


class Closing:
    """Token classes that end JSON soonest, for the last tokens of a budget, in order:

    - inside a string: tokens that close it (`"` then only `}` `]` `,` `:`);
    - else: tokens of only `}` and `]` (and the end of text, allowed once the JSON is complete);
      then separators (`,`, `},`, ...), which end a number or move to the next required field;
      then the shortest values (`null`, `0`, `true`, `false`, `[]`, `{}` and their first
      pieces), which end a recursion.

    A class the grammar allows none of is skipped; when none is allowed, the model's own choice
    stands (a string's pattern still to complete, say). The state is a tiny JSON lexer over the
    tokens' text: (inside a string, after a backslash, open objects and arrays, length of the
    number being written, the string's last character and the length of the run of its kind:
    digits, letters, or that character). Inside a string that cannot close yet, a run past
    `_runaway` has its kind refused (the tokens of only digits, say), so a pattern's next part
    comes (a time's zone after endless fraction digits)."""

    LITERALS = ("null", "true", "false", "0", "[]", "{}")

    def __init__(self, texts: list[str], vocab_size: int, eos_ids):
        self.texts = texts
        self._words, self._only = -(-vocab_size // 32), {}
        seps, ends = set(",:"), set("}]")

        def cls(test) -> torch.Tensor:
            return _pack((bool(t.strip()) and test(t.strip()) for t in texts), self._words)

        # the literals' first pieces too (a tokenizer may split `null`), but not a lone `[` or
        # `{`: that opens a structure instead of ending one
        prefixes = {lit[:k] for lit in self.LITERALS for k in range(1, len(lit) + 1)}
        prefixes -= {"[", "{"}
        self.string = cls(lambda t: t[0] == '"' and set(t[1:]) <= ends | seps)
        self.end = cls(lambda t: set(t) <= ends)
        for i in eos_ids:
            if i < vocab_size:
                self.end[0, i // 32] |= _word_bit(i % 32)
        self.separate = cls(lambda t: set(t) <= ends | seps and bool(set(t) & seps))
        self.short = cls(lambda t: t in prefixes)

    @staticmethod
    def runaway(state: tuple) -> bool:
        """A number, or one kind of character in a string, has run past any sensible length."""
        return state[3] >= RUNAWAY_NUMBER or state[5] >= _runaway(state[4])

    def tiers(self, state: tuple) -> tuple[torch.Tensor, ...]:
        inside, _, _, _, ch, run = state
        if not inside:
            return (self.end, self.separate, self.short)
        return (self.string, ~self.only(ch)) if run >= _runaway(ch) else (self.string,)

    def only(self, ch: str) -> torch.Tensor:
        """(1, W) bits of the tokens made only of `ch`'s kind: digits for a digit (a fraction
        that never ends), letters for a letter, else `ch` itself (cached)."""
        kind = str.isdigit if ch.isdigit() else str.isalpha if ch.isalpha() else ch.__eq__
        key = kind.__name__ if ch.isalnum() else ch
        if key not in self._only:
            flags = (bool(t) and all(kind(c) for c in t) for t in self.texts)
            self._only[key] = _pack(flags, self._words)
        return self._only[key]

    def advance(self, state: tuple, token: int) -> tuple:
        return self.advance_text(state, self.texts[token] if token < len(self.texts) else "")

    @staticmethod
    def advance_text(state: tuple, text: str) -> tuple:
        inside, escaped, depth, number, last, run = state
        for ch in text:
            if inside:
                run = run + 1 if _kind(ch) == _kind(last) else 1
                last = ch
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    inside, last, run = False, "", 0
                continue
            number = number + 1 if ch in NUMBER_CHARS else 0
            if ch == '"':
                inside = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth = max(0, depth - 1)
        return inside, escaped, depth, number, last, run


def _word_bit(b: int) -> int:
    """Bit b of an int32 word, as the signed value torch stores."""
    return -(1 << 31) if b == 31 else 1 << b


def _pack(flags, n_words: int) -> torch.Tensor:
    """Token i's flag -> (1, W) int32 words, bit i % 32 of word i // 32.

    Packed in Python, not with vocabulary-sized torch ops: this runs where a grammar is compiled
    (a server's preparation thread), and a parallel torch op there would give that thread an
    OpenMP team of its own for its life, which slows the engine's decode threefold
    (step/threads.py, the module docstring)."""
    words = [0] * n_words
    for i, flag in enumerate(flags):
        if flag:
            words[i >> 5] |= 1 << (i & 31)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                        dtype=torch.int32)[None]  # fmt: skip
