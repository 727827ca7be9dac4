"""Writing files so that a reader never sees half of one: a temporary sibling, then a rename.

Temporary names carry the host name, the process id and a random token: nodes that share a folder on a
network file system (a common `--out-dir` or preprocessing cache) never write to the same temporary
file, even when two hosts' processes have the same pid.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def temp_path(path: str | Path) -> Path:
    """A hidden sibling of `path` that no other process, on this host or another, will pick."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")


NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})  # a full disk, a full quota, a file-size limit


def out_of_room(error: BaseException) -> OSError | None:
    """The write refused for want of room (a full disk or quota, a file-size limit) that `error` is or arose
    from (torch.save's zip writer, failing to finish the file, raises a RuntimeError over it); else None.
    A restart would only repeat such a failure."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError) and error.errno in NO_ROOM:
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


STALE_AFTER_S = 60.0  # a temporary file or folder untouched this long, of a dead process: left behind


def remove_stale_temps(path: str | Path) -> list[Path]:
    """Remove the `temp_path` siblings of `path` that processes of this host, now gone, left behind (killed
    while they wrote: a signal's default action runs no `finally`); another host's are left alone. Returns
    what was removed."""
    path = Path(path)
    prefix = f".{path.name}.tmp-"
    removed = []
    for temp in path.parent.glob(f"{prefix}*") if path.parent.is_dir() else ():
        # the name's end is HOST-PID-TOKEN, split from the right: a host name may hold dashes (node-7)
        host, pid, token = (temp.name[len(prefix) :].rsplit("-", 2) + ["", ""])[:3]
        if host != socket.gethostname() or not pid.isdigit() or not re.fullmatch("[0-9a-f]{8}", token):
            continue
        if _alive(int(pid)) or time.time() - _newest_mtime(temp) < STALE_AFTER_S:
            continue  # (the age: a writer in another PID namespace of a host of the same name looks dead)
        if temp.is_dir():
            shutil.rmtree(temp, ignore_errors=True)
        else:
            temp.unlink(missing_ok=True)
        removed.append(temp)
    return removed


def _newest_mtime(path: Path) -> float:
    """The latest modification time in `path` (a folder's own mtime stays as files are written deeper down)."""
    newest = path.stat().st_mtime
    if path.is_dir():
        for inner in path.rglob("*"):
            try:
                newest = max(newest, inner.stat().st_mtime)
            except OSError:  # gone meanwhile
                continue
    return newest


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def writable_folder(path: str | Path, named: str) -> Path:
    """`path`, created with its parents, once a file has been written there and removed.

    Raises:
        ValueError: starting with `named` (the option and its value) and naming the folder, where it cannot be
            created or written (a read-only or missing mount, a file in the way, no permission).
    """
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = temp_path(path / "write-test")
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{named}: cannot write {path} ({e.strerror or e})") from e
    return path


def atomic_write(
    path: str | Path,
    write: Callable[[BinaryIO], object],
    *,
    durable: bool = False,
    previous: str | Path | None = None,
) -> None:
    """Write `path` through `write(file)` into a temporary sibling, then rename it into place.

    On any failure (a full disk, say) the temporary file is removed and `path` is left as it was.

    Args:
        write: writes the content to the open binary file it is given.
        durable: fsync the file and the folder, so the new content survives a power loss (checkpoints).
        previous: keep the file `path` held until now under this name.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        if previous is not None and path.exists():
            os.replace(path, previous)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        room = out_of_room(e)
        if room is not None:  # said plainly, naming the file (a write's error names none)
            raise OSError(room.errno, room.strerror or str(room), str(path)) from e
        raise
    if durable:
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)  # make the rename itself durable
        finally:
            os.close(folder)


def atomic_write_text(path: str | Path, text: str) -> None:
    """`atomic_write` of a UTF-8 text."""
    atomic_write(path, lambda f: f.write(text.encode()))
