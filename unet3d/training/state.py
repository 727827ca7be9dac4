"""What a checkpoint holds, as one object: the model and its optimisation state, and where training stands.

The position is exact: `epoch` epochs completed plus, after a graceful stop, `partial_epoch.step` steps of
the next one with that partial epoch's totals. With every rank's generator states (saved beside it) a run
resumed from a checkpoint continues as if it had never stopped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from data.plan import Plan
from data.prepare import RunData
from unet3d.checkpoint import CheckpointError, load_weights
from unet3d.model import UNet3D
from unet3d.precision import apply_memory_format, grad_scaler
from unet3d.training import rng
from unet3d.training.config import TrainConfig
from unet3d.training.control import TimeBudget
from unet3d.training.optim import (
    ProgressSchedule,
    build_optimizer,
    build_schedule,
    fit_state_to_parameters,
    optimizer_kernels,
)
from unet3d.training.runtime import Runtime

CHECKPOINT_FORMAT = 2  # 1: before TrainState (no "format" key), which loads the same way

KERNEL_FLAGS = ("fused", "foreach")  # an optimizer group's choice of implementation


@dataclass
class PartialEpoch:
    """The part of an epoch trained before a stop, carried into the resumed run (totals over all ranks)."""

    step: int = 0  # steps of the epoch already trained
    loss_sum: float = 0.0
    samples: int = 0
    seconds: float = 0.0


@dataclass(kw_only=True)
class TrainState:
    """Everything a checkpoint holds, `state_dict()` to write it and `load()` to continue from it.

    `model` is the unwrapped model (never the DDP wrapper or a compiled module), so checkpoints carry no
    `module.` or `_orig_mod.` prefix.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: ProgressSchedule
    scaler: torch.amp.GradScaler
    config: TrainConfig  # the resolved configuration
    plan: Plan  # how the data was brought into one space, and the network planned for it
    model_args: dict[str, Any]  # UNet3D(**model_args)
    class_names: list[str]
    split: dict[str, list[str]] = field(default_factory=dict)  # the case names of "train" and "val"
    epoch: int = 0  # epochs completed
    trained_steps: int = 0  # optimizer steps of the completed epochs (each at its run's steps per epoch)
    partial_epoch: PartialEpoch = field(default_factory=PartialEpoch)  # of the next epoch, after a stop
    best_metric: float = -math.inf  # the best mean validation Dice so far
    budget: TimeBudget | None = None  # the --time-limit budget of the job that trains now
    resumed_from: str | None = None  # the file --resume named when this run started from another checkpoint
    validation_pending: bool = False  # the last epoch's due validation was cut short by a stop signal

    @property
    def step(self) -> int:
        """Steps of the next epoch already trained (non-zero only after a graceful stop)."""
        return self.partial_epoch.step

    def record(self, mean_dice: float | None) -> bool:
        """Note a validation result; whether it is a new best."""
        if mean_dice is None or not mean_dice > self.best_metric:
            return False
        self.best_metric = mean_dice
        return True

    def state_dict(self, *, world_size: int, rng_states: list[dict[str, Any]]) -> dict[str, Any]:
        """The checkpoint: plain types and tensors only, loadable with weights_only=True.

        Args:
            world_size: the number of ranks that trained (continuing mid-epoch needs the same number).
            rng_states: every rank's generator states (`rng.capture`), in rank order.
        """
        return {
            "format": CHECKPOINT_FORMAT,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.schedule.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.epoch,
            "trained_steps": self.trained_steps,
            "step": self.step,
            "epoch_partial": dataclasses.asdict(self.partial_epoch),  # the key of format 1
            "best_metric": self.best_metric,
            "config": dataclasses.asdict(self.config),
            "plan": self.plan.to_dict(),
            "model_args": dict(self.model_args),
            "class_names": list(self.class_names),
            "split": {k: list(v) for k, v in self.split.items()},
            "world_size": world_size,
            "rng": rng_states,
            "time_budget": self.budget.state_dict() if self.budget is not None else None,
            "resumed_from": self.resumed_from,
            "validation_pending": self.validation_pending,
        }

    def load(
        self,
        checkpoint: dict[str, Any],
        *,
        source: str,
        rank: int,
        world_size: int,
        warn: Callable[[str], None],
    ) -> None:
        """Continue from `checkpoint` (a `state_dict()` of format 1 or 2, loaded onto this rank's device) as
        rank `rank` of `world_size`.

        This rank's generator states are restored when this run has as many ranks as the one that wrote them
        (a run on more ranks has no saved state for its extra ones, one on fewer would take other ranks'
        streams). The saved time budget is restored as it was; `TimeBudget.for_job` decides whether it
        still applies.
        """
        load_weights(self.model, checkpoint["model"], source)
        # load_state_dict replaces each group's settings with the saved ones, the kernel flags too: a bf16
        # run's checkpoint (fused) resumed under fp16 loss scaling would step with the fused kernels,
        # which must never run there (`optimizer_kernels`). The kernels are this run's choice.
        kernels = [{k: group.get(k) for k in KERNEL_FLAGS} for group in self.optimizer.param_groups]
        try:
            self.optimizer.load_state_dict(checkpoint["optimizer"])
            self.schedule.load_state_dict(checkpoint["scheduler"])
        except (KeyError, TypeError, ValueError, RuntimeError) as e:  # a restart would only repeat it
            raise CheckpointError(
                f"cannot resume from {source}: its optimizer or schedule state does not fit ({e})"
            ) from e
        for group, chosen in zip(self.optimizer.param_groups, kernels, strict=True):
            group.update(chosen)
        fit_state_to_parameters(self.optimizer)  # step counts and buffer layouts for this run's kernels
        # The hyperparameters are this run's too: load_state_dict put the saved lr, momentum and weight decay
        # back, so a resume with --lr 0.1 trained at the old rate while the warning named lr as changed
        cfg = self.config
        for group in self.optimizer.param_groups:
            group["weight_decay"] = cfg.weight_decay
            if "momentum" in group:
                group["momentum"] = cfg.momentum
        self.schedule.base_lrs = [cfg.lr] * len(self.optimizer.param_groups)
        self.schedule.set_progress(self.schedule.progress)
        if self.scaler.is_enabled() and not checkpoint["scaler"]:
            # Written without fp16 loss scaling (fp32 or bf16): the scale starts afresh, as in a new run.
            warn(f"{source} holds no GradScaler state (it was trained without fp16): the loss scale starts afresh")
        else:
            self.scaler.load_state_dict(checkpoint["scaler"])  # a no-op for a disabled scaler
        saved_rng = checkpoint.get("rng") or []
        if len(saved_rng) == checkpoint.get("world_size") == world_size:
            rng.restore(saved_rng[rank], next(self.model.parameters()).device)  # the model is on this rank's device
        elif saved_rng and rank == 0:
            warn(
                f"{source} was written by {len(saved_rng)} rank(s), this run has {world_size}: the random "
                "generators start from the seed, not from where that run left them"
            )
        self.epoch = int(checkpoint["epoch"])
        self.trained_steps = trained_steps(checkpoint)
        step = int(checkpoint.get("step", 0))
        self.partial_epoch = PartialEpoch(**checkpoint["epoch_partial"]) if step else PartialEpoch()
        self.best_metric = float(checkpoint["best_metric"])
        self.resumed_from = checkpoint.get("resumed_from")
        self.validation_pending = bool(checkpoint.get("validation_pending", False))
        saved_budget = checkpoint.get("time_budget")
        self.budget = TimeBudget.from_state(saved_budget) if saved_budget else None


def trained_steps(checkpoint: dict[str, Any]) -> int:
    """The optimizer steps of a checkpoint's completed epochs; for one written before they were counted, its
    epochs at its own steps per epoch (samples per epoch / (batch size x world size))."""
    if "trained_steps" in checkpoint:
        return int(checkpoint["trained_steps"])
    cfg = checkpoint.get("config") or {}
    try:
        per_epoch = int(cfg["samples_per_epoch"]) // (int(cfg["batch_size"]) * int(checkpoint["world_size"]))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        per_epoch = 0
    return int(checkpoint["epoch"]) * per_epoch


def build_state(rt: Runtime, run: RunData) -> TrainState:
    """A fresh TrainState for the run's data and plan on this rank's device, laid out in its memory format."""
    args = {**run.plan.model_args(run.spec.in_channels, run.spec.num_classes)}
    args["deep_supervision"] = rt.cfg.deep_supervision == "on"
    torch.manual_seed(rt.cfg.seed)  # the same initial weights on every rank (DDP would broadcast them anyway)
    model = apply_memory_format(UNet3D(**args).to(rt.device), rt.memory_format)
    model.grad_checkpoint = rt.cfg.grad_checkpoint
    state = new_state(rt, model, run.plan, args, run.spec.class_names)
    state.split = {"train": [c.name for c in run.train], "val": [c.name for c in run.val]}
    return state


def new_state(
    rt: Runtime, model: nn.Module, plan: Plan, args: dict[str, Any], class_names: Sequence[str]
) -> TrainState:
    """A fresh TrainState around `model` (built from `args` for `plan`): the optimizer with the kernels that
    are safe for the run's precision, its schedule and the loss scaler."""
    cfg = rt.cfg
    kernels = optimizer_kernels(rt.device, rt.amp_dtype)
    optimizer = build_optimizer(model.parameters(), cfg.optimizer, cfg.lr, cfg.weight_decay, cfg.momentum, kernels)
    return TrainState(
        model=model,
        optimizer=optimizer,
        schedule=build_schedule(optimizer, cfg.optimizer),
        scaler=grad_scaler(rt.device, rt.amp_dtype),
        config=cfg,
        plan=plan,
        model_args=dict(args),
        class_names=list(class_names),
    )
