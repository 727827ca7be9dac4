"""Evaluate a checkpoint on one device: per-case metrics, predictions as NIfTI, a summary and an overview.

    python evaluate.py --checkpoint runs/default/checkpoints/best.pt --split val --out-dir runs/default/eval

Reads checkpoints written by train_ddp.py and bare state dicts (with or without `module.` / `_orig_mod.`
prefixes). `--gpu 5` masks the process to physical GPU 5 before CUDA initialises and then works on cuda:0.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
from tqdm import tqdm

from data.geometry import to_native
from data.msd import Case, DatasetSpec, load_dataset_json, split_cases
from data.nifti import load_image, load_label, spacing
from data.plan import Plan, legacy_plan
from data.preprocess import preprocess
from unet3d.checkpoint import load_model
from unet3d.inference.devices import choose_device
from unet3d.inference.metrics import case_metrics
from unet3d.inference.pictures import Preview, middle_planes, overlay, write_overview
from unet3d.inference.sliding_window import InferenceSettings, predict_probabilities
from unet3d.model import fit_patch
from unet3d.precision import (
    AMP_CHOICES,
    MEMORY_FORMAT_CHOICES,
    apply_memory_format,
    format_name,
    resolve_amp,
    resolve_memory_format,
)

METRICS = ("dice", "iou", "hd95_mm", "pred_volume_ml", "ref_volume_ml")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="train_ddp.py checkpoint or a bare state dict")
    p.add_argument("--data-dir", help="dataset in the MSD layout (default: the checkpoint's training data)")
    p.add_argument(
        "--split",
        choices=("val", "test", "train"),
        default="val",
        help="val/train: the training run's split of the training list; test: imagesTs/ (default: val)",
    )
    p.add_argument("--out-dir", help="output folder (default: eval_SPLIT beside the checkpoints folder)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--gpu", type=int, help="physical GPU id as nvidia-smi numbers it; used as cuda:0")
    where.add_argument("--device", help="cpu or cuda:N (default: the first visible GPU, else the CPU)")
    p.add_argument("--window", type=int, nargs="+", metavar="N", help="sliding window (default: the training patch)")
    p.add_argument("--overlap", type=float, default=0.5, help="sliding-window overlap (default: 0.5)")
    p.add_argument("--sw-batch-size", type=int, help="windows per forward pass (default: the training batch size)")
    p.add_argument(
        "--amp",
        choices=AMP_CHOICES,
        default="auto",
        help="mixed precision, as in training (default: auto)",
    )
    p.add_argument(
        "--memory-format",
        choices=MEMORY_FORMAT_CHOICES,
        default="auto",
        help="layout of the activations, as in training (default: auto)",
    )
    p.add_argument("--tta", action="store_true", help="average the softmax over mirroring on the three axes")
    p.add_argument("--overview-cases", type=int, default=4, help="cases drawn in overview.png (default: 4)")
    bare = p.add_argument_group("for bare state dicts, which carry no configuration")
    bare.add_argument("--in-channels", type=int, help="input channels (default: inferred from the weights)")
    bare.add_argument("--num-classes", type=int, help="classes with background (default: inferred)")
    bare.add_argument("--features", type=int, nargs="+", metavar="N", help="channels per level (default: inferred)")
    bare.add_argument("--val-fraction", type=float, default=0.2, help="the training run's --val-fraction")
    bare.add_argument("--seed", type=int, default=0, help="the training run's --seed")
    return p


def select_cases(data_dir: str | Path, split: str, val_fraction: float, seed: int) -> tuple[list[Case], Any]:
    """The cases of `split` and the dataset's description; val/train rebuild the training run's split."""
    spec = load_dataset_json(data_dir)
    if split == "test":
        if not spec.test:
            raise ValueError(f"{spec.root / 'dataset.json'} lists no test images")
        return list(spec.test), spec
    train, val = split_cases(spec.training, val_fraction, seed)
    return (val if split == "val" else train), spec


def save_prediction(pred: np.ndarray, like: nib.Nifti1Image, path: Path) -> None:
    """uint8 label map with the input image's affine and header, so it overlays in ITK-SNAP or Slicer."""
    header = like.header.copy()
    header.set_data_dtype(np.uint8)
    out = nib.Nifti1Image(pred.astype(np.uint8), like.affine, header)
    out.header.set_slope_inter(1, 0)
    out.header["cal_min"], out.header["cal_max"] = 0, int(pred.max())
    nib.save(out, path)


def summarise(rows: list[dict[str, Any]], class_names: Sequence[str]) -> dict[str, Any]:
    """Per-class mean and std of every metric over cases, and mean_dice over foreground classes.

    An undefined HD95 (exactly one of prediction and reference empty) is left out of its mean and counted.
    """
    classes = {}
    for k, name in enumerate(class_names[1:], start=1):
        mine = [r for r in rows if r["class"] == k]
        stats: dict[str, Any] = {}
        for metric in METRICS:
            values = np.array([r[metric] for r in mine], dtype=np.float64)
            defined = values[~np.isnan(values)]
            stats[metric] = {
                "mean": float(defined.mean()) if len(defined) else None,
                "std": float(defined.std()) if len(defined) else None,
            }
        stats["hd95_undefined"] = int(sum(math.isnan(r["hd95_mm"]) for r in mine))
        classes[name] = stats
    dice = [c["dice"]["mean"] for c in classes.values() if c["dice"]["mean"] is not None]
    return {"mean_dice": float(np.mean(dice)) if dice else None, "classes": classes}


def print_table(summary: dict[str, Any], num_cases: int) -> None:
    def cell(stat: dict[str, Any]) -> str:
        return "n/a" if stat["mean"] is None else f"{stat['mean']:.4f} ± {stat['std']:.4f}"

    print(f"\n{'class':<16}{'Dice':>20}{'IoU':>20}{'HD95 (mm)':>20}{'HD95 undef.':>13}")
    for name, stats in summary["classes"].items():
        print(
            f"{name:<16}{cell(stats['dice']):>20}{cell(stats['iou']):>20}{cell(stats['hd95_mm']):>20}"
            f"{stats['hd95_undefined']:>13}"
        )
    print(f"{'mean Dice':<16}{summary['mean_dice']:>20.4f}   over {num_cases} case(s)")


def _plain(value: Any) -> Any:
    """JSON-safe: NaN -> None, tuples -> lists."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return evaluate(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"evaluate.py: error: {e}", file=sys.stderr)
        return 2


def evaluation_plan(checkpoint: dict[str, Any], spec: DatasetSpec, source: str) -> Plan:
    """The plan the checkpoint was trained with; checkpoints from before plans, and bare state dicts, use
    their cases as stored (plan "none"), as they were trained."""
    if "plan" in checkpoint:
        return Plan.from_dict(checkpoint["plan"])
    cfg = checkpoint.get("config") or {}
    what = "is from before plans" if cfg else "is a bare state dict"
    print(f"note: {source} {what}: cases are used as stored (plan none: no reorientation, resampling or crop)")
    return legacy_plan(spec.modalities, cfg.get("patch_size", (128, 128, 128)), cfg.get("features", (1, 1)))


def evaluate(args: argparse.Namespace) -> int:
    device = choose_device(args.gpu, args.device)  # masks --gpu before anything touches CUDA
    overrides = {"in_channels": args.in_channels, "num_classes": args.num_classes, "features": args.features}
    model, checkpoint = load_model(args.checkpoint, device, overrides)
    cfg = checkpoint.get("config")
    data_dir = args.data_dir or (cfg or {}).get("data_dir")
    if data_dir is None:
        raise ValueError(f"{args.checkpoint} carries no configuration: give --data-dir")
    val_fraction = cfg["val_fraction"] if cfg else args.val_fraction
    seed = cfg["seed"] if cfg else args.seed
    cases, spec = select_cases(data_dir, args.split, val_fraction, seed)
    class_names = checkpoint.get("class_names") or spec.class_names
    if len(class_names) != model.num_classes:
        raise ValueError(f"the model predicts {model.num_classes} classes but {data_dir} has {class_names}")
    plan = evaluation_plan(checkpoint, spec, args.checkpoint)
    divisor = model.size_divisor
    window = None  # None: fitted to each case
    if args.window:
        window = tuple(args.window * 3 if len(args.window) == 1 else args.window)
    elif cfg:
        window = tuple(cfg["patch_size"])
    sw_batch = args.sw_batch_size or (cfg["batch_size"] if cfg else 2)
    amp_dtype = resolve_amp(args.amp, device)
    memory_format = resolve_memory_format(args.memory_format, device, amp_dtype)
    apply_memory_format(model, memory_format)
    out = Path(args.out_dir) if args.out_dir else Path(args.checkpoint).resolve().parent.parent / f"eval_{args.split}"
    (out / "predictions").mkdir(parents=True, exist_ok=True)

    rows: list[dict[str, Any]] = []
    overview = []
    scored = 0
    for case in tqdm(cases, desc=f"evaluate {args.split}", unit="case"):
        image, img = load_image(case.image)
        ref = load_label(case.label)[0] if case.label is not None else None
        planned = preprocess(image, img.affine, plan, ref, len(class_names))  # the label for the picture
        case_window = window or fit_patch((128, 128, 128), planned.image.shape[1:], divisor)
        if any(w % d for w, d in zip(case_window, divisor)):
            raise ValueError(f"--window {case_window}: each size must be divisible by {divisor}")
        settings = InferenceSettings(
            window=case_window, overlap=args.overlap, sw_batch_size=sw_batch, amp_dtype=amp_dtype, tta=args.tta
        )
        probs = predict_probabilities(model, planned.image, settings, device)
        pred = to_native(probs, planned.geometry)  # the file's own grid: its shape, orientation and affine
        save_prediction(pred, img, out / "predictions" / f"{case.name}.nii.gz")
        caption = case.name
        if ref is not None:
            if ref.shape != pred.shape:
                raise ValueError(f"{case.label}: shape {ref.shape} differs from its image's {pred.shape}")
            metrics = case_metrics(pred, ref, len(class_names), spacing(img))
            for k, row in enumerate(metrics, start=1):
                rows.append({"case": case.name, "class": k, "class_name": class_names[k], **row})
            caption += f"  Dice {np.mean([r['dice'] for r in metrics]):.3f}"
            scored += 1
        if len(overview) < args.overview_cases:
            planes = middle_planes(planned.image, planned.label, probs.argmax(0))
            overview.append(overlay(Preview(*planes, planned.geometry.planned_spacing[:2], caption)))

    with open(out / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["case", "class", "class_name", *METRICS])
        writer.writeheader()
        writer.writerows(rows)
    write_overview(overview, out / "overview.png", class_names)
    summary = {
        **(summarise(rows, class_names) if scored else {"mean_dice": None, "classes": {}}),
        "num_cases": len(cases),
        "num_scored": scored,
        "split": args.split,
        "checkpoint": str(Path(args.checkpoint).resolve()),
        "data_dir": str(data_dir),
        "inference": {
            "window": case_window if window is None else window,
            "overlap": args.overlap,
            "sw_batch_size": sw_batch,
            "amp": str(amp_dtype),
            "memory_format": format_name(memory_format),
            "tta": args.tta,
            "device": str(device),
        },
        "plan": plan.to_dict(),
        "config": cfg,
    }
    (out / "summary.json").write_text(json.dumps(_plain(summary), indent=2))
    if scored:
        print_table(summary, scored)
    else:
        print(f"no reference labels for {args.split}: wrote predictions only")
    print(f"\nwrote {out / 'metrics.csv'}, {out / 'summary.json'}, {out / 'predictions'}/, {out / 'overview.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
