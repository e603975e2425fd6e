"""Shared fixtures: tiny checkpoints written to disk once per session."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))
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


@pytest.fixture(scope="session")
def random_laneformer_dir(tmp_path_factory):
    """A random tiny Laneformer (8 lanes, delay 2, sliding + full layers) with a tokenizer."""
    from expresslane.assets import build_random_model

    return build_random_model(tmp_path_factory.mktemp("random-laneformer"))
