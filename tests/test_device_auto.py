"""`--device auto`: a GPU when there is one, except for a model small enough to be faster on the
CPU (checkpoint.AUTO_CPU_MAX_PARAMETERS). The GPU is simulated (torch.cuda.is_available patched):
a wrong pick would put the embedded model on CUDA, which this machine does not have."""

from __future__ import annotations

import argparse

import pytest
import torch

from expresslane.assets import default_model_dir
from expresslane.checkpoint import (
    AUTO_CPU_MAX_PARAMETERS,
    load_config,
    load_model,
    parameter_count,
    resolve_device,
)
from expresslane.presets import get_preset
from expresslane.weights.packing import load_packed


@pytest.fixture
def gpu_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.fixture(scope="module")
def embedded():
    return load_config(default_model_dir())


def test_parameter_count_is_the_loaded_models(embedded):
    model = load_model(default_model_dir(), device="cpu", progress=False)
    assert parameter_count(embedded) == sum(p.numel() for p in model.parameters())


def test_auto_keeps_the_embedded_model_on_the_cpu(gpu_present, embedded):
    assert parameter_count(embedded) <= AUTO_CPU_MAX_PARAMETERS
    assert resolve_device("auto", embedded).type == "cpu"
    assert resolve_device("auto").type == "cuda"  # no model named: the GPU
    assert resolve_device("cpu", embedded).type == "cpu"


@pytest.mark.parametrize("preset", ["smollm-135m", "llama-3.2-1b", "laneformer-2b"])
def test_auto_puts_larger_models_on_the_gpu(gpu_present, preset):
    cfg = get_preset(preset)
    assert parameter_count(cfg) > AUTO_CPU_MAX_PARAMETERS
    assert resolve_device("auto", cfg).type == "cuda"


def test_without_a_gpu_auto_is_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", get_preset("laneformer-2b")).type == "cpu"


def test_loading_with_auto_follows_the_rule(gpu_present):
    """The load plan and the load agree: the embedded model loads on the CPU, packed as `run`
    packs it there (CUDA does not exist here, so any CUDA pick would fail)."""
    model = load_packed(default_model_dir(), device="auto", progress=False)
    assert next(model.parameters()).device.type == "cpu"


def test_run_with_auto_builds_the_cpu_engine(gpu_present):
    """`run`/`serve` resolve `auto` once: the CPU's packed step (decode "graph" where the C
    step is built), not the GPU's choices on CPU weights."""
    from expresslane.cli.run import add_model_arguments, load_engine
    from expresslane.step.choose import default_decode

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    engine, _ = load_engine(parser.parse_args([]))
    assert engine.device.type == "cpu"
    assert engine.decode == default_decode(torch.device("cpu"))
