"""Fault tolerance end to end: killed ranks, stop signals, bad steps, bad datasets, bad checkpoints, time
limits and two nodes, each run through launch.sh and the real torchrun, judged by its artifacts."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import REPO, SMALL_EPOCH_STEPS, free_port, rendezvous_address, run, small_options
from unet3d.training.config import parse_args
from unet3d.training.preflight import preflight

EPOCH_STEPS = SMALL_EPOCH_STEPS
options = small_options


@pytest.fixture(scope="module")
def shared(small_shared) -> Path:
    """The synthetic dataset and cache shared by the runs of this module (and of others)."""
    return small_shared


def launch(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return run(["bash", "launch.sh", "cpu:2", *args], env=env, timeout=timeout)


def start(*args: str, env: dict | None = None) -> subprocess.Popen:
    """launch.sh in the background, in its own session (killed as a group if the test fails)."""
    return subprocess.Popen(
        ["bash", "launch.sh", "cpu:2", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out\nstdout:\n{out.decode()}\nstderr:\n{err.decode()}") from None
    return proc.returncode, out.decode(), err.decode()


def wait_for(path: Path, pattern: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and re.search(pattern, path.read_text()):
            return
        time.sleep(0.05)
    raise AssertionError(f"{pattern!r} did not appear in {path} within {timeout} s")


def rank_pid(out: Path, rank: int) -> int:
    """The pid of the newest process of `rank`, from its log file."""
    return int(re.findall(r"=== rank \d+ pid (\d+)", (out / "logs" / f"rank{rank}.log").read_text())[-1])


def loss_steps(out: Path) -> list[int]:
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return [e.step for e in acc.Scalars("train/loss")]


def step_losses(out: Path) -> list[int]:
    """The steps of train/loss_step, which the run keeps in a folder of its own (purged by steps)."""
    acc = EventAccumulator(str(out / "tensorboard" / "steps"))
    acc.Reload()
    return [e.step for e in acc.Scalars("train/loss_step")]


def checkpoint(out: Path, name: str = "last.pt") -> dict:
    return torch.load(out / "checkpoints" / name, map_location="cpu", weights_only=True)


# --- a rank dies ----------------------------------------------------------------------------------------


def test_sigkill_of_one_rank_mid_epoch_resumes_and_completes(shared, tmp_path):
    out = tmp_path / "run"
    proc = start(*options(shared, out, 2))
    wait_for(out / "logs" / "rank0.log", r"epoch 1/2:")  # logged after epoch 1's checkpoint: now in epoch 2
    os.kill(rank_pid(out, 1), signal.SIGKILL)
    rc, stdout, stderr = finish(proc)
    assert rc == 0, stderr[-3000:]
    assert "resumed from" in stdout and "1 epoch(s) and 0 step(s) done" in stdout
    for epoch in (1, 2):  # epoch 2 is trained in full after the restart
        assert stdout.count(f"epoch {epoch}/2:") == 1, f"epoch {epoch} must complete exactly once"
    assert loss_steps(out) == [1, 2], "TensorBoard: no duplicated or backwards steps"
    assert step_losses(out) == list(range(1, 2 * EPOCH_STEPS + 1)), "every step once: epoch 1's kept"
    assert checkpoint(out)["epoch"] == 2
    assert "torchrun restart 1" in (out / "logs" / "rank1.log").read_text()


# --- graceful stop and exact resume ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(two_epoch_run) -> Path:
    """The out dir of a run of two epochs that nothing interrupted, with `options` (copy it to resume it)."""
    return two_epoch_run[0]


def test_sigterm_stops_all_ranks_and_resuming_equals_an_uninterrupted_run(shared, uninterrupted, tmp_path):
    full = uninterrupted
    out = tmp_path / "run"
    proc = start(*options(shared, out, 2))
    # Logged after epoch 1's checkpoint: the signal lands in epoch 2, whose first step is always trained
    # before the ranks agree to stop, so the position recorded is inside the epoch.
    wait_for(out / "logs" / "rank0.log", r"epoch 1/2:")
    os.kill(rank_pid(out, 1), signal.SIGTERM)
    rc, stdout, stderr = finish(proc, timeout=60)
    assert rc == 0, stderr[-3000:]
    assert "stopped by a stop signal" in stdout and "run the same command again to continue" in stdout
    stopped = checkpoint(out)
    assert stopped["epoch"] == 1 and 0 < stopped["step"] < EPOCH_STEPS, "the position inside epoch 2 is recorded"
    assert "torchrun restart 1" not in (out / "logs" / "rank0.log").read_text(), "a stop is not a failure"

    resumed = launch(*options(shared, out, 2))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"1 epoch(s) and {stopped['step']} step(s) done" in resumed.stdout
    a, b = checkpoint(full), checkpoint(out)
    assert a["epoch"] == b["epoch"] == 2
    for key, value in a["model"].items():
        torch.testing.assert_close(b["model"][key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert loss_steps(out) == [1, 2]
    assert step_losses(out) == list(range(1, 2 * EPOCH_STEPS + 1)), "the stopped epoch's steps, then the rest"


GRACEFUL = "launch.sh: torchrun ended on the signal after all 2 rank(s) had stopped and saved"


def test_ctrl_c_stops_the_ranks_gracefully_and_exits_0(shared, tmp_path):
    """Ctrl-C in the terminal reaches launch.sh and torchrun (one process group): torchrun passes the signal
    on and exits 1 with its SignalException, and launch.sh, told by every rank that it stopped and saved,
    exits 0. (A SIGTERM to launch.sh alone ends the first job of the second-job test below.)"""
    out, scratch = tmp_path / "run", tmp_path / "tmp"
    scratch.mkdir()
    proc = start(*options(shared, out, 2), env={"TMPDIR": str(scratch)})
    wait_for(out / "logs" / "rank0.log", r"epoch 1/2:")
    made = sorted(p.name for p in scratch.glob("unet3d-stop.*"))  # the ranks' stop lines, and the agent's mark
    assert len(made) == 2 and made[1] == f"{made[0]}.agent", made
    os.killpg(proc.pid, signal.SIGINT)
    rc, stdout, stderr = finish(proc, timeout=60)
    assert rc == 0, stderr[-3000:]
    assert "stopped by a stop signal" in stdout and "run the same command again to continue" in stdout
    stopped = checkpoint(out)
    assert stopped["epoch"] == 1 and 0 < stopped["step"] < EPOCH_STEPS, "the position inside epoch 2 is recorded"
    assert "SignalException" in stderr and GRACEFUL in stderr, stderr[-3000:]
    assert not list(scratch.glob("unet3d-stop.*")), "launch.sh removes its file"


def test_a_signal_to_the_launcher_before_training_ends_the_job_without_a_restart(shared, tmp_path):
    """SIGTERM to launch.sh while the ranks start (before their stop handlers exist, so the signal ends them):
    the job ends, and torchrun, told to stop, restarts nothing."""
    out = tmp_path / "run"
    proc = start(*options(shared, out, 2))
    wait_for(out / "logs" / "rank0.log", r"=== rank 0 pid")
    os.kill(proc.pid, signal.SIGTERM)
    rc, stdout, stderr = finish(proc, timeout=60)
    assert "launch.sh: SIGTERM: stopping" in stderr, stderr[-3000:]
    logs = [(out / "logs" / f"rank{r}.log").read_text() for r in (0, 1) if (out / "logs" / f"rank{r}.log").exists()]
    assert all("torchrun restart 1" not in log for log in logs), "a stop must not become a restart"
    assert "epoch 2/2:" not in stdout and (rc == 0) == ("stopped by a stop signal" in stdout), (rc, stdout[-2000:])


def test_a_second_job_into_the_same_out_dir_is_refused_while_the_first_trains(shared, tmp_path):
    """Started twice by mistake: the second job's pre-flight is refused (no rank starts), as is a single process
    without the launcher, and the first job trains on undisturbed. It is then stopped by a SIGTERM to launch.sh
    alone (`kill PID`, a scheduler signalling the batch shell), which tells torchrun to stop: torchrun passes
    the signal on, and launch.sh, told by every rank that it stopped and saved, exits 0."""
    out, scratch = tmp_path / "run", tmp_path / "tmp"
    scratch.mkdir()
    first = start(*options(shared, out, 50), env={"TMPDIR": str(scratch)})  # stopped once the others are refused
    wait_for(out / "logs" / "rank0.log", r"epoch 1/50:")
    holder = f"pid {rank_pid(out, 0)} on "
    second = launch(*options(shared, out, 50), timeout=120)
    assert second.returncode == 2, second.stdout + second.stderr[-3000:]
    assert f"error: --out-dir {out} is in use by another job ({holder}" in second.stdout, second.stdout
    alone = run(["python", "train_ddp.py", *options(shared, out, 50)], env={"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert alone.returncode == 2 and f"is in use by another job ({holder}" in alone.stdout, alone.stdout
    assert first.poll() is None, "the first job still trains"
    os.kill(first.pid, signal.SIGTERM)
    rc, stdout, stderr = finish(first, timeout=60)
    assert rc == 0 and "stopped by a stop signal" in stdout, stderr[-3000:]
    assert "launch.sh: SIGTERM: stopping (the ranks finish their step and save" in stderr and GRACEFUL in stderr
    assert not list(scratch.glob("unet3d-stop.*")), "launch.sh removes its file"
    assert "resumed from" not in stdout and checkpoint(out)["epoch"] >= 1
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    assert (out / "logs" / "rank0.log").read_text().count("=== rank 0 pid") == 2, (
        "the first job's and the refused one's"
    )


# --- non-finite steps -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nan_run(shared, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One run whose rank 1 sees a NaN loss at epoch 1's step 4 alone, then in epoch 2's steps 3 to 5."""
    out = tmp_path_factory.mktemp("nan") / "run"
    faults = {"UNET3D_FAULT_NAN": f"1:3,{EPOCH_STEPS + 2},{EPOCH_STEPS + 3},{EPOCH_STEPS + 4}"}
    return out, launch(*options(shared, out, 2, "--max-bad-steps", "3"), env=faults)


def test_a_nan_on_one_rank_is_skipped_by_both(nan_run):
    out, result = nan_run
    line = "epoch 1 step 4: skipped, a rank saw a non-finite loss or gradient"
    for rank in (0, 1):
        assert (out / "logs" / f"rank{rank}.log").read_text().count(line) == 1
    epoch_1 = [s for s in result.stdout.splitlines() if s.startswith("epoch 1/2:")]
    assert len(epoch_1) == 1 and "1 step(s) skipped" in epoch_1[0], result.stdout
    assert all(torch.isfinite(v).all() for v in checkpoint(out)["model"].values())


def test_repeated_nan_stops_the_job_without_restarts(nan_run):
    out, result = nan_run
    assert result.returncode != 0
    assert "non-finite loss or gradients in 3 consecutive steps" in result.stdout
    assert "torchrun restart 1" not in (out / "logs" / "rank0.log").read_text(), "a restart would repeat it"
    assert checkpoint(out)["epoch"] == 1, "nothing written after the bad steps"
    assert "epoch 2/2:" not in result.stdout


def test_out_of_memory_on_one_rank_ends_the_job_once_with_advice(shared, tmp_path):
    """A rank that runs out of GPU memory (injected here: the CPU has no such error) ends the job itself:
    a restart would run out again, and the other rank, waiting in a collective, is stopped with it."""
    out = tmp_path / "run"
    result = launch(*options(shared, out, 2), env={"UNET3D_FAULT_OOM": "1:3"})
    assert result.returncode != 0
    assert "error: rank 1 (cpu) ran out of memory" in result.stdout and "--grad-checkpoint" in result.stdout
    for rank in (0, 1):
        assert "torchrun restart 1" not in (out / "logs" / f"rank{rank}.log").read_text(), "no restart"


def test_a_full_disk_ends_the_job_once_with_what_to_do(shared, tmp_path):
    """The kernel refuses the first checkpoint (a file-size limit, `ulimit -f`: EFBIG, as a full disk gives
    ENOSPC): every rank learns it from rank 0 and the job ends at once with the file named, where torchrun
    restarted it to fail again after another epoch each time; nothing half-written is left."""
    out = tmp_path / "run"
    began = time.monotonic()
    command = ["bash", "-c", 'ulimit -f 1024 && exec bash launch.sh cpu:2 "$@"', "launch", *options(shared, out, 2)]
    result = run(command, timeout=240)  # a 1 MiB limit: the small model's checkpoint takes about 2.9 MB
    assert result.returncode == 1, result.stdout + result.stderr
    assert re.search(
        rf"(?m)^error: \[Errno 27\] File too large: '{re.escape(str(out))}/checkpoints/(best|last)\.pt': a restart "
        "would fail the same way, so the job ends here; .* Make room",
        result.stdout,
    ), result.stdout
    assert "train 2/2" not in result.stdout + result.stderr, "the job ended at the first save"
    for rank in (0, 1):
        assert "torchrun restart 1" not in (out / "logs" / f"rank{rank}.log").read_text(), "no restart"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [], "no temporary file left"
    assert time.monotonic() - began < 120


def test_a_rank_held_up_past_the_dist_timeout_is_named_with_where_it_was(shared, tmp_path):
    """Rank 1 stops for 8 s inside its first step (as a deadlock or a stuck DataLoader would); rank 0 waits in
    the step's collective. Past 0.9 x --dist-timeout each rank says so and logs its threads' stacks (rank 1's
    at the stop, rank 0's in the collective); rank 0's collective fails at the timeout with an error line
    that names it, and the job ends with no checkpoint half-written."""
    out = tmp_path / "run"
    begun = time.monotonic()
    result = launch(
        *options(shared, out, 1, "--dist-timeout", "4"), env={"UNET3D_SLOW_STEP": "1:8", "MAX_RESTARTS": "0"}
    )
    assert result.returncode != 0
    assert time.monotonic() - begun < 120, "the job ends at the timeout, not when the held-up rank would"
    for rank in (0, 1):
        prefix = "[rank 1] " if rank else ""
        assert re.search(
            rf"(?m)^{re.escape(prefix)}rank {rank}: no collective has returned on this rank for "
            r"3\.\d s, 90% of --dist-timeout 4 s",
            result.stdout,
        ), result.stdout
    error = re.search(
        r"(?m)^error: rank 0: (.*), (\d+\.\d) s after a collective last returned on this rank "
        r"\(--dist-timeout 4 s\): a rank hung",
        result.stdout,
    )
    assert error is not None, result.stdout
    assert "Timed out" in error[1] and 4.0 <= float(error[2]) < 8.0
    logs = {rank: (out / "logs" / f"rank{rank}.log").read_text() for rank in (0, 1)}
    held_up = logs[1].split("rank 1 after", 1)[1]
    assert "faults.py" in held_up and "time.sleep(self.slow)" in held_up, "where rank 1 was: the injected stop"
    waiting = logs[0].split("rank 0 after", 1)[1].split("thread MainThread:\n", 1)[1].split("\nthread ", 1)[0]
    assert "in all_reduce" in waiting or "in backward" in waiting, waiting
    saved = [str(path.relative_to(out)) for path in out.rglob("*") if "checkpoints" in path.parts and path.is_file()]
    assert saved == [], "no epoch ended: nothing saved, and nothing half-written"


# --- bad datasets ---------------------------------------------------------------------------------------


def broken_copy(shared: Path, tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A copy of the dataset with one kind of damage, and the file name the error must mention."""
    root = tmp_path / "data"
    shutil.copytree(shared / "data", root)
    meta_path = root / "dataset.json"
    case = "synth_002.nii.gz"
    image, label = root / "imagesTr" / case, root / "labelsTr" / case
    if kind == "no dataset.json":
        meta_path.unlink()
        return root, "dataset.json"
    if kind == "malformed dataset.json":
        meta_path.write_text('{"labels": {"0": "background"')
        return root, "dataset.json"
    if kind == "missing image":
        image.unlink()
        return root, f"imagesTr/{case}"
    img, lbl = nib.load(image), nib.load(label)
    data, seg = np.asarray(img.dataobj), np.asarray(lbl.dataobj)
    if kind == "shape mismatch":
        nib.save(nib.Nifti1Image(seg[:, :, :-1], lbl.affine), label)
    elif kind == "affine mismatch":
        nib.save(nib.Nifti1Image(seg, lbl.affine @ np.diag([1, 1, 1.2, 1])), label)
    elif kind == "undeclared label":
        seg = seg.copy()
        seg[0, 0, 0] = 7
        nib.save(nib.Nifti1Image(seg, lbl.affine), label)
    elif kind == "sheared affine":
        sheared = img.affine @ np.array([[1, 0.4, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1.0]])
        nib.save(nib.Nifti1Image(data, sheared), image)
        nib.save(nib.Nifti1Image(seg, sheared), label)
    elif kind == "2D image":
        nib.save(nib.Nifti1Image(data[:, :, :1], img.affine), image)
        nib.save(nib.Nifti1Image(seg[:, :, :1], lbl.affine), label)
    elif kind == "truncated label":  # an interrupted copy: the header reads, the voxels end early
        raw = label.read_bytes()
        label.write_bytes(raw[: len(raw) // 2])
    elif kind == "NaN image":
        data = data.copy()
        data[1, 2, 3] = np.nan
        nib.save(nib.Nifti1Image(data, img.affine), image)
    elif kind == "no validation case":
        return root, "dataset.json"
    return root, case


LAUNCHED = {"malformed dataset.json", "sheared affine", "no validation case"}  # the rest: the pre-flight in-process


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("no dataset.json", "no dataset.json in"),
        ("malformed dataset.json", "is not valid JSON"),
        ("missing image", "listed in dataset.json but missing"),
        ("shape mismatch", "has spatial shape"),
        ("affine mismatch", "are not where those of"),
        ("sheared affine", "the affine is sheared"),
        ("2D image", "is not a 3D volume"),
        ("undeclared label", "label value(s) [7] not declared"),
        ("NaN image", "NaN or infinite value(s)"),
        ("truncated label", "cannot read its voxels (EOFError"),
        ("no validation case", "holds out no validation case"),
    ],
)
def test_a_broken_dataset_stops_before_any_rank_starts(shared, tmp_path, kind, message, capsys):
    """Through launch.sh for three kinds (a dataset.json, an image and a split problem): the pre-flight stops
    the job before torchrun starts a rank. The others call that pre-flight (`train_ddp.py --prepare-only`,
    what launch.sh runs) in this process: the same check, without a launch's start-up time."""
    data, name = broken_copy(shared, tmp_path, kind)
    fraction = "0" if kind == "no validation case" else "0.5"
    args = ["--data-dir", str(data), "--out-dir", str(tmp_path / "run"), "--val-fraction", fraction]
    args += ["--cache-dir", str(tmp_path / "cache")]
    if kind in LAUNCHED:
        result = launch(*args, timeout=60)
        returncode, stdout = result.returncode, result.stdout
    else:
        returncode = preflight(parse_args([*args, "--prepare-only"]))
        stdout = capsys.readouterr().out
    assert returncode == 2
    errors = [line for line in stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stdout
    assert message in stdout and name in stdout
    assert not (tmp_path / "run" / "logs").exists(), "no rank may start"


def test_the_ranks_check_the_dataset_too_and_fail_together_without_restarts(shared, tmp_path):
    """Started by torchrun directly (no pre-flight): rank 0's verdict reaches every rank, the job ends once."""
    data, _ = broken_copy(shared, tmp_path, "NaN image")
    result = run(
        [
            "torchrun",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "3",
            "train_ddp.py",
            "--data-dir",
            str(data),
            "--out-dir",
            str(tmp_path / "run"),
            "--val-fraction",
            "0.5",
            "--cache-dir",
            str(tmp_path / "cache"),
        ],
        env={"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        timeout=60,
    )
    assert result.returncode != 0
    assert result.stdout.count("NaN or infinite value(s)") == 1, "one message, from rank 0"
    for rank in (0, 1):
        log = (tmp_path / "run" / "logs" / f"rank{rank}.log").read_text()
        assert "NaN or infinite value(s)" in log and "torchrun restart 1" not in log


def test_a_rank_that_finds_no_usable_gpu_ends_the_job_once_without_restarts(shared, tmp_path):
    """launch.sh was given GPU ids, but this torch sees none (a CPU build, a driver CUDA cannot use: NVML,
    which the pre-flight asks, may still list the cards). The ranks find it before any process group exists:
    each says so once and the job ends with exit 2, not 1 after torchrun restarted it 3 times. Local rank 0
    is held back, so rank 1 fails first: its exit alone would reach the agent as a failed worker, and the
    agent restarted the job before rank 0 asked it to end (a race that the order of the tests decided)."""
    command = ["torchrun", "--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "train_ddp.py"]
    command += ["--data-dir", str(shared / "data"), "--out-dir", str(tmp_path / "run")]
    env = {"CUDA_VISIBLE_DEVICES": "", "UNET3D_EXPECT_CUDA": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    env["UNET3D_SLOW_START"] = "0:3"
    result = run(command, env={**env, "OMP_NUM_THREADS": "1"}, timeout=60)
    assert result.returncode != 0
    said = result.stderr.count("error: launch.sh was given GPUs (CUDA_VISIBLE_DEVICES=)")
    # rank 0's request may end rank 1 before it has said so itself; each restart would have said it again
    assert 1 <= said <= 2, result.stderr
    assert 'train_ddp.py", line' not in result.stderr, "a message, not a rank's traceback"


# --- bad checkpoints ------------------------------------------------------------------------------------


def test_an_unreadable_checkpoint_found_by_rank_0_alone_is_bad_input_on_every_rank(shared, tmp_path):
    """Started by torchrun directly (no pre-flight, as after a torchrun restart): rank 0 alone reads the
    checkpoint and finds it unusable; the other rank must reach the same verdict (bad input: exit 2, the job
    ended once, no restart), not crash with another error that torchrun would restart 3 times."""
    (tmp_path / "broken.pt").write_bytes(b"not a checkpoint")
    command = ["torchrun", "--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "train_ddp.py"]
    command += options(shared, tmp_path / "run", 1, "--resume", str(tmp_path / "broken.pt"))
    env = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    result = run(command, env=env, timeout=90)
    assert result.returncode != 0
    assert result.stdout.count("cannot read checkpoint") == 1 and "broken.pt" in result.stdout, result.stdout
    logs = [(tmp_path / "run" / "logs" / f"rank{rank}.log").read_text() for rank in (0, 1)]
    assert all("torchrun restart 1" not in log for log in logs), logs
    assert "error: no usable checkpoint to resume from: cannot read checkpoint" in logs[0], logs[0]
    # rank 1 took the same exit (fail_together's error line), not a crash with a traceback
    assert "error: rank 0 failed: CheckpointError: no usable checkpoint" in logs[1], logs[1]
    assert "Traceback" not in logs[1], logs[1]
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_a_crafted_checkpoint_is_refused_without_running_it(shared, tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"model": Evil(), "epoch": 1}, tmp_path / "evil.pt")
    result = launch(*options(shared, tmp_path / "run", 1, "--resume", str(tmp_path / "evil.pt")), timeout=60)
    assert result.returncode == 2 and "cannot read checkpoint" in result.stdout and "evil.pt" in result.stdout
    assert not marker.exists()


def test_resuming_with_more_epochs_makes_up_a_cut_short_validation_then_trains_on(shared, uninterrupted, tmp_path):
    """Stopped during the last epoch's validation, the epoch was saved unvalidated, and a resumed run ended
    without it: no val/ scalars, best.pt never chosen on the final model. The checkpoint records the pending
    validation (here set on a finished run's last.pt, as such a stop leaves it), and the resumed run makes it
    up first. The run resumes with a setting that may change (README: say --epochs), listed in a warning,
    and training goes on from the checkpoint's position: one more epoch, not three."""
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    shutil.rmtree(out / "tensorboard")
    saved = checkpoint(out)
    torch.save({**saved, "validation_pending": True, "best_metric": -1.0}, out / "checkpoints" / "last.pt")
    (out / "checkpoints" / "best.pt").unlink()
    result = launch(*options(shared, out, 3), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    line = re.search(r"epoch 2 validated on resuming: val Dice ([0-9.]+).*", result.stdout)
    assert line and "new best" in line.group(0), result.stdout
    made_up = float(line.group(1))
    assert "resuming with changed settings: epochs" in result.stdout, result.stdout
    assert "2 epoch(s) and 0 step(s) done" in result.stdout and "epoch 3/3:" in result.stdout
    assert "epoch 1/3:" not in result.stdout and "epoch 2/3:" not in result.stdout, "nothing trained again"
    after = checkpoint(out)
    assert after["validation_pending"] is False and after["epoch"] == 3 and after["best_metric"] >= made_up - 1e-4
    assert checkpoint(out, "best.pt")["best_metric"] == after["best_metric"]
    board = EventAccumulator(str(out / "tensorboard"))
    board.Reload()
    assert [e.step for e in board.Scalars("val/mean_dice")] == [2, 3]
    assert abs(board.Scalars("val/mean_dice")[0].value - made_up) < 1e-4
    # the schedule is laid over the 3 epochs: it resumes at 2/3 of them (the poly rate at 2/3 of 1e-2), not
    # held at the 2-epoch run's end
    assert "the learning-rate schedule resumes at 0.667 of this run (2 of 3 epochs)" in result.stdout
    assert f"the learning rate goes back up to {0.01 * (1 / 3) ** 0.9:.2e}" in result.stdout


def test_resuming_with_another_architecture_names_the_fields(shared, uninterrupted, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    result = launch(*options(shared, out, 3, "--features", "4", "8", "16", "--patch-size", "16"), timeout=60)
    assert result.returncode == 2
    assert "configuration differs in" in result.stdout
    assert "features (checkpoint [8, 16, 32, 64], now [4, 8, 16])" in result.stdout
    assert "patch_size (checkpoint [32, 32, 16], now [16, 16, 16])" in result.stdout


# --- time limit -----------------------------------------------------------------------------------------


def test_time_limit_ends_in_time_with_an_annealed_model_and_a_last_validation(shared, tmp_path):
    out = tmp_path / "run"
    limit = 20
    result = launch(*options(shared, out, 1000, "--time-limit", f"00:00:{limit}"), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stopped by the time limit (20 s)" in result.stdout
    state = checkpoint(out)
    assert state["time_budget"]["limit_s"] == limit
    # By the run's own clock (launch.sh's start, recorded in the budget), not by how fast this machine
    # returns control to the test: the last checkpoint is written inside the limit.
    written = (out / "checkpoints" / "last.pt").stat().st_mtime - state["time_budget"]["start_wall"]
    assert written < limit, f"the last checkpoint was written {written:.1f} s into a {limit} s budget"
    last_lr = state["optimizer"]["param_groups"][0]["lr"]
    assert last_lr < 0.05 * state["config"]["lr"], "the schedule anneals over the time budget"
    last_line = [line for line in result.stdout.splitlines() if line.startswith("epoch ")][-1]
    assert "stopped at step" in last_line and "val Dice" in last_line, "a last validation fits in the budget"


def test_a_torchrun_restart_keeps_the_time_budget(shared, tmp_path):
    """A rank killed under --time-limit: the restarted ranks go on with the budget of the job (its start,
    its starting progress), not a new one that would start the schedule over, and still end inside it."""
    out = tmp_path / "run"
    limit = 28
    proc = start(*options(shared, out, 1000, "--time-limit", str(limit)))
    wait_for(out / "logs" / "rank0.log", r"epoch 1/1000:")  # logged after epoch 1's checkpoint
    before = checkpoint(out)["time_budget"]
    os.kill(rank_pid(out, 1), signal.SIGKILL)
    rc, stdout, stderr = finish(proc, timeout=180)
    assert rc == 0, stderr[-3000:]
    assert "torchrun restart 1" in (out / "logs" / "rank1.log").read_text(), "the kill was a restart"
    assert "resumed from" in stdout and f"stopped by the time limit ({limit} s)" in stdout
    assert "epoch 2/1000" in stdout, "the restarted ranks trained on inside the budget"
    state = checkpoint(out)
    after = state["time_budget"]
    assert after == before, "the restart keeps the job's budget: its start, starting progress and run id"
    assert after["start_progress"] == 0.0
    written = (out / "checkpoints" / "last.pt").stat().st_mtime - after["start_wall"]
    assert written < limit, f"the last checkpoint was written {written:.1f} s into a {limit} s budget"
    assert state["optimizer"]["param_groups"][0]["lr"] < 0.05 * state["config"]["lr"], "annealed over the budget"


# --- two nodes ------------------------------------------------------------------------------------------


def test_node_0_on_a_port_another_job_holds_stops_at_once(shared, tmp_path):
    """Node 0 hosts the store by its rank: on a port that another job's store holds it stops with the port
    named (EADDRINUSE), rather than joining that job's store as torchrun's own guess lets it, and writes
    nothing."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"NNODES": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "MAX_RESTARTS": "0"}
        result = run(["bash", "launch.sh", "cpu:1", *options(shared, tmp_path / "run", 1)], env=env, timeout=120)
    assert result.returncode != 0
    assert f"port: {port}" in result.stderr and "address already in use" in result.stderr, result.stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def start_two_nodes(shared: Path, tmp_path: Path, epochs: int, env: list[dict] | None = None) -> list[subprocess.Popen]:
    """Two "nodes" of one rank each on this machine (`launch.sh cpu:1` twice, in their own sessions), each
    training into tmp_path/node<N> with its own extra `env`. MASTER_ADDR is an address of this machine that
    torchrun's own guess of the store's host does not match where the machine has one (`rendezvous_address`)."""
    port = free_port()
    common = {
        "NNODES": "2",
        "MASTER_ADDR": rendezvous_address(),
        "MASTER_PORT": str(port),
        "RDZV_ID": f"test{port}",
        "OMP_NUM_THREADS": "1",  # two "nodes" on these two cores: each would take both (6x slower steps)
    }
    return [
        subprocess.Popen(
            ["bash", "launch.sh", "cpu:1", *options(shared, tmp_path / f"node{node}", epochs)],
            cwd=REPO,
            env={**os.environ, **common, "NODE_RANK": str(node), **(env[node] if env else {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        for node in (0, 1)
    ]


def test_two_nodes_on_one_machine_train_and_only_global_rank_0_writes(shared, tmp_path):
    """Two "nodes" of one rank each. MASTER_ADDR is an address of this machine that torchrun's own guess of
    the store's host does not match where the machine has one (`rendezvous_address`): with that guess every
    node was a client and the job waited for a store nobody hosted; node 0 must host it by its rank."""
    results = [finish(p, timeout=180) for p in start_two_nodes(shared, tmp_path, 1)]
    assert [rc for rc, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    writers = [n for n in (0, 1) if (tmp_path / f"node{n}" / "checkpoints").exists()]
    assert len(writers) == 1, "exactly one node holds global rank 0"
    stdout = results[writers[0]][1]
    assert "world size 2" in stdout and "rank 1: host" in stdout
    assert checkpoint(tmp_path / f"node{writers[0]}")["world_size"] == 2
    other = 1 - writers[0]
    assert (tmp_path / f"node{other}" / "logs" / "rank1.log").exists()
    assert not (tmp_path / f"node{other}" / "tensorboard").exists()


def test_a_rank_out_of_memory_on_one_node_ends_the_other_nodes_part_too(shared, tmp_path):
    """Two "nodes" of one rank each; node 1's rank runs out of memory (whichever global rank it is: only its
    node has the fault variable). Its agent ends node 1; node 0, the rendezvous host, learns it from the
    notice in the store and ends too. Before, its agent restarted its rank and waited at the rendezvous for
    node 1 until RDZV_TIMEOUT (120 s here: the test would time out)."""
    began = time.monotonic()
    env = [{"RDZV_TIMEOUT": "120"}, {"RDZV_TIMEOUT": "120", "UNET3D_FAULT_OOM": "0:3;1:3"}]
    procs = start_two_nodes(shared, tmp_path, 2, env)
    results = [finish(p, timeout=100) for p in procs]
    assert time.monotonic() - began < 100
    assert all(rc != 0 for rc, _, _ in results), [err[-2000:] for _, _, err in results]
    failed = re.search(r"error: rank (\d) \(cpu\) ran out of memory", results[1][1])
    assert failed is not None, results[1][1]
    assert f"error: rank {failed[1]} ended the job: rank {failed[1]} (cpu) ran out of memory" in results[0][1]
    for node in (0, 1):
        for log in (tmp_path / f"node{node}" / "logs").glob("rank*.log"):
            assert "torchrun restart 1" not in log.read_text(), f"node {node} restarted"
