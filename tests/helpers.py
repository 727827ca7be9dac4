"""Running real processes from tests: commands in their own session, and groups of gloo ranks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]


def run(
    args: Sequence[str], timeout: float = 300, env: dict[str, str] | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """Run a command in a new session; on timeout kill its whole process group and fail with its output.

    Output is decoded without newline translation, so a progress bar's carriage returns stay as they are.
    """
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(
        list(args), cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"{' '.join(args)} timed out after {timeout} s\nstdout:\n{out.decode()}\nstderr:\n{err.decode()}"
        ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous_address() -> str:
    """An address of this machine for a two-node test's MASTER_ADDR: where there is one, a non-loopback IPv4
    address that torchrun's guess of the store's host does not recognise as this machine's (an address on
    an interface the hostname does not resolve to, as a cluster's InfiniBand IP), else 127.0.0.1."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    try:
        listed = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        listed = []
    for address in listed:
        if "." in address and not address.startswith("127.") and not _matches_machine_hostname(address):
            with socket.socket() as s:
                try:
                    s.bind((address, 0))
                except OSError:
                    continue
            return address
    return "127.0.0.1"


def _rank_main(rank: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    from unet3d.training import dist

    info = dist.setup(timeout=timedelta(seconds=60))
    try:
        fn(info, *args)
    finally:
        dist.cleanup()


def spawn_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180) -> None:
    """Run fn(info, *args) in `world_size` fresh gloo processes; fail if any fails or the group hangs.

    `fn` must be importable (a module-level function); it reports results through files.
    """
    ctx = mp.start_processes(
        _rank_main, args=(fn, world_size, free_port(), args), nprocs=world_size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError(f"{world_size} ranks did not finish within {timeout} s")


def runtime(info, steps: int, amp_dtype: torch.dtype | None = None, **config):
    """A Runtime for tests that call the training functions directly: a resolved configuration (tiny
    network, SGD at lr 0.1, one epoch of `steps` steps) on `info`'s device, fields overridable."""
    from unet3d.training.config import TrainConfig
    from unet3d.training.runtime import Runtime

    fields = dict(
        features=(4, 8, 16), patch_size=(16, 16, 8), epochs=1, samples_per_epoch=steps * 2 * info.world_size,
        lr=0.1, momentum=0.99, num_workers=0, max_bad_steps=3,
    )  # fmt: skip
    cfg = TrainConfig(**{**fields, **config})
    return Runtime(
        cfg=cfg, dist=info, amp_dtype=amp_dtype, memory_format=torch.contiguous_format, steps_per_epoch=steps
    )


def state_for(rt, model):
    """A fresh TrainState around `model`, as training builds one (`unet3d.training.state.new_state`), with
    the plan of a dataset used as stored."""
    from data.plan import legacy_plan
    from unet3d.training.state import new_state

    plan = legacy_plan(["MRI"] * model.in_channels, rt.cfg.patch_size, model.features)
    args = {"in_channels": model.in_channels, "num_classes": model.num_classes, "features": list(model.features)}
    return new_state(rt, model, plan, args, [f"class{k}" for k in range(model.num_classes)])


def control_for(rt):
    """The per-step agreement of a run without a time budget."""
    from unet3d.training.control import StepControl

    return StepControl(rt.device, rt.cfg.max_bad_steps, budget=None, started=time.time())


def small_synthetic(tmp_path_factory, name: str) -> Path:
    """A folder holding `data/`: six synthetic cases of 32 mm (seed 0, no test split), for module fixtures whose
    runs share one dataset and cache."""
    from data.synthetic import write_synthetic_dataset

    root = tmp_path_factory.mktemp(name)
    write_synthetic_dataset(root / "data", num_cases=6, size=32, seed=0, num_test=0)
    return root


SMALL_EPOCH_STEPS = 8  # 32 samples per epoch, batch 2, two ranks


def small_options(shared: Path, out: Path, epochs: int, *extra: str) -> list[str]:
    """train_ddp.py's options for two ranks on `small_synthetic`'s dataset under `shared` (half of its six cases
    for validation, so both ranks score some) and its cache, `SMALL_EPOCH_STEPS` steps per epoch."""
    data = ["--data-dir", str(shared / "data"), "--cache-dir", str(shared / "cache"), "--out-dir", str(out)]
    run_length = ["--epochs", str(epochs), "--samples-per-epoch", str(4 * SMALL_EPOCH_STEPS)]
    return [*data, "--val-fraction", "0.5", *run_length, "--num-workers", "1", *extra]
