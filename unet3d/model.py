"""The 3D U-Net of Cicek et al. (2016) in the shape nnU-Net uses for 3D full-resolution training."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# Under autocast, blocks that work on feature maps this small (any side) run in float32: bf16 convolutions
# over 2x2x2 maps have produced NaN weight gradients on CPUs while the loss stayed finite, and the
# deepest blocks cost next to nothing anyway.
FP32_MAX_SIDE = 2


def instance_norm(channels: int) -> nn.GroupNorm:
    """Instance normalisation with a per-channel affine map, as nnU-Net uses it.

    GroupNorm with one channel per group computes exactly InstanceNorm3d(affine=True), but its kernels are
    faster on CPUs (measured by benchmarks/run.py) and it accepts a single voxel per channel.
    """
    return nn.GroupNorm(channels, channels, eps=1e-5, affine=True)


Triple = tuple[int, int, int]


def _triples(values: Sequence[int | Sequence[int]], what: str) -> tuple[Triple, ...]:
    out = []
    for v in values:
        t = (int(v),) * 3 if isinstance(v, int) else tuple(int(x) for x in v)
        if len(t) != 3 or min(t) < 1:
            raise ValueError(f"{what} must be positive ints or triples of them, got {list(values)}")
        out.append(t)
    return tuple(out)


class ConvBlock(nn.Sequential):
    """Two (convolution, instance norm, LeakyReLU) units; the first may downsample by its stride.

    The convolutions have no bias: the normalisation right after them would remove it.

    Args:
        in_channels: channels of the input.
        out_channels: channels of both convolutions' outputs.
        kernel: kernel size per axis, odd (3x3x3, or 3x3x1 for a level whose voxels are still thick on one axis).
        stride: stride of the first convolution per axis (2 halves a size, as nnU-Net downsamples; 1 keeps it).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel: Triple = (3, 3, 3), stride: Triple = (1, 1, 1)):
        padding = tuple(k // 2 for k in kernel)
        super().__init__(
            nn.Conv3d(in_channels, out_channels, kernel, stride=stride, padding=padding, bias=False),
            instance_norm(out_channels),
            nn.LeakyReLU(0.01, inplace=True),
            nn.Conv3d(out_channels, out_channels, kernel, padding=padding, bias=False),
            instance_norm(out_channels),
            nn.LeakyReLU(0.01, inplace=True),
        )
        self.stride = tuple(stride)


class UpBlock(nn.Module):
    """Transposed-convolution upsampling (kernel = stride), skip concatenation, then a ConvBlock.

    Args:
        in_channels: channels of the coarser feature map coming up the decoder.
        out_channels: channels of the skip connection and of the output.
        kernel: the ConvBlock's kernel (that of the finer level).
        stride: the upsampling factor per axis (the stride the encoder used to reach the coarser level).
    """

    def __init__(self, in_channels: int, out_channels: int, kernel: Triple, stride: Triple) -> None:
        super().__init__()
        self.up = nn.ConvTranspose3d(in_channels, out_channels, kernel_size=stride, stride=stride, bias=False)
        self.conv = ConvBlock(2 * out_channels, out_channels, kernel)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        """(B, in, D, H, W) and skip (B, out, sD, sH, sW) -> (B, out, sD, sH, sW), s = the stride."""
        return self.conv(torch.cat([self.up(x), skip], dim=1))


def _in_float32(block: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    with torch.autocast(inputs[0].device.type, enabled=False):
        return block(*(t.float() for t in inputs))


def _run(
    block: Callable[..., torch.Tensor], smallest_side: int, recompute: bool, *inputs: torch.Tensor
) -> torch.Tensor:
    """block(*inputs): in float32 with autocast off when it works on maps of FP32_MAX_SIDE or less; with
    `recompute`, its activations are recomputed in the backward pass instead of kept (less memory)."""
    if smallest_side <= FP32_MAX_SIDE and torch.is_autocast_enabled(inputs[0].device.type):
        block = functools.partial(_in_float32, block)
    if recompute and torch.is_grad_enabled():
        return checkpoint(block, *inputs, use_reentrant=False)
    return block(*inputs)


class UNet3D(nn.Module):
    """3D U-Net: an encoder of ConvBlocks that downsamples per level, a mirrored decoder with skips.

    Args:
        in_channels: input channels (imaging modalities).
        num_classes: output channels: one logit per class, background included.
        features: channels per level, finest first; its length is the number of levels.
        kernels: per level, the convolution kernel (an int or a triple; default 3 everywhere).
        strides: per level, the stride that reaches it from the level above (the first is 1; default 2
            elsewhere). A stride of 1 on an axis keeps that axis's size: in-plane-only pooling while the voxels
            are still anisotropic, as planned by `plan_topology`.
        deep_supervision: in training mode, also return logits from the decoder's coarser levels (1 to
            levels - 3, as nnU-Net supervises them: its coarsest output has weight 0), finest first; in eval
            mode the model returns the full-resolution logits only.

    Input sizes must be divisible by `size_divisor` (the product of the strides) on each axis. Setting
    `grad_checkpoint = True` recomputes each encoder and decoder block's activations during the backward
    pass instead of keeping them: less memory for larger patches, at the cost of a second forward pass.
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        features: Sequence[int] = (32, 64, 128, 256, 320),
        kernels: Sequence[int | Sequence[int]] | None = None,
        strides: Sequence[int | Sequence[int]] | None = None,
        deep_supervision: bool = False,
    ) -> None:
        super().__init__()
        features = tuple(int(f) for f in features)
        if in_channels < 1 or num_classes < 1:
            raise ValueError(f"in_channels and num_classes must be >= 1, got {in_channels}, {num_classes}")
        if len(features) < 2 or min(features) < 1:
            raise ValueError(f"features needs at least two positive entries, got {features}")
        levels = len(features)
        kernels = _triples(kernels if kernels is not None else [3] * levels, "kernels")
        strides = _triples(strides if strides is not None else [1] + [2] * (levels - 1), "strides")
        if len(kernels) != levels or len(strides) != levels:
            raise ValueError(f"kernels and strides need one entry per level ({levels}), got {kernels}, {strides}")
        if any(k % 2 == 0 for kernel in kernels for k in kernel):
            raise ValueError(f"kernels must be odd, got {kernels}")
        if strides[0] != (1, 1, 1):
            raise ValueError(f"the first level's stride must be 1, got {strides[0]}")
        self.in_channels = in_channels
        self.num_classes = num_classes
        self.features, self.kernels, self.strides = features, kernels, strides
        self.encoder = nn.ModuleList(
            [ConvBlock(in_channels, features[0], kernels[0])]
            + [ConvBlock(features[i - 1], features[i], kernels[i], strides[i]) for i in range(1, levels)]
        )
        self.decoder = nn.ModuleList(
            [UpBlock(features[i + 1], features[i], kernels[i], strides[i + 1]) for i in reversed(range(levels - 1))]
        )
        self.head = nn.Conv3d(features[0], num_classes, kernel_size=1)
        self.deep_supervision = deep_supervision
        self.aux_heads = nn.ModuleList(
            [nn.Conv3d(features[i], num_classes, kernel_size=1) for i in range(1, levels - 2)]
            if deep_supervision
            else []
        )
        self.grad_checkpoint = False

    @property
    def size_divisor(self) -> Triple:
        """Every spatial input size must be a multiple of this, per axis."""
        return tuple(math.prod(s[axis] for s in self.strides) for axis in range(3))

    def supervision_scales(self) -> list[Triple]:
        """The downsampling factor per axis of each output `forward` returns in training mode, finest first."""
        scales = [(1, 1, 1)]
        for level in range(1, len(self.aux_heads) + 1):
            scales.append(tuple(math.prod(s[a] for s in self.strides[: level + 1]) for a in range(3)))
        return scales

    def forward(self, x: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        """(B, in_channels, D, H, W) -> logits (B, num_classes, D, H, W); with deep supervision in training
        mode a list: those, then (B, num_classes, D/s, H/s, W/s) for each of `supervision_scales()[1:]`."""
        if x.ndim != 5 or x.shape[1] != self.in_channels:
            raise ValueError(f"expected input (B, {self.in_channels}, D, H, W), got {tuple(x.shape)}")
        if any(s % d for s, d in zip(x.shape[2:], self.size_divisor)):
            raise ValueError(
                f"spatial size {tuple(x.shape[2:])} is not divisible by {self.size_divisor} "
                f"(the product of the strides of {len(self.features)} levels)"
            )
        skips = []
        for block in self.encoder:
            x = _run(block, min(s // st for s, st in zip(x.shape[2:], block.stride)), self.grad_checkpoint, x)
            skips.append(x)
        skips.pop()  # the bottleneck output is x itself
        supervise = self.deep_supervision and self.training
        aux = []
        for i, up in enumerate(self.decoder):
            x = _run(up, min(x.shape[2:]), self.grad_checkpoint, x, skips.pop())
            level = len(self.decoder) - 1 - i
            if supervise and 1 <= level <= len(self.aux_heads):
                aux.append(self.aux_heads[level - 1](x.contiguous()))
        # The 1x1x1 head runs channels-first whatever the model's memory format (see unet3d.precision): a
        # no-op for contiguous activations, a cheap copy of the last feature map for channels-last ones.
        logits = self.head(x.contiguous())
        return [logits, *reversed(aux)] if supervise else logits


def fit_patch(patch: Sequence[int], shape: Sequence[float], divisor: Sequence[int]) -> Triple:
    """`patch`, shrunk on each axis to `shape` rounded up to a multiple of that axis's `divisor` (a size UNet3D
    with that `size_divisor` accepts)."""
    return tuple(min(int(p), math.ceil(s / d) * d) for p, s, d in zip(patch, shape, divisor))


MIN_FEATURE_MAP = 4  # no axis is pooled below this many voxels (nnU-Net's bottleneck floor)


def plan_topology(spacing: Sequence[float], patch: Sequence[int], levels: int) -> tuple[list[Triple], list[Triple]]:
    """Per-level kernels and strides for a patch at a voxel spacing, by nnU-Net's rule, up to `levels` levels.

    At each pooling stage an axis is halved when its feature map is still at least 2 * MIN_FEATURE_MAP voxels
    and its current spacing is within a factor 2 of the finest current spacing among such axes: thick axes
    wait (stride 1) until in-plane pooling has made the voxels nearly isotropic. An axis gets a 3-wide kernel
    once its spacing is within a factor 2 of the finest (1 before: 3x3x1 convolutions on thick slices), and
    keeps it; the bottleneck's kernel is 3 on every axis. Stops early when no axis can be pooled (or only a
    single axis shorter than 3 * MIN_FEATURE_MAP), so fewer than `levels` levels may come back.

    Returns:
        (kernels, strides), one triple per level, finest first; strides[0] is (1, 1, 1).
    """
    current, size = [float(s) for s in spacing], [float(p) for p in patch]
    kernel = [1, 1, 1]
    kernels: list[Triple] = []
    strides: list[Triple] = [(1, 1, 1)]
    while len(strides) < levels:
        poolable = [a for a in range(3) if size[a] >= 2 * MIN_FEATURE_MAP]
        if not poolable:
            break
        finest = min(current[a] for a in poolable)
        poolable = [a for a in poolable if current[a] / finest < 2]
        if len(poolable) == 1 and size[poolable[0]] < 3 * MIN_FEATURE_MAP:
            break
        kernel = [3 if k == 3 or current[a] / min(current) < 2 else 1 for a, k in enumerate(kernel)]
        kernels.append(tuple(kernel))
        stride = tuple(2 if a in poolable else 1 for a in range(3))
        for a in poolable:
            current[a] *= 2
            size[a] = math.ceil(size[a] / 2)
        strides.append(stride)
    kernels.append((3, 3, 3))  # the bottleneck
    return kernels, strides
