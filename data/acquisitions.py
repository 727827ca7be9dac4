"""Simulated thick slices: training patches of finely acquired cases made, at random, to look as the dataset's
thick-slice cases look in the planned space, while keeping their own, exact labels.

A thick-slice case comes into the planned space blurred along its thick axis (each measured slice averages its
slab, the planes between are interpolated), and its labels there are known only on the measured slices. A fine
case of the same dataset shows what lies inside those slabs. So a patch of a fine case is, with probability
P_SIMULATE, re-acquired like one of the dataset's thick acquisitions: averaged over slabs of that
acquisition's thickness (at a random phase) along its thick axis and interpolated back linearly between the
slabs' centres, as preprocessing interpolates a real thick-slice case, the label left as it was. The network
then learns from exact labels how a structure looks through thick slices, which the thick cases teach only on
their measured planes. nnU-Net simulates low resolution too, but isotropically and at scales of its choosing;
here the axes and thicknesses are the dataset's own, so a dataset of one acquisition is left untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

THICK = 2.0  # an axis whose voxels span this many planned voxels or more is a thick-slice axis
P_SIMULATE = 1 / 3  # share of a fine case's patches re-acquired as thick slices


def voxel_ratios(canonical_spacing: Sequence[float], planned_spacing: Sequence[float]) -> np.ndarray:
    """How many planned voxels a case's own voxel spans along each canonical axis (3,)."""
    return np.asarray(canonical_spacing, dtype=np.float64) / np.asarray(planned_spacing, dtype=np.float64)


def thick_acquisitions(ratios: Sequence[np.ndarray]) -> tuple[tuple[int, float], ...]:
    """The dataset's thick-slice acquisitions as (axis, slab thickness in planned voxels), from every training
    case's `voxel_ratios`, thicknesses rounded to a twentieth of a voxel; () when no case has a thick axis."""
    found = set()
    for r in ratios:
        for axis in range(3):
            if r[axis] >= THICK:
                found.add((axis, round(float(r[axis]) * 20) / 20))
    return tuple(sorted(found))


def is_fine(ratio: np.ndarray) -> bool:
    """Whether a case (its `voxel_ratios`) has no thick-slice axis: its labels are exact in the planned space."""
    return bool(np.all(np.asarray(ratio) < THICK))


def noise_sd(image: np.ndarray, axis: int) -> np.ndarray:
    """A robust estimate of each channel's voxel noise (C,): the median absolute deviation of the differences
    between neighbours along `axis`, which edges barely move (a difference of two independent voxels has
    twice a voxel's variance)."""
    d = np.diff(np.asarray(image, dtype=np.float32), axis=axis + 1).reshape(image.shape[0], -1)
    mad = np.median(np.abs(d - np.median(d, axis=1, keepdims=True)), axis=1)
    return mad / 0.6745 / np.sqrt(2.0)


def thick_slices(
    image: np.ndarray, axis: int, thickness: float, phase: float, rng: np.random.Generator | None = None
) -> np.ndarray:
    """`image` (C, X, Y, Z) as a thick-slice acquisition along spatial `axis` would show it after resampling.

    Slabs `thickness` voxels thick start at `phase - thickness` (in voxels, `phase` in [0, thickness)); voxel i
    covers [i - 0.5, i + 0.5). Each slab's value is the mean of the image over the part of it inside the patch
    (the integral of the piecewise-constant voxels, so a slab may cut a voxel); every voxel then takes the
    linear interpolation between the two nearest slab centres (the nearest one beyond the outermost). With
    `rng`, each slab gets the noise its averaging removed (`noise_sd` of the image), so a slab is as noisy as
    one of the case's own voxels, as a thick slice of the same scanner is.

    Returns:
        a new (C, X, Y, Z) float32 array.
    """
    if not thickness > 1:
        raise ValueError(f"a slab must be thicker than one voxel, got {thickness}")
    moved = np.moveaxis(np.asarray(image, dtype=np.float32), axis + 1, 0)  # (N, C, ...): planes along `axis`
    n = moved.shape[0]

    def per_plane(values: np.ndarray) -> np.ndarray:  # (len,) -> (len, 1, ...), to scale planes
        return values.reshape(-1, *([1] * (moved.ndim - 1)))

    cum = np.concatenate([np.zeros((1, *moved.shape[1:])), np.cumsum(moved, axis=0, dtype=np.float64)])
    starts = -0.5 + phase - thickness + thickness * np.arange(int(np.ceil(n / thickness)) + 2)
    lo, hi = np.clip(starts, -0.5, n - 0.5), np.clip(starts + thickness, -0.5, n - 0.5)
    keep = hi - lo > 1e-6  # the slabs that reach into the patch, cut to it
    lo, hi = lo[keep], hi[keep]

    def integral(x: np.ndarray) -> np.ndarray:  # of the image from -0.5 to x along the axis: (len(x), C, ...)
        k = np.minimum(np.floor(x + 0.5).astype(int), n - 1)
        f = per_plane(x + 0.5 - k)
        return cum[k] * (1 - f) + cum[k + 1] * f

    length = per_plane(hi - lo)
    slabs = (integral(hi) - integral(lo)) / length  # (S, C, ...)
    if rng is not None:
        sd = noise_sd(image, axis).reshape(1, -1, *([1] * (moved.ndim - 2)))
        slabs += rng.standard_normal(slabs.shape) * sd * np.sqrt(np.clip(1 - 1 / length, 0, None))
    centres = (lo + hi) / 2
    if len(centres) == 1:
        out = np.broadcast_to(slabs[0], moved.shape)
    else:
        at = np.arange(n, dtype=np.float64)
        right = np.clip(np.searchsorted(centres, at, side="right"), 1, len(centres) - 1)
        left = right - 1
        w = per_plane(np.clip((at - centres[left]) / (centres[right] - centres[left]), 0, 1))
        out = slabs[left] * (1 - w) + slabs[right] * w
    return np.ascontiguousarray(np.moveaxis(out.astype(np.float32), 0, axis + 1))


def simulate(
    image: np.ndarray,
    ratio: np.ndarray,
    acquisitions: Sequence[tuple[int, float]],
    rng: np.random.Generator,
    channel: bool = False,
) -> np.ndarray:
    """A patch `image` (C, X, Y, Z) of a case whose voxels span `ratio` planned voxels: with probability
    P_SIMULATE, when the case is fine and the dataset has thick acquisitions, re-acquired as one of them
    (`thick_slices`, at a random phase, with the noise the averaging removed); else unchanged. Draws from
    `rng` only when the case is fine and there are acquisitions to simulate, so a dataset without them keeps
    every sample's random stream. With `channel`, the last channel is the acquisition channel
    (`plane_distance`): it is not re-acquired but set to the simulated slabs' `simulated_distance`."""
    if not acquisitions or not is_fine(ratio):
        return image
    if rng.random() >= P_SIMULATE:
        return image
    axis, thickness = acquisitions[int(rng.integers(len(acquisitions)))]
    phase = float(rng.uniform(0, thickness))
    if not channel:
        return thick_slices(image, axis, thickness, phase, rng)
    out = np.empty(image.shape, np.float32)
    out[:-1] = thick_slices(image[:-1], axis, thickness, phase, rng)
    out[-1] = simulated_distance(image.shape[1:], axis, thickness, phase)
    return out


def plane_distance(source: Sequence[int], planned: Sequence[int], ratio: Sequence[float]) -> np.ndarray:
    """The acquisition channel of a case resampled from `source` to `planned` voxels (spatial shapes), whose
    own voxels span `ratio` planned voxels: per planned voxel, its distance to the nearest measured plane
    along a thick axis (ratio >= THICK), in units of half the slice spacing: 0 on a measured plane, 1 halfway
    between two; 0 everywhere for a fine case. The planned voxel j of an axis of `n` planes resampled from `a`
    sits at source coordinate (j + 0.5) a / n - 0.5 (`data.geometry`'s resampling), kept inside the volume.

    Returns:
        (X, Y, Z) float32 (the largest of the thick axes' distances, for a case thick along several).
    """
    out = np.zeros(tuple(int(n) for n in planned), np.float32)
    for axis, (a, n, r) in enumerate(zip(source, planned, ratio)):
        if r < THICK:
            continue
        x = np.clip((np.arange(n, dtype=np.float64) + 0.5) * a / n - 0.5, 0, a - 1)
        d = (2 * np.abs(x - np.round(x))).astype(np.float32)
        np.maximum(out, d.reshape([-1 if i == axis else 1 for i in range(3)]), out=out)
    return out


def simulated_distance(shape: Sequence[int], axis: int, thickness: float, phase: float) -> np.ndarray:
    """`plane_distance` of a patch of `shape` re-acquired by `thick_slices(..., axis, thickness, phase)`: the
    distance of each plane to the nearest slab centre, over half the slab thickness. (X, Y, Z) float32."""
    at = np.arange(int(shape[axis]), dtype=np.float64) - (phase - thickness / 2 - 0.5)  # from a slab centre
    m = np.mod(at, thickness)
    d = (2 * np.minimum(m, thickness - m) / thickness).astype(np.float32)
    return np.ascontiguousarray(
        np.broadcast_to(d.reshape([-1 if i == axis else 1 for i in range(3)]), tuple(int(s) for s in shape))
    )
