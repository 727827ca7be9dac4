"""launch.sh's pre-flight, before any rank starts: the dataset and the checkpoint to resume from are
checked in one process, so a bad input gives one message and exit code 2 instead of torchrun restarting
the same failure. The preprocessing cache is built on the way, by several worker processes."""

from __future__ import annotations

import dataclasses
import os

import torch

from data.prepare import DatasetError, build, in_processes, inspect, resolve_data
from unet3d.checkpoint import CheckpointError
from unet3d.files import writable_folder
from unet3d.training.checkpointing import check_compatible, find_resume, follow_checkpoint
from unet3d.training.config import TrainConfig, plan_request
from unet3d.training.dist import DistInfo, check_gpus_visible
from unet3d.training.loading import choose_plan
from unet3d.training.logs import setup_logging
from unet3d.training.runlock import lock_run_folder
from unet3d.training.runtime import resolve_config


def preflight(cfg: TrainConfig) -> int:
    """0 when the job may start; 2, after one `error:` line naming every problem, when it may not."""
    log = setup_logging(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    # launch.sh sets PYTORCH_NVML_BASED_CUDA_CHECK: this asks NVML, so no CUDA context is created anywhere
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        check_gpus_visible()
        found = find_resume(cfg.resume, cfg.out_dir, "cpu", log.warning)
        checkpoint = found[1] if found is not None else None
        cfg = follow_checkpoint(cfg, checkpoint)
        run = resolve_data(cfg.data(), lambda make: make())
        request = plan_request(cfg, device.type)
        processes = max(local_world, min(8, os.cpu_count() or 1))
        problems = in_processes(inspect, run, request, processes=processes)
        if problems:
            raise DatasetError(run.data_dir, problems)
        run = run.with_plan(choose_plan(run, request, checkpoint))
        problems = in_processes(build, run, processes=processes)
        if problems:
            raise DatasetError(run.data_dir, problems)
        info = DistInfo(0, 0, world, local_world, device)
        resolved = resolve_config(cfg, run, info)
        if found is not None:
            args = run.plan.model_args(run.spec.in_channels, run.spec.num_classes)
            check_compatible(checkpoint, dataclasses.asdict(resolved), args, world, found[0], run.spec.class_names)
        # last, so that a job refused for its data leaves no folder behind
        writable_folder(os.path.join(cfg.out_dir, "logs"), f"--out-dir {cfg.out_dir}")
        unguarded = lock_run_folder(cfg.out_dir, wait_s=1.0, keep=False)  # no other job trains into it
        if unguarded:
            log.warning(unguarded)
    except (ValueError, OSError, CheckpointError) as e:  # OSError: a folder it cannot write, a full disk
        log.error(f"error: {e}")
        return 2
    note = f"will resume from {found[0]}" if found is not None else "starting fresh"
    log.info(f"checked {len(run.spec.training)} case(s) of {run.data_dir} (cache {run.cache}); {note}")
    log.info(run.plan.describe())
    return 0
