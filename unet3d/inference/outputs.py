"""What evaluation writes: label maps (and probabilities) on the input's grid, metrics.csv, summary.json, the
per-class table; every file written atomically, so a stopped run leaves no half-written output."""

from __future__ import annotations

import csv
import gzip
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np

from unet3d.files import atomic_write, atomic_write_text

METRICS = ("dice", "iou", "hd95_mm", "pred_volume_ml", "ref_volume_ml")


def save_prediction(pred: np.ndarray, like: nib.Nifti1Image, path: Path) -> None:
    """uint8 label map with the input image's affine and header, so it overlays in ITK-SNAP or Slicer."""
    header = like.header.copy()
    header.set_data_dtype(np.uint8)
    out = nib.Nifti1Image(pred.astype(np.uint8), like.affine, header)
    out.header.set_slope_inter(1, 0)
    out.header["cal_min"], out.header["cal_max"] = 0, int(pred.max())
    data = out.to_bytes()
    atomic_write(path, lambda f: f.write(gzip.compress(data, compresslevel=6) if path.name.endswith(".gz") else data))


def save_probabilities(probs: np.ndarray, class_names: Sequence[str], path: Path) -> None:
    """(K, X, Y, Z) float16 probabilities on the input's grid, with the class names, as a compressed .npz."""
    half = probs.astype(np.float16, copy=False)  # already float16 from `to_native_probabilities`: no copy
    atomic_write(path, lambda f: np.savez_compressed(f, probabilities=half, class_names=np.array(list(class_names))))


def summarise(rows: list[dict[str, Any]], class_names: Sequence[str]) -> dict[str, Any]:
    """Per-class mean and std of every metric over cases, and mean_dice over foreground classes.

    An undefined HD95 (exactly one of prediction and reference empty) is left out of its mean and counted.
    """
    classes = {}
    for k, name in enumerate(class_names[1:], start=1):
        mine = [r for r in rows if r["class"] == k]
        stats: dict[str, Any] = {}
        for metric in METRICS:
            values = np.array([r[metric] for r in mine], dtype=np.float64)
            defined = values[~np.isnan(values)]
            stats[metric] = {
                "mean": float(defined.mean()) if len(defined) else None,
                "std": float(defined.std()) if len(defined) else None,
            }
        stats["hd95_undefined"] = int(sum(math.isnan(r["hd95_mm"]) for r in mine))
        classes[name] = stats
    dice = [c["dice"]["mean"] for c in classes.values() if c["dice"]["mean"] is not None]
    return {"mean_dice": float(np.mean(dice)) if dice else None, "classes": classes}


def rows_from_json(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metric rows read back from JSON (a shard's), where `plain` wrote an undefined value (NaN) as null: NaN
    again, so they are summarised and written like the rows of a single process."""
    return [{k: math.nan if k in METRICS and v is None else v for k, v in row.items()} for row in rows]


def print_table(summary: dict[str, Any], num_cases: int) -> None:
    def cell(stat: dict[str, Any]) -> str:
        return "n/a" if stat["mean"] is None else f"{stat['mean']:.4f} ± {stat['std']:.4f}"

    print(f"\n{'class':<16}{'Dice':>20}{'IoU':>20}{'HD95 (mm)':>20}{'HD95 undef.':>13}")
    for name, stats in summary["classes"].items():
        print(
            f"{name:<16}{cell(stats['dice']):>20}{cell(stats['iou']):>20}{cell(stats['hd95_mm']):>20}"
            f"{stats['hd95_undefined']:>13}"
        )
    print(f"{'mean Dice':<16}{summary['mean_dice']:>20.4f}   over {num_cases} case(s)")


def plain(value: Any) -> Any:
    """JSON-safe: NaN -> None, tuples -> lists."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def write_metrics(rows: list[dict[str, Any]], path: Path) -> None:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=["case", "class", "class_name", *METRICS])
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buffer.getvalue())


def write_json(value: Any, path: Path) -> None:
    atomic_write_text(path, json.dumps(plain(value), indent=2) + "\n")


SETTINGS_FILE = ".segmentation.json"  # in an --images output folder: what made the segmentations there
OVERWRITING = "overwriting"  # in the settings file while an --overwrite run has not finished


RECORDED_LATER = ("device",)  # settings an older record lacks


def claim_folder(folder: Path, settings: dict[str, Any], overwrite: bool) -> None:
    """Record in `folder` the settings that segment into it; refuse other settings than those that made the
    segmentations already there, which a run that skips the cases written would leave unchanged and
    describe as its own. `overwrite`: the new settings replace the old ones (every case is segmented again),
    marked as unfinished until `release_folder`: a folder an --overwrite run left half done holds cases of
    two settings, and only another --overwrite run may continue it.

    Raises:
        ValueError: naming the folder and each setting that differs, unless `overwrite`.
    """
    path = folder / SETTINGS_FILE
    if path.is_file() and not overwrite and any(folder.glob("*.nii.gz")):  # (settings that wrote nothing: free)
        try:
            before = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            before = {}
        if before.pop(OVERWRITING, False):
            raise ValueError(
                f"an --overwrite run into {folder} did not finish, so its segmentations are of two settings: run "
                "it again with --overwrite"
            )
        now = plain(settings)
        for key in RECORDED_LATER:  # a record written before the key was: taken to match
            if key not in before and key in now:
                before[key] = now[key]
        if before != now:
            differ = [
                f"{k} (then {before.get(k)!r}, now {now.get(k)!r})"
                for k in sorted(set(before) | set(now))
                if before.get(k) != now.get(k)
            ]
            raise ValueError(
                f"{folder} holds segmentations made with other settings ({'; '.join(differ)}); give another "
                "--out-dir, or --overwrite to segment every case again"
            )
    folder.mkdir(parents=True, exist_ok=True)
    write_json({**settings, OVERWRITING: True} if overwrite else settings, path)


def release_folder(folder: Path) -> None:
    """An --overwrite run has been through every case: its settings are the folder's, as any run's."""
    path = folder / SETTINGS_FILE
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return
    if saved.pop(OVERWRITING, False):
        write_json(saved, path)
