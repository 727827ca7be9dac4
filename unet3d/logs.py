"""Console logging: rank 0 reports progress, the other ranks only warnings and errors."""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "unet3d"


def setup_logging(rank: int) -> logging.Logger:
    """The project's logger, configured for this rank (idempotent)."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    prefix = f"[rank {rank}] " if rank > 0 else ""
    handler.setFormatter(logging.Formatter(f"{prefix}%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
    return logger


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)
