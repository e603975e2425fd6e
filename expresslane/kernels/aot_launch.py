"""A Triton launch recorded as the JIT would compile it, on any machine (kernels/aot.py's input).

Within `recording`, `JITFunction.run` appends a `Launch` instead of running: each launch is
specialised by the runtime JIT's own binder for the target (16-byte-aligned pointers and
integers divisible by 16 get `tt.divisibility 16`, an integer equal to 1 becomes a constant), and
the launch plan of the GPU it stands for is simulated (gemv.PLANNED_GPU: SM count, PDL).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

# Launch options that are not kernel parameters (triton's launch keywords).
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "launch_pdl", "launch_cooperative_grid")
_DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch as the JIT would compile it: the kernel, its typed signature, its
    constexprs (by name), the JIT's specialisation attributes, the options and the grid."""

    kernel: object  # triton JITFunction
    signature: tuple[tuple[str, str], ...]  # (name, type) in parameter order
    constexprs: tuple[tuple[str, object], ...]
    options: tuple[tuple[str, object], ...]  # launch keywords as given (num_warps, launch_pdl)
    grid: tuple[int, ...]
    attrs: tuple[tuple[tuple[int, ...], tuple], ...] = ()  # path -> (("tt.divisibility", 16),)
    # tensor arguments: (parameter name, shape, element bytes), for byte counts (bench/profile)
    tensors: tuple[tuple[str, tuple[int, ...], int], ...] = ()

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def label(self) -> str:
        keys = ("MODE", "SPLIT_K", "HAS_NORM", "HAS_WINDOW", "BLOCK_O", "BLOCK_N", "BLOCK_V",
                "INT4", "GROUP", "BLOCK_S")  # fmt: skip
        shown = [f"{k}={v}" for k, v in self.constexprs if k in keys]
        return f"{self.name}[{','.join(shown)}]"

    def source(self):
        """The triton.compile source of this launch (its specialisation attributes included)."""
        from triton.compiler import ASTSource

        attrs = {path: [list(a) for a in attr] for path, attr in self.attrs}
        return ASTSource(self.kernel, dict(self.signature), dict(self.constexprs), attrs)

    def compile(self, arch: int):
        """The launch compiled for sm_`arch` as the JIT would (triton's cache serves a repeat)."""
        import triton
        from triton.backends.compiler import GPUTarget

        return triton.compile(self.source(), target=GPUTarget("cuda", arch, 32),
                              options=dict(self.options))  # fmt: skip

    def aligned(self) -> list[str]:
        """The parameters specialised as divisible by 16."""
        names = [n for n, _ in self.signature]
        return [names[path[0]] for path, attr in self.attrs
                if any(a[0] == "tt.divisibility" for a in attr)]  # fmt: skip


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no triton type for a {type(value).__name__} argument")


def _unspecialised(kernel, bound: dict) -> tuple[dict, dict]:
    """(signature, constexprs) with no specialisation: the fallback where the binder is missing."""
    sig, const = {}, {}
    for p in kernel.params:
        value = bound.get(p.name, p.default)
        if p.is_constexpr or value is None:
            sig[p.name] = "constexpr"
            const[(kernel.arg_names.index(p.name),)] = value
        else:
            sig[p.name] = _arg_type(value)
    return sig, const


def _specialise(kernel, backend, args, kwargs) -> tuple[dict, dict, dict]:
    """(signature, constexprs by path, attrs by path), by the runtime JIT's binder for `backend`
    (triton 3.6 and 3.9: create_function_from_signature + JITFunction._pack_args)."""
    from triton.runtime import jit

    binder = jit.create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    _, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound, specialization, options
    )
    return signature, constexprs, attrs


def _as_launch(kernel, grid, args, kwargs, backend=None) -> Launch:
    names = kernel.arg_names
    bound = dict(zip(names, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    if backend is not None:
        sig, const, attrs = _specialise(kernel, backend, args, kwargs)
    else:
        (sig, const), attrs = _unspecialised(kernel, bound), {}
    tensors = tuple((n, tuple(v.shape), v.element_size()) for n, v in bound.items()
                    if isinstance(v, torch.Tensor))  # fmt: skip
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k in _OPTIONS))
    grid = grid(bound) if callable(grid) else grid
    return Launch(
        kernel,
        tuple(sig.items()),
        tuple((names[path[0]], v) for path, v in sorted(const.items())),
        options,
        tuple(int(g) for g in grid),
        tuple(
            sorted((path, tuple(tuple(a) for a in attr)) for path, attr in attrs.items() if attr)
        ),  # fmt: skip
        tensors,
    )


def jit_backend(arch: int):
    """triton's CUDA backend for sm_`arch`: what the JIT would specialise and compile with."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    return make_backend(GPUTarget("cuda", arch, 32))


@contextlib.contextmanager
def recording(sms: int = 132, pdl: bool = True, arch: int | None = 90):
    """Within: Triton launches are appended to the yielded list instead of running, specialised
    as the JIT would for sm_`arch` (None: unspecialised, only to count launches)."""
    from triton.runtime.jit import JITFunction

    from . import gemv

    launches: list[Launch] = []
    original = JITFunction.run
    backend = jit_backend(arch) if arch else None

    def record(self, *args, grid, warmup, **kwargs):
        launches.append(_as_launch(self, grid, args, kwargs, backend))

    JITFunction.run = record
    gemv.PLANNED_GPU.update(sms=sms, pdl=pdl)
    try:
        yield launches
    finally:
        JITFunction.run = original
        gemv.PLANNED_GPU.clear()
