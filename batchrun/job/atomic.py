"""One way to write a file that a reader, or a run resumed after a crash, relies on: it sees the old file or the
whole new one, never a part, and the new one survives a power loss once this returns."""
from __future__ import annotations

import os
from typing import IO, Callable


def atomic_write(path: str, data: str | bytes | Callable[[IO[bytes]], None]) -> None:
    """Write `data` (text as UTF-8, bytes, or a function that writes into the open binary file) to a hidden
    temporary name beside `path`, fsync it, rename it over `path`, then fsync the directory (the rename itself)."""
    directory, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(directory, f".{name}.tmp")
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:   # a failed or interrupted write leaves the old file and no temporary one
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(directory)


def fsync_dir(path: str) -> None:
    """Make the directory's entries (a rename, a new or removed file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
