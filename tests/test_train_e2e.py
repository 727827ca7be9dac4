"""End to end: `bash launch.sh cpu:2` with the real torchrun, on six synthetic cases (the run that
test_reliability interrupts and resumes) and on another dataset."""

from __future__ import annotations

import io
import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import run
from unet3d.inference.pictures import class_colours

CHECKPOINT_KEYS = {"model", "optimizer", "scheduler", "scaler", "epoch", "best_metric", "config"}


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def launch(tmp: Path, *extra: str, epochs: int = 2) -> tuple[int, str, str]:
    args = [
        "bash",
        "launch.sh",
        "cpu:2",
        "--out-dir",
        str(tmp / "run"),
        "--cache-dir",
        str(tmp / "cache"),
        "--synthetic-dir",
        str(tmp / "syn"),
        "--epochs",
        str(epochs),
        "--samples-per-epoch",
        "8",
        "--num-workers",
        "1",
        *extra,
    ]
    result = run(args, timeout=240)
    return result.returncode, result.stdout, result.stderr


@pytest.fixture(scope="module")
def trained(two_epoch_run) -> tuple[Path, str, str]:
    """Two epochs on six synthetic cases of 32 mm (half for validation, so both ranks score some), the run
    test_reliability resumes (conftest's `two_epoch_run`): (the folder holding it as run/, stdout, stderr)."""
    out, result = two_epoch_run
    return out.parent, result.stdout, result.stderr


def test_checkpoint_is_unwrapped_and_safe_to_load(trained):
    tmp, _, _ = trained
    state = torch.load(tmp / "run/checkpoints/last.pt", map_location="cpu", weights_only=True)
    assert state.keys() >= CHECKPOINT_KEYS
    assert state["epoch"] == 2
    assert state["model"] and not any(k.startswith("module.") for k in state["model"])
    assert state["config"]["epochs"] == 2 and state["config"]["patch_size"] == (32, 32, 16)
    assert state["model_args"] == {
        "in_channels": 1,
        "num_classes": 3,
        "features": [8, 16, 32, 64],
        "kernels": [[3, 3, 3]] * 4,
        "strides": [[1, 1, 1], [2, 2, 2], [2, 2, 2], [2, 2, 1]],  # 16 voxels along z: no third halving
        "deep_supervision": False,  # the CPU default
    }
    assert state["plan"]["network"]["strides"] == state["model_args"]["strides"]
    assert state["plan"]["spacing"] == [1.0, 1.0, 1.5] and state["plan"]["orientation"] == "RAS"
    assert json.loads((tmp / "run" / "plan.json").read_text()) == state["plan"]
    assert 0 <= state["best_metric"] <= 1
    assert (tmp / "run/checkpoints/best.pt").is_file()
    assert not [p for p in (tmp / "run/checkpoints").iterdir() if p.name.startswith(".")], "no temporary files"


def test_tensorboard_holds_training_and_validation_scalars(trained):
    tmp, _, _ = trained
    loss = scalars(tmp / "run", "train/loss")
    assert [s for s, _ in loss] == [1, 2] and all(np.isfinite(v) and v > 0 for _, v in loss)
    assert [s for s, _ in scalars(tmp / "run", "val/mean_dice")] == [1, 2]
    assert [s for s, _ in scalars(tmp / "run", "val/dice_lesion")] == [1, 2]
    assert len(scalars(tmp / "run", "train/lr")) == 2


def test_tensorboard_holds_a_validation_overlay(trained):
    tmp, _, _ = trained
    acc = EventAccumulator(str(tmp / "run" / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    images = acc.Images("val/overlay")
    assert [i.step for i in images][:2] == [1, 2]
    picture = np.asarray(Image.open(io.BytesIO(images[0].encoded_image_string)))
    assert picture.shape[1] % 3 == 0 and picture.shape[1] >= 3 * 192, "image | reference | prediction side by side"
    panel = picture[-10:, : picture.shape[1] // 3].astype(int)
    other = picture[-10:, picture.shape[1] // 3 : 2 * picture.shape[1] // 3].astype(int)
    assert picture.shape[0] > picture.shape[1] // 3, "a caption above the panels"
    assert panel.shape == other.shape
    seen = {tuple(int(v) for v in p) for p in picture[: 2 * 18].reshape(-1, picture.shape[-1])[:, :3]}
    assert {tuple(int(v) for v in c) for c in class_colours(3)[1:]} <= seen, "a legend of the classes on top"


def test_evaluate_reproduces_the_runs_own_validation(trained):
    tmp, _, _ = trained
    checkpoint = tmp / "run/checkpoints/last.pt"
    epoch = torch.load(checkpoint, map_location="cpu", weights_only=True)["epoch"]
    logged = dict(scalars(tmp / "run", "val/mean_dice"))[epoch]
    result = run(["python", "evaluate.py", "--checkpoint", str(checkpoint), "--device", "cpu"], timeout=120)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp / "run/eval_val/summary.json").read_text())
    assert summary["split"] == "val" and summary["num_cases"] == 3
    assert abs(summary["mean_dice"] - logged) < 1e-4
    assert "mean Dice" in result.stdout and "lesion" in result.stdout
    for name in ("metrics.csv", "overview.png"):
        assert (tmp / "run/eval_val" / name).is_file()
    assert len(list((tmp / "run/eval_val/predictions").glob("*.nii.gz"))) == 3


def test_output_shows_world_size_and_one_progress_bar(trained):
    _, out, err = trained
    assert "world size 2, batch 2 per process, global batch 4" in out
    assert "rank 1: host" in out and "device cpu, CUDA_VISIBLE_DEVICES=" in out
    bars = [line for line in err.split("\n") if "train 1/2" in line]
    assert len(bars) == 1, f"expected one progress bar for epoch 1, got {len(bars)}"
    assert "[rank 1]" not in out, "rank 1 reports nothing but warnings and errors"
    assert "epoch 2/2: loss" in out


def write_two_channel_ct_dataset(root: Path, n: int = 5) -> Path:
    """An MSD-layout dataset unlike the synthetic one: 4D images with CT and PET channels, one class."""
    rng = np.random.default_rng(0)
    (root / "imagesTr").mkdir(parents=True)
    (root / "labelsTr").mkdir()
    training = []
    for i in range(n):
        label = np.zeros((20, 28, 12), np.uint8)
        x, y = rng.integers(4, 14), rng.integers(4, 20)
        label[x : x + 5, y : y + 6, 3:9] = 1
        ct = rng.normal(-500, 100, label.shape) + 900.0 * label
        pet = rng.normal(1, 0.2, label.shape) + 3.0 * label
        image = np.stack([ct, pet], axis=-1).astype(np.float32)
        affine = np.diag([0.8, 0.8, 2.5, 1.0])
        nib.save(nib.Nifti1Image(image, affine), root / "imagesTr" / f"pt_{i}.nii.gz")
        nib.save(nib.Nifti1Image(label, affine), root / "labelsTr" / f"pt_{i}.nii.gz")
        training.append({"image": f"./imagesTr/pt_{i}.nii.gz", "label": f"./labelsTr/pt_{i}.nii.gz"})
    meta = {"labels": {"0": "background", "1": "tumour"}, "modality": {"0": "CT", "1": "PET"}, "training": training}
    (root / "dataset.json").write_text(json.dumps(meta))
    return root


def test_trains_on_another_msd_dataset(tmp_path):
    data = write_two_channel_ct_dataset(tmp_path / "Task99_PETCT")
    rc, out, err = launch(tmp_path, "--data-dir", str(data), "--val-fraction", "0.4")
    assert rc == 0, f"stdout:\n{out}\nstderr:\n{err}"
    state = torch.load(tmp_path / "run/checkpoints/last.pt", map_location="cpu", weights_only=True)
    assert state["model_args"]["in_channels"] == 2 and state["model_args"]["num_classes"] == 2
    assert state["class_names"] == ["background", "tumour"] and state["epoch"] == 2
    assert state["config"]["data_dir"] == str(data)
    assert [s for s, _ in scalars(tmp_path / "run", "val/dice_tumour")] == [1, 2]
