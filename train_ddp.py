"""Train a 3D U-Net with DistributedDataParallel: `bash launch.sh 5,6,7 [options]`, or `python train_ddp.py`.

Reads top to bottom: configuration -> set-up -> data -> model -> loop -> teardown.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import socket
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from data.cache import open_case
from data.dataset import EpochSampler, PatchDataset, close_loader, ignore_stop_signals
from data.prepare import DatasetError, RunData, check_dataset, dataset_problems, resolve_data, unique
from unet3d import dist, rng
from unet3d.amp import grad_scaler, resolve_amp
from unet3d.checkpoint import CheckpointError, save_checkpoint
from unet3d.config import TrainConfig, parse_args, resolve
from unet3d.control import StepControl, TimeBudget, TrainingError, end_job_without_restart, nan_fault_steps
from unet3d.engine import EpochCarry, train_one_epoch
from unet3d.layout import apply_memory_format, format_name, resolve_memory_format
from unet3d.logs import file_only, get_logger, setup_logging
from unet3d.loss import build_loss
from unet3d.model import UNet3D
from unet3d.optim import build_optimizer, build_schedule, optimizer_kernels
from unet3d.report import epoch_summary, log_epoch
from unet3d.resume import (
    BEST,
    LAST,
    PREVIOUS,
    Position,
    check_compatible,
    checkpoint_dir,
    find_resume,
    restore,
    training_state,
)
from unet3d.validation import ValResult, shard, validate

INPUT_ERRORS = (ValueError, FileNotFoundError)  # bad data, options or checkpoints: exit 2, one message


@record
def main(argv: Sequence[str] | None = None) -> int:
    started = time.time()
    cfg = parse_args(argv)
    if cfg.prepare_only:
        return prepare_only(cfg)
    info = dist.setup(timedelta(seconds=cfg.dist_timeout), timedelta(seconds=cfg.setup_timeout))
    log = setup_logging(info.rank, Path(cfg.out_dir) / "logs")
    try:
        return train(cfg, info, started)
    except (*INPUT_ERRORS, TrainingError) as e:  # every rank reached the same verdict; rank 0 says it
        (log.error if info.is_main else lambda m: file_only(log, m))(f"error: {e}")
        # Stopping the agent stops every local rank: first give them a moment to record the verdict too.
        dist.arrive("failed", wait=10.0 if info.local_rank == 0 else 0.0)
        if end_job_without_restart(info.local_rank):
            file_only(log, "asked torchrun to end the job: a restart would repeat this failure")
        return 1 if isinstance(e, TrainingError) else 2
    finally:
        dist.cleanup()


def train(cfg: TrainConfig, info: dist.DistInfo, started: float) -> int:
    log = get_logger()
    device = info.device
    torch.manual_seed(cfg.seed)
    torch.backends.cudnn.benchmark = True  # one patch size throughout: let cuDNN pick its fastest kernels

    # Data: the dataset (synthetic unless --data-dir), its split, checked and cached by the ranks together.
    run = resolve_data(cfg, lambda make: dist.run_on_local_main(make, info))
    problems = dataset_problems(run, info.local_rank, info.local_world_size)
    problems = unique([p for rank_problems in dist.all_gather_object(problems) for p in rank_problems])
    if problems:
        raise DatasetError(run.data_dir, problems)
    prepared = [open_case(c, run.cache) for c in run.train]
    my_val = [open_case(c, run.cache) for c in shard(run.val, info.rank, info.world_size)]
    cfg = resolve_config(cfg, run, device, info.world_size, info.local_world_size, prepared)
    amp_dtype = resolve_amp(cfg.amp, device)
    memory_format = resolve_memory_format(cfg.memory_format, device, amp_dtype)
    steps = cfg.samples_per_epoch // (cfg.batch_size * info.world_size)
    describe_run(cfg, run, info, amp_dtype, memory_format, steps)

    # Model, optimizer, schedule; a checkpoint restored on every rank before DDP wraps the model.
    model_args = {"in_channels": run.spec.in_channels, "num_classes": run.spec.num_classes, "features": cfg.features}
    model = apply_memory_format(UNet3D(**model_args).to(device), memory_format)
    kernels = optimizer_kernels(device, amp_dtype)
    optimizer = build_optimizer(model.parameters(), cfg.optimizer, cfg.lr, cfg.weight_decay, cfg.momentum, kernels)
    schedule = build_schedule(optimizer, cfg.optimizer)
    scaler = grad_scaler(device, amp_dtype)
    position = Position()
    source = dist.run_on_main(lambda: resume_source(cfg))
    if source is not None:
        position = restore(
            Path(source),
            cfg,
            model_args,
            model,
            optimizer,
            schedule,
            scaler,
            info.rank,
            info.world_size,
            device,
            log.warning,
        )
        log.info(f"resumed from {source}: {position.epoch} epoch(s) and {position.step} step(s) done")
    model.grad_checkpoint = cfg.grad_checkpoint
    ddp = model  # a single process trains the model itself: no process group, nothing to synchronise
    if dist.is_dist():
        ddp = DDP(model, device_ids=[info.local_rank] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    if cfg.compile:
        ddp = torch.compile(ddp)  # checkpoints and validation keep using the plain `model`
    loss_fn = build_loss(cfg.loss)

    dataset = PatchDataset(prepared, cfg.patch_size, cfg.samples_per_epoch, cfg.fg_fraction, cfg.seed)
    sampler = EpochSampler(dataset, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=cfg.seed)
    loader = DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        num_workers=cfg.num_workers,
        pin_memory=device.type == "cuda",
        drop_last=True,
        persistent_workers=cfg.num_workers > 0,
        worker_init_fn=ignore_stop_signals,
    )
    writer = None
    if info.is_main:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(Path(cfg.out_dir) / "tensorboard"), purge_step=position.epoch + 1)
    budget = make_budget(cfg, position.budget, started, schedule.progress)
    control = StepControl(device, cfg.max_bad_steps, budget, started)
    control.progress_floor = schedule.progress
    faults = frozenset(nan_fault_steps(info.rank))
    folder = checkpoint_dir(cfg.out_dir)

    stopped, best = None, position.best
    control.signal.install()
    try:
        for epoch in range(position.epoch, cfg.epochs):
            resumed_here = epoch == position.epoch and position.step > 0
            sampler.set_epoch(epoch, skip=position.step * cfg.batch_size if resumed_here else 0)
            stats = train_one_epoch(
                ddp,
                loader,
                steps,
                loss_fn,
                optimizer,
                schedule,
                scaler,
                amp_dtype,
                device,
                epoch,
                cfg.epochs,
                control,
                position.carry if resumed_here else None,
                faults,
            )
            stopped = stats.stopped
            done = epoch + 1 if stopped is None else epoch
            val = None
            if (stopped is None and (done % cfg.val_every == 0 or done == cfg.epochs)) or (
                stopped is not None and budget is not None and stopped.startswith("the time limit")
            ):
                val = timed_validation(model, my_val, run, cfg, device, amp_dtype, budget)
            is_best = val is not None and val.mean_dice > best
            best = max(best, val.mean_dice) if val is not None else best
            stopped_at = Position(done, 0 if stopped is None else stats.steps_done, stats.carry(), best)
            write_checkpoints(
                model, optimizer, schedule, scaler, stopped_at, cfg, model_args, run, info, budget, is_best
            )
            if info.is_main:
                if stopped is None or val is not None:
                    log_epoch(writer, epoch + 1, stats, val, run.spec.class_names)
                log.info(epoch_summary(epoch + 1, cfg.epochs, stats, val, run.spec.class_names, is_best))
            if stopped is not None:
                break
    finally:
        control.signal.uninstall()
        close_loader(loader)
        if writer is not None:
            writer.close()
    if stopped is not None:
        log.info(
            f"stopped by {stopped} after step {stats.steps_done}/{steps} of epoch {epoch + 1}; checkpoint "
            f"{folder / LAST} records the position: run the same command again to continue"
        )
        return 0
    best_note = f"; best mean Dice {best:.4f}: {folder / BEST}" if best > -math.inf else ""
    log.info(f"done. checkpoint: {folder / LAST}{best_note}")
    log.info(f"TensorBoard logs: {Path(cfg.out_dir) / 'tensorboard'} (tensorboard --logdir {cfg.out_dir}/tensorboard)")
    return 0


def timed_validation(model, cases, run: RunData, cfg: TrainConfig, device, amp_dtype, budget) -> ValResult:
    """Validate on every rank; with a time budget, the time it took (agreed across ranks) sizes the reserve."""
    began = time.perf_counter()
    pairs = ((c.image, c.label) for c in cases)
    val = validate(
        model,
        pairs,
        run.spec.num_classes,
        cfg.patch_size,
        device,
        cfg.val_overlap,
        cfg.batch_size,
        amp_dtype,
        keep_preview=dist.is_main(),
    )
    if budget is not None:  # the reserve steers every rank's learning rate: it must be the same everywhere
        seconds = dist.all_reduce_sum(torch.tensor([time.perf_counter() - began], device=device))
        budget.plan_reserve(seconds.item() / dist.get_world_size())
    return val


def write_checkpoints(
    model,
    optimizer,
    schedule,
    scaler,
    at: Position,
    cfg: TrainConfig,
    model_args: dict,
    run: RunData,
    info: dist.DistInfo,
    budget: TimeBudget | None,
    is_best: bool,
) -> None:
    """Every rank: refuse non-finite weights, gather the generator states; rank 0 writes, all learn the outcome."""
    if not torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all():  # one device sync
        raise TrainingError("the weights hold NaN or inf values: refusing to write a checkpoint")
    states = dist.all_gather_object(rng.capture(info.device))
    state = None
    if info.is_main:
        state = training_state(
            model=model,
            optimizer=optimizer,
            schedule=schedule,
            scaler=scaler,
            epoch=at.epoch,
            step=at.step,
            partial=at.carry if at.step else EpochCarry(),
            best=at.best,
            config=cfg,
            model_args=model_args,
            class_names=run.spec.class_names,
            world_size=info.world_size,
            rng=states,
            budget=budget.state_dict() if budget is not None else None,
        )
    dist.run_on_main(functools.partial(save_all, state, checkpoint_dir(cfg.out_dir), is_best))


def resolve_config(cfg: TrainConfig, run: RunData, device, world: int, local_world: int, cases) -> TrainConfig:
    """Fill the device- and data-dependent defaults; the dataset's folder is recorded too."""
    median_shape = np.median([c.label.shape for c in cases], axis=0)
    cpus = len(os.sched_getaffinity(0))
    cfg = dataclasses.replace(cfg, data_dir=str(run.data_dir))
    return resolve(cfg, device.type, world, median_shape, cpus, local_world)


def resume_source(cfg: TrainConfig) -> str | None:
    """The checkpoint every rank will load (rank 0 decides, falling back past unreadable files)."""
    found = find_resume(cfg.resume, cfg.out_dir, "cpu", get_logger().warning)
    return str(found[0]) if found is not None else None


def make_budget(cfg: TrainConfig, saved: dict | None, started: float, progress: float) -> TimeBudget | None:
    """The --time-limit budget: kept across torchrun restarts of one job, new for a new job."""
    if cfg.time_limit is None:
        return None
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", f"pid{os.getpid()}")
    if saved is not None and saved.get("run_id") == run_id and saved.get("limit_s") == cfg.time_limit:
        budget = TimeBudget(saved["limit_s"], saved["start_wall"], saved["start_progress"], run_id)
    else:  # launch.sh records when the job started, so its pre-flight and torchrun's start-up count too
        budget = TimeBudget(cfg.time_limit, float(os.environ.get("UNET3D_LAUNCH_TIME", started)), progress, run_id)
    budget.plan_reserve(None)
    return budget


def save_all(state: dict, folder: Path, is_best: bool) -> None:
    """last.pt (the one it replaces kept as previous.pt) and, at a new best, best.pt."""
    save_checkpoint(state, folder / LAST, previous=folder / PREVIOUS)
    if is_best:
        save_checkpoint(state, folder / BEST)


def describe_run(
    cfg: TrainConfig, run: RunData, info: dist.DistInfo, amp_dtype, memory_format: torch.memory_format, steps: int
) -> None:
    """The start-up report: every rank's device, the batch arithmetic, the data and the configuration."""
    mine = f"rank {info.rank}: host {socket.gethostname()}, local rank {info.local_rank}, device {info.device}"
    if info.device.type == "cuda":
        props = torch.cuda.get_device_properties(info.device)
        uuid = getattr(props, "uuid", None)  # not on every torch this project allows
        mine += f" = {props.name}" + (f" (UUID GPU-{uuid})" if uuid is not None else "")
    mine += f", CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}"
    devices = dist.all_gather_object(mine)
    log = get_logger()
    log.info("devices:\n  " + "\n  ".join(devices))
    if info.world_size == 1:
        log.info("running alone: one process, no process group, no DistributedDataParallel")
    log.info(
        f"world size {info.world_size}, batch {cfg.batch_size} per process, global batch "
        f"{cfg.batch_size * info.world_size}, {steps} step(s) per epoch, {cfg.num_workers} DataLoader worker(s) "
        "per process"
    )
    log.info(
        f"data {run.data_dir}: {len(run.train)} training, {len(run.val)} validation case(s), "
        f"classes {run.spec.class_names}, cache {run.cache}"
    )
    log.info(
        f"precision {amp_dtype or torch.float32}, memory format {format_name(memory_format)}; checkpoints in "
        f"{checkpoint_dir(cfg.out_dir)}, TensorBoard logs in {Path(cfg.out_dir) / 'tensorboard'}, per-rank logs in "
        f"{Path(cfg.out_dir) / 'logs'}; configuration:\n  "
        + "\n  ".join(f"{k} = {v}" for k, v in dataclasses.asdict(cfg).items())
    )


def prepare_only(cfg: TrainConfig) -> int:
    """launch.sh's pre-flight, before any rank starts: one message and exit code 2 for a bad dataset or an
    unusable checkpoint, so torchrun's restarts never repeat the same failure. Builds the cache meanwhile."""
    log = setup_logging(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    try:
        run = resolve_data(cfg, lambda make: make())
        problems = check_dataset(run, processes=max(local_world, min(8, os.cpu_count() or 1)))
        if problems:
            raise DatasetError(run.data_dir, problems)
        cases = [open_case(c, run.cache) for c in run.train]
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # NVML only: see launch.sh
        resolved = resolve_config(cfg, run, device, world, local_world, cases)
        found = find_resume(cfg.resume, cfg.out_dir, "cpu", log.warning)
        if found is not None:
            path, state = found
            model_args = {
                "in_channels": run.spec.in_channels,
                "num_classes": run.spec.num_classes,
                "features": resolved.features,
            }
            check_compatible(state, dataclasses.asdict(resolved), model_args, world, path)
    except (*INPUT_ERRORS, CheckpointError) as e:
        log.error(f"error: {e}")
        return 2
    note = f"will resume from {found[0]}" if found is not None else "starting fresh"
    log.info(f"checked {len(run.spec.training)} case(s) of {run.data_dir} (cache {run.cache}); {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
