"""Tandem's state on disk is readable by its own user only: directories 0700, files 0600.

The state directory holds what a notebook is made of: the Raft WAL and snapshots carry every
replicated variable (pickles), the data store the large ones, the input history the code, logs
the cells' metadata, connection files the kernels' HMAC keys. Each place that creates such a
file or directory goes through here, so the mode does not depend on the umask of whoever
started the service (a systemd unit, a shell with umask 022, a test). Modes are set at
creation, and an existing directory Tandem owns is tightened when it is opened again (a state
directory left by an older version).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path
from typing import IO

DIR_MODE = 0o700
FILE_MODE = 0o600


def private_dir(path: str | os.PathLike[str], *, tighten: bool = True) -> Path:
    """``mkdir -p`` whose every created directory is 0700. ``tighten``: an existing ``path``
    owned by this user loses its group and other bits too (its sticky bit kept); not for a
    directory the operator named, such as the state dir. Parents that existed are left as
    they are."""
    path = Path(path)
    missing: list[Path] = []
    current = path
    while not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process
            directory.mkdir(mode=DIR_MODE)
    if tighten:
        _tighten(path, DIR_MODE)
    return path


# sun_path holds 108 bytes with its NUL; a socket deeper than this goes to a private temp dir
MAX_SOCKET_PATH = 100


def private_socket_path(preferred: Path, temp_prefix: str) -> tuple[Path, Path | None]:
    """Where to bind a Unix socket that only this user may reach: ``preferred`` in its 0700
    directory, or, when that path is too long for a socket, the same name in a new private
    temporary directory (returned second, for its owner to remove)."""
    if len(str(preferred)) <= MAX_SOCKET_PATH:
        private_dir(preferred.parent)
        return preferred, None
    made = Path(tempfile.mkdtemp(prefix=temp_prefix))  # 0700
    return made / preferred.name, made


def _tighten(path: Path, mode: int) -> None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return
    if st.st_uid == os.getuid() and st.st_mode & 0o077 & ~mode:
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o077 | mode)


def open_private(path: str | os.PathLike[str], flags: int) -> int:
    """``os.open`` creating a 0600 file (a file that existed with wider modes is narrowed)."""
    fd = os.open(path, flags | os.O_CREAT, FILE_MODE)
    try:
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private_file(path: str | os.PathLike[str], mode: str = "ab") -> IO[bytes]:
    """A binary file object opened in ``mode`` ("ab", "wb"), created 0600."""
    flags = {"ab": os.O_WRONLY | os.O_APPEND, "wb": os.O_WRONLY | os.O_TRUNC}[mode]
    return os.fdopen(open_private(path, flags), mode)


def write_private(path: str | os.PathLike[str], data: str | bytes, *, exclusive: bool = False) -> None:
    """Write ``data`` to ``path`` (created or truncated), 0600. ``exclusive``: the file must be
    new (a temporary file in a shared directory: never written through another's file)."""
    raw = data.encode() if isinstance(data, str) else data
    flags = os.O_WRONLY | (os.O_EXCL if exclusive else os.O_TRUNC)
    with os.fdopen(open_private(path, flags), "wb") as f:
        f.write(raw)


def replace_private(path: Path, data: str | bytes) -> None:
    """Replace ``path`` (0600, in a private directory) atomically: a reader, or a restart after a
    crash, sees the old content or the new, never half of it (a service's persisted registry)."""
    private_dir(path.parent)
    tmp = path.with_suffix(".tmp")
    write_private(tmp, data)
    os.replace(tmp, path)
