"""Models that predict together: one checkpoint, an ensemble of several (their softmax averaged, each after
its own mirroring TTA), or the folds of a cross-validation (each case predicted by the fold that held it
out). They must share their classes and their preprocessing (the plan's), so one planned image serves all."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data.geometry import to_native, to_native_probabilities
from data.msd import DatasetSpec
from data.plan import Plan, legacy_plan
from data.preprocess import Planned, preprocess
from unet3d.checkpoint import load_model
from unet3d.inference import postprocess
from unet3d.inference.sliding_window import InferenceSettings, for_resampling, predict_probabilities
from unet3d.model import UNet3D, fit_patch
from unet3d.precision import apply_memory_format


@dataclass
class Member:
    """One model and how it predicts."""

    source: str
    model: UNet3D
    checkpoint: dict[str, Any]  # what was loaded with it: config, class_names, plan, split
    window: tuple[int, int, int] | None  # None: fitted to each case (bare state dicts)

    @property
    def config(self) -> dict[str, Any] | None:
        return self.checkpoint.get("config")


@dataclass(frozen=True, kw_only=True)
class Options:
    """The inference settings shared by every member (from evaluate.py's command line)."""

    overlap: float = 0.5
    sw_batch_size: int | None = None  # None: each member's training batch size
    amp_dtype: torch.dtype | None = None
    memory_format: torch.memory_format = torch.contiguous_format
    tta: bool = False
    window: tuple[int, int, int] | None = None  # None: each member's training patch


def load_members(paths: Sequence[str], device: torch.device, overrides: dict[str, Any], options: Options) -> list:
    members = []
    for path in paths:
        model, checkpoint = load_model(path, device, overrides)
        apply_memory_format(model, options.memory_format)
        cfg = checkpoint.get("config")
        window = options.window or (tuple(cfg["patch_size"]) if cfg else None)
        members.append(Member(str(path), model, checkpoint, window))
    return members


def image_channels(member: Member) -> int:
    """The channels of the images the member reads: its model's input, less the plan's acquisition channel."""
    plan = member.checkpoint.get("plan")
    return member.model.in_channels - (Plan.from_dict(plan).extra_channels if plan else 0)


def member_plan(member: Member, spec: DatasetSpec, note) -> Plan:
    """The plan the member was trained with; checkpoints from before plans, and bare state dicts, use their
    cases as stored (plan "none"), as they were trained, which `note` is told."""
    if "plan" in member.checkpoint:
        return Plan.from_dict(member.checkpoint["plan"])
    cfg = member.config or {}
    what = "is from before plans" if cfg else "is a bare state dict"
    note(f"note: {member.source} {what}: cases are used as stored (plan none: no reorientation, resampling or crop)")
    return legacy_plan(spec.modalities, cfg.get("patch_size", (128, 128, 128)), member.model.features)


class Predictor:
    """Predicts cases with its members on one device, in their shared plan's space, back to each file's grid."""

    def __init__(self, members: list[Member], plan: Plan, class_names: Sequence[str], options: Options,
                 device: torch.device, rules: dict[str, Any] | None = None) -> None:  # fmt: skip
        self.members, self.plan, self.class_names = members, plan, list(class_names)
        self.options, self.device, self.rules = options, device, rules or {}
        self.in_channels = image_channels(members[0])  # the images' own channels

    def settings(self, member: Member, planned_shape: Sequence[int]) -> InferenceSettings:
        o, divisor, cfg = self.options, member.model.size_divisor, member.config or {}
        window = member.window or fit_patch((128, 128, 128), planned_shape, divisor)
        if any(w % d for w, d in zip(window, divisor)):
            raise ValueError(f"--window {window}: each size must be divisible by {divisor}")
        if o.window is not None:  # a window beyond the case is cut to it (rounded up to a size the model takes):
            # the rest would be padding, whose memory (--window 1000: every case padded to 1000^3) and zeros
            # (in the normalisation's statistics) buy nothing; never below the training patch, so a window
            # of the patch's size predicts as validation does
            patch = tuple(cfg["patch_size"]) if cfg else (0, 0, 0)
            cut = fit_patch(window, planned_shape, divisor)
            window = tuple(max(c, min(w, p)) for c, w, p in zip(cut, window, patch))
        batch = o.sw_batch_size if o.sw_batch_size is not None else cfg.get("batch_size", 2)
        return InferenceSettings(
            window=window, overlap=o.overlap, sw_batch_size=batch, amp_dtype=o.amp_dtype, tta=o.tta
        )

    def probabilities(self, planned: Planned, members: Sequence[Member] | None = None) -> torch.Tensor:
        """(K, *planned_shape) softmax averaged over the members (all, or the ones given)."""
        members = members or self.members
        total = None
        for member in members:
            settings = self.settings(member, planned.image.shape[1:])
            probs = predict_probabilities(member.model, planned.image, settings, self.device)
            if total is not None and total.device != probs.device:  # one member's stitched on the host: sum there
                total, probs = total.cpu(), probs.cpu()
            total = probs if total is None else total.add_(probs)
        return total.div_(len(members))

    def predict(
        self, image: np.ndarray, affine: np.ndarray, label: np.ndarray | None = None,
        members: Sequence[Member] | None = None, with_probabilities: bool = False,
    ) -> tuple[np.ndarray, Planned, torch.Tensor, np.ndarray | None]:  # fmt: skip
        """(labels on the file's grid, the planned case, planned probabilities, probabilities on the file's
        grid (float16) when asked) for `image` (C, X, Y, Z) as read with `affine`; the post-processing rules
        are applied to the labels. A `label` is brought into the planned space too (for pictures)."""
        planned = preprocess(image, affine, self.plan, label, len(self.class_names))
        probs = self.probabilities(planned, members)
        back = for_resampling(probs, planned.geometry.cropped_shape)
        labels = postprocess.apply(to_native(back, planned.geometry), self.rules, self.class_names)
        native = to_native_probabilities(back, planned.geometry) if with_probabilities else None
        return labels, planned, probs, native


def check_members(members: Sequence[Member], plans: Sequence[Plan], names: Sequence[Sequence[str]]) -> None:
    """Members must share their classes, their input channels and their preprocessing."""
    first = members[0]
    for member, plan, classes in zip(members[1:], plans[1:], names[1:]):
        if list(classes) != list(names[0]):
            raise ValueError(f"{member.source} predicts {list(classes)}, {first.source} {list(names[0])}")
        if member.model.in_channels != first.model.in_channels:
            raise ValueError(f"{member.source} takes {member.model.in_channels} channel(s), {first.source} "
                             f"{first.model.in_channels}")  # fmt: skip
        if plan.preprocessing() != plans[0].preprocessing():
            raise ValueError(
                f"{member.source} was trained on other preprocessing than {first.source} (plans "
                f"{plan.digest()} and {plans[0].digest()}): they cannot share one planned image"
            )


def output_name(out: Path, case: str) -> Path:
    return out / f"{case}.nii.gz"
