from __future__ import annotations

import pytest
import torch

from unet3d import UNet3D

SHAPES = [
    # (in_channels, num_classes, features, input spatial size)
    (1, 2, (4, 8), (8, 8, 8)),
    (1, 3, (4, 8, 16), (16, 24, 8)),
    (4, 5, (4, 8, 16, 32), (16, 16, 32)),
    (2, 3, (2, 4, 8, 16, 20), (32, 16, 48)),
]


@pytest.mark.parametrize(("in_channels", "num_classes", "features", "size"), SHAPES)
def test_output_shape(in_channels, num_classes, features, size):
    model = UNet3D(in_channels, num_classes, features)
    out = model(torch.randn(2, in_channels, *size))
    assert out.shape == (2, num_classes, *size)


def test_default_width_is_nnunet():
    model = UNet3D(1, 3)
    assert model.features == (32, 64, 128, 256, 320)
    assert [b[0].out_channels for b in model.encoder] == [32, 64, 128, 256, 320]
    assert model.size_divisor == 16
    assert isinstance(model.encoder[1][0], torch.nn.Conv3d) and model.encoder[1][0].stride == (2, 2, 2)
    assert isinstance(model.encoder[0][1], torch.nn.InstanceNorm3d)
    assert isinstance(model.encoder[0][2], torch.nn.LeakyReLU)


@pytest.mark.parametrize(
    ("features", "size"),
    [((4, 8, 16), (10, 16, 16)), ((4, 8), (8, 8, 7)), ((4, 8, 16, 32), (16, 16, 20))],
)
def test_rejects_indivisible_sizes(features, size):
    model = UNet3D(1, 2, features)
    with pytest.raises(ValueError, match=r"not divisible by \d+") as err:
        model(torch.randn(1, 1, *size))
    assert str(tuple(size)) in str(err.value)


def test_rejects_wrong_channels_and_bad_arguments():
    with pytest.raises(ValueError, match=r"\(B, 2, D, H, W\)"):
        UNet3D(2, 2, (4, 8))(torch.randn(1, 1, 8, 8, 8))
    with pytest.raises(ValueError, match="at least two"):
        UNet3D(1, 2, (4,))
    with pytest.raises(ValueError, match="num_classes"):
        UNet3D(1, 0, (4, 8))


def test_skips_are_used():
    """Perturbing the input near one voxel changes the output there at full resolution."""
    torch.manual_seed(0)
    model = UNet3D(1, 2, (4, 8, 16)).eval()
    x = torch.randn(1, 1, 16, 16, 16)
    y = x.clone()
    y[..., 3, 3, 3] += 5
    with torch.no_grad():
        diff = (model(x) - model(y)).abs().sum(1)[0]
    assert diff[3, 3, 3] > 0 and diff[12:, 12:, 12:].max() < diff[3, 3, 3]
