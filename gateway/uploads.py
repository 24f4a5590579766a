"""Uploaded files spilled to disk (``--upload-dir``).

Without an upload dir a multipart file part is read into memory, as it always was. With one,
a part that grows past ``spill_bytes`` is written to a file as it arrives (the first
``spill_bytes`` are held until then), so a slow or large upload holds no more than that in
memory. The file is read back only when the request is serialized for the conductor (see
``generate``): neither the gateway's body nor its gRPC call keeps a copy for the request's
life. The conductor then holds the bytes it decodes, as before.

Each request's files live in a folder of their own under ``<dir>/gateway-<pid>/``, removed
when the request ends, however it ends (the handler's ``finally``: success, error, timeout,
cancel, client disconnect); the gateway's folder goes when it stops, and the launcher removes
it after a crash. ``max_bytes`` bounds what this gateway keeps in the folder at once: an
upload that would pass it is refused with 413 RESOURCE_EXHAUSTED naming the bound.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from mstar.gateway.errors import ApiError


@dataclass(frozen=True)
class UploadSettings:
    directory: str
    #: a file part larger than this goes to disk, bytes
    spill_bytes: int = 1 << 20
    #: the most bytes of spilled files this gateway keeps in ``directory`` at once
    max_bytes: int = 1 << 30

    def __post_init__(self):
        if self.spill_bytes < 0 or self.max_bytes <= 0:
            raise ValueError(f"spill_bytes must be >= 0 and max_bytes > 0, got {self.spill_bytes} and {self.max_bytes}")


class UploadDir:
    """This gateway's folder in the upload dir and the bytes its requests hold there."""

    def __init__(self, settings: UploadSettings):
        self.settings = settings
        self.root = Path(settings.directory) / f"gateway-{os.getpid()}"
        self.used = 0
        self._requests = 0

    def open(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def request(self) -> RequestFiles:
        self._requests += 1
        return RequestFiles(self, self.root / f"r{self._requests}")


class RequestFiles:
    """One request's spilled files; ``remove()`` deletes them and frees their share of the bound."""

    def __init__(self, spool: UploadDir, folder: Path):
        self.spool, self.folder = spool, folder
        self.bytes = 0
        self._files = 0

    @property
    def spill_bytes(self) -> int:
        return self.spool.settings.spill_bytes

    def reserve(self, n: int) -> None:
        limit = self.spool.settings.max_bytes
        if self.spool.used + n > limit:
            raise ApiError(413, f"uploads spilled to {self.spool.settings.directory} would pass its bound of {limit} "
                                f"bytes ({limit / 2**20:g} MiB, --upload-dir-max-mb) with the requests in flight; "
                                "retry later, or raise the bound", code="RESOURCE_EXHAUSTED")
        self.spool.used += n
        self.bytes += n

    def new_file(self) -> Path:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._files += 1
        return self.folder / f"part{self._files}"

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self.spool.used -= self.bytes
        self.bytes = 0
