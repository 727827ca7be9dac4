"""Checkpoint I/O: atomic saves, safe loads onto a chosen device, and wrapper-prefix stripping."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP / DataParallel, torch.compile


def save_checkpoint(state: Mapping[str, Any], path: str | Path) -> None:
    """Write `state` to `path` through a temporary file in the same folder, fsynced, then renamed.

    A reader never sees a half-written file; on failure the temporary file is removed and any previous
    checkpoint at `path` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(dict(state), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def load_checkpoint(path: str | Path, device: torch.device | str) -> dict[str, Any]:
    """Load a checkpoint with every tensor mapped to `device`, refusing pickled code (weights_only)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    return torch.load(path, map_location=device, weights_only=True)


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
