"""Patch augmentation, run in the DataLoader workers, as nnU-Net augments.

`basic`: mirroring on the three axes, intensity scale and shift, gamma. `nnunet` adds nnU-Net's spatial and
intensity transforms: rotation (up to 30 degrees about each axis) and scaling (0.7 to 1.4) of the patch's
sampling grid (the label follows through nearest-neighbour sampling, `spatial_transform`), Gaussian noise,
Gaussian blur, contrast, simulated low resolution and inverted gamma. Probabilities follow nnU-Net's
defaults. A sample's augmentation depends only on its own generator.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import ndimage

AUGMENTATIONS = ("basic", "nnunet")
P_FLIP = 0.5  # per axis
P_SCALE, SCALE_RANGE = 0.15, (0.75, 1.25)  # multiplicative intensity change
P_SHIFT, SHIFT_STD = 0.15, 0.1  # additive change, in units of the normalised intensity
P_GAMMA, GAMMA_RANGE = 0.3, (0.7, 1.5)
# nnunet only
P_ROTATE, MAX_ANGLE = 0.2, math.radians(30)  # the probability of a rotation; each axis's angle in +-MAX_ANGLE
MAX_IN_PLANE_ANGLE = math.pi  # a thick-slice patch's one rotation, about its short axis (nnU-Net: +-180)
P_ZOOM, ZOOM_RANGE = 0.2, (0.7, 1.4)  # the patch's sampling grid scaled by this (>1: a larger field of view)
P_NOISE, NOISE_VARIANCE = 0.1, (0.0, 0.1)
P_BLUR, BLUR_SIGMA = 0.2, (0.5, 1.0)  # per sample; then each channel with probability 0.5
P_CONTRAST, CONTRAST_RANGE = 0.15, (0.75, 1.25)
P_LOWRES, LOWRES_ZOOM = 0.25, (0.5, 1.0)  # per sample; then each channel with probability 0.5
P_INVERTED_GAMMA = 0.1
ANISOTROPY_LIMIT = 3  # a patch whose longest side exceeds its shortest this many times is transformed in-plane


def thin_axis(patch_size: tuple[int, ...]) -> int | None:
    """The short axis of a strongly anisotropic patch (its longest side more than ANISOTROPY_LIMIT times its
    shortest, as on thick slices whose thick axis the plan does not pool), else None."""
    return int(np.argmin(patch_size)) if max(patch_size) > ANISOTROPY_LIMIT * min(patch_size) else None


def spatial_transform(rng: np.random.Generator, patch_size: tuple[int, ...] = (1, 1, 1)) -> np.ndarray | None:
    """A random 3x3 map from patch offsets to volume offsets (rotation and scaling), or None for none.

    A strongly anisotropic patch (its longest side more than ANISOTROPY_LIMIT times its shortest, as on thick
    slices whose thick axis the plan does not pool) is transformed in-plane only, as nnU-Net does: rotated
    about its short axis, by up to 180 degrees (nnU-Net's range for in-plane rotation), and scaled across it,
    so a thick slice never tilts into its neighbours."""
    thin = thin_axis(patch_size)
    matrix = np.eye(3)
    if rng.random() < P_ROTATE:
        for axis in range(3):
            angle = rng.uniform(-MAX_ANGLE, MAX_ANGLE)
            if thin is not None and axis != thin:
                continue  # the angle is still drawn: the generator's stream does not depend on the patch
            if thin is not None:
                angle *= MAX_IN_PLANE_ANGLE / MAX_ANGLE  # the same draw, over the in-plane range
            c, s = math.cos(angle), math.sin(angle)
            rotation = np.eye(3)
            i, j = [a for a in range(3) if a != axis]
            rotation[i, i], rotation[i, j], rotation[j, i], rotation[j, j] = c, -s, s, c
            matrix = rotation @ matrix
    if rng.random() < P_ZOOM:
        zoom = np.full(3, rng.uniform(*ZOOM_RANGE))
        if thin is not None:
            zoom[thin] = 1.0
        matrix = matrix * zoom  # scales the patch's axes: columns
    return None if np.array_equal(matrix, np.eye(3)) else matrix


def sample_transformed(
    image: np.ndarray,
    label: np.ndarray,
    centre: np.ndarray,
    patch: np.ndarray,
    matrix: np.ndarray,
    share: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The patch of `patch` voxels around `centre` on a grid mapped by `matrix`: image (C, X, Y, Z) linearly,
    label (X, Y, Z) by nearest neighbour, both from the same coordinates; outside the volume 0 (the
    normalised mean, and background). Only the box the grid touches is read (volumes may be memory maps).
    With `share` (2, X, Y, Z), the soft label's runner-up and share (`data.patches`) follow the label, and the
    label returned is (3, *patch)."""
    offsets = np.stack(np.meshgrid(*[np.arange(p) - (p - 1) / 2 for p in patch], indexing="ij"), axis=0)
    coords = np.tensordot(matrix, offsets, axes=1) + centre.reshape(3, 1, 1, 1)  # (3, *patch), volume voxels
    lo = np.maximum(np.floor(coords.reshape(3, -1).min(1)).astype(int) - 1, 0)
    hi = np.minimum(np.ceil(coords.reshape(3, -1).max(1)).astype(int) + 2, label.shape)
    box = tuple(slice(int(a), int(b)) for a, b in zip(lo, np.maximum(hi, lo + 1)))
    local = coords - lo.reshape(3, 1, 1, 1)
    region = np.asarray(image[(slice(None),) + box], dtype=np.float32)
    out = np.stack([ndimage.map_coordinates(c, local, order=1, mode="constant", cval=0.0) for c in region])
    planes = [label[box]] + ([] if share is None else [share[0][box], share[1][box]])
    seg = [ndimage.map_coordinates(np.asarray(p), local, order=0, mode="constant", cval=0) for p in planes]
    seg = seg[0] if share is None else np.stack(seg)
    return out.astype(np.float32), seg.astype(np.uint8)


def gamma(channel: np.ndarray, g: float, inverted: bool = False) -> np.ndarray:
    """Gamma on the channel rescaled to [0, 1] (of the inverted channel when `inverted`), then mapped back so
    its mean and std are kept."""
    lo, hi = float(channel.min()), float(channel.max())
    if hi - lo < 1e-8:
        return channel
    mean, std = float(channel.mean()), float(channel.std())
    unit = (channel - lo) / (hi - lo)
    unit = 1 - (1 - unit) ** g if inverted else unit**g
    out = unit * (hi - lo) + lo
    out_std = float(out.std())
    if out_std > 1e-8:
        out = (out - out.mean()) / out_std * std + mean
    return out.astype(np.float32)


def _low_resolution(channel: np.ndarray, zoom: float) -> np.ndarray:
    """Down by `zoom` (nearest) and back up (cubic), on every axis but a thick-slice patch's short one, whose
    slices are coarse already: averaging them together is no acquisition's (nnU-Net ignores that axis too)."""
    zooms = [zoom] * channel.ndim
    thin = thin_axis(channel.shape)
    if thin is not None:
        zooms[thin] = 1.0
    small = ndimage.zoom(channel, zooms, order=0)
    return ndimage.zoom(small, [a / b for a, b in zip(channel.shape, small.shape)], order=3)[
        tuple(slice(0, n) for n in channel.shape)
    ]


def augment(
    image: np.ndarray, label: np.ndarray, rng: np.random.Generator, level: str = "basic", fixed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Random augmentation of one patch (after `spatial_transform`, if any); the label follows every spatial
    change.

    Args:
        image: (C, X, Y, Z) float32.
        label: (X, Y, Z) uint8, or a soft label (3, X, Y, Z) uint8 (`data.patches`), mirrored alike.
        rng: the generator of this sample; the result depends on nothing else.
        level: `basic` or `nnunet` (see the module's description).
        fixed: the last `fixed` channels are not intensities (the acquisition channel, `data.acquisitions`):
            they are mirrored with the rest and never rescaled, shifted, blurred or noised.

    Returns:
        augmented contiguous copies of image and label.
    """
    whole = np.array(image, dtype=np.float32)  # writable copies: the patch may view a read-only memory map
    label = np.array(label, dtype=np.uint8)
    image = whole[: whole.shape[0] - fixed]  # a view: the intensity changes below write into `whole`
    full = level == "nnunet"
    if full and rng.random() < P_NOISE:
        image += rng.normal(0.0, math.sqrt(rng.uniform(*NOISE_VARIANCE)), image.shape).astype(np.float32)
    if full and rng.random() < P_BLUR:
        for c in range(image.shape[0]):
            if rng.random() < 0.5:
                image[c] = ndimage.gaussian_filter(image[c], rng.uniform(*BLUR_SIGMA))
    if rng.random() < P_SCALE:
        image *= rng.uniform(*SCALE_RANGE)
    if full and rng.random() < P_CONTRAST:
        factor = rng.uniform(*CONTRAST_RANGE)
        for c in range(image.shape[0]):
            lo, hi, mean = image[c].min(), image[c].max(), image[c].mean()
            image[c] = np.clip((image[c] - mean) * factor + mean, lo, hi)
    if full and rng.random() < P_LOWRES:
        for c in range(image.shape[0]):
            if rng.random() < 0.5:
                image[c] = _low_resolution(image[c], rng.uniform(*LOWRES_ZOOM))
    if rng.random() < P_SHIFT:
        image += rng.normal(0.0, SHIFT_STD)
    if full and rng.random() < P_INVERTED_GAMMA:
        g = rng.uniform(*GAMMA_RANGE)
        for c in range(image.shape[0]):
            image[c] = gamma(image[c], g, inverted=True)
    if rng.random() < P_GAMMA:
        g = rng.uniform(*GAMMA_RANGE)
        for c in range(image.shape[0]):
            image[c] = gamma(image[c], g)
    for axis in range(3):
        if rng.random() < P_FLIP:
            whole = np.flip(whole, axis + 1)
            label = np.flip(label, axis + label.ndim - 3)
    return np.ascontiguousarray(whole), np.ascontiguousarray(label)
