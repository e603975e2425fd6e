"""CPU thread count: the bytes a decode step streams, the cores idle now, and --threads."""

from __future__ import annotations

import pytest

from expresslane.errors import ConfigError
from expresslane.step import threads

MB = 1 << 20


def test_requested_threads_win_and_must_be_positive():
    assert threads.choose_threads(10 * MB, requested=3, idle=0.0) == 3
    with pytest.raises(ConfigError, match="--threads 0"):
        threads.choose_threads(10 * MB, requested=0)


def test_busy_cores_and_small_models_get_one_thread(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    assert threads.choose_threads(2000 * MB, idle=0.3) == 1  # the other cores are busy
    assert threads.choose_threads(10 * MB, idle=8.0) == 1  # a fork/join costs more than it brings
    assert threads.choose_threads(100 * MB, idle=8.0) == 3  # one per 32 MB
    assert threads.choose_threads(2000 * MB, idle=5.6) == 6
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    assert threads.choose_threads(2000 * MB, idle=8.0) == 2


def test_idle_cores_is_a_fraction_of_the_machine():
    idle = threads.idle_cores(sample_s=0.05)
    assert 0.0 <= idle <= (threads.os.cpu_count() or 1) + 1e-9
