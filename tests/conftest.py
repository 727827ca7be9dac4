"""Shared fixtures: small real datasets written as NIfTI files in the MSD layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from data.synthetic import write_synthetic_dataset


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six training and two test cases of 24 x 24 x 16 voxels, with labelsTs/."""
    return write_synthetic_dataset(tmp_path_factory.mktemp("data") / "tiny", num_cases=6, size=24, seed=1, num_test=2)


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """No torchrun environment in this test process: the distributed accessors answer for one process."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
