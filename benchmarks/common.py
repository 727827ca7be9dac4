"""Shared pieces of the benchmarks: clocks, the two models configured identically, a training step, FLOPs."""

from __future__ import annotations

import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from unet3d import DiceCELoss, UNet3D
from unet3d.precision import apply_memory_format, autocast

NNUNET_FEATURES = (32, 64, 128, 256, 320)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds one call of `fn` takes: CUDA events on a GPU (synchronised), the wall clock on the CPU."""
    if device.type == "cuda":
        # Recorded on `device`'s stream, which `fn`'s work is queued on; a bare record() uses the current
        # device's, another GPU's whenever the current device is not `device`.
        stream = torch.cuda.current_stream(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sync(device)
        start.record(stream)
        fn()
        end.record(stream)
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


@contextmanager
def fp32_precision(device: torch.device, tf32: bool) -> Iterator[None]:
    """On a GPU, fp32 convolutions (cuDNN) and matrix products (cuBLAS) in TF32 (`tf32`) or in strict IEEE
    fp32 while the block runs; the previous settings are restored after it.

    PyTorch's defaults differ between the two (cuDNN TF32 on, cuBLAS TF32 off), so without this a step of
    convolutions in TF32 would be compared with a matmul rate in strict fp32, several times slower. The
    settings are read when a kernel is chosen and launched, on the host, so restoring them before queued
    kernels have finished is safe. Nothing changes on the CPU, where fp32 is always IEEE, and GPUs before
    Ampere have no TF32: both settings are strict fp32 there.
    """
    if device.type != "cuda":
        yield
        return
    previous = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = previous


def with_fp32_precision(fn: Callable[[], object], device: torch.device, tf32: bool) -> Callable[[], object]:
    """`fn`, run under `fp32_precision(device, tf32)` at every call: for a function timed alternately with
    others that keep the settings they run under."""

    def call() -> object:
        with fp32_precision(device, tf32):
            return fn()

    return call


def has_tf32(device: torch.device) -> bool:
    """Whether `device` is a GPU with TF32 tensor cores (compute capability 8.0 on: Ampere, Hopper, ...)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def release_gpu_memory() -> None:
    """Free what this process has cached on its GPUs, before it spawns children that measure there.

    Tensors it still holds can't be freed, so they are reported: a child's speed and peak memory are only
    its own on a GPU that holds nothing else. Never initialises CUDA (which would create nothing to free).
    """
    gc.collect()  # tensors held only by reference cycles
    # The current device is the only one this process computes on. With nothing reserved there it has no
    # work queued either, and it returns at once: synchronising would create the context it has avoided.
    if not torch.cuda.is_initialized() or torch.cuda.memory_reserved() == 0:
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated() / 2**20
    if held > 0:
        print(f"warning: this process still holds {held:.0f} MiB on the GPU while children measure", file=sys.stderr)


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


def matmul_flops_per_s(dtype: torch.dtype, device: torch.device, n: int | None = None, repeats: int = 5) -> float:
    """The machine's dense matrix-multiply rate in `dtype`: the reference for model FLOP utilisation.

    On a GPU the matrices are 8192 wide (n) and each timed call runs several products back to back: a 2048
    product in bf16 takes tens of microseconds there, too little work to reach the dense rate and too short
    to time against the launch and the events. fp32 runs under the caller's `fp32_precision`.
    """
    gpu = device.type == "cuda"
    n = n or (8192 if gpu else 2048)
    per_call = 4 if gpu else 1
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def products() -> None:
        for _ in range(per_call):
            torch.mm(a, b)

    seconds = interleaved_medians({"mm": products}, repeats, device)["mm"] / per_call
    return 2 * n**3 / seconds


def _peak_memory_child(features, patch, batch, amp_dtype, recompute, device_name, results) -> None:
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work: the context and cuDNN's handles on this GPU only
        torch.backends.cudnn.benchmark = True  # as training runs (a spawned process starts with the default)
    step = TrainStep(UNet3D(1, 3, features), patch, batch, amp_dtype, device)
    step.model.grad_checkpoint = recompute
    if device.type == "cuda":
        # A first step outside the count: it holds cuDNN's benchmark of candidate algorithms (workspaces far
        # larger than the chosen ones') and allocates the momentum buffers that every later step holds.
        step()
        sync(device)
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
    """Peak memory of one training step in a fresh process: GPU memory allocated by a step after a first one,
    or the process's peak RSS (its VmHWM, which includes the interpreter and PyTorch themselves, about 400 MiB)."""
    import multiprocessing as mp

    if device.type == "cuda":
        release_gpu_memory()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    args = (tuple(features), tuple(patch), batch, amp_dtype, recompute, str(device), results)
    proc = ctx.Process(target=_peak_memory_child, args=args)
    proc.start()
    peak = results.get(timeout=900)
    proc.join()
    return peak
