from __future__ import annotations

import pytest
import torch

from unet3d import UNet3D
from unet3d.model import plan_topology

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
    assert model.size_divisor == (16, 16, 16)
    assert isinstance(model.encoder[1][0], torch.nn.Conv3d) and model.encoder[1][0].stride == (2, 2, 2)
    assert model.encoder[0][0].bias is None, "no bias before a normalisation"
    assert isinstance(model.encoder[0][2], torch.nn.LeakyReLU)


def test_normalisation_is_instance_norm():
    torch.manual_seed(0)
    norm = UNet3D(1, 2, (4, 8)).encoder[0][1]
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2)
        norm.bias.uniform_(-1, 1)
    reference = torch.nn.InstanceNorm3d(4, affine=True)
    reference.load_state_dict(norm.state_dict())
    x = torch.randn(3, 4, 5, 6, 7) * 4 + 2
    torch.testing.assert_close(norm(x), reference(x), rtol=1e-5, atol=1e-5)


def test_tiny_feature_maps_run_in_float32_under_autocast():
    """Under bf16 autocast the blocks on 2x2x2 maps run in fp32; the others stay in bf16; gradients are finite."""
    torch.manual_seed(0)
    model = UNet3D(1, 3, (4, 8, 16, 32, 32))
    dtypes = {}
    for name, module in [
        ("first", model.encoder[0]),
        ("bottleneck", model.encoder[4]),
        ("up_from_2", model.decoder[0]),
        ("up_from_4", model.decoder[1]),
    ]:
        module.register_forward_hook(lambda m, i, o, name=name: dtypes.update({name: o.dtype}))
    x = torch.randn(2, 1, 32, 32, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    assert dtypes == {
        "first": torch.bfloat16,
        "bottleneck": torch.float32,
        "up_from_2": torch.float32,
        "up_from_4": torch.bfloat16,
    }
    out.float().logsumexp(1).mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    dtypes.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(1, 1, 64, 64, 64))
    assert dtypes["bottleneck"] == torch.bfloat16, "4x4x4 maps stay in bf16"
    dtypes.clear()
    model(x)
    assert set(dtypes.values()) == {torch.float32}


@pytest.mark.parametrize(
    ("features", "size"),
    [((4, 8, 16), (10, 16, 16)), ((4, 8), (8, 8, 7)), ((4, 8, 16, 32), (16, 16, 20))],
)
def test_rejects_indivisible_sizes(features, size):
    model = UNet3D(1, 2, features)
    with pytest.raises(ValueError, match=r"not divisible by \(\d+, \d+, \d+\)") as err:
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


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    model = UNet3D(2, 3, (4, 8, 16))
    x = torch.randn(2, 2, 16, 16, 8)
    grads = []
    for recompute in (False, True):
        model.zero_grad()
        model.grad_checkpoint = recompute
        model(x).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for plain, recomputed in zip(*grads):
        torch.testing.assert_close(recomputed, plain, rtol=1e-5, atol=1e-6)


def test_checkpointed_blocks_store_fewer_activations():
    """Saved tensors for backward: with recomputation only the block inputs are kept."""
    torch.manual_seed(0)
    model = UNet3D(1, 2, (4, 8, 16))
    x = torch.randn(1, 1, 32, 32, 32)
    saved = []
    for recompute in (False, True):
        model.grad_checkpoint = recompute
        sizes: list[int] = []

        def pack(t, sizes=sizes):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x).sum()
        saved.append(sum(sizes))
    assert saved[1] < saved[0] / 2


ANISOTROPIC = [
    # (in_channels, num_classes, features, kernels, strides, input size)
    (1, 3, (4, 8, 16), [(3, 3, 1), (3, 3, 1), (3, 3, 3)], [(1, 1, 1), (2, 2, 1), (2, 2, 2)], (16, 16, 4)),
    (2, 2, (4, 8), [3, 3], [1, (1, 2, 2)], (8, 16, 16)),
]


@pytest.mark.parametrize(("in_channels", "num_classes", "features", "kernels", "strides", "size"), ANISOTROPIC)
def test_per_level_kernels_and_strides(in_channels, num_classes, features, kernels, strides, size):
    model = UNet3D(in_channels, num_classes, features, kernels, strides)
    out = model(torch.randn(2, in_channels, *size))
    assert out.shape == (2, num_classes, *size)
    first = model.encoder[0][0]
    assert first.kernel_size == model.kernels[0] and first.padding == tuple(k // 2 for k in model.kernels[0])
    expected = tuple(int(torch.tensor([s[a] for s in model.strides]).prod()) for a in range(3))
    assert model.size_divisor == expected


def test_bad_kernels_and_strides_are_refused():
    with pytest.raises(ValueError, match="one entry per level"):
        UNet3D(1, 2, (4, 8), kernels=[3])
    with pytest.raises(ValueError, match="odd"):
        UNet3D(1, 2, (4, 8), kernels=[3, 2])
    with pytest.raises(ValueError, match="first level's stride must be 1"):
        UNet3D(1, 2, (4, 8), strides=[2, 2])


def test_topology_for_thick_slices_pools_in_plane_first():
    """0.8 x 0.8 x 5 mm: the first levels pool in-plane only (and convolve 3x3x1) until the voxels are nearly
    isotropic; then every axis, as nnU-Net's planner does."""
    kernels, strides = plan_topology((0.8, 0.8, 5.0), (192, 160, 48), 6)
    assert strides[:3] == [(1, 1, 1), (2, 2, 1), (2, 2, 1)]
    assert kernels[:2] == [(3, 3, 1), (3, 3, 1)] and kernels[2:] == [(3, 3, 3)] * (len(kernels) - 2)
    assert all(s == (2, 2, 2) for s in strides[3:5])
    isotropic_kernels, isotropic = plan_topology((1.0, 1.0, 1.0), (128, 128, 128), 6)
    assert isotropic == [(1, 1, 1)] + [(2, 2, 2)] * 5 and isotropic_kernels == [(3, 3, 3)] * 6
    _, short = plan_topology((1.0, 1.0, 1.0), (128, 128, 16), 6)
    assert [s[2] for s in short] == [1, 2, 2, 1, 1, 1], "an axis is not pooled below 4 voxels"


def test_deep_supervision_outputs_targets_and_weights():
    from unet3d.loss import DeepSupervisionLoss, DiceCELoss, build_loss, supervision_weights

    model = UNet3D(1, 3, (4, 8, 16, 32, 32), strides=[1, (2, 2, 1), 2, 2, 2], deep_supervision=True)
    assert model.supervision_scales() == [(1, 1, 1), (2, 2, 1), (4, 4, 2)]
    outputs = model(torch.randn(2, 1, 32, 32, 16))
    assert [tuple(o.shape) for o in outputs] == [(2, 3, 32, 32, 16), (2, 3, 16, 16, 16), (2, 3, 8, 8, 8)]
    weights = supervision_weights(3)
    assert weights == pytest.approx([4 / 7, 2 / 7, 1 / 7]) and sum(weights) == pytest.approx(1)
    loss = build_loss("dice_ce", model)
    assert isinstance(loss, DeepSupervisionLoss) and loss.weights == weights
    label = torch.randint(0, 3, (2, 32, 32, 16))
    targets = loss.targets(label)
    assert [tuple(t.shape) for t in targets] == [(2, 32, 32, 16), (2, 16, 16, 16), (2, 8, 8, 8)]
    assert torch.equal(targets[2], label[:, ::4, ::4, ::2]), "nearest neighbour: every s-th voxel"
    expected = sum(w * DiceCELoss()(o, t) for w, o, t in zip(weights, outputs, targets))
    torch.testing.assert_close(loss(outputs, label), expected)
    model.eval()
    assert isinstance(model(torch.randn(1, 1, 32, 32, 16)), torch.Tensor), "inference sees the full resolution only"
    assert not UNet3D(1, 3, (4, 8, 16)).aux_heads and not isinstance(build_loss("dice"), DeepSupervisionLoss)
