"""When a run saves its TrainState, where it finds the one to resume from, and whether it may continue it.

Saving: every rank refuses non-finite weights and contributes its generator states; global rank 0 writes
`last.pt` (keeping the file it replaces as `previous.pt`) and, at a new best, `best.pt`, each atomically;
every rank learns at once if that failed. Resuming: rank 0 picks the file (falling back past unreadable
ones), every rank loads it onto its own device into the unwrapped model, before DDP wraps it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from data.msd import DatasetSpec
from data.plan import Plan, legacy_plan
from unet3d.checkpoint import CheckpointError, load_resumable, save_checkpoint
from unet3d.training import dist, rng
from unet3d.training.config import TrainConfig
from unet3d.training.control import TrainingError
from unet3d.training.logs import get_logger
from unet3d.training.runtime import Runtime
from unet3d.training.state import TrainState

LAST, PREVIOUS, BEST = "last.pt", "previous.pt", "best.pt"
UNREADABLE = "last.pt.unreadable"
REQUIRED_KEYS = ("model", "optimizer", "scheduler", "scaler", "epoch", "best_metric", "config", "model_args")
# A checkpoint of another architecture, class set or patch cannot be continued.
# The optimizer too: SGD's state in AdamW failed at load ('step'), AdamW's in SGD at the first step ('momentum').
STRICT_FIELDS = ("features", "patch_size", "fold", "deep_supervision", "optimizer")
# Continuing in the middle of an epoch needs the epoch's sample order: the same sharding and batches.
POSITION_FIELDS = ("batch_size", "samples_per_epoch", "seed")
# Settings that may change between runs without a word.
FREE_FIELDS = (
    "resume",
    "prepare_only",
    "num_workers",
    "dist_timeout",
    "setup_timeout",
    "time_limit",
    "cache_dir",
    "compile",
    "grad_checkpoint",
    "memory_format",
    "profile",
    "profile_every_rank",
)


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def save_checkpoints(rt: Runtime, state: TrainState, is_best: bool) -> None:
    """Every rank: refuse non-finite weights, gather the generator states; rank 0 writes, all learn the outcome."""
    if not torch.stack([torch.isfinite(p).all() for p in state.model.parameters()]).all():  # one device sync
        raise TrainingError("the weights hold NaN or inf values: refusing to write a checkpoint")
    rng_states = dist.all_gather_object(rng.capture(rt.device))
    folder = checkpoint_dir(rt.out_dir)

    def write() -> None:
        checkpoint = state.state_dict(world_size=rt.world_size, rng_states=rng_states)
        if is_best:  # first: a last.pt that carries the new best_metric never stands beside an older best.pt
            save_checkpoint(checkpoint, folder / BEST)
        save_checkpoint(checkpoint, folder / LAST, previous=folder / PREVIOUS)

    dist.run_on_main(write)


def resume_source(cfg: TrainConfig) -> str | None:
    """The checkpoint to continue from, or None (rank 0 decides, falling back past unreadable files).

    A last.pt passed over for previous.pt is renamed last.pt.unreadable: the next save would otherwise keep
    it as previous.pt in place of the good one, and for an epoch the only older checkpoint would be the bad one.
    """
    found = find_resume(cfg.resume, cfg.out_dir, "cpu", get_logger().warning)
    folder = checkpoint_dir(cfg.out_dir)
    if cfg.resume == "none" and any((folder / name).exists() for name in (LAST, PREVIOUS, BEST)):
        get_logger().warning(
            f"--resume none: starting over; this run's checkpoints will replace those in {folder} (its best.pt "
            "at this run's first new best)"
        )
    if cfg.resume == "auto" and found is not None and found[0] == folder / PREVIOUS and (folder / LAST).exists():
        (folder / LAST).replace(folder / UNREADABLE)
        get_logger().warning(f"kept the unreadable {folder / LAST} as {folder / UNREADABLE}")
    return str(found[0]) if found is not None else None


def saved_plan(checkpoint: dict[str, Any], spec: DatasetSpec) -> Plan:
    """The plan a checkpoint was trained with; for one from before plans (format 1), the plan that describes
    what that code did: every case as stored, per-case normalisation, 3x3x3 kernels and stride 2."""
    if "plan" in checkpoint:
        return Plan.from_dict(checkpoint["plan"])
    cfg = checkpoint["config"]
    get_logger().warning(
        "the checkpoint is from before plans: applying the plan it was trained with (cases as stored, no "
        "reorientation, resampling or crop, per-case normalisation)"
    )
    return legacy_plan(spec.modalities, cfg["patch_size"], cfg["features"])


def follow_checkpoint(cfg: TrainConfig, checkpoint: dict[str, Any] | None) -> TrainConfig:
    """`--deep-supervision auto` on a resumed run means the checkpoint's model (one older than the option
    had none), whatever this device's default: the same weights continue. An explicit choice stays, and
    `check_resumable` refuses one the checkpoint's model does not match."""
    if checkpoint is None or cfg.deep_supervision != "auto":
        return cfg
    supervised = bool(checkpoint.get("model_args", {}).get("deep_supervision", False))
    return dataclasses.replace(cfg, deep_supervision="on" if supervised else "off")


def check_resumable(
    rt: Runtime, checkpoint: dict[str, Any], model_args: dict[str, Any], source: Path, class_names: Sequence[str]
) -> None:
    """Refuse (CheckpointError naming every field) a checkpoint this run cannot continue; warn of settings
    that changed (the dataset's class names among them)."""
    config = dataclasses.asdict(rt.cfg)
    changed = check_compatible(checkpoint, config, model_args, rt.world_size, source, class_names)
    if changed:
        get_logger().warning(f"resuming with changed settings: {', '.join(changed)}")


def resume(rt: Runtime, state: TrainState, checkpoint: dict[str, Any], source: Path) -> None:
    """Load `checkpoint` (read onto this rank's device) into `state`, before DDP wraps its model.

    From the file `--resume PATH` names, the state records it (`resumed_from`), so that a restart or a rerun
    of the same command continues this run's own last.pt instead of going back to PATH; and from another
    run folder's checkpoint, this folder's best.pt is chosen afresh (that best Dice was that run's)."""
    state.load(checkpoint, source=str(source), rank=rt.dist.rank, world_size=rt.world_size, warn=get_logger().warning)
    if rt.cfg.resume not in ("auto", "none") and Path(rt.cfg.resume).resolve() == source.resolve():
        state.resumed_from = str(source.resolve())
        if source.resolve().parent != checkpoint_dir(rt.out_dir).resolve() and state.best_metric > -math.inf:
            get_logger().info(
                f"{source} is another run's: its best validation Dice ({state.best_metric:.4f}) is not this "
                f"folder's, whose best.pt is chosen afresh"
            )
            state.best_metric = -math.inf
    get_logger().info(f"resumed from {source}: {state.epoch} epoch(s) and {state.step} step(s) done")


def find_resume(resume: str, out_dir: str | Path, device, warn: Callable[[str], None]) -> tuple[Path, dict] | None:
    """The checkpoint to continue from and its content, or None to start fresh.

    `auto`: last.pt, falling back to previous.pt (with a warning naming the unreadable file); files that
    exist but none of which can be read are an error. `none`: start over. A path: that file or an error,
    unless this run folder's own last.pt (or previous.pt) started from that file: then the run has trained
    on from it (a torchrun restart, or the same command run again after a stop), and continues its own.
    """
    if resume == "none":
        return None
    folder = checkpoint_dir(out_dir)
    if resume == "auto":
        return load_resumable([folder / LAST, folder / PREVIOUS], device, REQUIRED_KEYS, warn)
    path = Path(resume)
    if not path.is_file():
        raise FileNotFoundError(f"--resume {resume}: no such checkpoint")
    try:
        own = load_resumable([folder / LAST, folder / PREVIOUS], device, REQUIRED_KEYS, lambda message: None)
    except CheckpointError:
        own = None
    if own is not None and own[0].resolve() != path.resolve() and own[1].get("resumed_from") == str(path.resolve()):
        warn(f"--resume {resume}: continuing from {own[0]}, this run's own, which trained on from it")
        return own
    found = load_resumable([path], device, REQUIRED_KEYS, lambda message: None)
    assert found is not None
    return found


def check_compatible(
    state: dict[str, Any], config: dict[str, Any], model_args: dict[str, Any], world_size: int, source: Path,
    class_names: Sequence[str] | None = None,
) -> list[str]:  # fmt: skip
    """Raise CheckpointError naming every field that forbids continuing; return the fields that changed, and
    the class names where the dataset names its classes otherwise than the checkpoint (the same number: a
    renamed class trains on as the same output channel, so it is a warning, as in evaluate.py)."""
    saved = state["config"]
    errors = []
    for name in ("in_channels", "num_classes"):
        if state["model_args"][name] != model_args[name]:
            errors.append(f"{name} (checkpoint {state['model_args'][name]}, now {model_args[name]})")
    for name in STRICT_FIELDS:
        if name in saved and _plain(saved[name]) != _plain(config[name]):  # (absent: older than the option)
            errors.append(f"{name} (checkpoint {_plain(saved.get(name))}, now {_plain(config[name])})")
    if config["fold"] is not None and saved.get("folds") != config["folds"]:  # another fold's cases
        errors.append(f"folds (checkpoint {saved.get('folds')}, now {config['folds']})")
    if state.get("step", 0) > 0:
        saved_world = state.get("world_size")
        if saved_world != world_size:
            errors.append(f"world size (checkpoint {saved_world}, now {world_size}; needed to resume mid-epoch)")
        for name in POSITION_FIELDS:
            if saved.get(name) != config[name]:
                errors.append(f"{name} (checkpoint {saved.get(name)}, now {config[name]}; needed to resume mid-epoch)")
    if errors:
        raise CheckpointError(f"cannot resume from {source}: the configuration differs in " + "; ".join(errors))
    ignored = set(FREE_FIELDS) | set(STRICT_FIELDS)  # (a changed position field mid-epoch was refused above)
    # options newer than the checkpoint are not "changed": it was trained before they existed
    if "data_dir" in saved:  # recorded relative to where the run started before it was recorded absolute
        saved = {**saved, "data_dir": _absolute(saved["data_dir"])}
    changed = sorted(k for k in config if k not in ignored and k in saved and _plain(saved[k]) != _plain(config[k]))
    before = state.get("class_names")
    if class_names is not None and before is not None and list(before) != list(class_names):
        changed.append(f"class names (checkpoint {list(before)}, now {list(class_names)})")
    return changed


def _absolute(path: str | None) -> str | None:
    return None if path is None else os.path.abspath(path)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
