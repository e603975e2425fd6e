"""Import first in a kernel test module: without CUDA, the Triton kernels run in the interpreter.

TRITON_INTERPRET=1 must be set before the first `import triton` (triton.language's own @jit
helpers are built for a GPU otherwise, and the interpreter cannot use them). When another module
imported triton first in this process, the importing module is skipped, saying so. `GPU` and
`DEVICE` say where the kernels run.
"""

import os
import sys

import pytest
import torch

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
if not GPU:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "triton was imported before TRITON_INTERPRET=1 could be set: run this file on its "
            "own or export TRITON_INTERPRET=1",
            allow_module_level=True,
        )
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")
