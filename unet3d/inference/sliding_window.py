"""Sliding-window inference over whole volumes with Gaussian importance weighting (as nnU-Net), and the one
prediction path that validation and evaluate.py share."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import nn

from unet3d.precision import autocast


def window_starts(size: int, window: int, overlap: float) -> list[int]:
    """Window starts along one axis: every int(window * (1 - overlap)) voxels, the last one moved back to end
    at the border. `size` >= `window`. The same positions as MONAI's sliding_window_inference, so the two
    give the same output for the same weights (benchmarks/run.py checks it).
    """
    if size <= window:
        return [0]
    step = max(int(window * (1 - overlap)), 1)
    count = next(i for i in range(size) if i * step + window >= size) + 1
    return [min(i * step, size - window) for i in range(count)]


MAX_OVERLAP = 0.9  # each voxel is predicted in about (1 / (1 - overlap))^3 windows: 8 at 0.5, 1000 at 0.9;
# beyond it the count explodes (at 0.999 a window every voxel: millions per scan, a run that never ends)


def overlap_problem(option: str, overlap: float) -> str | None:
    """Why `overlap` cannot be used as the value of `option`, or None."""
    if 0 <= overlap <= MAX_OVERLAP:  # (NaN fails too)
        return None
    return (
        f"{option} must be in [0, {MAX_OVERLAP}], got {overlap} (each voxel is predicted in about "
        f"(1 / (1 - overlap))^3 windows: 8 at 0.5, 64 at 0.75, 1000 at {MAX_OVERLAP})"
    )


SIGMA_SCALE = 0.125  # the Gaussian's sigma per axis, as a fraction of the window (nnU-Net, MONAI)


@dataclass(frozen=True, kw_only=True)
class InferenceSettings:
    """How a whole volume is predicted: the same settings in validation and in evaluate.py."""

    window: tuple[int, int, int]  # sliding window (X, Y, Z), each a size the model accepts
    overlap: float = 0.5  # fraction of a window shared with its neighbour, in [0, MAX_OVERLAP]
    sw_batch_size: int = 2  # windows per forward pass
    amp_dtype: torch.dtype | None = None  # autocast dtype, or None for full precision
    tta: bool = False  # average the softmax over the 8 mirrorings of the three axes

    def __post_init__(self) -> None:
        if problem := overlap_problem("overlap", self.overlap):
            raise ValueError(problem)
        if self.sw_batch_size < 1:
            raise ValueError(f"sw_batch_size must be >= 1, got {self.sw_batch_size}")
        object.__setattr__(self, "window", tuple(int(w) for w in self.window))


@lru_cache(maxsize=8)
def gaussian_weight(window: tuple[int, ...]) -> torch.Tensor:
    """Importance map (*window) on the CPU: a Gaussian with sigma = window * SIGMA_SCALE per axis, floored
    at 1e-3. Voxels near a window's border, which see less context, count less where windows overlap."""
    weight = None
    for w in window:
        x = torch.arange(-(w - 1) / 2.0, (w - 1) / 2.0 + 1, dtype=torch.float)
        axis = torch.exp(x**2 / (-2 * (w * SIGMA_SCALE) ** 2))
        weight = axis if weight is None else weight.unsqueeze(-1) * axis
    return weight.clamp_min(max(weight.min().item(), 1e-3))


GPU_SHARE = 0.5  # the stitched logits may take this share of the GPU's free memory, else they go to the host


def accumulator_device(device: torch.device, nbytes: int) -> torch.device:
    """Where a volume's stitched logits are summed: on its GPU while the volume's tensors (`nbytes`) take at
    most GPU_SHARE of the memory it can still give, else in host memory (a 512 x 512 x 600 CT with 14
    classes needs 9.4 GB of logits alone), so a large case is slower to stitch, never out of memory.

    What the GPU can give is its free memory plus what PyTorch's caching allocator holds unused: after a
    training epoch the cache keeps the training's blocks, which the driver counts as used."""
    if device.type != "cuda":
        return device
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return device if nbytes <= GPU_SHARE * (free + cached) else torch.device("cpu")


RESAMPLE_BYTES_PER_VOXEL = 16  # taking probabilities back to a file's grid: the running maximum, the winning
# class, an interpolation buffer and a thick axis's intermediate, per voxel of the (cropped) native grid


def resampling_device(device: torch.device, native_voxels: int) -> torch.device:
    """Where planned-space probabilities on `device` are taken back to a file's grid of `native_voxels` (cropped):
    on their GPU while that fits as the stitching does (`accumulator_device`), else on the host. A scan finer
    than the planned spacing has more voxels on its own grid than in the planned space (a 0.7 mm CT planned at
    1.5 mm: ten times), which the stitching's choice did not count."""
    return accumulator_device(device, RESAMPLE_BYTES_PER_VOXEL * native_voxels)


def for_resampling(probs: torch.Tensor, native_shape: Sequence[int]) -> torch.Tensor:
    """`probs` (K, *planned) where they are to be taken back to a (cropped) native grid of `native_shape`:
    where they are, or on the host (`resampling_device`)."""
    return probs.to(resampling_device(probs.device, math.prod(native_shape)))


def volume_bytes(num_classes: int, voxels: int, tta: bool) -> int:
    """float32 bytes alive at once for one volume of `voxels`: the stitched logits and their weights, then
    the softmax beside the logits; with TTA also the running sum of probabilities and a mirrored copy."""
    volumes = 3 * num_classes + 1 if tta else 2 * num_classes + 1
    return volumes * voxels * 4


@torch.no_grad()
def sliding_window_inference(model: nn.Module, image: torch.Tensor, settings: InferenceSettings) -> torch.Tensor:
    """Logits of a whole volume, stitched from overlapping Gaussian-weighted windows.

    Args:
        model: maps (B, C, *window) to (B, K, *window); called in its current mode (use eval()).
        image: (C, X, Y, Z) on the model's device; any size, padded internally when smaller than the window.
        settings: window, overlap, windows per pass and autocast dtype (`tta` is `predict`'s).

    Returns:
        (K, X, Y, Z) float32 logits on the image's device, or on the host when they would not fit on the GPU
        (`accumulator_device`).
    """
    if image.ndim != 4:
        raise ValueError(f"expected an image (C, X, Y, Z), got shape {tuple(image.shape)}")
    window, overlap = settings.window, settings.overlap
    size = tuple(image.shape[1:])
    pad = [max(w - s, 0) for w, s in zip(window, size)]
    if any(pad):
        # F.pad takes (last axis first) pairs; pad symmetrically with 0, the normalised mean
        pairs = [(p // 2, p - p // 2) for p in pad]
        image = nn.functional.pad(image, [v for pair in reversed(pairs) for v in pair])
    padded = tuple(image.shape[1:])
    starts = [
        (x, y, z)
        for x in window_starts(padded[0], window[0], overlap)
        for y in window_starts(padded[1], window[1], overlap)
        for z in window_starts(padded[2], window[2], overlap)
    ]
    device = image.device
    logits: torch.Tensor | None = None
    for i in range(0, len(starts), settings.sw_batch_size):
        chunk = starts[i : i + settings.sw_batch_size]
        slices = [tuple(slice(s, s + w) for s, w in zip(start, window)) for start in chunk]
        batch = torch.stack([image[(slice(None),) + sl] for sl in slices])  # (b, C, *window)
        with autocast(device, settings.amp_dtype):
            out = model(batch).float()  # (b, K, *window)
        if logits is None:
            on = accumulator_device(device, volume_bytes(out.shape[1], math.prod(padded), settings.tta))
            logits = torch.zeros((out.shape[1],) + padded, device=on)
            norm = torch.zeros(padded, device=on)
            weight = gaussian_weight(window).to(on)
        out = out.to(on)
        for sl, o in zip(slices, out):
            logits[(slice(None),) + sl].addcmul_(o, weight)  # in place: no (K, *window) temporary
            norm[sl] += weight
    assert logits is not None
    logits /= norm
    if any(pad):
        crop = tuple(slice(p // 2, p // 2 + s) for p, s in zip(pad, size))
        logits = logits[(slice(None),) + crop]
    return logits


@torch.no_grad()
def predict_probabilities(
    model: nn.Module, image: np.ndarray | torch.Tensor, settings: InferenceSettings, device: torch.device
) -> torch.Tensor:
    """Class probabilities of a whole normalised volume: the one prediction path of validation and evaluate.py.

    Args:
        image: (C, X, Y, Z) normalised intensities (NumPy arrays, memory maps included, are copied).
        settings: the sliding window, and with `tta` the softmax averaged over the 8 mirrorings.

    Returns:
        (K, X, Y, Z) float32 softmax probabilities on `device`.
    """
    was_training = model.training
    model.eval()
    try:
        x = torch.from_numpy(np.array(image, dtype=np.float32)) if isinstance(image, np.ndarray) else image
        x = x.to(device, torch.float32)
        if not settings.tta:
            return torch.softmax(sliding_window_inference(model, x, settings), dim=0)
        probs = None
        mirrorings = [axes for r in range(4) for axes in itertools.combinations((1, 2, 3), r)]
        for axes in mirrorings:
            # One volume's tensors at a time (a CT's logits take gigabytes): this pass's logits are freed
            # once softmaxed, its probabilities once summed, before the next pass stitches its own.
            logits = sliding_window_inference(model, x.flip(axes) if axes else x, settings)
            p = torch.softmax(logits, dim=0)
            del logits
            if axes:
                p = p.flip(axes)
            if probs is not None and probs.device != p.device:  # this pass was stitched on the host: sum there
                probs, p = probs.cpu(), p.cpu()
            probs = p if probs is None else probs.add_(p)
            del p
        return probs.div_(len(mirrorings))
    finally:
        model.train(was_training)


def predict(
    model: nn.Module, image: np.ndarray | torch.Tensor, settings: InferenceSettings, device: torch.device
) -> torch.Tensor:
    """(X, Y, Z) int64 labels on `device`: the argmax of `predict_probabilities`."""
    return predict_probabilities(model, image, settings, device).argmax(0)
