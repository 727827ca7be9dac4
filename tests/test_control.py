"""Stop signals, time budgets and fault injection of unet3d.control, in real processes where signals matter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from tests.helpers import REPO
from unet3d.training import control
from unet3d.training.config import parse_duration
from unet3d.training.control import EXIT_MARGIN_S, TimeBudget
from unet3d.training.faults import fault_steps

SCRIPT = """
import os, signal, sys, time
sys.path.insert(0, {repo!r})
from unet3d.training.control import StopSignal
stop = StopSignal()
if sys.argv[1] == "training":
    stop.install()
print("ready", flush=True)
for line in sys.stdin:
    print("received" if stop.received is not None else "nothing", flush=True)
"""


def _start(mode: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT.format(repo=str(REPO)), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _ask(proc: subprocess.Popen) -> str:
    proc.stdin.write("?\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_first_signal_asks_to_stop_a_second_one_ends_at_once(first):
    """SIGHUP too (a closed terminal, and torchrun passes a hangup on): a stop, not the end of the rank."""
    proc = _start("training")
    proc.send_signal(first)
    time.sleep(0.2)
    assert _ask(proc) == "received" and proc.poll() is None
    proc.send_signal(signal.SIGTERM)  # within the debounce window: the same event delivered twice
    time.sleep(0.2)
    assert proc.poll() is None
    time.sleep(2.0)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) == -signal.SIGINT


def test_a_signal_before_training_ends_the_process_at_once():
    proc = _start("not yet training")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == -signal.SIGTERM


def test_time_budget_progress_and_reserve():
    budget = TimeBudget(limit_s=100, start_wall=0.0, start_progress=0.2, run_id="x")
    budget.plan_reserve(None)
    assert budget.reserve_s == pytest.approx(10 + 2 + EXIT_MARGIN_S)
    assert budget.progress(0) == pytest.approx(0.2)
    assert budget.progress(budget.limit_s - budget.reserve_s) == pytest.approx(1.0)
    assert budget.progress(1e6) == 1.0 and not budget.exhausted(50) and budget.exhausted(90)
    budget.plan_reserve(4.0)
    assert budget.reserve_s == pytest.approx(6 + 2 + EXIT_MARGIN_S)
    never = TimeBudget.for_job(100, None, started=0.0, progress=0.0, validates=False)  # --fold all
    assert never.reserve_s == pytest.approx(2 + EXIT_MARGIN_S), "no room kept for a validation that never comes"
    assert TimeBudget.for_job(100, None, started=0.0, progress=0.0).reserve_s == pytest.approx(10 + 2 + EXIT_MARGIN_S)


def test_a_budget_is_kept_across_restarts_of_one_job_and_renewed_by_a_new_job(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "unet3d")  # a multi-node job's default rendezvous id
    monkeypatch.setenv("UNET3D_LAUNCH_TIME", "1000.5")
    first = TimeBudget.for_job(100, None, started=2000.0, progress=0.3)
    assert (first.start_wall, first.start_progress, first.run_id) == (1000.5, 0.3, "unet3d"), "from launch.sh"
    saved = TimeBudget.from_state(first.state_dict())
    restarted = TimeBudget.for_job(100, saved, started=1600.0, progress=0.7)
    assert restarted.state_dict() == first.state_dict(), "a torchrun restart of the same job keeps its budget"
    # Two nodes whose launch.sh started apart: one budget on every rank, from the first start.
    nodes = TimeBudget.for_job(100, None, started=2000.0, progress=0.3, launches=[1000.5, 1000.5, 990.0, 990.0])
    assert nodes.start_wall == 990.0
    kept = TimeBudget.for_job(100, TimeBudget.from_state(nodes.state_dict()), 1600.0, 0.7, launches=[1000.5, 990.0])
    assert kept.state_dict() == nodes.state_dict()
    # The same run id with a new launch.sh start (the next job with the same RDZV_ID, a requeued Slurm job):
    # a new budget, not yesterday's, which would stop the job at its first step.
    monkeypatch.setenv("UNET3D_LAUNCH_TIME", "5000.0")
    again = TimeBudget.for_job(100, saved, started=5010.0, progress=0.7)
    assert (again.start_wall, again.start_progress) == (5000.0, 0.7), "a new job anneals from where it was"
    longer = TimeBudget.for_job(200, saved, started=5010.0, progress=0.7)
    assert (longer.limit_s, longer.start_wall) == (200, 5000.0), "a new limit is a new budget"
    # Started by torchrun without launch.sh: the run id decides (each torchrun has its own).
    monkeypatch.setenv("UNET3D_LAUNCH_TIME", "")
    bare = TimeBudget.for_job(100, None, started=7000.0, progress=0.0)
    assert bare.start_wall == 7000.0
    assert TimeBudget.for_job(100, bare, started=7050.0, progress=0.4).start_wall == 7000.0
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-torchrun")
    assert TimeBudget.for_job(100, bare, started=7050.0, progress=0.4).start_wall == 7050.0


def test_duration_and_fault_parsing():
    assert parse_duration("01:30:00") == parse_duration("5400") == parse_duration("90:00") == 5400.0
    with pytest.raises(ValueError, match="HH:MM:SS"):
        parse_duration("1h")
    spec = "1:3,4;0:9"
    assert fault_steps(spec, 1) == {3, 4} and fault_steps(spec, 0) == {9} and fault_steps(spec, 2) == set()
    assert fault_steps("", 0) == set()


def test_the_agent_is_asked_to_end_the_job_once_per_attempt_however_many_ranks_ask(monkeypatch, tmp_path):
    """Several ranks out of GPU memory at once each end the job: a third SIGTERM to torchrun's agent cut its
    shutdown short, and a rank that had not failed was left running without a parent. One signal per agent
    and attempt; a restart (another attempt) or another agent may ask again."""
    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("UNET3D_STOP_FILE", raising=False)  # plain torchrun: marks in the temporary folder
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job/42")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setattr(os, "getppid", lambda: 4242)
    assert all(control.end_job_without_restart() for _ in range(3)), "each rank is told the job is ending"
    assert sent == [(4242, signal.SIGTERM)]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert control.end_job_without_restart()
    monkeypatch.setattr(os, "getppid", lambda: 4343)
    assert control.end_job_without_restart()
    assert sent == [(4242, signal.SIGTERM), (4242, signal.SIGTERM), (4343, signal.SIGTERM)]
    # under launch.sh: beside its stop file, which it removes with them at exit
    monkeypatch.setenv("UNET3D_STOP_FILE", str(tmp_path / "unet3d-stop.abc"))
    assert control.end_job_without_restart() and control.end_job_without_restart()
    assert len(sent) == 4 and [p.name for p in tmp_path.glob("unet3d-stop.abc.end-*")] == ["unet3d-stop.abc.end-4343-1"]
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert not control.end_job_without_restart(), "not started by torchrun: nobody to ask"


def test_a_resumed_schedule_goes_on_where_it_stood_only_within_one_job(monkeypatch):
    """A torchrun restart keeps the time budget and the schedule's place in it. A new job (after a time
    budget annealed the schedule to its end), or a resume given more --epochs, starts at the epochs trained:
    holding the old end as a floor trained the whole next job at a learning rate near zero."""
    from unet3d.training.control import schedule_start

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "a")
    saved = TimeBudget(limit_s=100, start_wall=10.0, start_progress=0.0, run_id="a")
    same = TimeBudget.same_job(100, saved, launches=[10.0])  # a torchrun restart: the same launch.sh start
    new = TimeBudget.same_job(100, saved, launches=[500.0])  # a new job: another launch.sh
    assert same and not new and not TimeBudget.same_job(None, saved, [10.0])
    assert schedule_start(same, saved_progress=1.0, epoch_progress=0.3) == 1.0, "a torchrun restart"
    assert schedule_start(new, saved_progress=1.0, epoch_progress=0.3) == 0.3, "after an annealed job"
    assert schedule_start(new, saved_progress=0.5, epoch_progress=0.3) == 0.5, "after a preempted job"
    # without --epochs (until the time limit) the epochs trained are no progress: a preempted job goes on, one
    # after an annealed job starts a new cycle
    assert schedule_start(new, 0.3, epoch_progress=4e-5, until_time_limit=True) == 0.3
    assert schedule_start(new, 1.0, epoch_progress=4e-5, until_time_limit=True) == 0.0
    changed = schedule_start(False, saved_progress=0.97, epoch_progress=0.5, epochs_changed=True)
    assert changed == 0.5, "2 of 2 epochs, now of 4"
    assert schedule_start(False, saved_progress=0.47, epoch_progress=0.5) == 0.47, "an unchanged resume"


@pytest.mark.parametrize(
    "rank, world, local, posted", [(1, 2, 2, []), (3, 4, 2, [(3, 2, "bad label in case_7", 2, 0.0)])]
)
def test_failing_together_posts_the_end_notice_only_where_there_are_other_nodes(
    monkeypatch, rank, world, local, posted
):
    """A verdict that reached one node alone (rank 0's own write, say) must end the other nodes' part too: the
    notice `hang.EndWatch` reads, posted without waiting (the ranks that reached the verdict read nothing)."""
    import torch

    from unet3d.training import dist

    calls = []
    monkeypatch.setattr(dist, "post_end_notice", lambda *args, wait: calls.append((*args, wait)) or True)
    monkeypatch.setattr(dist, "arrive", lambda *args, **kwargs: True)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    info = dist.DistInfo(rank=rank, local_rank=1, world_size=world, local_world_size=local, device=torch.device("cpu"))
    assert control.fail_together(ValueError("bad label in case_7"), info) == 2
    assert calls == posted
