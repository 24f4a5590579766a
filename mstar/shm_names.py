"""Shared-memory name prefixes (``--socket-path-prefix``): every segment a mesh's services create
is ``/dev/shm/<prefix><owner>-<pid>-<n>``, and the launcher removes everything under its prefix
when it stops. So two meshes on one host must not share a prefix, nor may one's prefix begin
with the other's. Each launcher holds a lock on its prefix for as long as it runs (a file in
``LOCK_DIR`` named by the prefix, ``flock``ed); a launch whose prefix would overlap a held one
is refused before anything starts. A crashed launcher's lock is released by the kernel.
"""

from __future__ import annotations

import fcntl
import os
import re

SHM_DIR = "/dev/shm"
LOCK_DIR = os.path.join(SHM_DIR, ".mstar-prefixes")
_GUARD = ".guard"  # held while a launcher checks and takes its prefix
_VALID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")  # as shm.py accepts segment names


class PrefixError(ValueError):
    """The prefix is malformed or overlaps a running mesh's; the message says what to pass."""


def check_prefix(prefix: str) -> str:
    if not _VALID.fullmatch(prefix):
        raise PrefixError(f"--socket-path-prefix {prefix!r}: M* has no Unix sockets; the prefix names this mesh's "
                          f"shared-memory segments in {SHM_DIR}, so it must be 1-100 letters, digits, '.', '_' or '-' "
                          f"starting with a letter or digit (e.g. mstar_alice_)")
    return prefix


def _held(path: str) -> bool:
    """Whether a running launcher holds the lock file ``path``."""
    try:
        fd = os.open(path, os.O_RDONLY)  # flock needs no write access: another user's lock is probed too
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the probe's lock too
    return False


def _holder(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"


class PrefixLock:
    """This launcher's hold on its prefix: ``acquire()`` before starting services, ``release()``
    after removing their segments."""

    def __init__(self, prefix: str):
        self.prefix = check_prefix(prefix)
        self.path = os.path.join(LOCK_DIR, prefix)
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            os.mkdir(LOCK_DIR)
            os.chmod(LOCK_DIR, 0o1777)  # every user's launchers share it (sticky: each removes only its own)
        except FileExistsError:
            pass
        guard = os.open(os.path.join(LOCK_DIR, _GUARD), os.O_RDONLY | os.O_CREAT, 0o644)
        try:
            fcntl.flock(guard, fcntl.LOCK_EX)
            for other in sorted(os.listdir(LOCK_DIR)):
                if other == _GUARD or not (other.startswith(self.prefix) or self.prefix.startswith(other)):
                    continue
                path = os.path.join(LOCK_DIR, other)
                if _held(path):
                    same = "the same prefix" if other == self.prefix else f"the prefix {other!r}"
                    raise PrefixError(f"--socket-path-prefix {self.prefix!r}: a running mesh (launcher pid "
                                      f"{_holder(path)}) uses {same}; each mesh removes every segment under its "
                                      f"prefix when it stops, so pick a prefix that does not begin with, and is not "
                                      f"the beginning of, {other!r}")
                try:
                    os.unlink(path)  # a stopped launcher's leftover
                except OSError:  # gone already, or another user's (the sticky folder keeps it): harmless
                    pass
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, f"{os.getpid()}\n".encode())
            self._fd = fd
        finally:
            os.close(guard)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None
