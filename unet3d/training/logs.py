"""Logging: rank 0 reports progress on the console, the other ranks only warnings and errors; every rank
also keeps a complete log file of its own under OUT/logs/ (appended across restarts)."""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path

LOGGER_NAME = "unet3d"


def setup_logging(rank: int, log_dir: str | Path | None = None) -> logging.Logger:
    """The project's logger, configured for this rank (idempotent)."""
    logger = logging.getLogger(LOGGER_NAME)
    for handler in logger.handlers:
        handler.close()
    logger.handlers.clear()
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(logging.Formatter(f"[rank {rank}] %(message)s" if rank > 0 else "%(message)s"))
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.addHandler(console)
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        file = logging.FileHandler(Path(log_dir) / f"rank{rank}.log")
        file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(file)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    file_only(logger, f"=== rank {rank} pid {os.getpid()} on {socket.gethostname()}, torchrun restart {restart}")
    return logger


def file_only(logger: logging.Logger, message: str, level: int = logging.INFO) -> None:
    """Write `message` to this rank's log file, not to the console."""
    record = logger.makeRecord(logger.name, level, __file__, 0, message, None, None)
    for handler in logger.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)
