"""Logprobs on the wire: token display strings, the completions and chat logprobs objects.

`text_offset` (completions) says where each token starts in the returned `text`. It is counted
the way that text was made: the incremental detokenizer's output, token by token, so byte
tokens of one character share its start, and special tokens the tokenizer added around a string
prompt (`<s>`, which the echoed prompt does not contain) are zero-width.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..tokenizer import IncrementalDetokenizer, Tokenizer
from .jobs import TokenInfo

BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # byte-fallback tokens


class TokenText:
    """Display text and UTF-8 bytes of single tokens, cached (for logprobs)."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            piece = self.tok.id_to_piece(token_id)
            if BYTE_PIECE.fullmatch(piece):  # one byte of a character: named, not "\ufffd"
                hit = (piece, [int(piece[3:5], 16)])
            else:
                text = self.tok.decode([token_id])
                if piece.startswith("▁") and not text.startswith(" "):
                    text = " " + text  # SentencePiece-style decoders strip a leading space
                hit = (text, list(text.encode("utf-8")))
            self._cache[token_id] = hit
        return hit


class TokenIds(TokenText):
    """vLLM's return_tokens_as_token_ids: each logprobs token as "token_id:N" (its bytes those
    of that string, as vLLM encodes them), for clients that map tokens back to ids."""

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        name = f"token_id:{token_id}"
        return name, list(name.encode())


class TextOffsets:
    """Where each token of one stretch of returned text starts, token after token.

    `start` is where the stretch begins in the returned text; offsets never pass `limit`
    (the text's end: a stop string may have cut what the tokens spell). A token whose text is
    held back (a byte of an unfinished character) starts where that character starts; the
    token that releases it starts after it.
    """

    def __init__(
        self, tok: Tokenizer, start: int = 0, context: Sequence[int] = (), skip: bool = False
    ):
        self._tok = tok
        self._detok = IncrementalDetokenizer(tok, skip, context=context)  # as the text was made
        self._held: list[int] = []  # tokens pushed since the last text came out
        self.pos = start

    def take(self, ids: Sequence[int], limit: int, zero_width: Sequence[bool] = ()) -> list[int]:
        out = []
        for i, t in enumerate(ids):
            if i < len(zero_width) and zero_width[i]:
                out.append(min(self.pos, limit))
                continue
            new = self._detok.push(t)
            at = self.pos
            if new and self._held:  # the held tokens' text comes first
                head = self._tok.decode(self._held)
                at += len(head) if new.startswith(head) else 0
            out.append(min(at, limit))
            if new:
                self.pos += len(new)
                self._held = []
            else:
                self._held.append(t)
        return out


def completion_logprobs(tokens: list[TokenInfo], text: TokenText, offsets: list[int]) -> dict:
    """The legacy completions `logprobs` object; top_logprobs also holds the chosen token."""
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": list(offsets),
    }
    for t in tokens:
        s = text(t.id)[0]
        out["tokens"].append(s)
        out["token_logprobs"].append(t.logprob)
        if t.logprob is None:
            out["top_logprobs"].append(None)
            continue
        top: dict[str, float] = {}
        for tid, lp in t.top or []:  # best first; a repeated string keeps its best value
            top.setdefault(text(tid)[0], lp)
        top.setdefault(s, t.logprob)
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(tokens: list[TokenInfo], text: TokenText) -> list[dict]:
    """Entries of the chat `logprobs.content` list."""

    def entry(tid: int, lp: float) -> dict:
        s, raw = text(tid)
        return {"token": s, "logprob": lp, "bytes": raw}

    return [
        entry(t.id, t.logprob) | {"top_logprobs": [entry(i, v) for i, v in t.top or []]}
        for t in tokens
    ]


def prompt_logprobs(tokens: list[TokenInfo], text: TokenText) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: None for the first token, then per token {token id: {logprob,
    rank, decoded_token}} for the prompt's own token (its rank in the vocabulary) and the top n
    (ranks 1..n); the ids are JSON object keys, so strings."""

    def entry(tid: int, lp: float, rank: int | None) -> dict:
        return {"logprob": lp, "rank": rank, "decoded_token": text(tid)[0]}

    out: list[dict | None] = [None]
    for t in tokens[1:]:
        row = {str(t.id): entry(t.id, t.logprob, t.rank)}
        for rank, (tid, lp) in enumerate(t.top or [], 1):
            row.setdefault(str(tid), entry(tid, lp, rank))
        out.append(row)
    return out
