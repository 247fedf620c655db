"""Atomic file replacement shared by every writer of ``lowbit.io`` (``safetensors.py``,
``gguf.py``): write a temporary file in the destination's folder, flush and fsync it, then rename
it over the destination, so a crash or an error mid-write leaves the previous file intact.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator, Union

#: A file path: a string or an ``os.PathLike`` (``pathlib.Path``).
StrPath = Union[str, "os.PathLike[str]"]


@contextlib.contextmanager
def atomic_path(path: StrPath, suffix: str = "") -> Iterator[str]:
    """Yield a temporary path beside ``path``; on a clean exit it is fsynced and renamed to
    ``path``, on any error it is removed and ``path`` is left as it was.

    The temporary file sits in the same folder because ``os.replace`` is atomic only within one
    file system.
    """
    dest = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(dest))
    fd, tmp = tempfile.mkstemp(prefix=".lowbit-", suffix=suffix + ".tmp", dir=folder)
    os.close(fd)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, dest)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
