"""The Medical Segmentation Decathlon layout: dataset.json, imagesTr/, labelsTr/, imagesTs/ (labelsTs/)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

NIFTI_SUFFIXES = (".nii.gz", ".nii")


@dataclass(frozen=True)
class Case:
    """One image and, where it exists, its label map."""

    name: str  # file name without the NIfTI suffix: "la_003"
    image: Path
    label: Path | None


@dataclass(frozen=True)
class DatasetSpec:
    """What dataset.json says, with paths resolved against the dataset folder."""

    root: Path
    labels: dict[int, str]  # class index -> name, 0 = background, contiguous
    modality: dict[int, str]  # input channel -> modality ("CT", "MRI", "T2", ...)
    training: tuple[Case, ...]
    test: tuple[Case, ...]

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    @property
    def in_channels(self) -> int:
        return len(self.modality)

    @property
    def modalities(self) -> list[str]:
        """One modality name per input channel, in channel order (what normalisation goes by)."""
        return [self.modality[i] for i in range(self.in_channels)]

    @property
    def class_names(self) -> list[str]:
        return [self.labels[i] for i in range(self.num_classes)]


def case_name(path: str | Path) -> str:
    """'./imagesTr/la_003.nii.gz' -> 'la_003'."""
    name = Path(path).name
    for suffix in NIFTI_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    raise ValueError(f"{path} is not a NIfTI file (.nii or .nii.gz)")


def _index_map(raw: object, what: str, source: Path) -> dict[int, str]:
    """{"0": "background", ...} (MSD) or {"background": 0, ...} (nnU-Net v2) -> {0: "background", ...}."""
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{source}: '{what}' must be a non-empty object, got {raw!r}")
    try:
        if all(isinstance(v, int) for v in raw.values()):
            mapping = {int(v): str(k) for k, v in raw.items()}
        else:
            mapping = {int(k): str(v) for k, v in raw.items()}
    except (TypeError, ValueError) as e:
        raise ValueError(f"{source}: '{what}' keys must be integers, got {sorted(raw)}") from e
    if sorted(mapping) != list(range(len(mapping))):
        raise ValueError(f"{source}: '{what}' indices must be 0..{len(mapping) - 1}, got {sorted(mapping)}")
    return mapping


def _resolve(root: Path, rel: str) -> Path:
    """`rel` against the dataset folder, absolute, without following symbolic links: a case is named by the file
    dataset.json lists, not by the one a link points to (git-annex, DataLad and DVC keep files under hashes)."""
    return Path(os.path.abspath(root / rel))


def load_dataset_json(data_dir: str | Path, require_files: bool = True) -> DatasetSpec:
    """Parse `data_dir/dataset.json`; with `require_files`, every listed image and label must exist.

    Raises:
        FileNotFoundError: no dataset.json, or listed files that are missing (all of them named).
        ValueError: malformed JSON or fields.
    """
    root = Path(data_dir)
    source = root / "dataset.json"
    if not source.is_file():
        raise FileNotFoundError(f"no dataset.json in {root} (expected the Medical Segmentation Decathlon layout)")
    try:
        meta = json.loads(source.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{source} is not valid JSON: {e}") from e
    if not isinstance(meta, dict):
        raise ValueError(f"{source} must hold a JSON object")
    labels = _index_map(meta.get("labels"), "labels", source)
    if len(labels) < 2:
        raise ValueError(f"{source}: 'labels' needs background and at least one class, got {labels}")
    modality = _index_map(meta.get("modality", meta.get("channel_names")), "modality", source)
    entries = meta.get("training")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{source}: 'training' must be a non-empty list of {{'image', 'label'}} pairs")
    training = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not {"image", "label"} <= entry.keys():
            raise ValueError(f"{source}: training[{i}] must have 'image' and 'label', got {entry!r}")
        if not all(isinstance(entry[k], str) and entry[k] for k in ("image", "label")):
            raise ValueError(f"{source}: training[{i}] must give 'image' and 'label' as file paths, got {entry!r}")
        image = _resolve(root, entry["image"])
        training.append(Case(case_name(image), image, _resolve(root, entry["label"])))
    listed = meta.get("test")
    if listed is not None and not isinstance(listed, list):  # null (or absent): no test images
        raise ValueError(f"{source}: 'test' must be a list of image paths, got {listed!r}")
    test = []
    for i, rel in enumerate(listed or []):
        if isinstance(rel, dict):
            rel = rel.get("image")
        if not isinstance(rel, str) or not rel:
            raise ValueError(f"{source}: test[{i}] must be an image path (or {{'image': path}}), got {listed[i]!r}")
        image = _resolve(root, rel)
        label = root / "labelsTs" / image.name
        test.append(Case(case_name(image), image, label if label.is_file() else None))
    names = [c.name for c in training]
    if len(set(names)) != len(names):
        raise ValueError(f"{source}: training case names are not unique")
    missing = [str(p) for c in training for p in (c.image, c.label) if not p.is_file()]
    missing += [str(c.image) for c in test if not c.image.is_file()]
    if missing and require_files:
        raise FileNotFoundError(f"{source} lists {len(missing)} missing file(s): " + ", ".join(missing))
    return DatasetSpec(root, labels, modality, tuple(training), tuple(test))


def split_cases(cases: Sequence[Case], val_fraction: float, seed: int) -> tuple[list[Case], list[Case]]:
    """Hold out round(val_fraction * n) cases (at least one when val_fraction > 0) for validation.

    The split depends only on the case names, the fraction and the seed, so evaluation can rebuild it.
    """
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    ordered = sorted(cases, key=lambda c: c.name)
    n_val = max(1, round(val_fraction * len(ordered))) if val_fraction > 0 else 0
    if n_val >= len(ordered):
        raise ValueError(
            f"--val-fraction {val_fraction} holds out {n_val} of {len(ordered)} cases, leaving none to train on; "
            "lower it"
        )
    order = np.random.default_rng(seed).permutation(len(ordered))
    val_idx = set(order[:n_val].tolist())
    train = [c for i, c in enumerate(ordered) if i not in val_idx]
    val = [c for i, c in enumerate(ordered) if i in val_idx]
    return train, val


def fold_cases(cases: Sequence[Case], folds: int, fold: str, seed: int) -> tuple[list[Case], list[Case]]:
    """Cross-validation: (training, validation) cases of fold `fold` ("0".."folds-1") of `folds`, or every
    case for training and none for validation with fold "all".

    The cases, sorted by name, are shuffled by `seed` and dealt into `folds` parts of sizes differing by one
    at most: fold k validates on part k. The split depends only on the names, `folds` and `seed`.
    """
    ordered = sorted(cases, key=lambda c: c.name)
    if fold == "all":
        return ordered, []
    k = int(fold)
    if not 2 <= folds <= len(ordered):
        raise ValueError(f"--folds {folds}: needs 2 to {len(ordered)} folds for {len(ordered)} cases")
    if not 0 <= k < folds:
        raise ValueError(f"--fold {fold}: must be all or 0..{folds - 1}")
    order = np.random.default_rng(seed).permutation(len(ordered))
    val_idx = set(order[k::folds].tolist())
    return [c for i, c in enumerate(ordered) if i not in val_idx], [c for i, c in enumerate(ordered) if i in val_idx]


def run_split(cases: Sequence[Case], val_fraction: float, seed: int, fold: str | None, folds: int):
    """The training run's (training, validation) cases: a fold when `fold` is given, else a held-out share."""
    return fold_cases(cases, folds, fold, seed) if fold is not None else split_cases(cases, val_fraction, seed)
