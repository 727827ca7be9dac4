"""Validation with every rank taking part: each scores its own cases, all_reduces combine them.

The mean Dice is defined as in evaluate.py: per foreground class, the mean over cases of that case's
Dice; then the mean over classes. Ranks sum their cases' Dice and count their cases, and reducing those
sums gives exactly the single-process number, whatever the number of ranks and with no case counted twice
(no sampler padding). Ranks go through their cases in lockstep, one reduction per round of one case
each, so a rank with fewer cases (or none: more ranks than cases) waits at most one case's time in a
collective, never all of the others' validation, which on a large dataset could outlast --dist-timeout.
Each rank runs the unwrapped model, never the DDP wrapper, so no rank waits on another's forward pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from data.geometry import to_native
from data.patches import PreparedCase
from unet3d.inference.metrics import confusion_counts, dice_from_counts
from unet3d.inference.pictures import Preview, middle_planes
from unet3d.inference.sliding_window import InferenceSettings, for_resampling, predict_probabilities
from unet3d.training import dist
from unet3d.training.config import TrainConfig
from unet3d.training.control import StepControl, StopReason
from unet3d.training.runtime import Runtime


def shard(items: Sequence, rank: int, world_size: int) -> list:
    """This rank's share of `items`: items[rank::world_size], no padding, every item exactly once."""
    return list(items)[rank::world_size]


@dataclass
class ValResult:
    per_class: np.ndarray  # (K - 1,) mean Dice per foreground class over all ranks' cases
    mean_dice: float  # mean of per_class: the same definition as evaluate.py's mean_dice
    num_cases: int  # over all ranks
    preview: Preview | None  # the first case's middle planes, where kept


def validate(
    model: nn.Module,
    cases: Sequence[PreparedCase],
    num_classes: int,
    settings: InferenceSettings,
    device: torch.device,
    keep_preview: bool = False,
    stop: Callable[[], bool] | None = None,
) -> ValResult | None:
    """Per-class and mean Dice over every rank's validation cases. Every rank must call this.

    Each case is predicted in the planned space and scored on its file's own grid, the way evaluate.py
    scores it: the class probabilities resampled back, uncropped and reoriented (`data.geometry.to_native`),
    then compared with the label as stored. A case without a geometry is scored in the space it is in.

    Args:
        model: the unwrapped model (not the DDP wrapper).
        cases: this rank's cases (planned image and label, native label, geometry); may be empty.
        settings: the sliding-window inference settings.
        keep_preview: keep the middle planes of this rank's first case (`pictures.middle_planes`, in the planned
            space) for a picture; only the rank that draws it should, so the others hold no copy of a volume.
        stop: whether this rank was asked to stop (a stop signal); asked on every rank after every round.

    Returns:
        None when some rank was asked to stop: every rank gives up after the same round (a validation of
        many large scans can take longer than a scheduler or torchrun waits for a graceful stop).
    """
    rounds = int(dist.all_reduce_max(torch.tensor([len(cases)], dtype=torch.float64, device=device)).item())
    totals = torch.zeros(num_classes + 2, dtype=torch.float64, device=device)  # Dice sums per class, cases, stop
    preview = None
    for i in range(rounds):
        mine = torch.zeros(num_classes + 2, dtype=torch.float64, device=device)
        if i < len(cases):
            case = cases[i]
            probs = predict_probabilities(model, case.image, settings, device)
            if case.geometry is not None:  # on the host where the file's grid would not fit beside the model
                back = for_resampling(probs, case.geometry.cropped_shape)
                pred, ref = torch.from_numpy(to_native(back, case.geometry)), case.native_label
                del back
            else:
                pred, ref = probs.argmax(0), case.label
            ref = torch.from_numpy(np.array(ref)).to(pred.device)
            dice = dice_from_counts(confusion_counts(pred, ref, num_classes))
            mine[:num_classes], mine[num_classes] = dice.to(device), 1
            if keep_preview and preview is None:
                preview = _preview(case, probs.argmax(0), float(dice[1:].mean()))
            del probs, pred, ref  # freed before the next case's logits are stitched, not after
        if stop is not None and stop():
            mine[-1] = 1
        totals += dist.all_reduce_sum(mine)  # every rank, every round: a round waits for one case at most
        if stop is not None and totals[-1].item() > 0:  # (read back only where a stop can be asked for)
            return None
    n = int(totals[num_classes].item())
    if n == 0:
        raise ValueError("validation has no cases")
    per_class = (totals[1:num_classes] / n).cpu().numpy()
    return ValResult(per_class, float(per_class.mean()), n, preview)


def _preview(case: PreparedCase, pred: torch.Tensor, dice: float) -> Preview:
    spacing = case.geometry.planned_spacing[:2] if case.geometry is not None else (1.0, 1.0)
    return Preview(*middle_planes(case.image, case.label, pred), spacing, f"{case.name}  Dice {dice:.3f}")


def ever_validates(cfg: TrainConfig) -> bool:
    """False for --fold all, which trains on every case and holds none out."""
    return cfg.fold != "all"


def validation_due(cfg: TrainConfig, epochs_done: int, stopped: StopReason | None) -> bool:
    """Every --val-every epochs and after the last; after a stop only for the time limit, whose budget
    keeps room for this last validation (a stop signal wants the job gone quickly); never in a run that
    never validates (`ever_validates`)."""
    if not ever_validates(cfg):
        return False
    if stopped is not None:
        return stopped is StopReason.TIME_LIMIT
    return epochs_done % cfg.val_every == 0 or epochs_done == cfg.epochs


def run_validation(
    rt: Runtime, model: nn.Module, cases: Sequence[PreparedCase], num_classes: int, control: StepControl
) -> ValResult | None:
    """`validate` this rank's cases; with a time budget, the time it took (agreed across ranks) sizes the
    room kept for the next one. None when a stop signal came meanwhile (on any rank)."""
    began = time.perf_counter()
    asked = control.signal
    val = validate(
        model, cases, num_classes, rt.inference(), rt.device, keep_preview=rt.is_main,
        stop=lambda: asked.received is not None,
    )  # fmt: skip
    if val is None:  # every rank: the same verdict came out of the same reduction
        return None
    if control.budget is not None:  # the reserve steers every rank's learning rate: it must be the same everywhere
        seconds = dist.all_reduce_sum(torch.tensor([time.perf_counter() - began], device=rt.device))
        control.budget.plan_reserve(seconds.item() / rt.world_size)
    return val
