"""Train a 3D U-Net with DistributedDataParallel: `bash launch.sh 5,6,7 [options]`, or `python train_ddp.py`.

Reads top to bottom: configuration -> set-up -> data -> model -> loop -> teardown.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from data.cache import build_cache, open_case
from data.dataset import EpochSampler, PatchDataset
from data.msd import DatasetSpec, load_dataset_json, split_cases
from data.synthetic import write_synthetic_dataset
from unet3d import dist
from unet3d.amp import grad_scaler, resolve_amp
from unet3d.checkpoint import load_checkpoint, save_checkpoint, strip_wrapper_prefixes
from unet3d.config import TrainConfig, parse_args, resolve
from unet3d.engine import train_one_epoch
from unet3d.logs import setup_logging
from unet3d.loss import build_loss
from unet3d.model import UNet3D
from unet3d.optim import build_optimizer, build_schedule
from unet3d.report import epoch_summary, log_epoch
from unet3d.validation import shard, validate


def dataset_dir(cfg: TrainConfig) -> Path:
    """--data-dir, or the synthetic dataset, written once by rank 0 while the others wait."""
    if cfg.data_dir is not None:
        return Path(cfg.data_dir)
    target = Path(cfg.synthetic_dir) / f"cases{cfg.synthetic_cases}_size{cfg.synthetic_size}_seed{cfg.seed}"
    return Path(
        dist.run_on_main(
            lambda: str(write_synthetic_dataset(target, cfg.synthetic_cases, cfg.synthetic_size, cfg.seed))
        )
    )


def cache_dir(cfg: TrainConfig, data_dir: Path) -> Path:
    if cfg.cache_dir is not None:
        return Path(cfg.cache_dir)
    digest = hashlib.sha1(str(data_dir.resolve()).encode()).hexdigest()[:8]
    return Path("runs/cache") / f"{data_dir.resolve().name}-{digest}"


def prepare_cache(spec: DatasetSpec, cache: Path, info: dist.DistInfo) -> None:
    """Every local rank preprocesses its share of the cases; all problems are reported on every rank."""
    modalities = [spec.modality[i] for i in range(spec.in_channels)]
    errors = build_cache(spec.training, modalities, cache, info.local_rank, info.local_world_size)
    problems = [e for rank_errors in dist.all_gather_object(errors) for e in rank_errors]
    if problems:
        raise ValueError(f"{len(problems)} case(s) of {spec.root} could not be prepared:\n  " + "\n  ".join(problems))


def resume_path(cfg: TrainConfig) -> Path | None:
    if cfg.resume == "none":
        return None
    if cfg.resume == "auto":
        last = Path(cfg.out_dir) / "checkpoints" / "last.pt"
        return last if last.exists() else None
    path = Path(cfg.resume)
    if not path.is_file():
        raise FileNotFoundError(f"--resume {cfg.resume}: no such checkpoint")
    return path


def describe_devices(info: dist.DistInfo) -> list[str]:
    """One line per rank (gathered from all of them): rank, host, device, GPU name and UUID, the GPU mask."""
    mine = f"rank {info.rank}: host {socket.gethostname()}, local rank {info.local_rank}, device {info.device}"
    if info.device.type == "cuda":
        props = torch.cuda.get_device_properties(info.device)
        mine += f" = {props.name} (UUID GPU-{props.uuid})"
    mine += f", CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}"
    return dist.all_gather_object(mine)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    info = dist.setup()
    try:
        return train(cfg, info)
    finally:
        dist.cleanup()


def train(cfg: TrainConfig, info: dist.DistInfo) -> int:
    log = setup_logging(info.rank)
    device = info.device
    torch.manual_seed(cfg.seed)

    # Data: the dataset (synthetic unless --data-dir), its split, and the preprocessing cache.
    data_dir = dataset_dir(cfg)
    spec = load_dataset_json(data_dir)
    train_cases, val_cases = split_cases(spec.training, cfg.val_fraction, cfg.seed)
    cache = cache_dir(cfg, data_dir)
    prepare_cache(spec, cache, info)
    prepared = [open_case(c, cache) for c in train_cases]
    my_val = [open_case(c, cache) for c in shard(val_cases, info.rank, info.world_size)]
    median_shape = np.median([c.label.shape for c in prepared], axis=0)
    cfg = resolve(
        dataclasses.replace(cfg, data_dir=str(data_dir)),  # the synthetic dataset's folder is recorded too
        device.type,
        info.world_size,
        median_shape,
        len(os.sched_getaffinity(0)),
        info.local_world_size,
    )
    amp_dtype = resolve_amp(cfg.amp, device)

    log.info("devices:\n  " + "\n  ".join(describe_devices(info)))
    log.info(
        f"world size {info.world_size}, batch {cfg.batch_size} per process, global batch "
        f"{cfg.batch_size * info.world_size}, {cfg.num_workers} DataLoader worker(s) per process"
    )
    log.info(
        f"data {data_dir}: {len(train_cases)} training, {len(val_cases)} validation case(s), "
        f"classes {spec.class_names}, cache {cache}"
    )
    log.info(
        f"precision {amp_dtype or torch.float32}; configuration:\n  "
        + "\n  ".join(f"{k} = {v}" for k, v in dataclasses.asdict(cfg).items())
    )

    # Model, optimizer, schedule; weights restored on every rank before DDP wraps the model.
    model_args = {"in_channels": spec.in_channels, "num_classes": spec.num_classes, "features": cfg.features}
    model = UNet3D(**model_args).to(device)
    optimizer = build_optimizer(
        model.parameters(), cfg.optimizer, cfg.lr, cfg.weight_decay, cfg.momentum, fused=device.type == "cuda"
    )
    schedule = build_schedule(optimizer, cfg.optimizer)
    scaler = grad_scaler(device, amp_dtype)
    start_epoch, best = 0, -math.inf
    resume = resume_path(cfg)
    if resume is not None:
        state = load_checkpoint(resume, device)
        model.load_state_dict(strip_wrapper_prefixes(state["model"], model.state_dict().keys()))
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        start_epoch, best = int(state["epoch"]), float(state["best_metric"])
        log.info(f"resumed from {resume}: {start_epoch} epoch(s) done, best mean Dice {best:.4f}")
    ddp = (
        DDP(model, device_ids=[info.local_rank] if device.type == "cuda" else None, gradient_as_bucket_view=True)
        if dist.is_dist()
        else model
    )
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
    )
    writer = None
    if info.is_main:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(Path(cfg.out_dir) / "tensorboard"), purge_step=start_epoch + 1)
    ckpt_dir = Path(cfg.out_dir) / "checkpoints"
    log.info(
        f"training epochs {start_epoch + 1}..{cfg.epochs}, {len(loader)} step(s) per epoch per process; "
        f"checkpoints in {ckpt_dir}, TensorBoard logs in {Path(cfg.out_dir) / 'tensorboard'}"
    )

    try:
        for epoch in range(start_epoch, cfg.epochs):
            sampler.set_epoch(epoch)
            stats = train_one_epoch(
                ddp, loader, len(loader), loss_fn, optimizer, schedule, scaler, amp_dtype, device, epoch, cfg.epochs
            )
            done = epoch + 1
            val = None
            if done % cfg.val_every == 0 or done == cfg.epochs:
                val = validate(
                    model,
                    ((c.image, c.label) for c in my_val),
                    spec.num_classes,
                    cfg.patch_size,
                    device,
                    cfg.val_overlap,
                    cfg.batch_size,
                    amp_dtype,
                )
            is_best = val is not None and val.mean_dice > best
            best = max(best, val.mean_dice) if val is not None else best
            if info.is_main:
                log_epoch(writer, done, stats, val, spec.class_names)
                state = checkpoint_state(model, optimizer, schedule, scaler, done, best, cfg, model_args, spec)
                save_checkpoint(state, ckpt_dir / "last.pt")
                if is_best:
                    save_checkpoint(state, ckpt_dir / "best.pt")
                log.info(epoch_summary(done, cfg.epochs, stats, val, spec.class_names, is_best))
    finally:
        if writer is not None:
            writer.close()
    best_note = f"; best mean Dice {best:.4f}: {ckpt_dir / 'best.pt'}" if best > -math.inf else ""
    log.info(f"done. checkpoint: {ckpt_dir / 'last.pt'}{best_note}")
    log.info(f"TensorBoard logs: {Path(cfg.out_dir) / 'tensorboard'} (tensorboard --logdir {cfg.out_dir}/tensorboard)")
    return 0


def checkpoint_state(
    model, optimizer, schedule, scaler, epoch: int, best: float, cfg: TrainConfig, model_args: dict, spec: DatasetSpec
) -> dict[str, Any]:
    """Everything needed to resume or evaluate, as plain types loadable with weights_only=True."""
    return {
        "model": model.state_dict(),  # the unwrapped model: no `module.` prefix
        "optimizer": optimizer.state_dict(),
        "scheduler": schedule.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch,
        "best_metric": best,
        "config": dataclasses.asdict(cfg),
        "model_args": {**model_args, "features": list(model_args["features"])},
        "class_names": spec.class_names,
    }


if __name__ == "__main__":
    sys.exit(main())
