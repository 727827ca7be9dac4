"""Evaluate a checkpoint on one device: `python evaluate.py --checkpoint runs/default/checkpoints/best.pt`.

Rebuilds the model from the checkpoint's stored arguments, predicts every case of the chosen split by
sliding-window inference and prints the Dice per class.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from data.msd import Case, load_dataset_json, split_cases
from data.nifti import load_image, load_label, normalize
from unet3d.checkpoint import load_checkpoint, strip_wrapper_prefixes
from unet3d.metrics import confusion_counts, dice_from_counts
from unet3d.model import UNet3D
from unet3d.validation import predict_case


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a checkpoint written by train_ddp.py")
    parser.add_argument("--data-dir", help="dataset folder (default: the one the checkpoint was trained on)")
    parser.add_argument("--split", choices=("val", "train"), default="val", help="which cases to score")
    parser.add_argument("--device", default=None, help="cpu or cuda:N (default: cuda:0 if available, else cpu)")
    return parser


def load_model(path: str | Path, device: torch.device) -> tuple[UNet3D, dict]:
    """The checkpoint's model on `device` in eval mode, and the checkpoint itself."""
    state = load_checkpoint(path, device)
    model = UNet3D(**state["model_args"]).to(device)
    model.load_state_dict(strip_wrapper_prefixes(state["model"], model.state_dict().keys()))
    return model.eval(), state


def split_of(state: dict, data_dir: str | Path, split: str) -> tuple[list[Case], list[str]]:
    """The cases of `split`, rebuilt from the checkpoint's configuration, and the modalities."""
    spec = load_dataset_json(data_dir)
    cfg = state["config"]
    train, val = split_cases(spec.training, cfg["val_fraction"], cfg["seed"])
    return (val if split == "val" else train), [spec.modality[i] for i in range(spec.in_channels)]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    model, state = load_model(args.checkpoint, device)
    cfg = state["config"]
    cases, modalities = split_of(state, args.data_dir or cfg["data_dir"], args.split)
    names = state["class_names"]
    dice = []
    for case in cases:
        image = normalize(load_image(case.image)[0], modalities)
        label = torch.from_numpy(load_label(case.label)[0]).to(device)
        pred = predict_case(model, image, cfg["patch_size"], device, cfg["val_overlap"])
        dice.append(dice_from_counts(confusion_counts(pred, label, len(names))).cpu().numpy())
    per_class = np.mean(dice, axis=0)[1:]
    for name, value in zip(names[1:], per_class):
        print(f"{name:>20s}  Dice {value:.4f}")
    print(f"{'mean':>20s}  Dice {per_class.mean():.4f}  ({len(cases)} {args.split} case(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
