"""Metrics against hand-built geometry, and the conventions for empty masks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from evaluate import summarise
from unet3d.inference.metrics import case_metrics, confusion_counts, dice_from_counts, hd95, iou_from_counts


def box(shape=(40, 40, 40), lo=(10, 10, 10), size=(10, 10, 10)) -> np.ndarray:
    mask = np.zeros(shape, bool)
    mask[tuple(slice(a, a + s) for a, s in zip(lo, size))] = True
    return mask


@pytest.mark.parametrize(
    ("axis", "k", "spacing"), [(2, 3, (1.0, 1.0, 2.5)), (0, 2, (0.8, 1.0, 3.0)), (1, 1, (1, 1, 1))]
)
def test_boxes_offset_by_k_voxels(axis, k, spacing):
    a = box()
    lo = [10, 10, 10]
    lo[axis] += k
    b = box(lo=tuple(lo))
    # Overlap is (10 - k) slices of 100 voxels: Dice = 2 (10 - k) 100 / 2000, IoU = (10 - k) / (10 + k).
    counts = confusion_counts(torch.from_numpy(a.astype(np.uint8)), torch.from_numpy(b.astype(np.uint8)), 2)
    assert dice_from_counts(counts)[1].item() == pytest.approx((10 - k) / 10)
    assert iou_from_counts(counts)[1].item() == pytest.approx((10 - k) / (10 + k))
    # The end faces (a fifth of each surface) are k voxels apart along `axis`: the 95th percentile is k * spacing.
    assert hd95(a, b, spacing) == pytest.approx(k * spacing[axis])
    assert hd95(b, a, spacing) == pytest.approx(k * spacing[axis])


def test_hd95_ignores_a_few_outlying_voxels_but_hausdorff_would_not():
    a = box()
    b = a.copy()
    b[38, 38, 38] = True  # one stray voxel far away
    assert hd95(a, b, (1, 1, 1)) == 0.0


def test_hd95_uses_spacing_not_voxels():
    a, b = box(), box(lo=(14, 10, 10))
    assert hd95(a, b, (2.0, 1.0, 1.0)) == pytest.approx(8.0)
    assert hd95(a, b, (0.5, 1.0, 1.0)) == pytest.approx(2.0)


def test_empty_mask_conventions():
    empty = np.zeros((10, 10, 10), bool)
    full = box((10, 10, 10), (2, 2, 2), (4, 4, 4))
    assert hd95(empty, empty, (1, 1, 1)) == 0.0
    assert math.isnan(hd95(empty, full, (1, 1, 1))) and math.isnan(hd95(full, empty, (1, 1, 1)))
    pred = np.zeros((10, 10, 10), np.uint8)
    ref = np.zeros((10, 10, 10), np.uint8)
    ref[full] = 2  # class 1 absent from both, class 2 missed entirely
    rows = case_metrics(pred, ref, 3, (1.0, 1.0, 2.0))
    assert rows[0] == {"dice": 1.0, "iou": 1.0, "hd95_mm": 0.0, "pred_volume_ml": 0.0, "ref_volume_ml": 0.0}
    assert rows[1]["dice"] == 0.0 and rows[1]["iou"] == 0.0 and math.isnan(rows[1]["hd95_mm"])
    assert rows[1]["ref_volume_ml"] == pytest.approx(64 * 2.0 / 1000)


def test_summary_leaves_undefined_hd95_out_and_counts_it():
    rows = [
        {"case": "a", "class": 1, "dice": 0.8, "iou": 0.6, "hd95_mm": 2.0, "pred_volume_ml": 1, "ref_volume_ml": 1},
        {
            "case": "b",
            "class": 1,
            "dice": 0.0,
            "iou": 0.0,
            "hd95_mm": math.nan,
            "pred_volume_ml": 0,
            "ref_volume_ml": 1,
        },
        {"case": "a", "class": 2, "dice": 1.0, "iou": 1.0, "hd95_mm": 0.0, "pred_volume_ml": 0, "ref_volume_ml": 0},
        {"case": "b", "class": 2, "dice": 0.5, "iou": 0.3, "hd95_mm": 4.0, "pred_volume_ml": 2, "ref_volume_ml": 1},
    ]
    summary = summarise(rows, ["background", "x", "y"])
    x, y = summary["classes"]["x"], summary["classes"]["y"]
    assert x["dice"]["mean"] == pytest.approx(0.4) and x["hd95_mm"]["mean"] == 2.0 and x["hd95_undefined"] == 1
    assert y["hd95_mm"]["mean"] == 2.0 and y["hd95_undefined"] == 0
    assert summary["mean_dice"] == pytest.approx((0.4 + 0.75) / 2), "mean over classes of each class's mean"
