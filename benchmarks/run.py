"""Performance of training and inference, measured side by side with MONAI in one process.

    python benchmarks/run.py --quick      # under 3 minutes on 2 CPU cores
    python benchmarks/run.py              # larger patches, more repeats

Prints a table of every measurement with its reference and ratio, and writes it to a JSON file. Needs the
benchmark extra (pip install -e ".[bench]") for MONAI. Speeds are ratios measured in the same run; the
absolute times depend on the machine, which the JSON file describes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import inspect
import json
import platform
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

from benchmarks import pipeline, preprocessing, scaling  # noqa: E402
from benchmarks.common import (  # noqa: E402
    NNUNET_FEATURES,
    TrainStep,
    fp32_precision,
    has_tf32,
    interleaved_medians,
    make_dynunet,
    make_ours,
    matmul_flops_per_s,
    peak_step_memory_mib,
    step_flops,
    with_fp32_precision,
)
from data.msd import load_dataset_json  # noqa: E402
from data.synthetic import folder_name, write_synthetic_dataset  # noqa: E402
from unet3d.inference.sliding_window import InferenceSettings, sliding_window_inference  # noqa: E402
from unet3d.precision import cpu_has_native_bf16, format_name, resolve_amp, resolve_memory_format  # noqa: E402
from unet3d.training.config import DEVICE_DEFAULTS, default_num_workers  # noqa: E402

# write_synthetic_dataset's own default size (cases, mm in-plane), which the data rows use
SYNTHETIC_DEFAULT = tuple(
    inspect.signature(write_synthetic_dataset).parameters[n].default for n in ("num_cases", "size")
)


@dataclass
class Row:
    section: str
    metric: str
    ours: float
    reference: float | None = None  # what `ours` is compared with, in the same unit
    ratio: float | None = None  # the comparison, oriented so that larger is better for us
    target: float | None = None  # the ratio the project promises

    @property
    def met(self) -> bool | None:
        return None if self.target is None or self.ratio is None else self.ratio >= self.target


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller patches and fewer repeats (under 3 min on 2 cores)")
    p.add_argument("--out", help="JSON file (default: benchmarks/results[-quick].json)")
    p.add_argument(
        "--data-dir",
        default=f"runs/synthetic/{folder_name(*SYNTHETIC_DEFAULT, 0, 'uniform')}",
        help="MSD-layout dataset for the data-pipeline rows (written if missing: the synthetic default)",
    )
    return p.parse_args(argv)


def machine(device: torch.device) -> dict:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    info = {
        "cpu": cpu,
        "cores": pipeline.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "native_bf16": cpu_has_native_bf16(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpus"] = torch.cuda.device_count()
    try:
        import monai

        info["monai"] = monai.__version__
    except ImportError:
        info["monai"] = None
    return info


def train_step_rows(device, mixed, quick: bool) -> list[Row]:
    """Our UNet3D against MONAI's DynUNet, identical configuration, fp32 and mixed precision; then FLOP rates.

    On a GPU every fp32 measurement runs in strict IEEE fp32 (`fp32_precision`), the step's convolutions and the
    reference matmul alike, and says so; on GPUs with TF32 one more row gives the step's FLOP rate with both
    in TF32, what an fp32 run (--amp off) gets by default. The mixed-precision step keeps PyTorch's settings.
    """
    gpu = device.type == "cuda"
    fp32 = "fp32 (strict, TF32 off)" if gpu else "fp32"  # how the rows name the fp32 measurements
    patch = (48, 48, 48) if quick else ((128, 128, 128) if gpu else (64, 64, 64))
    repeats, batch, rows, seconds = (3 if quick else 7), 2, [], {}
    flops = step_flops(functools.partial(make_ours, 1, 3, NNUNET_FEATURES), patch, batch)
    for name, dtype in [("fp32", None), (str(mixed).removeprefix("torch."), mixed)]:
        if name != "fp32" and dtype is None:
            continue
        label = fp32 if dtype is None else name
        layout = resolve_memory_format("auto", device, dtype)  # the project's layout for this precision
        steps = {
            "ours": TrainStep(make_ours(1, 3, NNUNET_FEATURES, layout), patch, batch, dtype, device),
            "monai": TrainStep(make_dynunet(1, 3, NNUNET_FEATURES), patch, batch, dtype, device),
        }
        with fp32_precision(device, tf32=False) if dtype is None else contextlib.nullcontext():
            t = interleaved_medians(steps, repeats, device)
            rate = matmul_flops_per_s(dtype or torch.float32, device)  # in the same precision as the step
        seconds[name] = t["ours"]
        voxels = batch * patch[0] * patch[1] * patch[2]
        rows.append(
            Row(
                "train step",
                f"{label} step, nnU-Net width, patch {patch[0]}^3 x{batch} (s)",
                t["ours"],
                t["monai"],
                t["monai"] / t["ours"],
                1.0,
            )
        )
        rows.append(
            Row(
                "train step",
                f"{label} voxels/s (millions)",
                voxels / t["ours"] / 1e6,
                voxels / t["monai"] / 1e6,
                t["monai"] / t["ours"],
            )
        )
        matmul = "strict fp32 matmul" if gpu and dtype is None else "dense matmul"
        rows.append(
            Row(
                "FLOP utilisation",
                f"{label} step GFLOP/s vs {matmul} GFLOP/s",
                flops / t["ours"] / 1e9,
                rate / 1e9,
                flops / t["ours"] / rate,
                0.8 if name == "fp32" else None,
            )
        )
        if dtype is None and has_tf32(device):  # our step alone again: a few steps and a few products more
            with fp32_precision(device, tf32=True):
                tf32_s = interleaved_medians({"ours": steps["ours"]}, repeats, device)["ours"]
                tf32_rate = matmul_flops_per_s(torch.float32, device)
            rows.append(
                Row(
                    "FLOP utilisation",
                    "tf32 (TF32 on) step GFLOP/s vs tf32 matmul GFLOP/s",
                    flops / tf32_s / 1e9,
                    tf32_rate / 1e9,
                    flops / tf32_s / tf32_rate,
                )
            )
        del steps
    if len(seconds) == 2:
        fp32_s, other = seconds.pop("fp32"), seconds.popitem()[1]
        metric = f"nnU-Net width: mixed precision vs {fp32}, steps/s"
        rows.append(Row("train step", metric, 1 / other, 1 / fp32_s, fp32_s / other))
    defaults = DEVICE_DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
    layout = resolve_memory_format("auto", device, mixed)
    plain = TrainStep(make_ours(1, 3, defaults["features"]), defaults["patch_size"], batch, None, device)
    steps = {  # the defaults (precision and layout, PyTorch's settings) against the plain fp32 model, strict on GPUs
        "fp32": with_fp32_precision(plain, device, tf32=False),
        "default": TrainStep(
            make_ours(1, 3, defaults["features"], layout), defaults["patch_size"], batch, mixed, device
        ),
    }
    t = interleaved_medians(steps, 5 if quick else 10, device)
    rows.append(
        Row(
            "train step",
            f"project defaults ({mixed or 'fp32'}, {format_name(layout)}, width {defaults['features'][0]}.."
            f"{defaults['features'][-1]}, patch {'x'.join(map(str, defaults['patch_size']))}) vs {fp32}, steps/s",
            1 / t["default"],
            1 / t["fp32"],
            t["fp32"] / t["default"],
            1.6,
        )
    )
    return rows


def memory_rows(device, mixed, quick: bool) -> list[Row]:
    """Peak memory of a training step with and without --grad-checkpoint (activation recomputation)."""
    patch = (64, 64, 64) if quick else ((160, 160, 160) if device.type == "cuda" else (96, 96, 96))
    peaks = {flag: peak_step_memory_mib(NNUNET_FEATURES, patch, 2, mixed, flag, device) for flag in (False, True)}
    return [
        Row(
            "memory per step",
            f"peak with --grad-checkpoint vs without, nnU-Net width, patch {patch[0]}^3 (MiB)",
            peaks[True],
            peaks[False],
            peaks[False] / peaks[True],
        )
    ]


def pipeline_rows(device, mixed, data_dir: Path, quick: bool) -> list[Row]:
    """Patches per second per worker against MONAI and against what the default training step consumes; memory."""
    spec = load_dataset_json(data_dir)
    cache = Path("runs/cache/benchmark") / data_dir.name
    pipeline.prepare_cache(spec, cache)
    defaults = DEVICE_DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
    patch, features, batch, world = defaults["patch_size"], defaults["features"], 2, 2
    ours = pipeline.ours_per_worker(cache, spec, patch, 60 if quick else 300)
    monai = pipeline.monai_per_worker(spec, patch, 12 if quick else 48)
    rows = [
        Row("data pipeline", f"patches/s per worker, patch {'x'.join(map(str, patch))}", ours, monai, ours / monai, 5.0)
    ]
    full = pipeline.ours_per_worker(cache, spec, patch, 30 if quick else 150, augmentation="nnunet")
    workers = default_num_workers(pipeline.cpu_count(), world)
    torch.set_num_threads(max(1, pipeline.cpu_count() // world))  # one rank's share of the cores
    step = TrainStep(make_ours(1, 3, features), patch, batch, mixed, device)
    consumed = batch / interleaved_medians({"step": step}, 5 if quick else 10, device)["step"]
    torch.set_num_threads(pipeline.cpu_count())
    delivered = pipeline.ours_loader(cache, spec, patch, batch, workers, world, 20 if quick else 60)
    rows.append(
        Row(
            "data pipeline",
            f"one rank's loader ({workers} worker(s)) vs the default step's consumption, patches/s",
            delivered,
            consumed,
            delivered / consumed,
            3.0,
        )
    )
    rows.append(
        Row(
            "data pipeline",
            "patches/s per worker with nnU-Net's augmentation vs the default step's consumption per rank",
            full,
            consumed,
            full / consumed,
            3.0,
        )
    )
    size = pipeline.dataset_bytes(spec) / 2**20
    ours_mem = pipeline.memory_per_rank("ours", cache, spec, patch)
    monai_mem = pipeline.memory_per_rank("monai", cache, spec, patch)
    rows.append(
        Row(
            "memory per rank",
            f"PSS added to hold a {size:.0f} MiB dataset, 2 ranks (MiB)",
            ours_mem["pss"],
            monai_mem["pss"],
            monai_mem["pss"] / max(ours_mem["pss"], 1e-3),
            1.0,
        )
    )
    rows.append(Row("memory per rank", "private (anonymous) memory added (MiB)", ours_mem["anon"], monai_mem["anon"]))
    return rows


def sliding_window_rows(device, quick: bool) -> list[Row]:
    """Whole-volume inference against monai.inferers.sliding_window_inference: same window, overlap, weighting."""
    from monai.inferers import sliding_window_inference as monai_swi

    features = DEVICE_DEFAULTS["cpu"]["features"] if device.type == "cpu" else NNUNET_FEATURES
    window = (48, 48, 32) if device.type == "cpu" else (128, 128, 128)
    shape = (96, 96, 64) if quick else (160, 160, 96)
    torch.manual_seed(0)
    model = make_ours(1, 3, features, resolve_memory_format("auto", device, None)).to(device).eval()
    reference = make_ours(1, 3, features).to(device).eval()  # MONAI's run: the same weights, channels-first
    reference.load_state_dict(model.state_dict())
    image = torch.randn(1, *shape, device=device)
    outputs = {}

    def ours():
        outputs["ours"] = sliding_window_inference(model, image, InferenceSettings(window=window, sw_batch_size=4))

    def monai():
        outputs["monai"] = monai_swi(image[None], window, 4, reference, overlap=0.5, mode="gaussian")[0]

    with torch.no_grad():
        t = interleaved_medians({"ours": ours, "monai": monai}, 3 if quick else 5, device)
    diff = (outputs["ours"] - outputs["monai"]).abs().max().item()
    return [
        Row(
            "sliding window",
            f"volume {'x'.join(map(str, shape))}, window {'x'.join(map(str, window))} (s)",
            t["ours"],
            t["monai"],
            t["monai"] / t["ours"],
            1.0,
        ),
        Row(
            "sliding window",
            "largest |ours - MONAI| of the logits, against the 1e-4 allowed",
            diff,
            1e-4,
            min(1e-4 / max(diff, 1e-12), 999.0),
            1.0,
        ),
    ]


def preprocessing_rows(quick: bool) -> list[Row]:
    """One CT-like case (LPS, 0.7 x 0.7 x 2.5 mm, 5 classes) to RAS at 1 x 1 x 1.5 mm: ours (reorient, crop,
    normalise, image and one-hot label resampling) against MONAI's Orientationd + Spacingd, fresh processes."""
    shape = (256, 256, 150) if quick else preprocessing.SHAPE
    image, label = preprocessing.write_ct(Path("runs/cache/benchmark") / "x".join(map(str, shape)), shape)
    ours = preprocessing.measure("ours", image, label)
    monai = preprocessing.measure("monai", image, label)
    size = preprocessing.case_mib(shape)
    name = "x".join(map(str, shape))
    return [
        Row(
            "preprocessing",
            f"CT {name}, 5 classes, to 1x1x1.5 mm RAS, 1 thread (s)",
            ours[0],
            monai[0],
            monai[0] / ours[0],
            1.0,
        ),
        Row(
            "preprocessing",
            f"peak memory added by loading and preprocessing (MiB; case {size:.0f} MiB)",
            ours[2],
            monai[2],
            monai[2] / ours[2],
            1.0,
        ),
        Row(
            "preprocessing",
            "peak memory added over the case's own (image float32 + label uint8)",
            ours[2] / size,
            monai[2] / size,
        ),
    ]


def scaling_rows(device, mixed, quick: bool) -> list[Row]:
    defaults = DEVICE_DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
    steps = 20 if quick else 40
    counts = range(1, torch.cuda.device_count() + 1) if device.type == "cuda" else (1, 2)
    if len(counts) < 2:  # one GPU: no scaling to measure, and its 1-rank rate alone would be no row
        return []
    threads = 1 if device.type == "cpu" else max(1, pipeline.cpu_count() // max(counts))
    job = scaling.ScalingRun(
        1, threads, tuple(defaults["features"]), tuple(defaults["patch_size"]), 2, mixed, steps, device.type
    )
    rates = {n: scaling.samples_per_s(dataclasses.replace(job, world=n)) for n in counts}
    rows = [
        Row(
            "DDP scaling",
            f"{n} ranks vs 1, {threads} thread(s) each, samples/s",
            rates[n],
            rates[1],
            rates[n] / rates[1],
            0.85 * n,
        )
        for n in counts
        if n > 1
    ]
    # The timing's cost is a collective and a few clock readings per step, far below this machine's noise
    # from run to run: alternate runs with and without it, and compare the medians.
    with_timing, without = [rates[2]], []
    for _ in range(4):  # fewer cannot rise above this machine's run-to-run spread (+-20 % on our 2-core VMs)
        without.append(scaling.samples_per_s(dataclasses.replace(job, world=2, timing=False)))
        with_timing.append(scaling.samples_per_s(dataclasses.replace(job, world=2)))
    timed, untimed = statistics.median(with_timing), statistics.median(without)
    rows.append(
        Row(
            "step timing",
            f"2 ranks, samples/s with the per-step timing vs without (medians of {len(without)} runs)",
            timed,
            untimed,
            timed / untimed,
            0.98,
        )
    )
    if device.type == "cpu":
        alone = scaling.samples_per_s(dataclasses.replace(job, world=2, ddp=False))
        rows.append(
            Row(
                "DDP scaling",
                "machine's ceiling: 2 processes without DDP vs 1 rank, samples/s",
                alone,
                rates[1],
                alone / rates[1],
            )
        )
    return rows


def print_header(info: dict) -> None:
    print(
        f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, MONAI {info['monai']}, "
        f"device {info['device']}"
    )
    print(f"{'section':<18}{'metric':<78}{'ours':>10}{'reference':>11}{'ratio':>8}{'target':>8}  met", flush=True)


def print_rows(rows: list[Row]) -> None:
    for r in rows:
        ref = "" if r.reference is None else f"{r.reference:.4g}"
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
        target = "" if r.target is None else f">={r.target:.2f}"
        met = "" if r.met is None else ("yes" if r.met else "NO")
        print(f"{r.section:<18}{r.metric:<78}{r.ours:>10.4g}{ref:>11}{ratio:>8}{target:>8}  {met}", flush=True)


def main(argv=None) -> int:
    args = parse(argv)
    try:
        import monai  # noqa: F401
    except ImportError:
        print('benchmarks/run.py compares with MONAI: pip install -e ".[bench]" first', file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    torch.set_num_threads(pipeline.cpu_count())
    torch.backends.cudnn.benchmark = True
    mixed = resolve_amp("auto", device)
    data_dir = Path(args.data_dir)
    if not (data_dir / "dataset.json").is_file():
        write_synthetic_dataset(data_dir)
    info = machine(device)
    print_header(info)
    # The sections that measure in spawned children on the GPU (peak memory per step, DDP scaling) run first,
    # before this process computes anything there: up to then it has only asked for the device's name and
    # capability, which allocates nothing (and creates no context), so the children's peak memory and speed
    # are theirs alone on a GPU that holds nothing else. Later, this process's models, steps and the caching
    # allocator's blocks would stay on cuda:0 beside them. (Each spawn also frees this process's cached GPU
    # memory first, and warns about any tensor still held.) One order on every device, for one table.
    sections = [
        lambda: memory_rows(device, mixed, args.quick),
        lambda: scaling_rows(device, mixed, args.quick),
        lambda: train_step_rows(device, mixed, args.quick),
        lambda: pipeline_rows(device, mixed, data_dir, args.quick),
        lambda: sliding_window_rows(device, args.quick),
        lambda: preprocessing_rows(args.quick),
    ]
    rows: list[Row] = []
    for section in sections:  # each printed as soon as it is measured
        new = section()
        print_rows(new)
        rows += new
    out = Path(args.out or f"benchmarks/results{'-quick' if args.quick else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": info, "quick": args.quick, "rows": [{**asdict(r), "met": r.met} for r in rows]}
    out.write_text(json.dumps(payload, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
