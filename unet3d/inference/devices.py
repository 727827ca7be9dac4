"""Choosing one device for a single-process job (evaluation) without touching any other GPU."""

from __future__ import annotations

import os

import torch


def mask_physical_gpu(gpu: int) -> None:
    """Make physical GPU `gpu`, numbered as nvidia-smi numbers it, the only visible one (then cuda:0).

    Must run before CUDA initialises: afterwards the mask would silently have no effect.
    """
    if gpu < 0:
        raise ValueError(f"--gpu must be a physical GPU index >= 0, got {gpu}")
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA is already initialised; the GPU mask must be set before any CUDA call")
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)


def choose_device(gpu: int | None, device: str | None) -> torch.device:
    """--gpu N (physical, masked to cuda:0), or --device cpu|cuda:N, or the first visible GPU, else the CPU."""
    if gpu is not None:
        mask_physical_gpu(gpu)
        if not torch.cuda.is_available():
            raise ValueError(f"--gpu {gpu}: no such GPU is visible (CUDA_VISIBLE_DEVICES={gpu}, PCI bus order)")
        # torch.cuda.is_initialized() misses CUDA started outside torch's lazy init (an is_available() call
        # before the mask starts the driver): the driver read the mask then, and then cuda:0 is not GPU `gpu`.
        # The driver's own count is what it saw (torch.cuda.device_count() would parse the new mask instead).
        count = getattr(torch._C, "_cuda_getDeviceCount", lambda: 1)()
        if count != 1:
            raise RuntimeError(
                f"--gpu {gpu}: CUDA was started before the mask and sees {count} GPUs, so cuda:0 need not be "
                f"physical GPU {gpu}: nothing may touch CUDA before choose_device"
            )
        chosen = torch.device("cuda", 0)
    elif device is not None:
        try:
            chosen = torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"--device {device!r} is not a device (use cpu or cuda:N)") from e
        if chosen.type == "cuda":
            index = 0 if chosen.index is None else chosen.index
            if not torch.cuda.is_available() or index >= torch.cuda.device_count():
                raise ValueError(f"--device {device}: no such GPU is visible")
            chosen = torch.device("cuda", index)
    else:
        chosen = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)  # before any CUDA work, so no context lands on another GPU
    return chosen
