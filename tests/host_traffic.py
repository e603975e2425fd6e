"""A dispatch mode that fails on anything a CUDA graph capture cannot hold, checked on the CPU.

The step under test runs on the `meta` device, which stands for the GPU: no data, every op's
shapes and dtypes, and a device that is not the host. `NoHostTraffic` then raises at the first
aten op that would move data between the host and the device or wait for the device:

- `_local_scalar_dense`: `.item()`, `int()`, `bool()`, a 0-dim tensor used as an index (a sync);
- `lift_fresh`, or a copy from a `scalar_tensor`: a tensor made from host data,
  `torch.tensor(...)` or a Python scalar written through indexing (`x[..., 0] = False`: on
  CUDA a 0-dim CPU tensor copied to the device, the first GPU run's top_p crash);
- a copy to or from another device (`.cpu()`, `.to("cpu")`, `.tolist()` and `.numpy()` fail on
  `meta` before dispatch: they have no data to read);
- an op that mixes a CPU tensor (0-dim included: a host value frozen into the graph) with
  device tensors, or a factory that makes a tensor on the CPU.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten
SYNCS = {aten._local_scalar_dense.default}
HOST_DATA = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
# On `meta` a Python scalar written through indexing becomes a `scalar_tensor` that is viewed,
# expanded and copied in; on CUDA the same line makes a CPU tensor and copies it to the device
# (python_variable_indexing.cpp). Other ops make a scalar_tensor for a constant (torch.where):
# only a copy from one is host traffic.
SCALAR = aten.scalar_tensor.default
VIEWS = {aten.view.default, aten.expand.default, aten.select.int, aten.slice.Tensor}
COPIES = {aten._to_copy.default, aten.copy_.default, aten.copy.default}


class HostTraffic(AssertionError):
    """The step touched the host: a capture would fail or freeze a host value."""


class NoHostTraffic(TorchDispatchMode):
    def __init__(self, device: str = "meta"):
        super().__init__()
        self.device = torch.device(device)
        # id -> tensor (held, so that no id is reused while the mode lives): scalar tensors and
        # their views; ids, as `in` on tensors would compare them elementwise (a sync)
        self.scalars: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCS:
            raise HostTraffic(f"{func}: reads a device value on the host (.item(), int(), "
                              "bool() or a 0-dim tensor as an index): a sync")  # fmt: skip
        if func in HOST_DATA:
            raise HostTraffic(f"{func}: a tensor made from host data (torch.tensor or a "
                              "Python scalar through indexing): a host-to-device copy")  # fmt: skip
        tensors = [a for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        devices = {t.device.type for t in tensors}
        target = kwargs.get("device")
        if target is not None:
            devices.add(torch.device(target).type)
        if "cpu" in devices and (self.device.type in devices or not tensors):
            raise HostTraffic(f"{func}: {self._where(tensors, target)}")
        if func in COPIES and len(devices) > 1:
            raise HostTraffic(f"{func}: a copy between {sorted(devices)}")
        if func in COPIES and len(args) > 1 and id(args[1]) in self.scalars:
            raise HostTraffic(f"{func}: a Python scalar written through indexing; on CUDA a "
                              "host-to-device copy (fill_ or masked_fill keep it a kernel "
                              "argument)")  # fmt: skip
        out = func(*args, **kwargs)
        if func is SCALAR or (func in VIEWS and id(args[0]) in self.scalars):
            self.scalars[id(out)] = out
        return out

    def _where(self, tensors: list[torch.Tensor], target) -> str:
        if not tensors:
            return f"a tensor made on the host (device={target}) inside the step"
        shapes = [(tuple(t.shape), t.device.type) for t in tensors]
        return f"host tensors mixed with {self.device.type} tensors {shapes}"
