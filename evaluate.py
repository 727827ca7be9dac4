"""Evaluate checkpoints on a dataset split, or segment a folder of new scans: predictions on each input's own
grid, per-case metrics where references exist, a summary and an overview.

    python evaluate.py --checkpoint runs/default/checkpoints/best.pt --split val --out-dir runs/default/eval
    python evaluate.py --checkpoint runs/f*/checkpoints/best.pt --split cv --out-dir runs/cv   # folds
    python evaluate.py --checkpoint runs/f*/checkpoints/best.pt --images scans/ --out-dir seg/  # ensemble

Reads checkpoints written by train_ddp.py and bare state dicts (with or without `module.` / `_orig_mod.`
prefixes). `--gpu 5` masks the process to physical GPU 5 before CUDA initialises and then works on cuda:0;
`--gpu 5,6,7` shards the cases over three processes, one per GPU, each masked the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import torch
from tqdm import tqdm

from data.check import label_problems
from data.geometry import obliquity
from data.msd import load_dataset_json, run_split
from data.nifti import load_label, records_orientation, spacing
from data.plan import OBLIQUE_DEGREES
from unet3d.files import out_of_room
from unet3d.inference import postprocess
from unet3d.inference.cases import InputCase, folder_cases, load_case_image
from unet3d.inference.devices import choose_device
from unet3d.inference.metrics import case_metrics
from unet3d.inference.outputs import (
    claim_folder,
    print_table,
    release_folder,
    rows_from_json,
    save_prediction,
    save_probabilities,
    summarise,
    write_json,
    write_metrics,
)
from unet3d.inference.pictures import Preview, middle_planes, overlay, write_overview
from unet3d.inference.predictor import (
    Options,
    Predictor,
    check_members,
    image_channels,
    load_members,
    member_plan,
)
from unet3d.inference.sliding_window import overlap_problem
from unet3d.precision import AMP_CHOICES, MEMORY_FORMAT_CHOICES, format_name, resolve_amp, resolve_memory_format
from unet3d.shutdown import exit_with


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations: the sharding parent strips --gpu/--device/--workers/--out-dir from the children's
    # arguments by name, and a shortened --worker 2 that reached them made every child shard again.
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument(
        "--checkpoint", required=True, nargs="+", metavar="PATH",
        help="train_ddp.py checkpoint(s) or bare state dicts; several: an ensemble (or the folds, with --split cv)",
    )  # fmt: skip
    p.add_argument("--data-dir", help="dataset in the MSD layout (default: the checkpoint's training data)")
    p.add_argument(
        "--split",
        choices=("val", "test", "train", "cv"),
        default="val",
        help="val/train: the training run's split of the training list; test: imagesTs/; cv: each fold's "
        "checkpoint predicts the cases it held out, scored together (default: val)",
    )
    p.add_argument("--images", metavar="DIR", help="segment every NIfTI file in DIR (no labels, no dataset.json)")
    p.add_argument("--out-dir", help="output folder (default: eval_SPLIT beside the checkpoints folder)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--gpu", help="physical GPU id(s) as nvidia-smi numbers them, e.g. 5 or 5,6,7 (sharded)")
    where.add_argument(
        "--device",
        help="cpu or cuda:N, N in CUDA's numbering of the visible GPUs, not masked (--gpu takes nvidia-smi's); "
        "default: the first visible GPU, else the CPU",
    )
    p.add_argument("--workers", type=int, default=1, help="with --device cpu: shard the cases over N processes")
    p.add_argument(
        "--window", type=int, nargs="+", metavar="N",
        help="sliding window (default: the training patch); cut to a case it is larger than, not below the patch",
    )  # fmt: skip
    p.add_argument("--overlap", type=float, default=0.5, help="sliding-window overlap, 0 to 0.9 (default: 0.5)")
    p.add_argument("--sw-batch-size", type=int, help="windows per forward pass (default: the training batch size)")
    p.add_argument("--amp", choices=AMP_CHOICES, default="auto", help="mixed precision, as in training (default: auto)")
    p.add_argument(
        "--memory-format", choices=MEMORY_FORMAT_CHOICES, default="auto",
        help="layout of the activations, as in training (default: auto)",
    )  # fmt: skip
    p.add_argument("--tta", action="store_true", help="average the softmax over mirroring on the three axes")
    p.add_argument("--save-probabilities", action="store_true", help="also write CASE.npz: float16 probabilities")
    p.add_argument("--postprocess", metavar="FILE", help="apply a post-processing file (written by --split cv)")
    p.add_argument("--overview-cases", type=int, default=4, help="cases drawn in overview.png (default: 4)")
    p.add_argument(
        "--overwrite", action="store_true",
        help="with --images: segment every case again, also those an earlier run wrote (which are otherwise "
        "skipped, and refused when that run's settings differ)",
    )  # fmt: skip
    p.add_argument("--shard", help=argparse.SUPPRESS)  # I/N: this process's share, started by the sharding parent
    bare = p.add_argument_group("for bare state dicts, which carry no configuration")
    bare.add_argument("--in-channels", type=int, help="input channels (default: inferred from the weights)")
    bare.add_argument("--num-classes", type=int, help="classes with background (default: inferred)")
    bare.add_argument("--features", type=int, nargs="+", metavar="N", help="channels per level (default: inferred)")
    bare.add_argument("--val-fraction", type=float, default=0.2, help="the training run's --val-fraction")
    bare.add_argument("--seed", type=int, default=0, help="the training run's --seed")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        check_options(args)
        gpus = [int(g) for g in args.gpu.split(",")] if args.gpu else []
        if args.workers < 1 or (args.workers > 1 and (gpus or (args.device or "cpu") != "cpu")):
            raise ValueError(f"--workers {args.workers}: N >= 1, and more than one only with --device cpu")
        if args.images and not args.shard:  # the shards' parent, or the one process
            claim_folder(output_dir(args), segmentation_settings(args), args.overwrite)
        if (len(gpus) > 1 or args.workers > 1) and not args.shard:  # a shard never shards again
            return run_shards(argv, args, gpus)
        return evaluate(args, gpus[0] if gpus else None)
    except (ValueError, FileNotFoundError) as e:
        print(f"evaluate.py: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk or quota, a file-size limit: every further file would fail the same way
        room = out_of_room(e)
        if room is None:
            raise
        print(
            f"evaluate.py: error: {room}: stopped; each file is written under a temporary name first, so those "
            "already written are complete. Make room (disk space, quota, ulimit -f) and run it again",
            file=sys.stderr,
        )
        return 1


def check_options(args: argparse.Namespace) -> None:
    """Refuse option values that every case would fail on (or that would be ignored), before any case."""
    ids = args.gpu.split(",") if args.gpu else []
    if not all(re.fullmatch("[0-9]+", i) for i in ids) or len({int(i) for i in ids}) != len(ids):
        raise ValueError(
            f"--gpu {args.gpu}: give physical GPU ids as nvidia-smi numbers them, each once, e.g. 5 or 5,6,7"
        )
    if args.window is not None and (len(args.window) not in (1, 3) or min(args.window) < 1):
        raise ValueError(f"--window takes one positive size or three, got {' '.join(map(str, args.window))}")
    if problem := overlap_problem("--overlap", args.overlap):
        raise ValueError(problem)
    if args.sw_batch_size is not None and args.sw_batch_size < 1:
        raise ValueError(f"--sw-batch-size must be >= 1, got {args.sw_batch_size}")
    if args.overview_cases < 0:
        raise ValueError(f"--overview-cases must be >= 0, got {args.overview_cases}")
    if args.images and Path(output_dir(args)).resolve() == Path(args.images).resolve():
        raise ValueError(
            f"--out-dir {args.out_dir} is the --images folder: each segmentation would be written over (or, "
            "without --overwrite, mistaken for) its own scan; give another --out-dir"
        )


def segmentation_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What decides the segmentations of `--images`: each checkpoint (its file, size and time), the window,
    overlap, TTA, precision, post-processing, probabilities and the bare-weights architecture."""
    checkpoints = []
    for given in args.checkpoint:
        path = Path(given).resolve()
        info = path.stat() if path.is_file() else None
        checkpoints.append([str(path), info.st_size if info else None, info.st_mtime_ns if info else None])
    rules = Path(args.postprocess).read_text() if args.postprocess and Path(args.postprocess).is_file() else None
    return {
        "checkpoints": checkpoints, "window": args.window, "overlap": args.overlap, "tta": args.tta,
        "amp": args.amp, "postprocess": rules, "save_probabilities": args.save_probabilities,
        "in_channels": args.in_channels, "num_classes": args.num_classes, "features": args.features,
        "device": device_kind(args),
    }  # fmt: skip


def device_kind(args: argparse.Namespace) -> str:
    """cuda or cpu, as the run will choose (without touching CUDA where --gpu is to mask it): --amp auto is
    fp32 on the CPU and bf16 or fp16 on a GPU, so a folder half segmented on one is not continued on the other."""
    if args.gpu:
        return "cuda"
    if args.workers > 1:  # the shards run on the CPU (`run_shards` gives each --device cpu)
        return "cpu"
    if args.device:
        try:
            return torch.device(args.device).type
        except RuntimeError:
            return args.device  # refused with a message once the device is chosen
    return "cuda" if torch.cuda.is_available() else "cpu"


def shown_prediction(probs: torch.Tensor, predictor: Predictor) -> torch.Tensor | np.ndarray:
    """What the overview draws of `probs` (K, X, Y, Z) in the planned space: the middle plane's labels (X, Y),
    post-processed as the saved and scored labels are (there on the file's grid, here in the planned space),
    whose rules need the whole volume: taken a few planes at a time to uint8 on the host, so neither the
    GPU nor the host holds more than a slab of int64 labels or a copy of the probabilities."""
    z = probs.shape[-1] // 2
    if not predictor.rules:
        return probs[..., z].argmax(0)
    slabs = [probs[..., i : i + 16].argmax(0).to(torch.uint8).cpu() for i in range(0, probs.shape[-1], 16)]
    labels = torch.cat(slabs, dim=-1).numpy()
    return postprocess.apply(labels, predictor.rules, predictor.class_names)[..., z]


def output_dir(args: argparse.Namespace) -> Path:
    if args.out_dir:
        return Path(args.out_dir)
    name = "predictions" if args.images else f"eval_{args.split}"
    return Path(args.checkpoint[0]).resolve().parent.parent / name


def select(args: argparse.Namespace, members) -> tuple[list[InputCase], dict[str, Any], Any]:
    """(the cases, the member(s) for each case by name, the dataset spec or None)."""
    if args.images:
        return folder_cases(args.images, image_channels(members[0])), {}, None
    cfg = members[0].config
    data_dir = args.data_dir or (cfg or {}).get("data_dir")
    if data_dir is None:
        raise ValueError(f"{members[0].source} carries no configuration: give --data-dir")
    # Only the chosen split's files are read: test images copied elsewhere (or not at all) do not stop the
    # validation split from being scored, and a missing file is one failed case, the rest scored.
    spec = load_dataset_json(data_dir, require_files=False)
    if args.split == "test":
        if not spec.test:
            raise ValueError(f"{spec.root / 'dataset.json'} lists no test images")
        return [InputCase(c.name, (c.image,), c.label) for c in spec.test], {}, spec
    owner: dict[str, Any] = {}
    chosen = []
    for member in members if args.split == "cv" else members[:1]:
        train, val = split_of(member, spec, args)
        for case in val if args.split in ("val", "cv") else train:
            if case.name in owner:
                raise ValueError(f"{case.name} is held out by {owner[case.name].source} and {member.source}")
            owner[case.name] = member
            chosen.append(InputCase(case.name, (case.image,), case.label))
    if not chosen:  # a run of --fold all (or --val-fraction 0) holds out nothing to score
        raise ValueError(
            f"{members[0].source} holds out no {args.split} case (trained with --fold all?): score it with "
            "--split test or --images"
        )
    if args.split != "cv":
        owner = {}
    return sorted(chosen, key=lambda c: c.name), owner, spec


def split_of(member, spec, args):
    """(training, validation) cases of a member's run: the names its checkpoint records, else rebuilt."""
    cfg = member.config or {}
    if "split" in member.checkpoint:  # the names the run trained on
        by_name = {c.name: c for c in spec.training}
        missing = [n for part in member.checkpoint["split"].values() for n in part if n not in by_name]
        if missing:
            raise ValueError(f"{member.source} was trained on cases {missing[:5]} that {spec.root} lacks")
        return [[by_name[n] for n in member.checkpoint["split"][k]] for k in ("train", "val")]
    fraction, seed = cfg.get("val_fraction", args.val_fraction), cfg.get("seed", args.seed)
    return run_split(spec.training, fraction, seed, cfg.get("fold"), cfg.get("folds", 5))


def evaluate(args: argparse.Namespace, gpu: int | None) -> int:
    device = choose_device(gpu, args.device)  # masks --gpu before anything touches CUDA
    amp_dtype = resolve_amp(args.amp, device)
    memory_format = resolve_memory_format(args.memory_format, device, amp_dtype)
    window = tuple(args.window * 3 if args.window and len(args.window) == 1 else args.window or ()) or None
    options = Options(
        overlap=args.overlap, sw_batch_size=args.sw_batch_size, amp_dtype=amp_dtype, memory_format=memory_format,
        tta=args.tta, window=window,
    )  # fmt: skip
    overrides = {"in_channels": args.in_channels, "num_classes": args.num_classes, "features": args.features}
    members = load_members(args.checkpoint, device, overrides, options)
    for member in members:  # refused once, before any case, rather than by every case
        divisor = member.model.size_divisor
        if member.window and any(w % d for w, d in zip(member.window, divisor)):
            raise ValueError(
                f"--window {' '.join(map(str, member.window))}: each size must be divisible by "
                f"{' x '.join(map(str, divisor))}, the pooling of {member.source}"
            )
    if args.split == "cv" and not args.images and len(members) < 2:
        raise ValueError("--split cv needs the checkpoints of two or more folds")
    names = [m.checkpoint.get("class_names") for m in members]
    cases, owner, spec = select(args, members)
    class_names = names[0] or (spec.class_names if spec else [f"class{k}" for k in range(members[0].model.num_classes)])
    names = [n or class_names for n in names]
    check_dataset_classes(members[0], names[0], spec)
    if len(class_names) != members[0].model.num_classes:
        raise ValueError(f"the model predicts {members[0].model.num_classes} classes but the data has {class_names}")
    plans = [member_plan(m, spec or _spec_for(m, class_names), print) for m in members]
    check_members(members, plans, names)
    rules = postprocess.read(args.postprocess, class_names, _raise) if args.postprocess else {}
    predictor = Predictor(members, plans[0], class_names, options, device, rules)
    out = output_dir(args)
    shard, shards = (int(v) for v in args.shard.split("/")) if args.shard else (0, 1)
    result = predict_cases(args, predictor, cases[shard::shards], owner, out, first=shard == 0)
    ensembled = len(members) if args.images or args.split != "cv" else 1  # cv: each case by its own fold
    info = {
        "checkpoint": str(Path(args.checkpoint[0]).resolve()),  # the first (or only) one
        "checkpoints": [str(Path(c).resolve()) for c in args.checkpoint],
        "inference": {
            "overlap": args.overlap, "amp": str(amp_dtype) if amp_dtype is not None else "off",
            "memory_format": format_name(memory_format),
            "tta": args.tta, "device": str(device), "ensemble": ensembled,
            "window": [m.window for m in members], "postprocess": rules,
        },
        "plan": plans[0].to_dict(), "config": members[0].config, "class_names": class_names,
        "split": "images" if args.images else args.split, "data_dir": str(spec.root) if spec else args.images,
    }  # fmt: skip
    if args.shard:  # the parent merges the shards' results
        write_json({**info, **result}, out / "shards" / f"{shard}.json")
        return 0
    return finish(args, {**info, **result}, [])


def check_dataset_classes(member, trained: list[str], spec) -> None:
    """Refuse to score a model on a dataset of another number of classes (its Dice would be computed under
    the model's class names, for labels that mean something else); warn where only the names differ."""
    if spec is None or not member.checkpoint.get("class_names"):
        return
    declared = list(spec.class_names)
    if len(declared) != len(trained):
        raise ValueError(
            f"{member.source} was trained on {len(trained)} classes {trained}, but {spec.root / 'dataset.json'} "
            f"declares {len(declared)}: {declared}; score it on a dataset of its own classes"
        )
    if declared != list(trained):
        print(f"warning: {member.source} names its classes {trained}, {spec.root / 'dataset.json'} {declared}")


def _raise(message: str) -> None:
    raise ValueError(message)


def _spec_for(member, class_names):
    """A stand-in dataset description for a folder of scans: the modalities the model was planned for."""
    from data.msd import DatasetSpec

    plan = member.checkpoint.get("plan")
    modalities = [n["modality"] for n in plan["normalization"]] if plan else ["MRI"] * member.model.in_channels
    return DatasetSpec(Path("."), dict(enumerate(class_names)), dict(enumerate(modalities)), (), ())


def predict_cases(args, predictor: Predictor, cases, owner, out: Path, first: bool) -> dict[str, Any]:
    """Predict, save and score this process's cases; a case that fails is reported and skipped."""
    folder = out if args.images else out / "predictions"
    folder.mkdir(parents=True, exist_ok=True)
    rows, errors, done, skipped, overview = [], [], [], [], []
    for case in tqdm(cases, desc="segment" if args.images else f"evaluate {args.split}", unit="case"):
        target = folder / f"{case.name}.nii.gz"
        if args.images and target.exists() and not args.overwrite:
            skipped.append(case.name)  # written by an earlier run (writes are atomic: it is complete)
            continue
        began = time.perf_counter()
        out_of_memory = False
        try:
            image, nii = load_case_image(case, predictor.in_channels)
            ref = None
            if case.label is not None:  # scored only on the image's grid, as training checks it
                ref, ref_nii = load_label(case.label, nii)
                classes = len(predictor.class_names)
                problems = label_problems(case.images[0], image.shape[1:], nii, case.label, ref, ref_nii, classes)
                if problems:  # reported with the other failed cases
                    raise ValueError("; ".join(problems))
            tilt = obliquity(nii.affine)
            if predictor.plan.orientation == "RAS" and tilt > OBLIQUE_DEGREES:
                tqdm.write(
                    f"warning: {case.name} lies {tilt:.1f} degrees off the scanner's axes: reorientation only "
                    "permutes and flips axes, so the network may see it turned a whole axis from the training "
                    "scans",
                    file=sys.stderr,
                )
            if predictor.plan.orientation == "RAS" and not records_orientation(nii):
                tqdm.write(
                    f"warning: {case.name} records no orientation (qform_code and sform_code 0): its reorientation "
                    "rests on nibabel's guess (x flipped), so left and right may be swapped against the training scans",
                    file=sys.stderr,
                )
            members = [owner[case.name]] if owner else None
            pred, planned, probs, native = predictor.predict(image, nii.affine, ref, members, args.save_probabilities)
        except (ValueError, FileNotFoundError, OSError) as e:
            errors.append(f"{case.name}: {e}")
            tqdm.write(f"error: {case.name}: {e}", file=sys.stderr)
            continue
        except torch.cuda.OutOfMemoryError as e:  # one large scan: reported, its memory freed, the rest predicted
            first_line = str(e).splitlines()[0] if str(e) else "out of memory"
            message = (
                f"{case.name}: out of memory on {predictor.device} ({first_line}); a smaller --sw-batch-size, "
                "--amp, or --device cpu may fit it"
            )
            errors.append(message)
            tqdm.write(f"error: {message}", file=sys.stderr)
            out_of_memory = True  # the failed case's tensors go with the exception, at the end of this clause
        if out_of_memory:
            if predictor.device.type == "cuda":
                torch.cuda.empty_cache()  # what the failed case held, back to the driver before the next one
            continue
        save_prediction(pred, nii, target)
        if native is not None:
            save_probabilities(native, predictor.class_names, folder / f"{case.name}.npz")
        caption = case.name
        if ref is not None:
            metrics = case_metrics(pred, ref, len(predictor.class_names), spacing(nii))
            for k, row in enumerate(metrics, start=1):
                rows.append({"case": case.name, "class": k, "class_name": predictor.class_names[k], **row})
            caption += f"  Dice {np.mean([r['dice'] for r in metrics]):.3f}"
        if first and len(overview) < args.overview_cases:
            planes = middle_planes(planned.image, planned.label, shown_prediction(probs, predictor))
            overview.append(overlay(Preview(*planes, planned.geometry.planned_spacing[:2], caption)))
        seconds = time.perf_counter() - began
        done.append({"case": case.name, "seconds": seconds})
        tqdm.write(f"{case.name}: {tuple(pred.shape)} in {seconds:.1f} s -> {target}")
        del image, pred, planned, probs, native  # freed before the next case is predicted, not after
    if overview:
        write_overview(overview, out / "overview.png", predictor.class_names)
    owners = {case.name: owner[case.name].source for case in cases if case.name in owner}
    return {"rows": rows, "errors": errors, "done": done, "skipped": skipped, "owners": owners}


MERGED = ("rows", "errors", "done", "skipped")  # what each shard has its own share of


def finish(args, result: dict[str, Any], shard_files: list[Path]) -> int:
    """Merge the shards (if any), write metrics.csv and summary.json, decide post-processing after cv."""
    out = output_dir(args)
    for path in shard_files:
        part = json.loads(path.read_text())
        part["rows"] = rows_from_json(part["rows"])
        for key in MERGED:
            result[key] = result.get(key, []) + part[key]
        result["owners"] = {**result.get("owners", {}), **part["owners"]}
    class_names = result["class_names"]
    rows, errors = result.pop("rows"), result["errors"]
    scored = sorted({r["case"] for r in rows})
    if args.split != "cv":
        result.pop("owners", None)
    summary = {**(summarise(rows, class_names) if rows else {"mean_dice": None, "classes": {}}), **result}
    summary.update(num_cases=len(result["done"]) + len(result["skipped"]) + len(errors), num_scored=len(scored))
    if args.split == "cv" and not args.images and rows:
        summary["folds"] = fold_scores(rows, result["owners"], class_names)
        if args.postprocess:  # the saved predictions are post-processed already: a decision from them would
            # compare the rules with themselves, choose nothing, and (into the cv folder) overwrite the rules given
            print(f"note: --postprocess given, so no post-processing is decided (the rules of {args.postprocess})")
        else:
            rules = postprocess.decide(saved_pairs(args, result, out), class_names)
            postprocess.write(rules, out / "postprocessing.json")
            summary["postprocessing"] = rules
    if not args.images:
        write_metrics(rows, out / "metrics.csv")
    elif args.overwrite:
        release_folder(out)  # every case was gone through (a failed one is failed under these settings too)
    write_json(summary, out / "summary.json")
    if rows:
        print_table(summary, len(scored))
    written = len(result["done"])
    print(f"\n{written} case(s) written, {len(result['skipped'])} already there, {len(errors)} failed; in {out}")
    for line in errors:
        print(f"error: {line}", file=sys.stderr)
    return 1 if errors else 0


def fold_scores(rows, owner, class_names) -> dict[str, float]:
    """The mean Dice of each fold's own cases (the cross-validation score is the mean over all of them)."""
    by_fold: dict[str, list[dict]] = {}
    for row in rows:
        by_fold.setdefault(owner[row["case"]], []).append(row)
    return {fold: summarise(fold_rows, class_names)["mean_dice"] for fold, fold_rows in sorted(by_fold.items())}


def saved_pairs(args, result, out: Path):
    """(prediction, reference) of every scored case, read back from the predictions written."""
    spec = load_dataset_json(result["data_dir"], require_files=False)  # the scored cases' labels alone are read
    labels = {c.name: c.label for c in spec.training}
    for case in sorted({d["case"] for d in result["done"]}):
        saved = nib.load(out / "predictions" / f"{case}.nii.gz")  # on its image's grid, in its voxel order
        yield np.asarray(saved.dataobj), load_label(labels[case], saved)[0]


def run_shards(argv: list[str], args: argparse.Namespace, gpus: list[int]) -> int:
    """One child process per GPU (each masked to its card before CUDA starts) or per CPU worker, each on its
    share of the cases; then one combined summary."""
    out = output_dir(args)
    (out / "shards").mkdir(parents=True, exist_ok=True)
    count = len(gpus) or args.workers
    keep = _strip(argv, ("--gpu", "--device", "--workers", "--out-dir"))
    threads = max(1, len(os.sched_getaffinity(0)) // count)
    procs = []
    for i in range(count):
        device = ["--gpu", str(gpus[i])] if gpus else ["--device", "cpu"]
        command = [sys.executable, __file__, *keep, *device, "--out-dir", str(out), "--shard", f"{i}/{count}"]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        procs.append(subprocess.Popen(command, env=env))
    codes = [p.wait() for p in procs]
    files = [out / "shards" / f"{i}.json" for i in range(count)]
    if any(c != 0 for c in codes) or not all(f.is_file() for f in files):
        raise ValueError(f"a shard failed (exit codes {codes}); see its messages above")
    first = json.loads(files[0].read_text())
    merged = {k: v for k, v in first.items() if k not in (*MERGED, "owners")}
    merged["inference"]["shards"] = [f"physical GPU {g}" for g in gpus] or [f"cpu x {count}"]
    code = finish(args, merged, files)
    shutil.rmtree(out / "shards", ignore_errors=True)  # merged into summary.json
    return code


def _strip(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """`argv` without these single-valued options and their values."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in options:
            skip = True
        elif not any(a.startswith(o + "=") for o in options):
            kept.append(a)
    return kept


if __name__ == "__main__":
    exit_with(main())
