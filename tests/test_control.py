"""Stop signals, time budgets and fault injection of unet3d.control, in real processes where signals matter."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import REPO
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


def test_first_signal_asks_to_stop_a_second_one_ends_at_once():
    proc = _start("training")
    proc.send_signal(signal.SIGTERM)
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


def test_duration_and_fault_parsing():
    assert parse_duration("01:30:00") == parse_duration("5400") == parse_duration("90:00") == 5400.0
    with pytest.raises(ValueError, match="HH:MM:SS"):
        parse_duration("1h")
    spec = "1:3,4;0:9"
    assert fault_steps(spec, 1) == {3, 4} and fault_steps(spec, 0) == {9} and fault_steps(spec, 2) == set()
    assert fault_steps("", 0) == set()
