"""Very long /tokenize replies, built in a helper process so that the server's GIL stays free.

`tokenizers` releases the GIL while it encodes, but turning its result into Python ints does
not: the `.ids` of a 4 MB text (1.6 M ids) held the GIL for 45-80 ms in one C call, and with
the list's concatenation and its JSON that stalled `/health` for ~0.2 s on the 2-vCPU VM
(BENCHMARKS.md, "Server: /health while busy"). A process of its own holds its own GIL: it loads
the same tokenizer (from the path the server's was read from), encodes the text and writes the
ids' JSON; the server gets the bytes back and splices them into the reply (`protocol.RawJSON`).

The process starts at the first text over `OFFLOAD_CHARS` (spawned: a fork of a server holding
a model and threads is not safe) and serves every later one. Shorter texts stay in the server:
below a million characters `.ids` takes a few milliseconds, less than the trip. A tokenizer with
no path (built in code) is never offloaded. If the helper dies, the text is encoded in the
server as before and the next long text starts a new helper.
"""

from __future__ import annotations

import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from ..tokenizer import Tokenizer
from .protocol import RawJSON, json_bytes

OFFLOAD_CHARS = 1 << 20  # characters: ~250k+ ids, where `.ids` alone passes ~10 ms

_TOKENIZER: Tokenizer | None = None  # the helper process's own


def _load(source: str) -> None:
    global _TOKENIZER
    _TOKENIZER = Tokenizer.from_dir(source)


def _encode(text: str, add_special_tokens: bool, token_strs: bool) -> tuple[int, bytes, bytes]:
    """In the helper: (count, the ids as JSON, the pieces as JSON or b"")."""
    ids = _TOKENIZER.encode(text, add_special_tokens=add_special_tokens)
    strs = json_bytes([_TOKENIZER.id_to_piece(i) for i in ids]) if token_strs else b""
    return len(ids), json_bytes(ids), strs


class TokenizeOffload:
    """The helper process of one tokenizer; `encode` is called from the preparer's threads."""

    def __init__(self, tok: Tokenizer):
        self.source = getattr(tok, "source", None)
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self.offloaded = 0  # texts encoded in the helper (tests and /metrics read it)

    def wants(self, text: str) -> bool:
        return self.source is not None and len(text) > OFFLOAD_CHARS

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                ctx = multiprocessing.get_context("spawn")
                self._pool = ProcessPoolExecutor(1, mp_context=ctx, initializer=_load,
                                                 initargs=(str(self.source),))  # fmt: skip
            return self._pool

    def encode(self, text: str, add_special_tokens: bool, token_strs: bool):
        """(count, RawJSON ids, RawJSON pieces or None), or None when the helper failed (the
        caller then encodes in the server)."""
        pool = self._executor()
        try:
            count, ids, strs = pool.submit(_encode, text, add_special_tokens, token_strs).result()
        except BrokenProcessPool:
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            return None
        self.offloaded += 1
        return count, RawJSON(ids), RawJSON(strs) if token_strs else None

    def shutdown(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
