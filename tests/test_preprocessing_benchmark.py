"""`python benchmarks/preprocessing.py`, the command the README gives for the full-size preprocessing
measurement, run as a user runs it (a small CT, so it takes seconds)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import preprocessing

ROOT = Path(__file__).resolve().parents[1]


def run_benchmark(tmp_path, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "result.json"
    shape = ("40", "36", "24")
    proc = subprocess.run(
        [sys.executable, "benchmarks/preprocessing.py", "--shape", *shape, "--folder", str(tmp_path / "ct"),
         "--json", str(out), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(out.read_text())


def planned_shape(shape) -> list[int]:
    """The CT's voxels at the target spacing: the whole volume is non-zero (air is -1000 HU), so no crop."""
    return [round(n * s / t) for n, s, t in zip(shape, preprocessing.SPACING, preprocessing.TARGET)]


def test_ours_alone_writes_the_ct_and_measures_it(tmp_path):
    proc, result = run_benchmark(tmp_path, "--reference", "none")
    assert result["shape"] == [40, 36, 24]
    assert (tmp_path / "ct" / "ct.nii.gz").is_file() and (tmp_path / "ct" / "ct_label.nii.gz").is_file()
    assert result["ours"]["output_shape"] == planned_shape((40, 36, 24))
    assert result["ours"]["seconds"] > 0 and result["ours"]["peak_mib"] > 0
    assert "monai" not in result and "ours" in proc.stdout and "ratio" not in proc.stdout


@pytest.mark.skipif(importlib.util.find_spec("monai") is None, reason="the MONAI reference needs the bench extra")
def test_against_monai_prints_the_ratios(tmp_path):
    proc, result = run_benchmark(tmp_path)
    # Spacingd rounds the extent differently at the edge; the orientation and spacing must agree
    assert all(abs(a - b) <= 1 for a, b in zip(result["monai"]["output_shape"], result["ours"]["output_shape"]))
    assert "ratio  MONAI / ours" in proc.stdout


def test_bad_shape_is_refused(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/preprocessing.py", "--shape", "4", "64", "64", "--reference", "none"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "(4, 64, 64)" in proc.stderr
