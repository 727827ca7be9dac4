"""The 3D U-Net of Cicek et al. (2016) in the shape nnU-Net uses for 3D full-resolution training."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class ConvBlock(nn.Sequential):
    """Two (3x3x3 convolution, InstanceNorm, LeakyReLU) units; the first may downsample by its stride.

    Args:
        in_channels: channels of the input.
        out_channels: channels of both convolutions' outputs.
        stride: stride of the first convolution (2 halves each spatial size, as nnU-Net downsamples).
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__(
            nn.Conv3d(in_channels, out_channels, 3, stride=stride, padding=1),
            nn.InstanceNorm3d(out_channels, eps=1e-5, affine=True),
            nn.LeakyReLU(0.01, inplace=True),
            nn.Conv3d(out_channels, out_channels, 3, padding=1),
            nn.InstanceNorm3d(out_channels, eps=1e-5, affine=True),
            nn.LeakyReLU(0.01, inplace=True),
        )


class UpBlock(nn.Module):
    """Transposed-convolution upsampling, skip concatenation, then a ConvBlock.

    Args:
        in_channels: channels of the coarser feature map coming up the decoder.
        out_channels: channels of the skip connection and of the output.
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose3d(in_channels, out_channels, kernel_size=2, stride=2)
        self.conv = ConvBlock(2 * out_channels, out_channels)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        """(B, in, D, H, W) and skip (B, out, 2D, 2H, 2W) -> (B, out, 2D, 2H, 2W)."""
        return self.conv(torch.cat([self.up(x), skip], dim=1))


class UNet3D(nn.Module):
    """3D U-Net: an encoder of ConvBlocks that halves the size per level, a mirrored decoder with skips.

    Args:
        in_channels: input channels (imaging modalities).
        num_classes: output channels: one logit per class, background included.
        features: channels per level, finest first; its length is the number of levels.

    Input sizes must be divisible by 2 ** (len(features) - 1) on every spatial axis.
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
            x = block(x)
            skips.append(x)
        skips.pop()  # the bottleneck output is x itself
        for up in self.decoder:
            x = up(x, skips.pop())
        return self.head(x)
