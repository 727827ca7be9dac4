"""launch.sh's one Python process per node: the pre-flight, then torchrun's agent, in the same interpreter.

`python train_ddp.py --torchrun TORCHRUN_ARGS train_ddp.py TRAIN_ARGS` is `torchrun TORCHRUN_ARGS train_ddp.py
TRAIN_ARGS` with `train_ddp.py TRAIN_ARGS --prepare-only` run first: when the pre-flight refuses the job, its
exit code (2) is this process's and no rank starts. One interpreter start instead of two: torch is imported
once, about 3 s of every launch on two CPU cores. The ranks run under this interpreter (`sys.executable`),
the one that checked their data.

Once the pre-flight has passed, the file `$UNET3D_STOP_FILE.agent` tells launch.sh that a signal is now for
torchrun (stop gracefully), no longer for the pre-flight (end the job).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path

from unet3d.training.control import STOP_FILE_ENV

AGENT_MARK = ".agent"  # beside launch.sh's UNET3D_STOP_FILE: the pre-flight has passed, torchrun's agent runs
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"  # set by launch.sh for the pre-flight, from before torch loads
NVML_CHECK_WAS = "UNET3D_NVML_CHECK_WAS"  # its value before: "set:VALUE", or "" where it was not set


def run_agent(argv: Sequence[str], train_main: Callable[[Sequence[str]], int]) -> int:
    """`train_main(TRAIN_ARGS + ["--prepare-only"])`, then torchrun's `main` on `argv` (torchrun's own command
    line, its script and TRAIN_ARGS included); the pre-flight's exit code when it refuses. torchrun's
    failures are raised as torchrun raises them."""
    from torch.distributed.run import main as torchrun_main
    from torch.distributed.run import parse_args

    args = parse_args(list(argv))
    local_world = int(args.nproc_per_node)
    nodes = 1 if args.standalone else int(str(args.nnodes).split(":")[-1])
    script_args = [*args.training_script_args, "--prepare-only"]
    was = os.environ.pop(NVML_CHECK_WAS, None)
    preflight_env = {"WORLD_SIZE": str(local_world * nodes), "LOCAL_WORLD_SIZE": str(local_world), NVML_CHECK: "1"}
    with _environment(preflight_env):
        status = train_main(script_args)
    if status:
        return status
    if was is not None:  # the ranks get the environment launch.sh was given
        _put(NVML_CHECK, was[len("set:") :] if was.startswith("set:") else None)
    stop_file = os.environ.get(STOP_FILE_ENV)
    if stop_file:
        Path(stop_file + AGENT_MARK).touch()
    torchrun_main(list(argv))
    return 0


@contextmanager
def _environment(values: dict[str, str]):
    """`values` in the environment, as launch.sh gave them to a pre-flight process of its own; restored after,
    so that the ranks get this process's environment as it came. (PyTorch asks NVML, not CUDA, whether GPUs
    exist, so no CUDA context is made in the agent: launch.sh sets that before torch loads.)"""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            _put(name, value)


def _put(name: str, value: str | None) -> None:
    """`name` set to `value` in the environment, or removed from it (None)."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
