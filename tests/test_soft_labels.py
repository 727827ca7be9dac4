"""Soft training targets: a boundary voxel of a case resampled to a coarser grid keeps the shares of its two
leading classes (data.geometry.resample_label_shares), patches and augmentation carry them
(data.patches, data.augment), and the loss trains towards them (unet3d.loss)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data.augment import augment, spatial_transform
from data.geometry import _resize, resample_label, resample_label_shares, separate_axis, to_native
from data.patches import PreparedCase, foreground_coords, sample_patch
from data.plan import Plan
from data.preprocess import preprocess
from data.synthetic import Acquisition, acquire, draw_phantom, extent
from unet3d.inference.metrics import confusion_counts, dice_from_counts
from unet3d.loss import DeepSupervisionLoss, DiceCELoss, DiceLoss, target_probabilities

FOV = extent(48)
AXIAL = Acquisition("LPS 0.8 x 0.8 x 3 mm", (0, 1, 2), (-1, -1, 1), (0.8, 0.8, 3.0))


def interpolated_masks(label: np.ndarray, shape, axis, num_classes: int) -> np.ndarray:
    """(K, *shape): every class's mask resampled on its own, as the shares are defined."""
    return np.stack(
        [
            _resize(torch.from_numpy((label == k).astype(np.float32))[None], shape, axis)[0].numpy()
            for k in range(num_classes)
        ]
    )


def test_shares_are_the_two_leading_interpolated_masks():
    label = np.random.default_rng(0).integers(0, 4, (13, 11, 9)).astype(np.uint8)
    shape = (8, 7, 5)
    hard, (runner, share) = resample_label_shares(label, shape, None, 4)
    assert np.array_equal(hard, resample_label(label, shape, None, 4)), "the label is resample_label's"
    masks = interpolated_masks(label, shape, None, 4)
    order = np.sort(masks, axis=0)
    p1, p2 = order[-1], order[-2]
    assert np.abs(share.astype(int) - np.round(255 * p2 / (p1 + p2))).max() <= 1
    picked = np.take_along_axis(masks, runner[None].astype(int), 0)[0]
    mixed = share > 0
    assert mixed.mean() > 0.5, "random labels: most planned voxels hold two classes"
    assert np.allclose(picked[mixed], p2[mixed], atol=1e-6), "the runner-up is a class with the second share"
    assert np.all(runner[mixed] != hard[mixed])
    assert np.all(runner[~mixed] == 0)


def test_a_grid_that_is_not_resampled_has_no_shares():
    label = np.random.default_rng(1).integers(0, 3, (6, 7, 8)).astype(np.uint8)
    hard, share = resample_label_shares(label, label.shape, None, 3)
    assert np.array_equal(hard, label) and share.shape == (2, 6, 7, 8) and not share.any()


def test_soft_targets_keep_the_boundaries_that_a_coarser_grid_loses():
    """A 0.8 x 0.8 x 3 mm scan planned at 1 mm: the planned hard label, taken back to the scan's grid as a
    prediction would be, misses boundaries by up to half a planned voxel; the soft targets put them back."""
    image, label, affine = acquire(draw_phantom(np.random.default_rng([0, 5]), FOV), AXIAL, FOV)
    plan = Plan(
        orientation="RAS", spacing=(1.0, 1.0, 1.0), spacing_rule="fixed", crop="nonzero",
        normalization=({"modality": "MRI", "scheme": "zscore"},), median_shape=(48, 48, 48),
        median_spacing=(1.0, 1.0, 1.0), patch_size=(32, 32, 32), features=(8,), kernels=((3, 3, 3),),
        strides=((1, 1, 1),),
    )  # fmt: skip
    planned = preprocess(image[None], affine, plan, label, 3)
    assert planned.label_share is not None and planned.label_share[1].any()

    def dice_back(probs: torch.Tensor) -> float:
        back = torch.from_numpy(to_native(probs, planned.geometry))
        return float(dice_from_counts(confusion_counts(back, torch.from_numpy(label), 3))[1:].mean())

    soft = np.concatenate([planned.label[None], planned.label_share])[None]
    hard_dice = dice_back(target_probabilities(torch.from_numpy(planned.label[None]), 3, torch.float32)[0])
    soft_dice = dice_back(target_probabilities(torch.from_numpy(soft), 3, torch.float32)[0])
    assert hard_dice < 0.99, f"the hard planned label should lose boundaries here ({hard_dice:.4f})"
    assert soft_dice > 0.995 and soft_dice > hard_dice + 0.015, (hard_dice, soft_dice)


def case_with_shares(shape=(20, 18, 16)) -> PreparedCase:
    rng = np.random.default_rng(2)
    label = np.zeros(shape, np.uint8)
    label[5:12, 4:14, 3:12] = 1
    label[7:9, 6:9, 5:8] = 2
    share = np.zeros((2, *shape), np.uint8)
    share[0] = rng.integers(0, 3, shape)
    share[1] = rng.integers(0, 128, shape)
    image = rng.normal(size=(1, *shape)).astype(np.float32)
    return PreparedCase("c", image, label, foreground_coords(label), label_share=share)


@pytest.mark.parametrize("patch", [(8, 8, 8), (24, 12, 20)])  # inside the case; larger than it (padding)
@pytest.mark.parametrize("transformed", [False, True])
def test_soft_patches_carry_the_same_voxels_as_hard_ones(patch, transformed):
    case = case_with_shares()
    for seed in range(6):
        matrix = spatial_transform(np.random.default_rng(99 + seed), patch) if transformed else None
        if transformed and matrix is None:
            continue
        image, hard = sample_patch(case, patch, np.random.default_rng(seed), seed % 2 == 0, matrix)
        image_s, soft = sample_patch(case, patch, np.random.default_rng(seed), seed % 2 == 0, matrix, soft=True)
        assert soft.shape == (3, *patch) and soft.dtype == np.uint8
        assert np.array_equal(image, image_s) and np.array_equal(soft[0], hard)
        # the runner-up and share come from the same voxels as the label: a volume that encodes positions
        coded = PreparedCase("p", case.image, case.label, case.fg_coords, label_share=case.label_share.copy())
        coded.label_share[1] = (np.arange(case.label.size).reshape(case.label.shape) % 250 + 1).astype(np.uint8)
        _, hard_code = sample_patch(
            PreparedCase("q", case.image, coded.label_share[1], case.fg_coords), patch,
            np.random.default_rng(seed), seed % 2 == 0, matrix,
        )  # fmt: skip
        _, soft_code = sample_patch(coded, patch, np.random.default_rng(seed), seed % 2 == 0, matrix, soft=True)
        assert np.array_equal(soft_code[2], hard_code)


def test_a_case_without_shares_gives_hard_targets():
    case = case_with_shares()
    bare = PreparedCase("b", case.image, case.label, case.fg_coords)
    _, soft = sample_patch(bare, (8, 8, 8), np.random.default_rng(0), True, soft=True)
    assert soft.shape == (3, 8, 8, 8) and not soft[1:].any()


def test_augmentation_mirrors_the_soft_label_with_the_image():
    case = case_with_shares()
    image, soft = sample_patch(case, (10, 12, 14), np.random.default_rng(3), True, soft=True)
    flipped = 0
    for seed in range(8):
        out_image, out_soft = augment(image, soft, np.random.default_rng(seed))
        _, out_hard = augment(image, soft[0], np.random.default_rng(seed))
        assert np.array_equal(out_soft[0], out_hard), "the same draws mirror the soft and the hard label"
        for plane in (1, 2):
            _, moved = augment(image, soft[plane], np.random.default_rng(seed))
            assert np.array_equal(out_soft[plane], moved)
        flipped += not np.array_equal(out_soft, soft)
    assert flipped, "some draw mirrored the patch"


def soft_target(label, runner, share) -> torch.Tensor:
    return torch.tensor([label, runner, share], dtype=torch.uint8).view(1, 3, 1, 1, 1).expand(1, 3, 2, 2, 2)


def test_target_probabilities_split_a_voxel_between_its_two_classes():
    probs = target_probabilities(soft_target(2, 1, 51), 4, torch.float32)
    assert probs.shape == (1, 4, 2, 2, 2)
    assert torch.allclose(probs[0, :, 0, 0, 0], torch.tensor([0.0, 0.2, 0.8, 0.0]))
    hard = torch.full((1, 2, 2, 2), 3)
    assert torch.equal(target_probabilities(hard, 4, torch.float32)[0, :, 0, 0, 0], torch.tensor([0.0, 0, 0, 1]))


def test_the_loss_of_a_soft_label_without_shares_is_the_hard_loss():
    logits = torch.randn(2, 3, 6, 5, 4)
    hard = torch.randint(0, 3, (2, 6, 5, 4))
    soft = torch.stack([hard, torch.randint(0, 3, hard.shape), torch.zeros_like(hard)], 1).to(torch.uint8)
    for loss in (DiceLoss(), DiceCELoss()):
        assert torch.allclose(loss(logits, soft), loss(logits, hard), atol=1e-6)


def test_training_on_a_soft_target_learns_the_share():
    """One voxel with 30 % of class 1 beside class 0: cross-entropy with the soft target is least where the
    predicted probability is 0.3, where the hard target drives it to 0."""
    logits = torch.zeros(1, 2, 2, 2, 2, requires_grad=True)
    target = soft_target(0, 1, round(0.3 * 255))
    optimizer = torch.optim.SGD([logits], lr=1.0)
    for _ in range(300):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(logits, target_probabilities(target, 2, torch.float32)).backward()
        optimizer.step()
    p = torch.softmax(logits, 1)[0, 1]
    assert torch.allclose(p, torch.full_like(p, 0.3), atol=0.01)
    # and DiceCELoss takes the soft target as such: its gradient differs from the hard label's
    logits = torch.zeros(1, 2, 2, 2, 2, requires_grad=True)
    DiceCELoss()(logits, target).backward()
    soft_grad = logits.grad.clone()
    logits.grad = None
    DiceCELoss()(logits, target[:, 0]).backward()
    assert not torch.allclose(soft_grad, logits.grad)


def test_deep_supervision_subsamples_a_soft_label_like_a_hard_one():
    soft = torch.randint(0, 3, (2, 3, 8, 8, 8), dtype=torch.uint8)
    loss = DeepSupervisionLoss(DiceLoss(), [(1, 1, 1), (2, 2, 1), (4, 4, 2)])
    for s, t, h in zip(loss.scales, loss.targets(soft), loss.targets(soft[:, 0])):
        assert t.shape == (2, 3, 8 // s[0], 8 // s[1], 8 // s[2]) and torch.equal(t[:, 0], h)


def test_separate_axis_resampling_gives_shares_too():
    label = np.zeros((12, 12, 4), np.uint8)
    label[3:7] = 1
    label[..., 2:] = 2
    shape = (30, 30, 12)
    axis = separate_axis((1, 1, 3), (0.4, 0.4, 1))
    hard, (runner, share) = resample_label_shares(label, shape, axis, 3)
    masks = interpolated_masks(label, shape, axis, 3)
    p = np.sort(masks, 0)
    assert np.array_equal(hard, resample_label(label, shape, axis, 3))
    assert np.abs(share.astype(int) - np.round(255 * p[-2] / (p[-1] + p[-2]))).max() <= 1
