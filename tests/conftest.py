"""Shared fixtures: small real datasets written as NIfTI files in the MSD layout."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import pytest

from data.synthetic import write_synthetic_dataset
from tests.helpers import run, small_options, small_synthetic

# A pytest started in a script's background (`python -m pytest &`) inherits SIGINT ignored, and so would every
# launch.sh it starts: a shell cannot trap a signal ignored at its start, so the Ctrl-C tests would hang there.
# Ctrl-C is tested as a terminal sends it, to a launch started with SIGINT at its default.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six training and two test cases of 24 x 24 x 16 voxels, with labelsTs/."""
    return write_synthetic_dataset(tmp_path_factory.mktemp("data") / "tiny", num_cases=6, size=24, seed=1, num_test=2)


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """No torchrun environment in this test process: the distributed accessors answer for one process."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="session")
def small_shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`small_synthetic`'s six cases and one preprocessing cache, for the runs of every module (`small_options`)."""
    return small_synthetic(tmp_path_factory, "small")


@pytest.fixture(scope="session")
def two_epoch_run(small_shared: Path, tmp_path_factory: pytest.TempPathFactory):
    """`bash launch.sh cpu:2` for two epochs with `small_options`, nothing interrupting it: (its out dir, named
    run, and the finished process). Tests read it, or add an evaluation folder; to resume it, copy it."""
    out = tmp_path_factory.mktemp("two_epochs") / "run"
    result: subprocess.CompletedProcess = run(["bash", "launch.sh", "cpu:2", *small_options(small_shared, out, 2)])
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return out, result
