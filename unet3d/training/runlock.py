"""One job per run folder: rank 0 holds a lock on OUT/.lock while it trains, so that a second job started
into the same --out-dir by mistake is refused before its checkpoints, logs and TensorBoard events are
interleaved with the first job's.

The lock is a POSIX record lock (`fcntl.lockf`): it belongs to the process that took it, so the DataLoader
workers it forks do not hold it, and the kernel releases it when that process ends however it ends, so a
rank 0 that torchrun restarts takes it again. It works on network file systems with lock support; where
locks are not supported at all, training goes on unguarded, with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path
from typing import IO

LOCK_NAME = ".lock"
WAIT_S = 5.0  # how long to wait for a restarted rank 0's predecessor to be gone
_held: IO[str] | None = None  # the lock file this process holds until it ends


def _try_lock(f: IO[str]) -> bool:
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return False
        raise


def lock_run_folder(out_dir: str | Path, wait_s: float = WAIT_S, keep: bool = True) -> str | None:
    """Take OUT/.lock for this process (until it ends; with `keep` False, only test that it is free).

    Returns:
        None when it was taken (or locks are unsupported), else a warning to log.

    Raises:
        ValueError: another process holds it, naming that process, after `wait_s` seconds of trying.
    """
    global _held
    folder = Path(out_dir)
    if not folder.is_dir():
        return None  # nothing trains into a folder that is not there
    f = open(folder / LOCK_NAME, "a+")  # noqa: SIM115  # held open for the life of the process
    try:
        deadline = time.monotonic() + wait_s
        while not _try_lock(f):
            if time.monotonic() >= deadline:
                f.seek(0)
                holder = f.read().strip() or "a process that left no name"
                raise ValueError(
                    f"--out-dir {folder} is in use by another job ({holder}): wait for it to end, or give "
                    f"another --out-dir (if that job is gone, its host crashed on a network file system that "
                    f"keeps the lock, remove {folder / LOCK_NAME})"
                )
            time.sleep(0.2)
    except OSError as e:  # ENOLCK, ENOSYS, EINVAL: a file system without locks
        f.close()
        return f"could not lock {folder / LOCK_NAME} ({e.strerror or e}): nothing keeps a second job out of it"
    except BaseException:
        f.close()
        raise
    if not keep:
        f.close()  # closing releases a POSIX lock
        return None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    _held = f
    return None
