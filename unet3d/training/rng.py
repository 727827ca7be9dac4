"""Random-number-generator states as plain types (lists and ints), so checkpoints load with weights_only."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture(device: torch.device) -> dict[str, Any]:
    """This process's torch (CPU and its CUDA device), NumPy and Python generator states."""
    np_state = np.random.get_state()
    py_version, py_state, py_gauss = random.getstate()
    state = {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_version, list(py_state), py_gauss],
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device).tolist()
    return state


def restore(state: dict[str, Any], device: torch.device) -> None:
    """Set the generators from `capture`'s output."""
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8), device)
