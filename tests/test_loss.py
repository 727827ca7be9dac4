from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from unet3d import DiceCELoss, DiceLoss
from unet3d.loss import build_loss


def confident_logits(label: torch.Tensor, num_classes: int, scale: float = 50.0) -> torch.Tensor:
    """(B, X, Y, Z) labels -> logits whose softmax is (almost exactly) the one-hot of the labels."""
    return F.one_hot(label, num_classes).movedim(-1, 1).float() * scale


@pytest.fixture
def label() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randint(0, 3, (2, 6, 6, 6))


def test_perfect_prediction_is_zero(label):
    for include_background in (True, False):
        loss = DiceLoss(include_background)(confident_logits(label, 3), label)
        assert loss.item() == pytest.approx(0.0, abs=1e-4)


def test_disjoint_prediction_is_one():
    label = torch.zeros(1, 8, 8, 8, dtype=torch.long)
    label[:, :4] = 1
    wrong = 1 - label
    loss = DiceLoss(include_background=True, smooth=1e-6)(confident_logits(wrong, 2), label)
    assert loss.item() == pytest.approx(1.0, abs=1e-4)


def test_hand_computed_value():
    # One case, 2 classes, 4 voxels; probabilities of class 1 chosen by hand.
    p1 = torch.tensor([0.9, 0.8, 0.3, 0.2])
    logits = torch.stack([torch.zeros(4), torch.log(p1 / (1 - p1))]).reshape(1, 2, 1, 1, 4)
    target = torch.tensor([1, 1, 0, 0]).reshape(1, 1, 1, 4)
    # class 1: intersection 1.7, sums 2.2 + 2 -> (3.4 + s) / (4.2 + s)
    # class 0: probs 0.1, 0.2, 0.7, 0.8; intersection 1.5, sums 1.8 + 2 -> (3 + s) / (3.8 + s)
    s = 1.0
    d1, d0 = (3.4 + s) / (4.2 + s), (3.0 + s) / (3.8 + s)
    assert DiceLoss(False, s)(logits, target).item() == pytest.approx(1 - d1, abs=1e-6)
    assert DiceLoss(True, s)(logits, target).item() == pytest.approx(1 - (d0 + d1) / 2, abs=1e-6)
    ce = -(torch.log(p1[:2]).sum() + torch.log(1 - p1[2:]).sum()) / 4
    assert DiceCELoss(False, s)(logits, target).item() == pytest.approx(1 - d1 + ce.item(), abs=1e-6)


def test_absent_class():
    label = torch.zeros(2, 6, 6, 6, dtype=torch.long)
    label[:, :3] = 1  # class 2 absent everywhere
    perfect = DiceLoss()(confident_logits(label, 3), label)
    assert perfect.item() == pytest.approx(0.0, abs=1e-4)
    wrong = label.clone()
    wrong[:, 3:] = 2  # predicts the absent class over half the volume
    assert DiceLoss()(confident_logits(wrong, 3), label).item() > 0.4


def test_loss_is_mean_over_cases(label):
    """Per-case Dice: a batch's loss is the mean of its cases' losses (what DDP averaging assumes)."""
    logits = torch.randn(2, 3, 6, 6, 6)
    for loss_fn in (DiceLoss(), DiceCELoss()):
        whole = loss_fn(logits, label)
        halves = (loss_fn(logits[:1], label[:1]) + loss_fn(logits[1:], label[1:])) / 2
        assert whole.item() == pytest.approx(halves.item(), abs=1e-6)


def test_gradients_are_finite(label):
    logits = torch.randn(2, 3, 6, 6, 6, requires_grad=True)
    for name in ("dice", "dice_ce"):
        logits.grad = None
        build_loss(name)(logits, label).backward()
        assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown loss 'focal'"):
        build_loss("focal")
    with pytest.raises(ValueError, match="smooth"):
        DiceLoss(smooth=0)
