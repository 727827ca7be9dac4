"""Checkpoint I/O: atomic saves, safe loads onto a chosen device, and wrapper-prefix stripping."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from unet3d.files import atomic_write, remove_stale_temps
from unet3d.model import UNet3D

WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP / DataParallel, torch.compile


class CheckpointError(ValueError):
    """A checkpoint file exists but cannot be used."""


def save_checkpoint(state: Mapping[str, Any], path: str | Path, previous: str | Path | None = None) -> None:
    """Write `state` to `path` atomically and durably (`unet3d.files.atomic_write`).

    A reader never sees a half-written file; on failure (a full disk, say) the checkpoints already there
    are left as they were. With `previous`, the file `path` held until now is kept under that name, so one
    unreadable checkpoint never leaves nothing to resume from.
    """
    remove_stale_temps(path)  # a half-written checkpoint of a process killed here before
    atomic_write(path, lambda f: torch.save(dict(state), f), durable=True, previous=previous)


def load_checkpoint(path: str | Path, device: torch.device | str) -> dict[str, Any]:
    """Load a checkpoint with every tensor mapped to `device`, refusing pickled code (weights_only).

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: the file is empty, truncated, corrupted, not a dict, or would run code.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # zip, pickle and EOF errors all mean the same here: unusable
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot read checkpoint {path}: {reason}") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"cannot read checkpoint {path}: holds a {type(state).__name__}, not a dict")
    return state


def load_resumable(
    candidates: Iterable[str | Path], device: torch.device | str, required: Iterable[str], warn
) -> tuple[Path, dict[str, Any]] | None:
    """The first of `candidates` that exists and loads with the `required` keys; None if none exists.

    A candidate that exists but can't be used is reported through `warn` and the next one is tried;
    when files exist and none can be used, that is an error, never a silent fresh start.
    """
    problems = []
    for candidate in map(Path, candidates):
        if not candidate.exists():
            continue
        try:
            state = load_checkpoint(candidate, device)
            missing = sorted(set(required) - state.keys())
            if missing:
                raise CheckpointError(f"cannot resume from {candidate}: it lacks {missing}")
        except CheckpointError as e:
            problems.append(str(e))
            warn(f"{e}; trying the previous checkpoint")
            continue
        return candidate, state
    if problems:
        raise CheckpointError(
            "no usable checkpoint to resume from: " + "; ".join(problems) + " (--resume none starts over)"
        )
    return None


def strip_wrapper_prefixes(state_dict: Mapping[str, Any], expected_keys: Iterable[str] | None = None) -> dict[str, Any]:
    """Remove the `module.` and `_orig_mod.` prefixes that wrappers put in front of every key.

    A prefix is a wrapper's only when every key carries it, so a model's own submodule called `module`
    (or `module_a`) is left alone. When `expected_keys` is given, the first stripping stage whose keys
    equal them wins, which settles the rare model whose every key really starts with `module.`.
    """
    current = dict(state_dict)
    expected = set(expected_keys) if expected_keys is not None else None
    while True:
        if expected is not None and set(current) == expected:
            return current
        prefix = next((p for p in WRAPPER_PREFIXES if current and all(k.startswith(p) for k in current)), None)
        if prefix is None:
            return current
        current = {k[len(prefix) :]: v for k, v in current.items()}


def state_dict_of(checkpoint: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """The model weights in a loaded file: train_ddp.py's `model` entry, a `state_dict` entry, or the
    whole mapping when it is a bare state dict (as `torch.save(model.state_dict())` writes)."""
    for key in ("model", "state_dict"):
        inner = checkpoint.get(key)
        if isinstance(inner, Mapping) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
            return dict(inner)
    if checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
        return dict(checkpoint)
    raise ValueError(f"no model weights found: keys are {sorted(checkpoint)[:10]}")


def infer_model_args(state_dict: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """UNet3D's arguments read off the weight shapes of an unprefixed state dict: in_channels, num_classes,
    features, and each level's kernel (its first convolution's) and stride (its up-convolution's kernel)."""
    try:
        features, kernels = [], []
        while f"encoder.{len(features)}.0.weight" in state_dict:
            weight = state_dict[f"encoder.{len(features)}.0.weight"]
            features.append(int(weight.shape[0]))
            kernels.append([int(k) for k in weight.shape[2:]])
        levels = len(features)
        # decoder[j] brings level levels-1-j up to levels-2-j with the stride that reached levels-1-j
        strides = [[1, 1, 1]] + [
            [int(k) for k in state_dict[f"decoder.{levels - 1 - i}.up.weight"].shape[2:]] for i in range(1, levels)
        ]
        in_channels = int(state_dict["encoder.0.0.weight"].shape[1])
        num_classes = int(state_dict["head.weight"].shape[0])
    except KeyError as e:
        raise ValueError(
            f"cannot infer the U-Net's shape: the weights have no {e}; give --in-channels, --num-classes and --features"
        ) from e
    return {
        "in_channels": in_channels,
        "num_classes": num_classes,
        "features": features,
        "kernels": kernels,
        "strides": strides,
        "deep_supervision": "aux_heads.0.weight" in state_dict,
    }


def load_weights(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], source: str | Path) -> None:
    """Load wrapper-stripped weights into `model`; a mismatch names the missing, unexpected and misshapen keys."""
    own = model.state_dict()
    weights = strip_wrapper_prefixes(state_dict, own.keys())
    missing = sorted(own.keys() - weights.keys())
    unexpected = sorted(weights.keys() - own.keys())
    misshapen = sorted(
        f"{k} {tuple(weights[k].shape)} vs {tuple(own[k].shape)}"
        for k in own.keys() & weights.keys()
        if weights[k].shape != own[k].shape
    )
    if missing or unexpected or misshapen:

        def show(keys: list[str]) -> str:
            return ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "") or "none"

        raise ValueError(
            f"{source} does not fit the model: missing keys: {show(missing)}; unexpected keys: {show(unexpected)}; "
            f"shape mismatches: {show(misshapen)}"
        )
    model.load_state_dict(weights)


def load_model(
    path: str | Path, device: torch.device, overrides: dict[str, Any] | None = None
) -> tuple[UNet3D, dict[str, Any]]:
    """(UNet3D on `device` in eval mode, the checkpoint's other entries: its `config`, `class_names`, `plan`, if any;
    not its weights, optimizer or scaler state, nor any tensor).

    Reads train_ddp.py's checkpoints (which carry the architecture) and bare state dicts of any wrapper
    (the architecture read off the weight shapes); `overrides` replace model arguments that are not None.
    """
    checkpoint = load_checkpoint(path, "cpu")  # the weights are copied to `device` by the model's loading
    weights = state_dict_of(checkpoint)
    model_args = checkpoint.get("model_args") or infer_model_args(strip_wrapper_prefixes(weights))
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if "features" in given and len(given["features"]) != len(model_args["features"]):
        model_args = {k: v for k, v in model_args.items() if k not in ("kernels", "strides")}  # the defaults
    model_args = {**model_args, **given}
    model = UNet3D(**model_args).to(device)
    load_weights(model, weights, path)
    # what callers read (config, class_names, plan, split...); not the weights or the optimizer's moments,
    # which would stay in memory beside the model for as long as the caller keeps the checkpoint
    heavy = ("model", "state_dict", "optimizer", "scaler")
    kept = {k: v for k, v in checkpoint.items() if k not in heavy and not isinstance(v, torch.Tensor)}
    return model.eval(), kept
