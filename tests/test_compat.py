"""Checkpoints written before the TrainState redesign (format 1, tests/fixtures/checkpoint_v1.pt: 1 epoch
of a (4, 8) U-Net on 6 synthetic cases of 24 x 24 x 16, two ranks) still evaluate and resume."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import evaluate
from data.synthetic import write_synthetic_dataset
from tests.helpers import run

FIXTURE = Path(__file__).parent / "fixtures" / "checkpoint_v1.pt"
# The options the fixture was trained with (its data is the synthetic dataset they generate).
TRAINED_WITH = ["--synthetic-cases", "6", "--synthetic-size", "24", "--val-fraction", "0.34", "--features", "4", "8"]
TRAINED_WITH += ["--patch-size", "16", "16", "8", "--samples-per-epoch", "8", "--num-workers", "0"]


def test_the_fixture_is_a_format_1_checkpoint():
    old = torch.load(FIXTURE, map_location="cpu", weights_only=True)
    assert "format" not in old and "sampler_epoch" in old and old["epoch"] == 1 and old["world_size"] == 2


def test_an_old_checkpoint_evaluates(tmp_path, capsys):
    data = write_synthetic_dataset(tmp_path / "syn" / "cases6_size24_seed0", num_cases=6, size=24, seed=0)
    out = tmp_path / "eval"
    argv = ["--checkpoint", str(FIXTURE), "--data-dir", str(data), "--split", "val", "--device", "cpu"]
    assert evaluate.main([*argv, "--out-dir", str(out)]) == 0
    assert "is from before plans: cases are used as stored (plan none" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["plan"]["orientation"] == "none" and summary["plan"]["spacing"] is None
    assert summary["num_cases"] == 2 and 0 <= summary["mean_dice"] <= 1
    assert summary["config"]["features"] == [4, 8]
    assert len(list((out / "predictions").glob("*.nii.gz"))) == 2


def test_an_old_checkpoint_resumes(tmp_path):
    out = tmp_path / "run"
    args = ["--synthetic-dir", str(tmp_path / "syn"), "--cache-dir", str(tmp_path / "cache"), "--out-dir", str(out)]
    result = run(
        ["bash", "launch.sh", "cpu:2", *args, *TRAINED_WITH, "--epochs", "2", "--resume", str(FIXTURE)], timeout=240
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert f"resumed from {FIXTURE}: 1 epoch(s) and 0 step(s) done" in result.stdout
    assert "epoch 1/2" not in result.stdout and "epoch 2/2: loss" in result.stdout
    new = torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert new["format"] == 2 and new["epoch"] == 2 and "sampler_epoch" not in new
