"""Segmentation metrics per class, with fixed conventions for empty masks.

Conventions, for one class of one case:
- prediction and reference both empty: Dice 1, IoU 1, HD95 0 (nothing to find, nothing found);
- exactly one of them empty: Dice 0, IoU 0, HD95 undefined (NaN). An undefined HD95 is left out of the
  class's mean and counted separately (`hd95_undefined` in evaluate.py's summary).
HD95 is the larger of the two directed 95th-percentile surface distances, in millimetres, using the
voxel spacing of the image's affine, so anisotropic voxels are measured correctly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from scipy import ndimage


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


def _surface(mask: np.ndarray) -> np.ndarray:
    """Voxels of `mask` with at least one face neighbour outside it (the volume's border counts as outside)."""
    eroded = ndimage.binary_erosion(mask, structure=ndimage.generate_binary_structure(3, 1), border_value=0)
    return mask & ~eroded


def hd95(pred: np.ndarray, ref: np.ndarray, spacing: Sequence[float]) -> float:
    """95th-percentile Hausdorff distance in millimetres between two binary masks (X, Y, Z).

    Returns 0 when both are empty and NaN when exactly one is.
    """
    pred, ref = np.asarray(pred, bool), np.asarray(ref, bool)
    if not pred.any() and not ref.any():
        return 0.0
    if not pred.any() or not ref.any():
        return math.nan
    # Every surface voxel of both masks lies in their joint bounding box, so distances computed inside it
    # are exact; cropping keeps large volumes with small structures fast.
    coords = np.argwhere(pred | ref)
    box = tuple(slice(lo, hi + 1) for lo, hi in zip(coords.min(0), coords.max(0)))
    sp, sr = _surface(pred[box]), _surface(ref[box])
    to_ref = ndimage.distance_transform_edt(~sr, sampling=spacing)[sp]
    to_pred = ndimage.distance_transform_edt(~sp, sampling=spacing)[sr]
    return float(max(np.percentile(to_ref, 95), np.percentile(to_pred, 95)))


def case_metrics(
    pred: np.ndarray, ref: np.ndarray, num_classes: int, spacing: Sequence[float]
) -> list[dict[str, float]]:
    """Metrics of every foreground class of one case.

    Args:
        pred, ref: (X, Y, Z) integer label maps.
        num_classes: K, background included.
        spacing: voxel size in millimetres along X, Y, Z.

    Returns:
        one dict per class 1..K-1 with dice, iou, hd95_mm, pred_volume_ml, ref_volume_ml.
    """
    counts = confusion_counts(torch.as_tensor(pred), torch.as_tensor(ref), num_classes)
    dice, iou = dice_from_counts(counts), iou_from_counts(counts)
    voxel_ml = float(np.prod(spacing)) / 1000.0
    rows = []
    for k in range(1, num_classes):
        rows.append(
            {
                "dice": float(dice[k]),
                "iou": float(iou[k]),
                "hd95_mm": hd95(pred == k, ref == k, spacing),
                "pred_volume_ml": float(counts[k, 1]) * voxel_ml,
                "ref_volume_ml": float(counts[k, 2]) * voxel_ml,
            }
        )
    return rows
