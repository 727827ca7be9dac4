"""Soft Dice and Dice + cross-entropy losses for multi-class 3D segmentation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def target_probabilities(target: torch.Tensor, num_classes: int, dtype: torch.dtype) -> torch.Tensor:
    """Class probabilities (B, C, *size) of a target: integer labels (B, *size) one-hot, or a soft label
    (B, 3, *size) uint8 (`data.patches`: label, runner-up class, runner-up's share in 255ths) as
    (1 - share) on the label and share on the runner-up."""
    if is_soft(target):
        label, runner = target[:, 0].long(), target[:, 1].long()
        share = target[:, 2:3].to(dtype) / 255
        onehot = F.one_hot(label, num_classes).movedim(-1, 1).to(dtype)
        return onehot * (1 - share) + F.one_hot(runner, num_classes).movedim(-1, 1).to(dtype) * share
    return F.one_hot(target.long(), num_classes).movedim(-1, 1).to(dtype)


def is_soft(target: torch.Tensor) -> bool:
    """Whether `target` is a soft label (B, 3, X, Y, Z) uint8 rather than labels (B, X, Y, Z)."""
    return target.ndim == 5 and target.dtype == torch.uint8


class DiceLoss(nn.Module):
    """1 - soft Dice over softmax probabilities, per case and class, averaged.

    Dice is computed per case (not over the whole batch) so that the loss of a batch is the mean of its
    cases' losses: DDP's gradient averaging over ranks then equals one process seeing the whole batch.
    The smoothing term in numerator and denominator makes a class that is absent from a case and
    not predicted there score Dice 1 (loss 0) instead of 0/0.

    Args:
        include_background: whether class 0 takes part in the mean (nnU-Net leaves it out).
        smooth: added to numerator and denominator.
    """

    def __init__(self, include_background: bool = False, smooth: float = 1.0) -> None:
        super().__init__()
        if smooth <= 0:
            raise ValueError(f"smooth must be > 0, got {smooth}")
        self.include_background = include_background
        self.smooth = smooth

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Args:
            logits: (B, C, D, H, W) raw scores.
            target: (B, D, H, W) integer labels in [0, C), or a soft label (B, 3, D, H, W) uint8
                (`target_probabilities`).

        Returns:
            scalar loss in [0, 1].
        """
        num_classes = logits.shape[1]
        if not self.include_background and num_classes < 2:
            raise ValueError("without background the loss needs at least 2 classes")
        probs = torch.softmax(logits.float(), dim=1)
        onehot = target_probabilities(target, num_classes, probs.dtype)  # (B, C, D, H, W)
        dims = tuple(range(2, logits.ndim))
        intersection = (probs * onehot).sum(dims)  # (B, C)
        denominator = probs.sum(dims) + onehot.sum(dims)
        dice = (2 * intersection + self.smooth) / (denominator + self.smooth)
        if not self.include_background:
            dice = dice[:, 1:]
        return 1 - dice.mean()


class DiceCELoss(nn.Module):
    """Soft Dice loss plus voxel-wise cross-entropy, weighted equally (as nnU-Net trains).

    Args:
        include_background: passed to DiceLoss.
        smooth: passed to DiceLoss.
    """

    def __init__(self, include_background: bool = False, smooth: float = 1.0) -> None:
        super().__init__()
        self.dice = DiceLoss(include_background=include_background, smooth=smooth)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """logits (B, C, D, H, W), target (B, D, H, W) labels or a soft label (B, 3, D, H, W) -> scalar loss."""
        if is_soft(target):
            probs = target_probabilities(target, logits.shape[1], torch.float32)
            return self.dice(logits, target) + F.cross_entropy(logits.float(), probs)
        return self.dice(logits, target) + F.cross_entropy(logits.float(), target.long())


def build_loss(name: str, model: nn.Module | None = None) -> nn.Module:
    """`dice` or `dice_ce` -> the loss module; over every output of a deeply supervised `model`."""
    losses = {"dice": DiceLoss, "dice_ce": DiceCELoss}
    if name not in losses:
        raise ValueError(f"unknown loss {name!r}; choose one of {sorted(losses)}")
    loss = losses[name]()
    if model is not None and getattr(model, "deep_supervision", False):
        return DeepSupervisionLoss(loss, model.supervision_scales())
    return loss


def supervision_weights(count: int) -> list[float]:
    """nnU-Net's weights of deep-supervision outputs, finest first: halved per level, normalised to 1 (the
    outputs here already leave out the coarsest decoder level, which nnU-Net weights 0)."""
    weights = [0.5**i for i in range(count)]
    return [w / sum(weights) for w in weights]


class DeepSupervisionLoss(nn.Module):
    """`loss` on each output of a deeply supervised model against the label downsampled to its resolution
    (nearest neighbour: every s-th voxel), weighted by `supervision_weights`.

    Args:
        loss: maps (logits (B, C, *size), target (B, *size)) to a scalar.
        scales: each output's downsampling factor per axis (`UNet3D.supervision_scales()`), finest first.
    """

    def __init__(self, loss: nn.Module, scales: list[tuple[int, int, int]]) -> None:
        super().__init__()
        self.loss = loss
        self.scales = [tuple(s) for s in scales]
        self.weights = supervision_weights(len(scales))

    def targets(self, target: torch.Tensor) -> list[torch.Tensor]:
        """The label (B, X, Y, Z), or soft label (B, 3, X, Y, Z), at every output's resolution."""
        return [target[..., :: s[0], :: s[1], :: s[2]] for s in self.scales]

    def forward(self, outputs: torch.Tensor | list[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        if isinstance(outputs, torch.Tensor):
            return self.loss(outputs, target)  # eval mode: the full-resolution logits only
        return sum(w * self.loss(o, t) for w, o, t in zip(self.weights, outputs, self.targets(target)))
