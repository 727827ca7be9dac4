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


class ConvBlock(nn.Sequential):
    """Two (3x3x3 convolution, instance norm, LeakyReLU) units; the first may downsample by its stride.

    The convolutions have no bias: the normalisation right after them would remove it.

    Args:
        in_channels: channels of the input.
        out_channels: channels of both convolutions' outputs.
        stride: stride of the first convolution (2 halves each spatial size, as nnU-Net downsamples).
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__(
            nn.Conv3d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
            instance_norm(out_channels),
            nn.LeakyReLU(0.01, inplace=True),
            nn.Conv3d(out_channels, out_channels, 3, padding=1, bias=False),
            instance_norm(out_channels),
            nn.LeakyReLU(0.01, inplace=True),
        )
        self.stride = stride


class UpBlock(nn.Module):
    """Transposed-convolution upsampling, skip concatenation, then a ConvBlock.

    Args:
        in_channels: channels of the coarser feature map coming up the decoder.
        out_channels: channels of the skip connection and of the output.
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose3d(in_channels, out_channels, kernel_size=2, stride=2, bias=False)
        self.conv = ConvBlock(2 * out_channels, out_channels)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        """(B, in, D, H, W) and skip (B, out, 2D, 2H, 2W) -> (B, out, 2D, 2H, 2W)."""
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
    """3D U-Net: an encoder of ConvBlocks that halves the size per level, a mirrored decoder with skips.

    Args:
        in_channels: input channels (imaging modalities).
        num_classes: output channels: one logit per class, background included.
        features: channels per level, finest first; its length is the number of levels.

    Input sizes must be divisible by 2 ** (len(features) - 1) on every spatial axis. Setting
    `grad_checkpoint = True` recomputes each encoder and decoder block's activations during the backward
    pass instead of keeping them: less memory for larger patches, at the cost of a second forward pass.
    """

    def __init__(self, in_channels: int, num_classes: int, features: Sequence[int] = (32, 64, 128, 256, 320)) -> None:
        super().__init__()
        features = tuple(int(f) for f in features)
        if in_channels < 1 or num_classes < 1:
            raise ValueError(f"in_channels and num_classes must be >= 1, got {in_channels}, {num_classes}")
        if len(features) < 2 or min(features) < 1:
            raise ValueError(f"features needs at least two positive entries, got {features}")
        self.in_channels = in_channels
        self.num_classes = num_classes
        self.features = features
        self.encoder = nn.ModuleList(
            [ConvBlock(in_channels, features[0])]
            + [ConvBlock(features[i - 1], features[i], stride=2) for i in range(1, len(features))]
        )
        self.decoder = nn.ModuleList(
            [UpBlock(features[i + 1], features[i]) for i in reversed(range(len(features) - 1))]
        )
        self.head = nn.Conv3d(features[0], num_classes, kernel_size=1)
        self.grad_checkpoint = False

    @property
    def size_divisor(self) -> int:
        """Every spatial input size must be a multiple of this."""
        return 2 ** (len(self.features) - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_channels, D, H, W) -> logits (B, num_classes, D, H, W)."""
        if x.ndim != 5 or x.shape[1] != self.in_channels:
            raise ValueError(f"expected input (B, {self.in_channels}, D, H, W), got {tuple(x.shape)}")
        if any(s % self.size_divisor for s in x.shape[2:]):
            raise ValueError(
                f"spatial size {tuple(x.shape[2:])} is not divisible by {self.size_divisor} "
                f"(2 ** (levels - 1) for {len(self.features)} levels)"
            )
        skips = []
        for block in self.encoder:
            x = _run(block, min(x.shape[2:]) // block.stride, self.grad_checkpoint, x)
            skips.append(x)
        skips.pop()  # the bottleneck output is x itself
        for up in self.decoder:
            x = _run(up, min(x.shape[2:]), self.grad_checkpoint, x, skips.pop())
        # The 1x1x1 head runs channels-first whatever the model's memory format (see unet3d.layout): a
        # no-op for contiguous activations, a cheap copy of the last feature map for channels-last ones.
        return self.head(x.contiguous())


def fit_patch(patch: Sequence[int], shape: Sequence[float], divisor: int) -> tuple[int, int, int]:
    """`patch`, shrunk on each axis to `shape` rounded up to a multiple of `divisor` (a size UNet3D accepts)."""
    return tuple(min(int(p), math.ceil(s / divisor) * divisor) for p, s in zip(patch, shape))
