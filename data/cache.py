"""Preprocessing cache: each case decoded from NIfTI and normalised once into uncompressed .npy files.

Training opens them as read-only memory maps, so every rank and DataLoader worker on a machine shares one
copy through the page cache instead of decompressing NIfTI or holding its own arrays. Foreground voxel
locations are stored beside them. A case is rebuilt when its source files change (size or mtime), when
the modalities change, or when the cache format changes.

Files per case: NAME_image.npy (C, X, Y, Z) float32, NAME_label.npy (X, Y, Z) uint8, NAME_fg.npy (N, 4)
int32 rows of (class, x, y, z), and NAME.json, written last, which marks the case complete.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from data.check import case_problems
from data.msd import Case
from data.nifti import load_image, load_label, normalize
from data.patches import PreparedCase, foreground_coords
from unet3d.files import atomic_write, atomic_write_text

CACHE_VERSION = 2


def _stamp(case: Case, modalities: Sequence[str], num_classes: int) -> dict:
    files = [case.image, case.label]
    return {
        "version": CACHE_VERSION,
        "modalities": list(modalities),
        "num_classes": num_classes,
        "sources": [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in files],
    }


def _paths(cache_dir: Path, name: str) -> dict[str, Path]:
    return {
        "image": cache_dir / f"{name}_image.npy",
        "label": cache_dir / f"{name}_label.npy",
        "fg": cache_dir / f"{name}_fg.npy",
        "meta": cache_dir / f"{name}.json",
    }


def is_fresh(case: Case, modalities: Sequence[str], num_classes: int, cache_dir: str | Path) -> bool:
    """Whether the cached files of `case` exist and were made (and checked) from its current source files."""
    paths = _paths(Path(cache_dir), case.name)
    try:
        meta = json.loads(paths["meta"].read_text())
    except (OSError, ValueError):
        return False
    try:
        stamp = _stamp(case, modalities, num_classes)
    except OSError:
        return False
    return meta.get("stamp") == stamp and all(p.is_file() for p in paths.values())


def _save_npy(path: Path, array: np.ndarray) -> None:
    atomic_write(path, lambda f: np.save(f, array))


def write_case(case: Case, modalities: Sequence[str], num_classes: int, cache_dir: str | Path) -> None:
    """Decode, check (`data.check.case_problems`) and normalise one case; write its cache files, meta last.

    Raises:
        ValueError: naming every problem of the case with its file.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    image, image_nii = load_image(case.image)
    label, label_nii = load_label(case.label)
    problems = case_problems(case, image, image_nii, label, label_nii, num_classes)
    if problems:
        raise ValueError("; ".join(problems))
    fg = foreground_coords(label)
    rows = [np.column_stack([np.full(len(c), k, np.int32), c]) for k, c in sorted(fg.items())]
    paths = _paths(cache_dir, case.name)
    _save_npy(paths["image"], normalize(image, modalities))
    _save_npy(paths["label"], label)
    _save_npy(paths["fg"], np.concatenate(rows) if rows else np.zeros((0, 4), np.int32))
    meta = {"stamp": _stamp(case, modalities, num_classes), "shape": list(label.shape), "channels": image.shape[0]}
    atomic_write_text(paths["meta"], json.dumps(meta))


def build_cache(
    cases: Sequence[Case],
    modalities: Sequence[str],
    num_classes: int,
    cache_dir: str | Path,
    shard: int = 0,
    num_shards: int = 1,
) -> list[str]:
    """Write the stale cases of shard `shard` of `num_shards` (cases[shard::num_shards]).

    Returns one message per case that could not be prepared (empty when all went well), so the caller
    can gather every rank's problems and report them together.
    """
    errors = []
    for case in list(cases)[shard::num_shards]:
        try:
            if not is_fresh(case, modalities, num_classes, cache_dir):
                write_case(case, modalities, num_classes, cache_dir)
        except (OSError, ValueError) as e:
            errors.append(f"{case.name}: {e}")
    return errors


def open_case(case: Case, cache_dir: str | Path) -> PreparedCase:
    """The cached case as read-only memory maps (FileNotFoundError if it was never built)."""
    paths = _paths(Path(cache_dir), case.name)
    if not paths["meta"].is_file():
        raise FileNotFoundError(f"case {case.name} is not in the cache {cache_dir}; build_cache first")
    fg = np.load(paths["fg"])
    coords = {int(k): fg[fg[:, 0] == k, 1:] for k in np.unique(fg[:, 0])}
    return PreparedCase(
        case.name, np.load(paths["image"], mmap_mode="r"), np.load(paths["label"], mmap_mode="r"), coords
    )
