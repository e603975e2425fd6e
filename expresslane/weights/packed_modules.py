"""The modules a packed model runs on (weights/packing.py installs them): a projection and an
embedding that hold a QTensor as buffers and compute from its dequantized values.

- `PackedProj`: a lane-major projection (or a plain linear) on packed storage, the model's
  `_Proj` twin; its product's dtype and dequantizer can be set for a block (`products_in`).
- `PackedEmbedding`: nn.Embedding on packed storage, rows dequantized at lookup.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from ..model import lane_linear
from .quant import QTensor

# How PackedProj computes inside `products_in`: (dtype or None for the input's, the dequantizer
# that writes its weights), or None outside. A context variable: one thread's prefill does not
# change another's forward.
_PRODUCTS: ContextVar[tuple | None] = ContextVar("products", default=None)


@contextmanager
def products_in(dtype: torch.dtype | None, dequantize: Callable | None = None) -> Iterator[None]:
    """Inside the block, every PackedProj takes its weights as `dequantize(q, dtype)` (default:
    the reference's, rounded), rounds its input to `dtype` (None: the input's own), multiplies
    in it, and returns the product in the input's dtype, biases added there. step/prefill.py
    runs a long prompt's products in bf16 this way, the weights from the C decoder."""
    token = _PRODUCTS.set((dtype, dequantize or (lambda q, dt: q.dequantize().to(dt))))
    try:
        yield
    finally:
        _PRODUCTS.reset(token)


class _Packed(nn.Module):
    """Holds a QTensor as buffers (they follow the module in state_dict and .to())."""

    def __init__(self, q: QTensor):
        super().__init__()
        self.fmt = q.fmt
        self.register_buffer("qdata", q.data)
        self.register_buffer("qscale", q.scale)
        self.register_buffer("qrowsum", q.rowsum)
        self.register_buffer("qmins", q.mins)
        self.register_buffer("qhigh", q.high)
        self.register_buffer("qsub", q.sub)

    @property
    def q(self) -> QTensor:
        return QTensor(self.fmt, self.qdata, self.qscale, self.qrowsum, self.qmins, self.qhigh,
                       self.qsub)  # fmt: skip

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized fp32 matrix (what the model's own forward computes with)."""
        return self.q.dequantize()


class PackedProj(_Packed):
    """A lane-major projection (or a plain linear) on packed storage; the model's _Proj twin."""

    def __init__(self, q: QTensor, bias: torch.Tensor | None):
        super().__init__(q)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        products = _PRODUCTS.get()  # (dtype or None, dequantize) inside products_in
        dt = (products[0] or x.dtype) if products else x.dtype
        w = products[1](self.q, dt) if products else self.weight.to(dt)
        if dt == x.dtype:  # the product the model's own projection computes, bias and all
            return self._product(x, w, None if self.bias is None else self.bias.to(dt))
        y = self._product(x.to(dt), w, None).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    @staticmethod
    def _product(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        if w.dim() == 2:  # an nn.Linear's place (the lane head)
            return F.linear(x, w, b)
        return lane_linear(x, w, b)


class PackedEmbedding(_Packed):
    """nn.Embedding on packed storage: rows dequantized at lookup."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.q.lookup(tokens)
