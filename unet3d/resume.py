"""What a training checkpoint holds, where a run finds the one to resume from, and whether it may.

A checkpoint records the position exactly: `epoch` epochs completed plus `step` steps of the next one
(non-zero only after a graceful stop), with the partial epoch's totals, every rank's generator states,
the schedule, optimizer and scaler. Resuming from it continues as if the run had never stopped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unet3d import rng
from unet3d.checkpoint import CheckpointError, load_checkpoint, load_resumable, load_weights
from unet3d.engine import EpochCarry

LAST, PREVIOUS, BEST = "last.pt", "previous.pt", "best.pt"
REQUIRED_KEYS = ("model", "optimizer", "scheduler", "scaler", "epoch", "best_metric", "config", "model_args")
# A checkpoint of another architecture, class set or patch cannot be continued.
STRICT_FIELDS = ("features", "patch_size")
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
)


@dataclass
class Position:
    """Where training continues: epochs done, steps of the next one done, and what goes with them."""

    epoch: int = 0
    step: int = 0
    carry: EpochCarry | None = None  # the partial epoch's totals when step > 0
    best: float = -math.inf
    budget: dict[str, Any] | None = None  # the --time-limit budget of the run that wrote the checkpoint


def restore(
    source: Path,
    config: Any,
    model_args: dict[str, Any],
    model,
    optimizer,
    schedule,
    scaler,
    rank: int,
    world_size: int,
    device: torch.device,
    warn: Callable[[str], None],
) -> Position:
    """Load `source` onto `device` into the unwrapped model and its training state (before DDP wraps it).

    This rank's generator states are restored when the world size is the one that wrote them.
    """
    state = load_checkpoint(source, device)
    changed = check_compatible(state, dataclasses.asdict(config), model_args, world_size, source)
    if changed:
        warn(f"resuming with changed settings: {', '.join(changed)}")
    load_weights(model, state["model"], source)
    try:
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["scheduler"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:  # a restart would only repeat it
        raise CheckpointError(f"cannot resume from {source}: its optimizer or schedule state does not fit ({e})") from e
    if scaler.is_enabled() and not state["scaler"]:
        # Written without fp16 loss scaling (fp32 or bf16): the scale starts afresh, as in a new run.
        warn(f"{source} holds no GradScaler state (it was trained without fp16): the loss scale starts afresh")
    else:
        scaler.load_state_dict(state["scaler"])  # a no-op for a disabled scaler
    saved_rng = state.get("rng") or []
    if len(saved_rng) == world_size:
        rng.restore(saved_rng[rank], device)
    step = int(state.get("step", 0))
    return Position(
        int(state["epoch"]),
        step,
        EpochCarry(**state["epoch_partial"]) if step else None,
        float(state["best_metric"]),
        state.get("time_budget"),
    )


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def find_resume(resume: str, out_dir: str | Path, device, warn: Callable[[str], None]) -> tuple[Path, dict] | None:
    """The checkpoint to continue from and its content, or None to start fresh.

    `auto`: last.pt, falling back to previous.pt (with a warning naming the unreadable file); files that
    exist but none of which can be read are an error. `none`: start over. A path: that file or an error.
    """
    if resume == "none":
        return None
    if resume == "auto":
        folder = checkpoint_dir(out_dir)
        return load_resumable([folder / LAST, folder / PREVIOUS], device, REQUIRED_KEYS, warn)
    path = Path(resume)
    if not path.is_file():
        raise FileNotFoundError(f"--resume {resume}: no such checkpoint")
    found = load_resumable([path], device, REQUIRED_KEYS, lambda message: None)
    assert found is not None
    return found


def check_compatible(
    state: dict[str, Any], config: dict[str, Any], model_args: dict[str, Any], world_size: int, source: Path
) -> list[str]:
    """Raise CheckpointError naming every field that forbids continuing; return the fields that changed."""
    saved = state["config"]
    errors = []
    for name in ("in_channels", "num_classes"):
        if state["model_args"][name] != model_args[name]:
            errors.append(f"{name} (checkpoint {state['model_args'][name]}, now {model_args[name]})")
    for name in STRICT_FIELDS:
        if _plain(saved.get(name)) != _plain(config[name]):
            errors.append(f"{name} (checkpoint {_plain(saved.get(name))}, now {_plain(config[name])})")
    if state.get("step", 0) > 0:
        saved_world = state.get("world_size")
        if saved_world != world_size:
            errors.append(f"world size (checkpoint {saved_world}, now {world_size}; needed to resume mid-epoch)")
        for name in POSITION_FIELDS:
            if saved.get(name) != config[name]:
                errors.append(f"{name} (checkpoint {saved.get(name)}, now {config[name]}; needed to resume mid-epoch)")
    if errors:
        raise CheckpointError(f"cannot resume from {source}: the configuration differs in " + "; ".join(errors))
    ignored = set(FREE_FIELDS) | set(STRICT_FIELDS) | set(POSITION_FIELDS)
    return sorted(k for k in config if k not in ignored and _plain(saved.get(k)) != _plain(config[k]))


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def training_state(
    *,
    model,
    optimizer,
    schedule,
    scaler,
    epoch: int,
    step: int,
    partial: Any,
    best: float,
    config: Any,
    model_args: dict[str, Any],
    class_names: list[str],
    world_size: int,
    rng: list[dict[str, Any]],
    budget: dict[str, Any] | None,
) -> dict[str, Any]:
    """The checkpoint dictionary: plain types and tensors only, loadable with weights_only=True."""
    return {
        "model": model.state_dict(),  # the unwrapped model: no `module.` prefix
        "optimizer": optimizer.state_dict(),
        "scheduler": schedule.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch,  # epochs completed
        "step": step,  # steps of the next epoch already trained (after a graceful stop)
        "epoch_partial": dataclasses.asdict(partial),
        "sampler_epoch": epoch,  # DistributedSampler.set_epoch value to continue with
        "best_metric": best,
        "config": dataclasses.asdict(config),
        "model_args": {**model_args, "features": list(model_args["features"])},
        "class_names": class_names,
        "world_size": world_size,
        "rng": rng,  # one entry per rank
        "time_budget": budget,
    }
