"""The Triton interpreter (TRITON_INTERPRET=1) without its cost per device-function call.

The interpreter runs a kernel's Python with `triton.language` patched to NumPy versions, and it
patches again at every call of a `@triton.jit` helper: `_patch_lang` walks the language's
modules with `inspect.getmembers`, some 150,000 times in one dry run of the persistent step, for
more than a third of its time. Once a launch has patched a module, a helper's patch of the same
module changes nothing (the builtins are already replaced, and the rest is set to the same
values), so `quicken()` skips the patches a launch has already made, and the launch's own
restore still undoes them at its end. The kernels' results are the same bits either way
(tests/test_interpreter.py compares them); only CPU tests and dry runs run the interpreter.

Nothing is changed unless TRITON_INTERPRET=1, or where the interpreter's internals are not the
ones this was written against (`_patch_lang(fn)` and `GridExecutor`, as in triton 3.6 and 3.9;
tested with 3.9): then it runs as shipped, only slower.
"""

from __future__ import annotations

import contextlib
import inspect
import os

_state: dict = {"langs": None, "installed": None}


class _Kept:
    """The scope of a patch not made again: nothing to restore."""

    def restore(self) -> None:
        pass


def _internals():
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return None
    patch, grid = getattr(ti, "_patch_lang", None), getattr(ti, "GridExecutor", None)
    if patch is None or grid is None or list(inspect.signature(patch).parameters) != ["fn"]:
        return None
    return tl, ti, patch, grid.__call__


def quicken() -> bool:
    """Skip the interpreter's repeated patches in this process; True where it does."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    if _state["installed"] is not None:
        return True
    found = _internals()
    if found is None:
        return False
    tl, ti, patch_lang, grid_call = found
    langs_of: dict = {}

    def quick_patch_lang(fn):
        langs = langs_of.get(fn)
        if langs is None:  # the language modules fn sees, as _patch_lang picks them
            langs = langs_of[fn] = frozenset(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)
            )
        patched = _state["langs"]
        if patched is not None and langs <= patched:
            return _Kept()
        scope = patch_lang(fn)
        _state["langs"] = langs | (patched or frozenset())
        return scope

    def quick_grid_call(self, *args, **kwargs):
        outer, _state["langs"] = _state["langs"], None  # a launch starts unpatched
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _state["langs"] = outer

    ti._patch_lang, ti.GridExecutor.__call__ = quick_patch_lang, quick_grid_call
    _state["installed"] = (ti, patch_lang, grid_call, quick_patch_lang, quick_grid_call)
    return True


@contextlib.contextmanager
def as_shipped():
    """The interpreter as triton ships it, inside the block (the reference for the tests)."""
    installed = _state["installed"]
    if installed is None:
        yield
        return
    ti, patch_lang, grid_call, quick_patch_lang, quick_grid_call = installed
    ti._patch_lang, ti.GridExecutor.__call__ = patch_lang, grid_call
    try:
        yield
    finally:
        ti._patch_lang, ti.GridExecutor.__call__ = quick_patch_lang, quick_grid_call
