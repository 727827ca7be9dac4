"""Every way the README starts training, end to end on the default synthetic data: `python train_ddp.py` and
`bash launch.sh cpu:N` for 1, 2 and 6 processes. Each must train, validate and leave a `best.pt` whose
validation Dice `evaluate.py --split val` reproduces. Six ranks hold more than the five validation cases of
the default split, so some ranks validate nothing and still take part in every collective. Two processes
(`bash launch.sh cpu`, the README's quick start) are walked by the GPU recipe's test below, with the same
checks (its first launch spells it `cpu`, as the quick start does), and by most tests of other modules.
Two launches also find their interpreter as the README's PYTHON paragraph says (`interpreter_env`): one
process for the pre-flight and torchrun's agent, or the pre-flight alone and then the TORCHRUN given."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import evaluate
from data.synthetic import folder_name
from tests.helpers import REPO, run
from unet3d.training.config import parse_args
from unet3d.training.preflight import preflight

# The defaults (24 synthetic cases of 64 x 64 x 40, the CPU network and patch), with one short epoch.
SHORT = ("--epochs", "1", "--samples-per-epoch", "12", "--num-workers", "0")


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    """One synthetic dataset and preprocessing cache for every launch of this module."""
    return tmp_path_factory.mktemp("modes")


def options(shared: Path, out: Path) -> list[str]:
    return ["--out-dir", str(out), "--synthetic-dir", str(shared / "syn"), "--cache-dir", str(shared / "cache"), *SHORT]


def check_trained(out: Path, stdout: str, world: int) -> dict:
    best = torch.load(out / "checkpoints" / "best.pt", map_location="cpu", weights_only=True)
    assert best["world_size"] == world and best["epoch"] == 1
    assert 0 <= best["best_metric"] <= 1
    assert f"world size {world}, batch 2 per process, global batch {2 * world}" in stdout
    assert "epoch 1/1: loss" in stdout and "val Dice" in stdout
    assert ("running alone: one process, no process group" in stdout) == (world == 1)
    return best


def evaluate_val(out: Path) -> dict:
    """evaluate.py in this process (its command line is walked by test_train_e2e and test_folds)."""
    argv = ["--checkpoint", str(out / "checkpoints" / "best.pt"), "--split", "val", "--device", "cpu"]
    assert evaluate.main([*argv, "--out-dir", str(out / "eval")]) == 0
    return json.loads((out / "eval" / "summary.json").read_text())


def test_single_process_without_a_launcher(shared, tmp_path):
    """`python train_ddp.py`: no torchrun, no process group, no DDP wrapper."""
    out = tmp_path / "run"
    result = run(["python", "train_ddp.py", *options(shared, out)], timeout=300, env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    best = check_trained(out, result.stdout, world=1)
    assert "done. checkpoint:" in result.stdout
    summary = evaluate_val(out)  # (evaluate.py's command line: test_train_e2e, test_folds)
    assert summary["num_cases"] == 5 and abs(summary["mean_dice"] - best["best_metric"]) < 1e-4

    # Between epochs a job may continue on more ranks: the one process's generator states fit none of them.
    # (launched by the TORCHRUN given: the pre-flight alone, then `python3 -m torch.distributed.run`)
    env = interpreter_env(tmp_path, "TORCHRUN set")
    more = run(["bash", str(REPO / "launch.sh"), "cpu:2", *options(shared, out), "--epochs", "2"], env=env, timeout=300)
    assert more.returncode == 0, f"stdout:\n{more.stdout}\nstderr:\n{more.stderr}"
    check_interpreter(tmp_path, "TORCHRUN set")
    assert "1 epoch(s) and 0 step(s) done" in more.stdout and "epoch 2/2: loss" in more.stdout
    assert "was written by 1 rank(s), this run has 2: the random generators start from the seed" in more.stdout
    last = torch.load(out / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert last["epoch"] == 2 and last["world_size"] == 2 and len(last["rng"]) == 2
    # TensorBoard's steps go on from the 6 steps of one process, though two ranks take 3 per epoch
    steps = EventAccumulator(str(out / "tensorboard" / "steps"))
    steps.Reload()
    assert [e.step for e in steps.Scalars("train/loss_step")] == list(range(1, 10)) and last["trained_steps"] == 9


@pytest.mark.parametrize("world", [1, 6])  # (3 ranks: test_ddp's and test_dist's gloo groups)
def test_launch_cpu_n_trains_and_evaluate_reproduces_best(shared, tmp_path, world):
    """One process also walks the quick start's default folders (runs/default, runs/synthetic and the cache
    under runs/cache, relative to where it is started), here from an empty folder beside the data."""
    out = tmp_path / "run"
    if world == 1:
        (tmp_path / "runs").mkdir()
        (shared / "syn").mkdir(exist_ok=True)  # (the first test of the module to run writes the data into it)
        (tmp_path / "runs" / "synthetic").symlink_to(shared / "syn", target_is_directory=True)
        command = ["bash", str(REPO / "launch.sh"), "cpu:1", *SHORT]
        result = run(command, timeout=300, cwd=tmp_path)
        out = tmp_path / "runs" / "default"
        assert "checkpoints/best.pt" in result.stdout and (out / "tensorboard").is_dir(), result.stdout[-2000:]
        data = (shared / "syn" / folder_name(24, 64, 0, "uniform")).resolve()
        caches = [p.name for p in (tmp_path / "runs" / "cache").iterdir()]
        assert len(caches) == 1 and caches[0].startswith(f"{data.name}-"), caches
    else:  # (launched by an interpreter given as PYTHON)
        env = interpreter_env(tmp_path, "PYTHON set")
        result = run(["bash", "launch.sh", f"cpu:{world}", *options(shared, out)], env=env, timeout=300)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    if world > 1:
        check_interpreter(tmp_path, "PYTHON set")
    best = check_trained(out, result.stdout, world)
    # with 6 ranks, rank 5 holds no validation case; it joined every collective, or the run would hang
    assert sorted(p.name for p in (out / "logs").iterdir()) == [f"rank{r}.log" for r in range(world)]
    summary = evaluate_val(out)
    assert summary["num_cases"] == 5
    assert abs(summary["mean_dice"] - best["best_metric"]) < 1e-4, "validation and evaluate.py agree"


def test_no_validation_case_is_refused_before_training(shared, tmp_path):
    out = tmp_path / "run"
    result = run(["bash", "launch.sh", "cpu:2", *options(shared, out), "--val-fraction", "0"], timeout=120)
    assert result.returncode == 2
    assert "holds out no validation case; raise --val-fraction" in result.stdout
    assert not (out / "logs").exists(), "no rank may start"


def test_an_out_dir_that_cannot_be_written_is_refused_before_training(shared, tmp_path):
    """A file in the way of --out-dir: launch.sh's pre-flight says so once and starts no rank; a single process
    (no pre-flight) says the same and exits as for bad input, not with a traceback."""
    (tmp_path / "taken").write_text("a file, not a folder")
    out = tmp_path / "taken" / "run"
    message = f"error: --out-dir {out}: cannot write {out / 'logs'} (Not a directory)"
    launched = run(["bash", "launch.sh", "cpu:2", *options(shared, out)], timeout=120)
    assert launched.returncode == 2 and launched.stdout.count(message) == 1, launched.stdout
    assert "rank 0 -> cpu" in launched.stdout and "Traceback" not in launched.stdout + launched.stderr
    alone = run(["python", "train_ddp.py", *options(shared, out)], timeout=120, env={"CUDA_VISIBLE_DEVICES": ""})
    assert alone.returncode == 2 and message in alone.stdout, alone.stdout + alone.stderr
    assert "Traceback" not in alone.stderr
    # the same for the synthetic dataset's folder, which the pre-flight writes
    synthetic = ["--synthetic-dir", str(tmp_path / "taken" / "syn")]
    unwritten = run(["bash", "launch.sh", "cpu:2", *options(shared, tmp_path / "run"), *synthetic], timeout=120)
    assert unwritten.returncode == 2 and "error: [Errno 20] Not a directory: " in unwritten.stdout, unwritten.stdout
    assert str(tmp_path / "taken" / "syn") in unwritten.stdout and "Traceback" not in unwritten.stderr


def test_the_gpu_recipe_trains_evaluates_and_resumes_on_the_cpu(shared, tmp_path, capsys):
    """The GPU defaults' ingredients (deep supervision, nnU-Net's augmentation) through every stage on two
    gloo ranks (`launch.sh cpu`, whose default is two): the checkpoint holds the auxiliary heads, evaluate.py
    reproduces the best validation, a resumed run with `auto` follows the checkpoint's model (this device's
    default is off), and an explicit change of the model is refused."""
    out = tmp_path / "run"
    recipe = ("--deep-supervision", "on", "--augmentation", "nnunet")
    result = run(["bash", "launch.sh", "cpu", *options(shared, out), *recipe], timeout=300)  # cpu = cpu:2
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "deep supervision on, augmentation nnunet" in result.stdout
    best = check_trained(out, result.stdout, world=2)
    assert best["model_args"]["deep_supervision"] is True
    assert any(k.startswith("aux_heads.") for k in best["model"]), "the coarser levels' heads are saved"
    summary = evaluate_val(out)
    assert abs(summary["mean_dice"] - best["best_metric"]) < 1e-4, "the full-resolution output is what is scored"

    resumed = run(["bash", "launch.sh", "cpu:2", *options(shared, out), "--epochs", "2"], timeout=300)
    assert resumed.returncode == 0, f"stdout:\n{resumed.stdout}\nstderr:\n{resumed.stderr}"
    assert "resumed from" in resumed.stdout and "epoch 2/2: loss" in resumed.stdout
    assert "deep supervision on, augmentation basic" in resumed.stdout, "auto follows the checkpoint's model"

    # the pre-flight that launch.sh runs (`train_ddp.py --prepare-only`), in this process: it refuses the change
    capsys.readouterr()
    changed = ["--epochs", "3", "--deep-supervision", "off", "--prepare-only"]
    assert preflight(parse_args([*options(shared, out), *changed])) == 2
    assert "deep_supervision (checkpoint on, now off)" in capsys.readouterr().out


def test_mixed_acquisitions_train_and_predict_on_each_scans_own_grid(tmp_path):
    """`--synthetic-geometry mixed` (the README's way to see the geometry handling): the dataset is written
    with its three protocols (isotropic RAS, thick-slice LPS, sagittal RIP with the thick axis first), two
    ranks plan and train on it, `evaluate.py --split val` reproduces the best validation (validation scores on
    the native grids too), and every test prediction has its own image's shape and affine."""
    import nibabel as nib

    out = tmp_path / "run"
    small = ["--synthetic-cases", "6", "--synthetic-size", "32", "--val-fraction", "0.34"]
    args = ["--out-dir", str(out), "--synthetic-dir", str(tmp_path / "syn"), "--cache-dir", str(tmp_path / "cache")]
    args += ["--acquisition-channel", "auto"]  # the experiment's channel (off by default), walked end to end
    result = run(["bash", "launch.sh", "cpu:2", *args, *SHORT, *small, "--synthetic-geometry", "mixed"], timeout=300)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    data = tmp_path / "syn" / folder_name(6, 32, 0, "mixed")
    images = sorted((data / "imagesTr").glob("*.nii.gz")) + sorted((data / "imagesTs").glob("*.nii.gz"))
    acquisitions = set()
    for path in images:
        nii = nib.load(path)
        acquisitions.add((nib.aff2axcodes(nii.affine), tuple(round(float(z), 3) for z in nii.header.get_zooms()[:3])))
    assert acquisitions == {
        (("R", "A", "S"), (1.0, 1.0, 1.0)),
        (("L", "P", "S"), (0.8, 0.8, 3.0)),
        (("R", "I", "P"), (3.3, 0.9, 0.9)),
    }, acquisitions
    assert "plan: orientation RAS, spacing" in result.stdout
    best = torch.load(out / "checkpoints" / "best.pt", map_location="cpu", weights_only=True)
    summary = evaluate_val(out)
    assert abs(summary["mean_dice"] - best["best_metric"]) < 1e-4, "validation and evaluate.py agree"

    argv = ["--checkpoint", str(out / "checkpoints" / "best.pt"), "--split", "test", "--device", "cpu"]
    assert evaluate.main([*argv, "--out-dir", str(out / "test")]) == 0
    for image in sorted((data / "imagesTs").glob("*.nii.gz")):
        source, prediction = nib.load(image), nib.load(out / "test" / "predictions" / image.name)
        assert prediction.shape == source.shape
        np.testing.assert_allclose(prediction.affine, source.affine, atol=1e-5)
    # the thick-slice scans among fine ones give the network the acquisition channel: one file per case is
    # still all a folder of scans needs (the channel is computed, not read)
    assert json.loads((out / "plan.json").read_text())["acquisition_channel"] is True
    assert best["model_args"]["in_channels"] == 2 and "distances to the measured planes" in result.stdout
    assert "simulated thick slices: a third of the fine cases' patches re-acquired as (" in result.stdout
    assert evaluate.main([*argv[:2], "--images", str(data / "imagesTs"), "--out-dir", str(out / "folder")]) == 0
    for image in sorted((data / "imagesTs").glob("*.nii.gz")):
        assert nib.load(out / "folder" / image.name).shape == nib.load(image).shape


def _interpreter(path: Path, log: Path) -> Path:
    """A `python` that notes each call's arguments in `log`, then runs this test's interpreter (which has torch)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return path


def interpreter_env(tmp_path: Path, form: str) -> dict[str, str]:
    """The environment of a launch that finds its interpreter by `form` (README: `PYTHON=... bash launch.sh`):
    "PYTHON set": one process of that interpreter runs the pre-flight and then torchrun's agent
    (`train_ddp.py --torchrun ...`), whose ranks run under it too; "TORCHRUN set" (`python3 -m
    torch.distributed.run`, python3 found on PATH): the pre-flight alone, then that command. In both a
    `torchrun` of another interpreter comes first on PATH, and must not run. The interpreter notes its calls
    for `check_interpreter`. Each form rides on a real training launch of a test above, which checks what it
    trained."""
    log, bin_dir = tmp_path / "calls.log", tmp_path / "bin"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}  # this venv's bin (its torchrun, python3) left out
    if form == "PYTHON set":
        env["PYTHON"] = str(_interpreter(tmp_path / "py" / "python", log))
    else:
        _interpreter(bin_dir / "python3", log)
        env["TORCHRUN"] = "python3 -m torch.distributed.run"
    bin_dir.mkdir(exist_ok=True)
    decoy = bin_dir / "torchrun"
    decoy.write_text(f"#!/bin/sh\ntouch {tmp_path / 'decoy-ran'}\nexit 1\n")  # another env's torchrun
    decoy.chmod(0o755)
    return env


def check_interpreter(tmp_path: Path, form: str) -> None:
    calls = (tmp_path / "calls.log").read_text().splitlines()
    if form == "PYTHON set":  # the pre-flight and the agent, one process; its ranks run under the agent's
        # own interpreter (sys.executable), the one the wrapper started
        agent = [c for c in calls if " --torchrun --standalone --nproc-per-node " in c]
        assert len(agent) == 1 and not any(c.endswith("--prepare-only") for c in calls), calls
    else:
        assert any(c.endswith("--prepare-only") for c in calls), calls  # the pre-flight
        assert any(c.startswith("-m torch.distributed.run --standalone ") for c in calls), calls  # TORCHRUN
    assert not (tmp_path / "decoy-ran").exists()
