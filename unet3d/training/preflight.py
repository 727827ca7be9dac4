"""launch.sh's pre-flight, before any rank starts: the dataset and the checkpoint to resume from are
checked in one process, so a bad input gives one message and exit code 2 instead of torchrun restarting
the same failure. The preprocessing cache is built on the way, by several worker processes."""

from __future__ import annotations

import dataclasses
import os

import torch

from data.cache import open_case
from data.prepare import DatasetError, check_dataset, resolve_data
from unet3d.checkpoint import CheckpointError
from unet3d.training.checkpointing import check_compatible, find_resume
from unet3d.training.config import TrainConfig
from unet3d.training.dist import DistInfo
from unet3d.training.logs import setup_logging
from unet3d.training.runtime import resolve_config
from unet3d.training.state import model_args


def preflight(cfg: TrainConfig) -> int:
    """0 when the job may start; 2, after one `error:` line naming every problem, when it may not."""
    log = setup_logging(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    # launch.sh sets PYTORCH_NVML_BASED_CUDA_CHECK: this asks NVML, so no CUDA context is created anywhere
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        run = resolve_data(cfg.data(), lambda make: make())
        problems = check_dataset(run, processes=max(local_world, min(8, os.cpu_count() or 1)))
        if problems:
            raise DatasetError(run.data_dir, problems)
        cases = [open_case(c, run.cache) for c in run.train]
        resolved = resolve_config(cfg, run, DistInfo(0, 0, world, local_world, device), cases)
        found = find_resume(cfg.resume, cfg.out_dir, "cpu", log.warning)
        if found is not None:
            path, state = found
            args = model_args(run.spec, resolved.features)
            check_compatible(state, dataclasses.asdict(resolved), args, world, path)
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        log.error(f"error: {e}")
        return 2
    note = f"will resume from {found[0]}" if found is not None else "starting fresh"
    log.info(f"checked {len(run.spec.training)} case(s) of {run.data_dir} (cache {run.cache}); {note}")
    return 0
