"""Validation with every rank taking part: each scores its own cases, one all_reduce combines them.

The mean Dice is defined as in evaluate.py: per foreground class, the mean over cases of that case's
Dice; then the mean over classes. Ranks sum their cases' Dice and count their cases per class, and a
single all_reduce of those sums gives exactly the single-process number, whatever the number of ranks
and with no case counted twice (no sampler padding). Each rank runs the unwrapped model, never the DDP
wrapper, so no rank waits on another's forward pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from unet3d import dist
from unet3d.inference import predict
from unet3d.metrics import confusion_counts, dice_from_counts
from unet3d.overlay import middle_planes


def shard(items: Sequence, rank: int, world_size: int) -> list:
    """This rank's share of `items`: items[rank::world_size], no padding, every item exactly once."""
    return list(items)[rank::world_size]


@dataclass
class ValResult:
    per_class: np.ndarray  # (K - 1,) mean Dice per foreground class over all ranks' cases
    mean_dice: float  # mean of per_class: the same definition as evaluate.py's mean_dice
    num_cases: int  # over all ranks
    preview: tuple[np.ndarray, np.ndarray, np.ndarray] | None  # middle planes of the first case, where kept


def validate(
    model: nn.Module,
    cases: Iterable[tuple[np.ndarray, np.ndarray]],
    num_classes: int,
    window: Sequence[int],
    device: torch.device,
    overlap: float = 0.5,
    sw_batch_size: int = 2,
    amp_dtype: torch.dtype | None = None,
    keep_preview: bool = False,
) -> ValResult:
    """Per-class and mean Dice over every rank's validation cases. Every rank must call this.

    Args:
        model: the unwrapped model (not the DDP wrapper).
        cases: this rank's (image (C, X, Y, Z), label (X, Y, Z)) pairs; may be empty.
        window, overlap, sw_batch_size, amp_dtype: sliding-window inference settings.
        keep_preview: keep the middle planes of this rank's first case (`overlay.middle_planes`) for a
            picture; only the rank that draws it should, so the others hold no copy of a volume.
    """
    sums = torch.zeros(num_classes, dtype=torch.float64, device=device)
    count = torch.zeros(1, dtype=torch.float64, device=device)
    preview = None
    for image, label in cases:
        pred = predict(model, image, window, device, overlap, sw_batch_size, amp_dtype)
        ref = torch.from_numpy(np.array(label)).to(device)
        sums += dice_from_counts(confusion_counts(pred, ref, num_classes))
        count += 1
        if keep_preview and preview is None:
            preview = middle_planes(image, label, pred)
    totals = dist.all_reduce_sum(torch.cat([sums, count]))  # one collective, outside the case loop
    n = int(totals[-1].item())
    if n == 0:
        raise ValueError("validation has no cases")
    per_class = (totals[1:num_classes] / n).cpu().numpy()
    return ValResult(per_class, float(per_class.mean()), n, preview)
