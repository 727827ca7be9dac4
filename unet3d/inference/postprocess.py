"""Post-processing chosen on cross-validation, as nnU-Net does: per class, keep only the largest connected
component when that raises the class's cross-validation Dice, decided from the folds' own predictions."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import ndimage

from unet3d.files import atomic_write_text
from unet3d.inference.metrics import confusion_counts, dice_from_counts


def largest_component(pred: np.ndarray, k: int) -> np.ndarray:
    """`pred` with every voxel of class `k` outside its largest connected component (26-connected) set to
    background."""
    mask = pred == k
    components, count = ndimage.label(mask, structure=np.ones((3, 3, 3), bool))
    if count <= 1:
        return pred
    sizes = np.bincount(components.ravel())
    sizes[0] = 0
    out = pred.copy()
    out[mask & (components != int(np.argmax(sizes)))] = 0
    return out


def apply(pred: np.ndarray, rules: dict[str, Any], class_names: Sequence[str]) -> np.ndarray:
    """A label map with the chosen rules applied: `rules["largest_component"]` names the classes."""
    for name in rules.get("largest_component", []):
        pred = largest_component(pred, class_names.index(name))
    return pred


def _dice(pred: np.ndarray, ref: np.ndarray, num_classes: int) -> torch.Tensor:
    return dice_from_counts(confusion_counts(torch.as_tensor(pred), torch.as_tensor(ref), num_classes))


def decide(cases: Iterable[tuple[np.ndarray, np.ndarray]], class_names: Sequence[str]) -> dict[str, Any]:
    """From (prediction, reference) of every cross-validation case: the classes whose mean Dice over the cases
    rises when only their largest component is kept, with the Dice before and after."""
    num_classes = len(class_names)
    before: list[list[float]] = [[] for _ in range(num_classes)]
    after: list[list[float]] = [[] for _ in range(num_classes)]
    for pred, ref in cases:
        plain = _dice(pred, ref, num_classes)
        for k in range(1, num_classes):
            before[k].append(float(plain[k]))
            after[k].append(float(_dice(largest_component(pred, k), ref, num_classes)[k]))
    chosen, dice = [], {}
    for k in range(1, num_classes):
        b, a = float(np.mean(before[k])), float(np.mean(after[k]))
        dice[class_names[k]] = {"without": b, "with": a}
        if a > b:
            chosen.append(class_names[k])
    return {"largest_component": chosen, "cross_validation_dice": dice, "num_cases": len(before[1])}


def write(rules: dict[str, Any], path: str | Path) -> None:
    atomic_write_text(path, json.dumps(rules, indent=2) + "\n")


def read(path: str | Path, class_names: Sequence[str], check: Callable[[str], None]) -> dict[str, Any]:
    """A post-processing file, its classes checked against the model's (`check` raises with a message)."""
    try:
        rules = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--postprocess {path}: cannot read it ({e})") from e
    unknown = [n for n in rules.get("largest_component", []) if n not in class_names]
    if unknown:
        check(f"--postprocess {path}: classes {unknown} are not the model's {list(class_names)}")
    return rules
