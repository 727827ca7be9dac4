"""The plan: how every case is brought into one space, and the network and patch that fit that space.

Made once from the training cases' fingerprints (their spacing, shape and, for CT, foreground intensities),
as nnU-Net plans: orientation RAS; a target spacing by nnU-Net's rule (the median spacing per axis, the
coarsest axis at its 10th percentile when the data is strongly anisotropic); a crop to the non-zero
region; normalisation with dataset-wide foreground statistics for CT and per case for everything else;
and a patch and a topology (per-level kernels and strides) for the resampled median shape. The plan is
written to OUT/plan.json and into every checkpoint; evaluation and resumed runs apply exactly that plan.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from data.acquisitions import THICK, voxel_ratios
from data.geometry import (
    ANISOTROPY,
    IDENTITY_ORNT,
    canonical_ornt,
    nonzero_box,
    obliquity,
    reorient,
    reoriented_spacing,
    resampled_shape,
    spacing_of,
)
from unet3d.files import atomic_write_text
from unet3d.model import plan_topology

PLAN_VERSION = 1
FOREGROUND_SAMPLES = 10_000  # CT foreground intensities sampled per case for the dataset statistics
MAX_PLANNED_VOXELS = 2**31  # a case larger than this in the planned space (8 GiB per float32 channel) is refused
OBLIQUE_DEGREES = 30.0  # a training case this far off the scanner's axes is named in the pre-flight
ORIENTATIONS = ("RAS", "none")
CROPS = ("nonzero", "none")
ACQUISITION_CHANNELS = ("auto", "off")


@dataclass(frozen=True, kw_only=True)
class Fingerprint:
    """What planning needs of one training case, measured in the canonical orientation."""

    name: str
    spacing: tuple[float, float, float]  # voxel size after reorientation (mm)
    shape: tuple[int, int, int]  # spatial shape after reorientation and the crop
    foreground: dict[int, list[float]] = field(default_factory=dict)  # CT channel -> foreground intensity samples
    full_shape: tuple[int, int, int] | None = None  # spatial shape before the crop (None: not measured)
    cropped_labels: int = 0  # labelled voxels outside the crop's box, which the crop takes away
    obliquity: float | None = None  # degrees off the scanner's axes (`geometry.obliquity`; None: not measured)
    unoriented: bool = False  # the header records no orientation (qform and sform codes 0): nibabel's guess

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "spacing": list(self.spacing),
            "shape": list(self.shape),
            "foreground": {str(c): v for c, v in self.foreground.items()},
            "full_shape": list(self.full_shape) if self.full_shape is not None else None,
            "cropped_labels": self.cropped_labels,
            "obliquity": self.obliquity,
            "unoriented": self.unoriented,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Fingerprint:
        foreground = {int(c): list(v) for c, v in d["foreground"].items()}
        full = tuple(d["full_shape"]) if d.get("full_shape") is not None else None
        return cls(
            name=d["name"],
            spacing=tuple(d["spacing"]),
            shape=tuple(d["shape"]),
            foreground=foreground,
            full_shape=full,
            cropped_labels=int(d.get("cropped_labels", 0)),
            obliquity=float(d["obliquity"]) if d.get("obliquity") is not None else None,
            unoriented=bool(d.get("unoriented", False)),
        )

    @property
    def kept_by_crop(self) -> float | None:
        """The share of the volume's voxels that the crop keeps (None when the full shape was not measured)."""
        return math.prod(self.shape) / math.prod(self.full_shape) if self.full_shape else None


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """The options that shape a plan, and the device's budget for the patch and the network."""

    orientation: str = "RAS"  # RAS or none
    spacing: str | tuple[float, float, float] = "auto"  # auto (nnU-Net's rule), none (as stored) or given
    crop: str = "nonzero"  # nonzero or none
    patch_voxels: int  # the device's patch budget (its default patch's voxel count)
    widths: tuple[int, int]  # (channels of the first level, the most any level gets); doubled per level
    max_levels: int
    patch_size: tuple[int, int, int] | None = None  # given with --patch-size
    features: tuple[int, ...] | None = None  # given with --features (their count fixes the levels)
    acquisition_channel: str = "off"  # auto: an input channel of plane distances when some case is thick-slice


def fingerprint_arrays(
    name: str,
    image: np.ndarray,
    affine: np.ndarray,
    label: np.ndarray,
    modalities: Sequence[str],
    request: PlanRequest,
) -> Fingerprint:
    """Measure one case (image (C, X, Y, Z) and label as read, the image's affine) in the request's orientation
    and crop; CT channels contribute up to FOREGROUND_SAMPLES foreground intensities, drawn with a seed of
    the case's name."""
    ornt = canonical_ornt(affine) if request.orientation == "RAS" else IDENTITY_ORNT
    image = reorient(image, ornt)
    box = nonzero_box(image) if request.crop == "nonzero" else tuple((0, s) for s in image.shape[1:])
    rng = np.random.default_rng(int(hashlib.sha1(name.encode()).hexdigest()[:8], 16))
    foreground = {}
    where = label > 0
    labelled = reorient(where, ornt)
    inside = int(np.count_nonzero(labelled[tuple(slice(lo, hi) for lo, hi in box)]))
    for c, modality in enumerate(modalities):
        if modality.upper() == "CT" and where.any():
            values = np.asarray(image[c][labelled], dtype=np.float64)  # the foreground only
            take = rng.choice(len(values), min(len(values), FOREGROUND_SAMPLES), replace=False)
            foreground[c] = [float(v) for v in values[take]]
    return Fingerprint(
        name=name,
        spacing=reoriented_spacing(spacing_of(affine), ornt),
        shape=tuple(hi - lo for lo, hi in box),
        foreground=foreground,
        full_shape=tuple(int(s) for s in image.shape[1:]),
        cropped_labels=int(np.count_nonzero(labelled)) - inside,
        obliquity=obliquity(affine),
    )


def target_spacing(
    spacings: Sequence[Sequence[float]], shapes: Sequence[Sequence[int]]
) -> tuple[tuple[float, ...], str]:
    """nnU-Net's target spacing: the median spacing per axis, except that when the median's coarsest axis is
    more than ANISOTROPY times the others' spacing and its median voxel count over ANISOTROPY times fewer,
    that axis takes the 10th percentile of its spacings (kept above the other axes' spacing), so thick-slice
    cases are not blown up to the thin ones' resolution. Returns (spacing, the rule that applied)."""
    spacings = np.asarray(spacings, dtype=np.float64)
    sizes = np.median(np.asarray(shapes, dtype=np.float64), axis=0)
    target = np.median(spacings, axis=0)
    worst = int(np.argmax(target))
    others = [a for a in range(3) if a != worst]
    aniso_spacing = target[worst] > ANISOTROPY * max(target[a] for a in others)
    aniso_voxels = sizes[worst] * ANISOTROPY < min(sizes[a] for a in others)
    if not (aniso_spacing and aniso_voxels):
        return tuple(float(t) for t in target), "median"
    tenth = float(np.percentile(spacings[:, worst], 10))
    target[worst] = max(tenth, max(target[a] for a in others) + 1e-5)
    return tuple(float(t) for t in target), f"median, axis {worst} at its 10th percentile (anisotropic data)"


@dataclass(frozen=True, kw_only=True)
class Plan:
    orientation: str  # RAS: every case reoriented; none: used as stored
    spacing: tuple[float, float, float] | None  # the target spacing; None: every case keeps its own
    spacing_rule: str
    crop: str  # nonzero or none
    normalization: tuple[dict[str, Any], ...]  # per input channel
    median_shape: tuple[int, int, int]  # the training cases' median shape in the planned space
    median_spacing: tuple[float, float, float]  # the spacing the network was planned for
    patch_size: tuple[int, int, int]
    features: tuple[int, ...]
    kernels: tuple[tuple[int, int, int], ...]
    strides: tuple[tuple[int, int, int], ...]
    num_cases: int = 0
    version: int = PLAN_VERSION
    # the network gets one more input channel, last: each planned voxel's distance to its case's nearest
    # measured plane along a thick axis (`data.acquisitions.plane_distance`); plans without the key: none
    acquisition_channel: bool = False

    @property
    def extra_channels(self) -> int:
        """Input channels the plan adds to the images' own (the acquisition channel)."""
        return int(self.acquisition_channel)

    def model_args(self, in_channels: int, num_classes: int) -> dict[str, Any]:
        """UNet3D's arguments for this plan, for images of `in_channels` channels."""
        return {
            "in_channels": in_channels + self.extra_channels,
            "num_classes": num_classes,
            "features": list(self.features),
            "kernels": [list(k) for k in self.kernels],
            "strides": [list(s) for s in self.strides],
        }

    def preprocessing(self) -> dict[str, Any]:
        """The fields that decide the preprocessed arrays (the cache's key)."""
        return {
            "version": self.version,
            "orientation": self.orientation,
            "spacing": list(self.spacing) if self.spacing else None,
            "crop": self.crop,
            "normalization": [dict(n) for n in self.normalization],
            **({"acquisition_channel": True} if self.acquisition_channel else {}),  # older plans' keys unchanged
        }

    def digest(self) -> str:
        return hashlib.sha1(json.dumps(self.preprocessing(), sort_keys=True).encode()).hexdigest()[:10]

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.preprocessing(),
            "spacing_rule": self.spacing_rule,
            "median_shape": list(self.median_shape),
            "median_spacing": list(self.median_spacing),
            "network": {
                "patch_size": list(self.patch_size),
                "features": list(self.features),
                "kernels": [list(k) for k in self.kernels],
                "strides": [list(s) for s in self.strides],
            },
            "num_cases": self.num_cases,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        net = d["network"]
        return cls(
            orientation=d["orientation"],
            spacing=tuple(d["spacing"]) if d["spacing"] is not None else None,
            spacing_rule=d["spacing_rule"],
            crop=d["crop"],
            normalization=tuple(dict(n) for n in d["normalization"]),
            median_shape=tuple(d["median_shape"]),
            median_spacing=tuple(d["median_spacing"]),
            patch_size=tuple(net["patch_size"]),
            features=tuple(net["features"]),
            kernels=tuple(tuple(k) for k in net["kernels"]),
            strides=tuple(tuple(s) for s in net["strides"]),
            num_cases=d.get("num_cases", 0),
            version=d.get("version", PLAN_VERSION),
            acquisition_channel=bool(d.get("acquisition_channel", False)),
        )

    def write(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=2) + "\n")

    def describe(self) -> str:
        spacing = "as stored" if self.spacing is None else " x ".join(f"{s:.3g}" for s in self.spacing) + " mm"
        norms = ", ".join(_describe_normalization(n) for n in self.normalization)
        levels = " ".join("x".join(map(str, s)) for s in self.strides[1:])
        kernels = " ".join("x".join(map(str, k)) for k in self.kernels)
        return (
            f"plan: orientation {self.orientation}, spacing {spacing} ({self.spacing_rule}), crop {self.crop}, "
            f"normalisation {norms}; median shape {'x'.join(map(str, self.median_shape))}, patch "
            f"{'x'.join(map(str, self.patch_size))}, {len(self.features)} levels of {list(self.features)} channels, "
            f"kernels {kernels}, strides {levels}"
            + ("; input channel of distances to the measured planes" if self.acquisition_channel else "")
        )


def _describe_normalization(n: dict[str, Any]) -> str:
    if n["scheme"] == "ct":
        return f"{n['modality']}: clip {n['clip'][0]:.4g}..{n['clip'][1]:.4g}, mean {n['mean']:.4g}, std {n['std']:.4g}"
    return f"{n['modality']}: {n['scheme']}" + (" inside the non-zero mask" if n.get("mask") else "")


MASK_RULE = 0.75  # nnU-Net: z-score inside the non-zero mask when the crop keeps less than this share, median


def normalization_plan(modalities: Sequence[str], fingerprints: Sequence[Fingerprint]) -> tuple[dict[str, Any], ...]:
    """Per channel: CT with the dataset-wide foreground statistics (clip to the 0.5 and 99.5 percentiles of
    every training case's foreground intensities, then z-score with their mean and std, as nnU-Net); every
    other modality a z-score per case. Where the crop to the non-zero region keeps less than MASK_RULE of
    the median case (skull-stripped or masked MR, whose box still holds much exact zero), the z-score is
    taken inside the non-zero mask and the rest stays 0 (`"mask": true`), as nnU-Net's
    use_mask_for_norm: otherwise a case's statistics depend on how much of its box the organ fills."""
    kept = [f.kept_by_crop for f in fingerprints if f.kept_by_crop is not None]
    masked = bool(kept) and float(np.median(kept)) < MASK_RULE
    out = []
    for c, modality in enumerate(modalities):
        samples = [v for f in fingerprints for v in f.foreground.get(c, [])]
        if modality.upper() == "CT" and samples:
            values = np.asarray(samples, dtype=np.float64)
            lo, hi = np.percentile(values, [0.5, 99.5])
            out.append(
                {
                    "modality": modality,
                    "scheme": "ct",
                    "clip": [float(lo), float(hi)],
                    "mean": float(values.mean()),
                    "std": float(max(values.std(), 1e-8)),
                }
            )
        else:
            out.append({"modality": modality, "scheme": "zscore", **({"mask": True} if masked else {})})
    return tuple(out)


def legacy_plan(modalities: Sequence[str], patch_size: Sequence[int], features: Sequence[int]) -> Plan:
    """The plan of checkpoints written before plans existed: every case as stored, per-case normalisation
    (CT clipped to its own 0.5 and 99.5 percentiles), 3x3x3 kernels and stride 2 on every level."""
    levels = len(features)
    return Plan(
        orientation="none",
        spacing=None,
        spacing_rule="none (a checkpoint from before plans)",
        crop="none",
        normalization=tuple(
            {"modality": m, "scheme": "ct-per-case" if m.upper() == "CT" else "zscore"} for m in modalities
        ),
        median_shape=tuple(int(p) for p in patch_size),
        median_spacing=(1.0, 1.0, 1.0),
        patch_size=tuple(int(p) for p in patch_size),
        features=tuple(int(f) for f in features),
        kernels=((3, 3, 3),) * levels,
        strides=((1, 1, 1),) + ((2, 2, 2),) * (levels - 1),
    )


def make_plan(fingerprints: Sequence[Fingerprint], modalities: Sequence[str], request: PlanRequest) -> Plan:
    """The plan for these training cases (see the module's description)."""
    if not fingerprints:
        raise ValueError("cannot plan without training cases")
    spacings = [f.spacing for f in fingerprints]
    shapes = [f.shape for f in fingerprints]
    if request.spacing == "auto":
        spacing, rule = target_spacing(spacings, shapes)
    elif request.spacing == "none":
        spacing, rule = None, "none (every case keeps its own)"
    else:
        spacing, rule = tuple(float(s) for s in request.spacing), "given (--spacing)"
    planned_shapes = [resampled_shape(s, sp, spacing) if spacing else s for s, sp in zip(shapes, spacings)]
    largest = int(np.argmax([math.prod(s) for s in planned_shapes]))
    if math.prod(planned_shapes[largest]) > MAX_PLANNED_VOXELS:
        raise ValueError(
            f"at the target spacing {' x '.join(f'{v:g}' for v in spacing or ())} mm ({rule}), case "
            f"{fingerprints[largest].name} would be {'x'.join(map(str, planned_shapes[largest]))} voxels, more than "
            f"{MAX_PLANNED_VOXELS:.1e} (4 bytes each per channel): give a coarser --spacing"
        )
    median_shape = tuple(int(v) for v in np.median(np.asarray(planned_shapes), axis=0))
    median_spacing = spacing or tuple(float(v) for v in np.median(np.asarray(spacings), axis=0))
    patch, features, kernels, strides = plan_network(median_shape, median_spacing, request)
    thick = spacing is not None and any(max(voxel_ratios(sp, spacing)) >= THICK for sp in spacings)
    return Plan(
        orientation=request.orientation,
        spacing=spacing,
        spacing_rule=rule,
        crop=request.crop,
        normalization=normalization_plan(modalities, fingerprints),
        median_shape=median_shape,
        median_spacing=tuple(float(s) for s in median_spacing),
        patch_size=patch,
        features=features,
        kernels=tuple(kernels),
        strides=tuple(strides),
        num_cases=len(fingerprints),
        acquisition_channel=request.acquisition_channel == "auto" and thick,
    )


def plan_network(median_shape: Sequence[int], spacing: Sequence[float], request: PlanRequest):
    """(patch, features, kernels, strides) for the median case at `spacing` within the device's budget.

    The patch covers the median case when it fits the budget, else a box of (nearly) equal extent in
    millimetres on each axis, capped by the median case, of about `patch_voxels` voxels; the topology
    follows nnU-Net's rule (`plan_topology`), and the patch is rounded to what that topology accepts.
    """
    levels = len(request.features) if request.features else request.max_levels
    patch = request.patch_size or _patch_for(median_shape, spacing, request.patch_voxels)
    kernels, strides = plan_topology(spacing, patch, levels)
    if len(strides) < 2 and not request.features:
        raise ValueError(
            f"a patch of {[int(p) for p in patch]} voxels at {[round(float(s), 3) for s in spacing]} mm (the median "
            f"case in the planned space is {[int(m) for m in median_shape]}) allows no downsampling: a U-Net needs "
            "an axis of 8 or more voxels to halve; give a finer --spacing or a larger --patch-size"
        )
    if request.features and len(strides) < levels:
        raise ValueError(
            f"--features {list(request.features)} asks for {levels} levels, but a patch of "
            f"{[int(p) for p in patch]} at {[round(float(s), 3) for s in spacing]} mm allows {len(strides)}: "
            "give fewer features or a larger patch"
        )
    divisor = [math.prod(s[a] for s in strides) for a in range(3)]
    if request.patch_size is None:
        patch = tuple(max(d, int(round(p / d)) * d) for p, d in zip(patch, divisor))
    else:
        bad = [p for p, d in zip(patch, divisor) if p % d]
        if bad:
            raise ValueError(
                f"--patch-size {list(patch)}: each size must be divisible by {divisor} (the product of the planned "
                f"strides per axis, {len(strides)} levels)"
            )
    base, cap = request.widths
    features = request.features or tuple(min(base * 2**i, cap) for i in range(len(strides)))
    return tuple(int(p) for p in patch), tuple(features), kernels, strides


def _patch_for(median_shape: Sequence[int], spacing: Sequence[float], budget: int) -> tuple[int, int, int]:
    shape = np.asarray(median_shape, dtype=np.float64)
    if np.prod(shape) <= budget:
        return tuple(int(s) for s in shape)
    extent = 1.0 / np.asarray(spacing, dtype=np.float64)  # a cube in millimetres, in voxels per mm
    lo, hi = 0.0, float(max(shape / extent))
    for _ in range(60):  # the largest scale whose capped box fits the budget
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.prod(np.minimum(extent * mid, shape)) <= budget else (lo, mid)
    return tuple(max(1, int(round(v))) for v in np.minimum(extent * lo, shape))


def _first_ten(names: Sequence[str]) -> str:
    """The first ten of a warning's cases, and how many more there are."""
    more = f" and {len(names) - 10} more" if len(names) > 10 else ""
    return ", ".join(names[:10]) + more


def crop_losses(fingerprints: Sequence[Fingerprint]) -> str | None:
    """A warning naming the cases whose labels reach outside the image's non-zero box (mask and image
    disagree, e.g. a segmentation beyond the skull-stripping), which the crop removes; None when none do."""
    lossy = [f for f in fingerprints if f.cropped_labels > 0]
    if not lossy:
        return None
    named = _first_ten([f"{f.name} ({f.cropped_labels} voxels)" for f in lossy])
    return (
        f"{len(lossy)} training case(s) have labelled voxels outside the image's non-zero box, which the crop "
        f"removes from training: {named} (--crop none keeps them)"
    )


def unoriented_cases(fingerprints: Sequence[Fingerprint], orientation: str) -> str | None:
    """A warning naming the training cases whose header records no orientation (qform and sform codes both 0)
    when they are reoriented (`orientation` "RAS"): their affine is nibabel's fallback, which flips x, so a
    case stored in any other voxel order than the others would train mirrored; None when there are none."""
    if orientation != "RAS":
        return None
    unknown = [f.name for f in fingerprints if f.unoriented]
    if not unknown:
        return None
    return (
        f"{len(unknown)} training case(s) record no orientation (qform_code and sform_code 0), so their "
        f"reorientation to RAS rests on a guess (x flipped, as the old Analyze format stored it): "
        f"{_first_ten(unknown)}. Set their qform/sform from the scanner's data, or use --orientation none if "
        f"every case shares one voxel order"
    )


def oblique_cases(fingerprints: Sequence[Fingerprint], orientation: str) -> str | None:
    """A warning naming the training cases more than OBLIQUE_DEGREES off the scanner's axes when they are
    reoriented (`orientation` "RAS"): reorientation only permutes and flips axes, so scans near 45 degrees
    can be lined up with axes 90 degrees apart from each other; None when no case is that oblique."""
    if orientation != "RAS":
        return None
    tilted = sorted(
        (f for f in fingerprints if f.obliquity is not None and f.obliquity > OBLIQUE_DEGREES),
        key=lambda f: -f.obliquity,
    )
    if not tilted:
        return None
    named = _first_ten([f"{f.name} ({f.obliquity:.1f} degrees)" for f in tilted])
    return (
        f"{len(tilted)} training case(s) lie more than {OBLIQUE_DEGREES:g} degrees off the scanner's axes: "
        f"{named}. Reorientation to RAS only permutes and flips axes, so scans near 45 degrees may be "
        f"turned a whole axis against each other; resample them onto the scanner's axes before training, or "
        f"use --orientation none if every case shares one voxel order"
    )


def plan_differences(saved: Plan, fresh: Plan) -> list[str]:
    """What differs between a saved plan and the one the data gives now, in words."""
    a, b = saved.to_dict(), fresh.to_dict()
    keys = [key for key in a if key != "version" and a[key] != b[key]]
    return [f"{key} planned {a[key]}, the data now gives {b[key]}" for key in keys]
