"""Static KV cache: allocated once for the maximum context; ring buffers on sliding layers.

Per layer: k and v of shape (cap, H_kv, hd) and `pos` (cap,) with the absolute position held in
each slot (-1 = empty). Full-attention layers have cap = max_len and slot = position; sliding
layers have cap = min(window, max_len) and slot = position % window, so a 2B Laneformer at 4096
tokens keeps 251.7 MB of bf16 KV instead of 377.5 MB. Keys are stored after RoPE. Masks are
built from `pos`, so attention never needs to know which slots wrapped. `headroom` adds slots to
every ring (speculative decoding writes draft positions ahead of the window).

`length` is the number of positions already written; the model advances it after a forward.

`tokens` is what the cache holds, for prefix reuse (prefix.py) and for rolling back rejected
draft tokens: the token id behind every position 0..len(tokens)-1 that every layer has written
(a full layer holds all of them; a ring the newest it has room for, as its `pos` says). The
engine `commit`s ids once the forward that wrote them has completed, so a forward that fails or
is abandoned half-way adds nothing; `truncate(n)` forgets every position >= n in every layer.
Invariant: len(tokens) <= length, and a slot whose `pos` is p < len(tokens) holds the key and
value computed from tokens[:p + 1].

The cache's dtype is the model's unless asked (`kv_cache_dtype`, vLLM's flag): a CPU model
computes in fp32, and a float16 or bfloat16 cache halves the bytes attention streams a token
(46 kB a slot of SmolLM2 in fp32: 377 MB at its 8,192 tokens, four times its 92 MB Q4_0 file)
at the cost of rounding each key and value once, as llama.cpp's default f16 cache does. Every
reader widens the stored values to the queries' dtype, so the eager forward with a half cache
is the reference of the C step's.

In static mode (a decode graph) the host count is not used; `live`, when set, bounds the slots a
step reads: positions < live only, so attention scans min(live, cap) slots, not all of them.
"""

from __future__ import annotations

import torch

from .config import ModelConfig
from .errors import RequestError
from .weights.hugepages import tensors

# --kv-cache-dtype's names: "auto" is the model's dtype. fp8 (vLLM's other choice) is not built:
# no kernel here reads it, and on a CPU the step's stream halves with 16 bits already.
KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16,
                   "bfloat16": torch.bfloat16}  # fmt: skip


def cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The cache dtype `name` asks for, for a model computing in `model_dtype` on `device`.

    A GPU's fused kernels write and read the cache in the model's dtype, so there only "auto"
    or that dtype's name is taken (a decision: other dtypes there are unbuilt and unmeasured)."""
    if name not in KV_CACHE_DTYPES:
        why = f"kv_cache_dtype={name!r}: expected one of {', '.join(KV_CACHE_DTYPES)}"
        raise RequestError(why, "kv_cache_dtype")
    dtype = KV_CACHE_DTYPES[name] or model_dtype
    if device.type != "cpu" and dtype != model_dtype:
        why = (
            f"kv_cache_dtype={name!r}: on {device.type} the cache takes the model's dtype "
            f"({str(model_dtype).removeprefix('torch.')}); use auto"
        )
        raise RequestError(why, "kv_cache_dtype")
    return dtype


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        kv_heads: int | None = None,
        headroom: int = 0,
    ):
        self.max_len = max_len
        self.windows = [cfg.window(i) for i in range(cfg.num_layers)]
        heads = kv_heads or cfg.num_kv_heads
        caps = [min(w + headroom, max_len) if w else max_len for w in self.windows]
        shapes = [(cap, heads, cfg.head_dim) for cap in caps for _ in "kv"]
        # a CPU decode step streams the cache as it streams the weights: huge pages, as those
        kv = tensors([(s, dtype) for s in shapes]) if torch.device(device).type == "cpu" else None
        for t in kv or ():  # the first request's pages now, at load, not in its time to first
            t.view(-1)[:1].zero_()  # token (a huge page's first touch: ~3 ms on a 2-vCPU VM)
        kv = kv or [torch.zeros(s, device=device, dtype=dtype) for s in shapes]
        self.k, self.v = kv[0::2], kv[1::2]
        self.pos = [torch.full((cap,), -1, device=device, dtype=torch.long) for cap in caps]
        self.length = 0
        self.tokens: list[int] = []  # the token id at each committed position
        # static: positions come only from the device tensor (no host counter), every slot below
        # `live` is returned and masked by `pos`; the shapes a captured decode graph needs.
        self.static = False
        self.live: int | None = None  # static mode: slots [0, live) can hold visible keys

    def forward_room(self) -> int | None:
        """The most tokens one forward may write: a ring must still hold the first token's
        window while the last one writes (its headroom + 1); None without a ring that wraps
        (any count: full layers, and rings as long as the context)."""
        room = [k.shape[0] - w + 1 for w, k in zip(self.windows, self.k, strict=True)
                if w and k.shape[0] < self.max_len]  # fmt: skip
        return max(1, min(room)) if room else None

    def reset(self) -> None:
        for p in self.pos:
            p.fill_(-1)
        self.length = 0
        self.tokens = []

    def commit(self, ids) -> None:
        """The forward that wrote the next len(ids) positions completed: record their ids.

        A static (graph) step keeps its position on the device; committing its tokens brings
        the host's `length` up to them."""
        self.tokens.extend(ids)
        self.length = max(self.length, len(self.tokens))

    def truncate(self, n: int) -> None:
        """Forget every position >= n in every layer (slots emptied), keep the first n.

        Also clears positions written but never committed (an abandoned forward, a decode
        graph that ran ahead of its last token). A ring keeps only the positions < n it still
        holds: whether a query at n finds its whole window there is prefix.py's question.
        """
        if not 0 <= n <= len(self.tokens):
            raise ValueError(f"truncate({n}): the cache holds {len(self.tokens)} committed tokens")
        for p in self.pos:
            p.masked_fill_(p >= n, -1)
        self.length = n
        del self.tokens[n:]

    def advance(self, n: int) -> None:
        if not self.static:  # static steps keep positions on the device only (no host state)
            self.length += n

    @property
    def nbytes(self) -> int:
        """Bytes of K and V (the `pos` bookkeeping is not KV)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Store k, v (S, H_kv, hd) for `positions` and return what the queries may attend to.

        Returns (keys, values, key_positions) covering every slot that can hold a visible key.
        """
        kc, vc, pc = self.k[layer], self.v[layer], self.pos[layer]
        k, v = k.to(kc.dtype), v.to(vc.dtype)  # a half cache: every reader sees rounded keys
        cap, n = kc.shape[0], k.shape[0]
        if self.static:  # one token per step; the caller keeps positions < max_len
            slots = positions % cap
            kc.index_copy_(0, slots, k)
            vc.index_copy_(0, slots, v)
            pc.index_copy_(0, slots, positions)
            span = cap if self.live is None else min(self.live, cap)
            return kc[:span], vc[:span], pc[:span]
        start, end = self.length, self.length + n
        if self.windows[layer] is None and end > cap:
            raise ValueError(f"KV cache overflow: {end} positions > max_len {cap}")
        if end <= cap:  # no slot reused yet: slot == position
            kc[start:end], vc[start:end], pc[start:end] = k, v, positions
            return kc[:end], vc[:end], pc[:end]
        if n == 1:  # decode on a full ring: the slot overwritten held a key out of the window
            slot = start % cap
            kc[slot], vc[slot], pc[slot] = k[0], v[0], positions[0]
            return kc, vc, pc
        # A chunk that wraps the ring would overwrite keys its own early queries still need:
        # attend over the old ring plus the new chunk, then keep the newest `cap` positions.
        keys, vals, kpos = torch.cat((kc, k)), torch.cat((vc, v)), torch.cat((pc, positions))
        keep = min(n, cap)
        slots = positions[-keep:] % cap
        kc.index_copy_(0, slots, k[-keep:])
        vc.index_copy_(0, slots, v[-keep:])
        pc.index_copy_(0, slots, positions[-keep:])
        return keys, vals, kpos
