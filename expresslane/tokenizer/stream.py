"""Streaming text out: UTF-8-safe incremental detokenization and stop strings."""

from __future__ import annotations

from collections.abc import Iterable

from .core import Tokenizer

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
