"""Patch augmentation: mirroring on the three axes, intensity scale and shift, gamma (as nnU-Net)."""

from __future__ import annotations

import numpy as np

P_FLIP = 0.5  # per axis
P_SCALE, SCALE_RANGE = 0.15, (0.75, 1.25)  # multiplicative intensity change
P_SHIFT, SHIFT_STD = 0.15, 0.1  # additive change, in units of the normalised intensity
P_GAMMA, GAMMA_RANGE = 0.3, (0.7, 1.5)


def gamma(channel: np.ndarray, g: float) -> np.ndarray:
    """Gamma on the channel rescaled to [0, 1], then mapped back so its mean and std are kept."""
    lo, hi = float(channel.min()), float(channel.max())
    if hi - lo < 1e-8:
        return channel
    mean, std = float(channel.mean()), float(channel.std())
    out = ((channel - lo) / (hi - lo)) ** g * (hi - lo) + lo
    out_std = float(out.std())
    if out_std > 1e-8:
        out = (out - out.mean()) / out_std * std + mean
    return out.astype(np.float32)


def augment(image: np.ndarray, label: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random augmentation of one patch; the label follows every spatial change.

    Args:
        image: (C, X, Y, Z) float32.
        label: (X, Y, Z) uint8.
        rng: the generator of this sample; the result depends on nothing else.

    Returns:
        augmented contiguous copies of image and label.
    """
    for axis in range(3):
        if rng.random() < P_FLIP:
            image = np.flip(image, axis + 1)
            label = np.flip(label, axis)
    image = np.array(image, dtype=np.float32)  # a writable copy
    if rng.random() < P_SCALE:
        image *= rng.uniform(*SCALE_RANGE)
    if rng.random() < P_SHIFT:
        image += rng.normal(0.0, SHIFT_STD)
    if rng.random() < P_GAMMA:
        g = rng.uniform(*GAMMA_RANGE)
        for c in range(image.shape[0]):
            image[c] = gamma(image[c], g)
    return image, np.ascontiguousarray(label)
