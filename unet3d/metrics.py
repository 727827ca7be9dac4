"""Overlap metrics between label maps, per class, with fixed conventions for empty masks.

Conventions: when prediction and reference are both empty for a class, Dice and IoU are 1; when exactly
one is empty they are 0.
"""

from __future__ import annotations

import torch


def confusion_counts(pred: torch.Tensor, ref: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Per-class voxel counts of a label map pair.

    Args:
        pred, ref: (X, Y, Z) integer label maps on the same device.
        num_classes: K, background included.

    Returns:
        (K, 3) int64: true positives, predicted voxels, reference voxels per class.
    """
    if pred.shape != ref.shape:
        raise ValueError(f"prediction {tuple(pred.shape)} and reference {tuple(ref.shape)} differ in shape")
    pred, ref = pred.reshape(-1).long(), ref.reshape(-1).long()
    tp = torch.bincount(ref[pred == ref], minlength=num_classes)[:num_classes]
    n_pred = torch.bincount(pred, minlength=num_classes)[:num_classes]
    n_ref = torch.bincount(ref, minlength=num_classes)[:num_classes]
    return torch.stack([tp, n_pred, n_ref], dim=1)


def dice_from_counts(counts: torch.Tensor) -> torch.Tensor:
    """(K, 3) counts from `confusion_counts` -> (K,) float64 Dice, 1 where both masks are empty."""
    tp, n_pred, n_ref = counts.double().unbind(-1)
    denom = n_pred + n_ref
    return torch.where(denom > 0, 2 * tp / denom.clamp_min(1), torch.ones_like(denom))


def iou_from_counts(counts: torch.Tensor) -> torch.Tensor:
    """(K, 3) counts -> (K,) float64 IoU, 1 where both masks are empty."""
    tp, n_pred, n_ref = counts.double().unbind(-1)
    union = n_pred + n_ref - tp
    return torch.where(union > 0, tp / union.clamp_min(1), torch.ones_like(union))
