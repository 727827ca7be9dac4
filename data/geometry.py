"""Where voxels are in the world: canonical orientation, voxel spacing, cropping and resampling, and the
record (`Geometry`) that takes a prediction back to the scanner's grid exactly.

Orientation is changed by axis permutations and flips only (no interpolation), to RAS: along the first
array axis the world position moves towards the patient's right (R), along the second towards anterior
(A), along the third towards superior (S), whatever order and direction the scanner wrote. Resampling
uses PyTorch's interpolation one channel or class at a time, so a large CT needs a few times its own
memory, not one copy per class.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import nibabel as nib
import numpy as np
import torch
import torch.nn.functional as F

AFFINE_ATOL_MM = 1e-3  # image and label affines may differ by rounding, not by geometry
AFFINE_RTOL = 1e-4
SHEAR_TOLERANCE = 1e-3  # |cosine| between two voxel axes above this is shear, not rounding
ANISOTROPY = 3.0  # an axis this many times coarser than the finest is resampled on its own (nnU-Net)
SLICES_PER_PASS = 16  # planes interpolated at once when an axis is resampled on its own


def spacing_of(affine: np.ndarray) -> tuple[float, float, float]:
    """Voxel size in millimetres along the three array axes: the lengths of the affine's columns."""
    return tuple(float(v) for v in np.linalg.norm(np.asarray(affine)[:3, :3], axis=0))


def affine_problems(affine: np.ndarray, shape: Sequence[int], path: object) -> list[str]:
    """Everything that makes a volume's geometry unusable: a 2D image, non-finite or zero voxel sizes, a
    singular or sheared affine. Oblique (rotated) acquisitions are fine."""
    problems = []
    if len(shape) < 3 or min(shape[:3]) < 2:
        problems.append(f"{path}: spatial shape {tuple(shape[:3])} is not a 3D volume (2 voxels or more per axis)")
    matrix = np.asarray(affine, dtype=np.float64)[:3, :3]
    if not np.isfinite(affine).all():
        return problems + [f"{path}: the affine holds NaN or infinite values"]
    sizes = np.linalg.norm(matrix, axis=0)
    if (sizes <= 1e-6).any():
        return problems + [f"{path}: voxel size {tuple(np.round(sizes, 6))} mm has a zero axis"]
    if abs(np.linalg.det(matrix)) < 1e-9 * np.prod(sizes):
        return problems + [f"{path}: the affine is singular (its voxel axes are not independent)"]
    unit = matrix / sizes
    cosines = np.abs(unit.T @ unit - np.eye(3))
    if cosines.max() > SHEAR_TOLERANCE:
        problems.append(
            f"{path}: the affine is sheared (voxel axes at {math.degrees(math.asin(min(1.0, cosines.max()))):.1f}"
            " degrees from orthogonal); resample it to an orthogonal grid first"
        )
    return problems


def same_grid(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two affines place their voxels at the same world positions (up to rounding)."""
    return bool(np.allclose(a, b, atol=AFFINE_ATOL_MM, rtol=AFFINE_RTOL))


def canonical_ornt(affine: np.ndarray) -> np.ndarray:
    """The permutation and flips (nibabel's `ornt`, (3, 2)) that bring an array to RAS axis order."""
    return nib.orientations.ornt_transform(
        nib.orientations.io_orientation(affine), nib.orientations.axcodes2ornt("RAS")
    )


def obliquity(affine: np.ndarray) -> float:
    """Degrees: the largest angle between a voxel axis and the world axis that `canonical_ornt` lines it up
    with; 0 for a scan on the scanner's axes, 20 for one turned 20 degrees about one axis. Near 45 degrees,
    two scans turned a few degrees apart can be lined up with axes 90 degrees apart."""
    axes = np.asarray(affine, dtype=np.float64)[:3, :3]
    axes = axes / np.linalg.norm(axes, axis=0)
    world = nib.orientations.io_orientation(affine)[:, 0].astype(int)
    cosines = np.abs(axes[world, np.arange(3)])
    return float(np.degrees(np.arccos(np.clip(cosines.min(), 0.0, 1.0))))


IDENTITY_ORNT = np.array([[0, 1], [1, 1], [2, 1]], dtype=np.float64)


def reorient(volume: np.ndarray, ornt: np.ndarray) -> np.ndarray:
    """Apply `ornt` (from `canonical_ornt`) to the last three axes of `volume` ((..., X, Y, Z)): a view."""
    lead = volume.ndim - 3
    for axis, flip in enumerate(ornt[:, 1]):
        if flip == -1:
            volume = np.flip(volume, lead + axis)
    order = [lead + int(i) for i in np.argsort(ornt[:, 0])]
    return volume.transpose(*range(lead), *order)


def undo_reorient(volume: np.ndarray, ornt: np.ndarray) -> np.ndarray:
    """The inverse of `reorient`: back to the file's own axis order and directions."""
    return reorient(volume, nib.orientations.ornt_transform(IDENTITY_ORNT, ornt))


def reoriented_spacing(spacing: Sequence[float], ornt: np.ndarray) -> tuple[float, float, float]:
    """Voxel sizes after `reorient`: the same sizes, permuted."""
    out = [0.0, 0.0, 0.0]
    for axis, (target, _) in enumerate(ornt):
        out[int(target)] = float(spacing[axis])
    return tuple(out)


def nonzero_box(image: np.ndarray) -> tuple[tuple[int, int], ...]:
    """The bounding box ((lo, hi) per spatial axis) of the voxels where any channel of `image` (C, X, Y, Z)
    is non-zero (nnU-Net's crop); the whole volume when nothing is."""
    mask = np.any(image != 0, axis=0)
    if not mask.any():
        return tuple((0, s) for s in mask.shape)
    box = []
    for axis in range(3):
        hit = np.flatnonzero(np.any(mask, axis=tuple(a for a in range(3) if a != axis)))
        box.append((int(hit[0]), int(hit[-1]) + 1))
    return tuple(box)


def resampled_shape(shape: Sequence[int], spacing: Sequence[float], target: Sequence[float]) -> tuple[int, int, int]:
    """The voxel counts that cover the same extent at the target spacing (at least one per axis)."""
    return tuple(max(1, int(round(n * s / t))) for n, s, t in zip(shape, spacing, target))


def separate_axis(spacing: Sequence[float], target: Sequence[float]) -> int | None:
    """The thick axis to resample on its own (the planes across it first, then along it), as nnU-Net does when
    the source or the target spacing is anisotropic (coarsest axis over ANISOTROPY times the finest); else None."""
    for spacings in (spacing, target):
        if max(spacings) > ANISOTROPY * min(spacings):
            return int(np.argmax(spacings))
    return None


def _buffer(work: dict | None, name: str, shape: Sequence[int], device: torch.device) -> torch.Tensor:
    """An uninitialised float32 tensor of `shape` on `device`, kept in `work` for the next call of the same
    shape (a large fresh allocation costs its page faults again, as much as the interpolation)."""
    shape = tuple(int(s) for s in shape)
    if work is not None:
        held = work.get(name)
        if held is not None and tuple(held.shape) == shape and held.device == device:
            return held
    out = torch.empty(shape, dtype=torch.float32, device=device)
    if work is not None:
        work[name] = out
    return out


def _resize(volume: torch.Tensor, shape: Sequence[int], axis: int | None, work: dict | None = None) -> torch.Tensor:
    """(N, X, Y, Z) of any dtype -> (N, *shape) float32: trilinear, or with `axis` the planes across it first,
    then along it (the input converted a few planes at a time: a uint8 mask needs no float copy).

    With `work` (a dict the caller keeps across calls of one shape), the thick-axis path writes into buffers
    held there and returns a view of one: valid until the next call with the same `work`."""
    shape = tuple(int(s) for s in shape)
    if tuple(volume.shape[1:]) == shape:
        return volume.float()
    if axis is None:
        return F.interpolate(volume[None].float(), size=shape, mode="trilinear", align_corners=False)[0]
    moved = volume.movedim(axis + 1, 1)  # (N, A, P, Q): planes along the thick axis
    n, a = moved.shape[:2]
    plane = [s for i, s in enumerate(shape) if i != axis]
    planes = _buffer(work, "planes", (n, a, *plane), volume.device)
    for i in range(0, a, SLICES_PER_PASS):  # a few planes at a time: no full-size copy of the input
        chunk = moved[:, i : i + SLICES_PER_PASS]
        flat = chunk.reshape(-1, 1, *chunk.shape[2:]).float()
        planes[:, i : i + SLICES_PER_PASS] = F.interpolate(
            flat, size=plane, mode="bilinear", align_corners=False
        ).reshape(n, -1, *plane)
    # then linearly along the thick axis, from the two nearest planes: nnU-Net takes the nearest plane here,
    # but linear measured better on thick-slice data (benchmarks/geometry.py on the first synthetic generator:
    # 0.954 against 0.942 test Dice, one run each)
    x = ((torch.arange(shape[axis], dtype=torch.float64) + 0.5) * a / shape[axis] - 0.5).clamp(0, a - 1)
    lo = x.floor().long()
    hi = (lo + 1).clamp(max=a - 1)
    w = (x - lo).to(planes.dtype).view(1, -1, 1, 1).to(planes.device)
    lo, hi = lo.to(planes.device), hi.to(planes.device)
    out = _buffer(work, "out", (n, shape[axis], *plane), volume.device)
    torch.index_select(planes, 1, lo, out=out)
    for j in range(0, shape[axis], SLICES_PER_PASS):  # in place, the upper planes a few at a time
        part = slice(j, j + SLICES_PER_PASS)
        out[:, part].lerp_(planes.index_select(1, hi[part]), w[:, part])
    return out.movedim(1, axis + 1)


def resample_image(image: np.ndarray, shape: Sequence[int], axis: int | None, extra: int = 0) -> np.ndarray:
    """(C, X, Y, Z) float32 -> (C + extra, *shape) float32, one channel at a time; the `extra` channels last
    are left for the caller to fill (one array: no copy to append them)."""
    if tuple(image.shape[1:]) == tuple(shape) and not extra:
        return np.ascontiguousarray(image, dtype=np.float32)
    out = np.empty((image.shape[0] + extra, *shape), np.float32)
    work: dict = {}  # the interpolation's buffers, reused from channel to channel
    for c in range(image.shape[0]):
        channel = torch.from_numpy(np.ascontiguousarray(image[c], dtype=np.float32))[None]
        out[c] = _resize(channel, shape, axis, work)[0].numpy()
    return out


def resample_label(label: np.ndarray, shape: Sequence[int], axis: int | None, num_classes: int) -> np.ndarray:
    """(X, Y, Z) labels -> (*shape) uint8: each class's mask interpolated as a probability, the most likely
    class kept, so no class is invented between two others (nnU-Net resamples segmentations this way)."""
    shape = tuple(int(s) for s in shape)
    if tuple(label.shape) == shape:
        return np.ascontiguousarray(label, dtype=np.uint8)
    return _argmax_resampled(_masks(label), num_classes, shape, axis)


def resample_label_shares(
    label: np.ndarray, shape: Sequence[int], axis: int | None, num_classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """`resample_label`, and what the argmax throws away: per planned voxel the runner-up class and its share of
    the two leading classes, as `data.patches` stores soft training targets.

    Where the planned grid is coarser than the case's own along some axis, a planned voxel on a boundary
    holds parts of two classes; its hard label puts the boundary on the planned grid, and a prediction that
    reproduces it, resampled back to the finer grid, misses the boundary by up to half a planned voxel
    (on the mixed synthetic data's 0.8 mm axial scans planned at 1 x 0.9 mm, 0.022 Dice before any
    learning). With the shares the network can learn where inside the voxel the boundary lies.

    Returns:
        label (*shape) uint8, and (2, *shape) uint8: the runner-up class and its share p2 / (p1 + p2) of the
        two leading interpolated masks in 255ths (0 where one class fills the voxel, or no resampling).
    """
    shape = tuple(int(s) for s in shape)
    if tuple(label.shape) == shape:
        return np.ascontiguousarray(label, dtype=np.uint8), np.zeros((2, *shape), np.uint8)
    return _argmax_resampled(_masks(label), num_classes, shape, axis, runner_up=True)


def _masks(label: np.ndarray):
    """k -> class k's mask of `label` (uint8 0/1), in one buffer rewritten for every class (valid until the
    next call)."""
    codes = torch.from_numpy(np.ascontiguousarray(label, dtype=np.uint8))  # a reoriented view: copied once
    hit = torch.empty(codes.shape, dtype=torch.bool)

    def channel(k: int) -> torch.Tensor:
        torch.eq(codes, k, out=hit)
        return hit.view(torch.uint8)  # `_resize` converts it to float a few planes at a time

    return channel


def _argmax_resampled(channel, num_classes: int, shape: Sequence[int], axis: int | None, runner_up: bool = False):
    """argmax over classes of `channel(k)` resampled to `shape`, keeping one class's volume at a time; with
    `runner_up`, (argmax, (2, *shape): runner-up class and its share of the two leading values in 255ths), all
    uint8 numpy arrays. The interpolation's buffers are reused from class to class, and the running maxima
    take the resampled volume's memory layout, so every step is one contiguous elementwise pass."""
    work: dict = {}
    best = labels = second = runners = None
    for k in range(num_classes):
        p = _resize(channel(k)[None], shape, axis, work)[0]
        if best is None:
            # copies (p's layout kept): `p` is a reused buffer, or without resampling a view of the caller's
            best = torch.empty_like(p).copy_(p)
            labels = torch.zeros_like(p, dtype=torch.uint8)
            if runner_up:
                second = torch.zeros_like(p)
                runners = torch.zeros_like(p, dtype=torch.uint8)
            continue
        better = p > best
        if runner_up:  # where `p` wins, the old best is the runner-up; elsewhere `p` may beat the runner-up
            # elementwise and in place (no boolean indexing, whose gathers cost more than the interpolation)
            runners.masked_fill_(p > second, k)
            torch.where(better, labels, runners, out=runners)
            torch.maximum(second, p, out=second)
            torch.where(better, best, second, out=second)
        labels.masked_fill_(better, k)
        torch.maximum(best, p, out=best)
        del better, p
    work.clear()
    hard = np.ascontiguousarray(labels.cpu().numpy())
    if not runner_up:
        return hard
    del labels
    second.clamp_min_(0)  # linear interpolation of masks in [0, 1] stays in [0, 1]; rounding may dip below 0
    best.clamp_min_(0).add_(second).clamp_min_(1e-6)  # now the two leading shares' sum
    share = second.mul_(255).div_(best).round_().to(torch.uint8)  # in [0, 128]: the runner-up holds at most half
    del second, best
    runners.masked_fill_(share == 0, 0)
    pair = np.empty((2, *shape), np.uint8)
    pair[0] = runners.cpu().numpy()
    pair[1] = share.cpu().numpy()
    return hard, pair


@dataclass(frozen=True, kw_only=True)
class Geometry:
    """How a volume was brought into the planned space, and so how to take a prediction back.

    native -> reorient (`ornt`) -> crop (`crop`, in canonical voxels) -> resample (`planned_shape`).
    """

    native_shape: tuple[int, int, int]  # the file's spatial shape
    native_affine: tuple[tuple[float, ...], ...]  # the file's affine (4 x 4)
    ornt: tuple[tuple[float, float], ...]  # nibabel ornt, native -> canonical (identity for plan "none")
    crop: tuple[tuple[int, int], ...]  # (lo, hi) per canonical axis
    canonical_spacing: tuple[float, float, float]  # voxel size after reorientation, before resampling
    planned_shape: tuple[int, int, int]  # after resampling
    separate_axis: int | None  # the thick axis resampled on its own, or None

    @property
    def canonical_shape(self) -> tuple[int, int, int]:
        return tuple(self.native_shape[int(i)] for i in np.argsort(np.asarray(self.ornt)[:, 0]))

    @property
    def canonical_affine(self) -> np.ndarray:
        """The affine of the reoriented (uncropped, not resampled) volume."""
        ornt = np.asarray(self.ornt)
        return np.asarray(self.native_affine) @ nib.orientations.inv_ornt_aff(ornt, self.native_shape)

    @property
    def planned_affine(self) -> np.ndarray:
        """The affine of the planned-space volume: voxel centres where the resampling put them."""
        scale = np.array(self.cropped_shape, float) / np.array(self.planned_shape, float)
        to_cropped = np.eye(4)
        to_cropped[:3, :3] = np.diag(scale)
        to_cropped[:3, 3] = [lo + 0.5 * r - 0.5 for (lo, _), r in zip(self.crop, scale)]
        return self.canonical_affine @ to_cropped

    @property
    def cropped_shape(self) -> tuple[int, int, int]:
        return tuple(hi - lo for lo, hi in self.crop)

    @property
    def planned_spacing(self) -> tuple[float, float, float]:
        """The voxel size in the planned space (the target spacing, up to rounding of the voxel counts)."""
        return tuple(s * n / m for s, n, m in zip(self.canonical_spacing, self.cropped_shape, self.planned_shape))

    def to_dict(self) -> dict:
        return {
            "native_shape": list(self.native_shape),
            "native_affine": [list(row) for row in self.native_affine],
            "ornt": [list(row) for row in self.ornt],
            "crop": [list(b) for b in self.crop],
            "canonical_spacing": list(self.canonical_spacing),
            "planned_shape": list(self.planned_shape),
            "separate_axis": self.separate_axis,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Geometry:
        return cls(
            native_shape=tuple(d["native_shape"]),
            native_affine=tuple(tuple(r) for r in d["native_affine"]),
            ornt=tuple(tuple(r) for r in d["ornt"]),
            crop=tuple(tuple(b) for b in d["crop"]),
            canonical_spacing=tuple(d["canonical_spacing"]),
            planned_shape=tuple(d["planned_shape"]),
            separate_axis=d["separate_axis"],
        )


def to_native(probs: torch.Tensor, geometry: Geometry) -> np.ndarray:
    """Planned-space class probabilities (K, *planned_shape), on any device -> the label map (uint8) on the
    file's own grid: probabilities resampled back to the cropped grid (not the labels: no blocky edges),
    placed in the uncropped volume (background outside the box), reoriented back, then the argmax."""
    num_classes = probs.shape[0]
    cropped = _argmax_resampled(lambda k: probs[k], num_classes, geometry.cropped_shape, geometry.separate_axis)
    full = np.zeros(geometry.canonical_shape, np.uint8)
    full[tuple(slice(lo, hi) for lo, hi in geometry.crop)] = cropped
    return np.ascontiguousarray(undo_reorient(full, np.asarray(geometry.ornt)))


def to_native_probabilities(probs: torch.Tensor, geometry: Geometry) -> np.ndarray:
    """Planned-space class probabilities (K, *planned_shape) -> (K, *native_shape) float16 on the file's own
    grid, one class at a time (background is certain outside the crop box)."""
    out = np.zeros((probs.shape[0], *geometry.native_shape), np.float16)
    box = tuple(slice(lo, hi) for lo, hi in geometry.crop)
    for k in range(probs.shape[0]):
        full = np.full(geometry.canonical_shape, 1.0 if k == 0 else 0.0, np.float32)
        full[box] = _resize(probs[k][None].float(), geometry.cropped_shape, geometry.separate_axis)[0].cpu().numpy()
        out[k] = undo_reorient(full, np.asarray(geometry.ornt))
    return out
