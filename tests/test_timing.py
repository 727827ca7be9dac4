"""Where each rank's time goes: the spans, the diagnoses, TensorBoard's time/ scalars, the profiler; end to end
with two gloo ranks, one of them slowed by a test hook (its data, or its steps)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import run
from unet3d.training.timing import FIELDS, EpochTiming

STEPS = 8  # 32 samples per epoch, batch 2, two ranks


@pytest.fixture(scope="module")
def shared(small_shared) -> Path:
    return small_shared


def launch(shared: Path, out: Path, *extra: str, env: dict | None = None):
    args = ["--data-dir", str(shared / "data"), "--cache-dir", str(shared / "cache"), "--out-dir", str(out)]
    args += ["--val-fraction", "0.34", "--epochs", "2", "--samples-per-epoch", str(4 * STEPS), "--num-workers", "0"]
    result = run(["bash", "launch.sh", "cpu:2", *args, *extra], env=env, timeout=240)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the run's TensorBoard folder and of its steps folder (train/loss_step)."""
    found = {}
    for folder in (out / "tensorboard", out / "tensorboard" / "steps"):
        acc = EventAccumulator(str(folder))
        acc.Reload()
        found.update({tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]})
    return found


def test_a_rank_with_slow_data_is_named_with_its_data_wait(shared, tmp_path):
    stdout = launch(shared, tmp_path / "run", env={"UNET3D_SLOW_DATA": "1:0.08"})
    lines = [line for line in stdout.splitlines() if "diagnosis:" in line]
    assert len(lines) == 1, stdout
    assert "rank 1 (" in lines[0] and "of each step for data" in lines[0]
    tags = scalars(tmp_path / "run")
    low, high = tags["time/data_wait_frac_min"][-1][1], tags["time/data_wait_frac_max"][-1][1]
    assert high > 0.3 and low < 0.15, "the slowed rank waits, the other does not"
    assert tags["time/sync_wait_frac_max"][-1][1] > 0.2, "the other rank waits for it at the meeting"


def test_a_slow_rank_is_named_as_the_straggler_and_every_step_is_logged_and_profiled(shared, tmp_path):
    """Each slowed run names exactly one cause: the slow-data run no straggler, this run no data wait, so a
    diagnosis that fired without its cause would fail the other run (a balanced run of its own, saying
    nothing, cost one more launch). This run also carries what every run logs: the epoch line's spans, one
    point per step, TensorBoard's time/ scalars per epoch, and each rank's profile of its first steps."""
    out = tmp_path / "run"
    stdout = launch(shared, out, "--profile", "3", "--profile-every-rank", env={"UNET3D_SLOW_STEP": "1:0.1"})
    lines = [line for line in stdout.splitlines() if "diagnosis:" in line]
    assert len(lines) == 1 and "diagnosis: rank 1 is" in lines[0] and "slower than the others" in lines[0], lines
    assert "sample(s) per rank per epoch" in stdout and "CPU(s) per rank on this node" in stdout
    assert "data wait" in stdout and "sync wait" in stdout
    tags = scalars(out)
    assert [s for s, _ in tags["train/loss_step"]] == list(range(1, 2 * STEPS + 1)), "one point per step"
    for tag in ("time/data_wait_frac", "time/sync_wait_frac", "time/compute_s", "time/compute_s_max"):
        assert [s for s, _ in tags[tag]] == [1, 2], tag
    for tag in ("time/epoch_s", "time/samples_per_s"):  # README's TensorBoard table
        assert [s for s, _ in tags[tag]] == [1, 2] and all(v > 0 for _, v in tags[tag]), tag
    assert tags["time/compute_s_max"][-1][1] > tags["time/compute_s"][-1][1], "the slowed rank's steps, the max"
    # --profile-every-rank: a trace per rank, for TensorBoard or Perfetto, each rank's log naming its own
    traces = sorted((out / "profile").glob("*.pt.trace.json"))
    assert [t.name.split("_")[0] for t in traces] == ["rank0", "rank1"], traces
    assert all(t.stat().st_size > 1000 for t in traces)
    assert f"profile: {traces[0]} (TensorBoard's profiler plugin" in stdout and str(traces[1]) not in stdout
    for rank, trace in enumerate(traces):
        log = (out / "logs" / f"rank{rank}.log").read_text()
        assert f"profile: {trace} (" in log and str(traces[1 - rank]) not in log, rank


def table(*rows: dict) -> EpochTiming:
    defaults = {"data_wait_s": 0.1, "compute_s": 1.0, "sync_wait_s": 0.1, "steps": 10, "peak_gib": 0, "workers": 2}
    defaults["cpus"] = 8
    full = [[{**defaults, **r}[name] for name in FIELDS] for r in rows]
    return EpochTiming(full, [f"host{i}, cuda:{i}" for i in range(len(rows))])


def test_diagnoses_by_their_thresholds():
    assert table({}, {}, {}).diagnoses() == {}
    slow_data = table({}, {"data_wait_s": 0.5}).diagnoses()
    assert set(slow_data) == {"data"} and "rank 1 (host1, cuda:1) waited 31 %" in slow_data["data"]
    assert "raise --num-workers (now 2; this node has 8 CPUs per rank)" in slow_data["data"]
    starved = table({"data_wait_s": 0.5, "cpus": 2}, {"data_wait_s": 0.5, "cpus": 2}).diagnoses()["data"]
    assert starved.startswith("ranks waited") and "more workers would only compete" in starved
    straggler = table({}, {}, {"compute_s": 1.4}, {}).diagnoses()
    assert straggler == {"straggler": "rank 2 is 1.4x slower than the others (host2, cuda:2): every step waits for it"}
    assert table({}, {"compute_s": 1.2}).diagnoses() == {}, "under 1.25x is noise"
    scalars = table({"peak_gib": 3.5}, {"peak_gib": 4.0}).scalars()
    assert scalars["memory/peak_gib_max"] == 4.0 and scalars["time/compute_s"] == 1.0
