"""Shared pieces of the benchmarks: clocks, the two models configured identically, a training step, FLOPs."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from unet3d import DiceCELoss, UNet3D
from unet3d.amp import autocast
from unet3d.layout import apply_memory_format

NNUNET_FEATURES = (32, 64, 128, 256, 320)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds one call of `fn` takes: CUDA events on a GPU (synchronised), the wall clock on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sync(device)
        start.record()
        fn()
        end.record()
        sync(device)
        return start.elapsed_time(end) / 1000
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int, device: torch.device) -> dict[str, float]:
    """Median seconds per call of each function, after one warm-up call each.

    The calls alternate between the functions, so a slow spell of a shared machine hits them alike.
    """
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timed(fn, device))
    return {name: statistics.median(values) for name, values in times.items()}


def make_ours(
    in_channels: int,
    num_classes: int,
    features: Sequence[int],
    memory_format: torch.memory_format = torch.contiguous_format,
) -> nn.Module:
    """UNet3D laid out as the project lays it out for training (`resolve_memory_format`)."""
    return apply_memory_format(UNet3D(in_channels, num_classes, features), memory_format)


def make_dynunet(in_channels: int, num_classes: int, features: Sequence[int]) -> nn.Module:
    """MONAI's DynUNet configured as UNet3D: 3x3x3 kernels, stride-2 downsampling, instance norm with affine,
    LeakyReLU(0.01), no deep supervision, no residual blocks."""
    from monai.networks.nets import DynUNet

    levels = len(features)
    return DynUNet(
        spatial_dims=3,
        in_channels=in_channels,
        out_channels=num_classes,
        kernel_size=[3] * levels,
        strides=[1] + [2] * (levels - 1),
        upsample_kernel_size=[2] * (levels - 1),
        filters=list(features),
        norm_name=("INSTANCE", {"affine": True}),
        act_name=("leakyrelu", {"negative_slope": 0.01, "inplace": True}),
        deep_supervision=False,
        res_block=False,
    )


class TrainStep:
    """One training step (forward, Dice + CE loss, backward, SGD) of a model on fixed random data."""

    def __init__(
        self, model: nn.Module, patch: Sequence[int], batch: int, amp_dtype: torch.dtype | None, device: torch.device
    ) -> None:
        torch.manual_seed(0)
        self.model = model.to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.99, nesterov=True)
        self.loss = DiceCELoss()
        self.x = torch.randn(batch, 1, *patch, device=device)
        self.y = torch.randint(0, 3, (batch, *patch), device=device)
        self.amp_dtype, self.device = amp_dtype, device

    def __call__(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        with autocast(self.device, self.amp_dtype):
            out = self.model(self.x)
        self.loss(out, self.y).backward()
        self.optimizer.step()


def step_flops(make: Callable[[], nn.Module], patch: Sequence[int], batch: int) -> int:
    """FLOPs of one forward and backward pass, counted by torch.utils.flop_counter on the meta device
    (no arithmetic is done); convolutions and matrix products, as model FLOP utilisation counts them."""
    with torch.device("meta"):
        model = make()
        x = torch.randn(batch, 1, *patch)
    counter = FlopCounterMode(display=False)
    with counter:
        model(x).float().sum().backward()
    return counter.get_total_flops()


def matmul_flops_per_s(dtype: torch.dtype, device: torch.device, n: int = 2048, repeats: int = 5) -> float:
    """The machine's dense matrix-multiply rate in `dtype`: the reference for model FLOP utilisation."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = interleaved_medians({"mm": lambda: torch.mm(a, b)}, repeats, device)["mm"]
    return 2 * n**3 / seconds


def _peak_memory_child(features, patch, batch, amp_dtype, recompute, device_type, results) -> None:
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    step = TrainStep(UNet3D(1, 3, features), patch, batch, amp_dtype, device)
    step.model.grad_checkpoint = recompute
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step()
    sync(device)
    if device.type == "cuda":
        results.put(torch.cuda.max_memory_allocated(device) / 2**20)
    else:  # this process's own high-water mark (ru_maxrss would include the parent it was forked from)
        status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        results.put(int(status["VmHWM"].split()[0]) / 1024)


def peak_step_memory_mib(
    features: Sequence[int], patch: Sequence[int], batch: int, amp_dtype, recompute: bool, device: torch.device
) -> float:
    """Peak memory of one training step in a fresh process: GPU memory allocated, or the process's peak RSS
    (its VmHWM, which includes the interpreter and PyTorch themselves, about 400 MiB)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = (tuple(features), tuple(patch), batch, amp_dtype, recompute, device.type, results)
    proc = ctx.Process(target=_peak_memory_child, args=args)
    proc.start()
    peak = results.get(timeout=900)
    proc.join()
    return peak
