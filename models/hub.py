"""Where model checkpoints live on this machine, and fetching the missing ones.

A checkpoint is named by a local directory or a Hugging Face repo id (``org/name``). A repo id
is looked up, in this order, under ``--cache-dir`` (when given), ``$HF_HUB_CACHE``,
``$HF_HOME/hub`` and ``~/.cache/huggingface/hub``, in either layout:

- the hub cache: ``models--{org}--{name}/snapshots/{commit}/``, with ``refs/{revision}`` holding
  the commit (``hf download`` and ``from_pretrained`` write this);
- a plain directory ``{dir}/{org}/{name}/`` (``hf download --local-dir``, a copy).

A model lists what it needs as ``CheckpointSpec``s (``Model.checkpoints``); ``ensure`` runs in
the launcher before any service starts: a missing checkpoint is downloaded with a progress bar
when downloads are allowed (``--download`` or ``MSTAR_DOWNLOAD=1``; huggingface_hub, imported
only then) and the network answers, else it is an error naming every missing repo id and the
command that fetches it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HOME_CACHE = Path("~/.cache/huggingface/hub")


class CheckpointError(Exception):
    """A checkpoint is missing, incomplete or does not match its config."""


@dataclass(frozen=True)
class CheckpointSpec:
    """A checkpoint a model needs: a repo id (or a local directory) and what makes it complete."""

    name: str  # "org/name", or a directory
    revision: str = "main"
    #: files it must hold; a tuple inside names alternatives (one of them is enough)
    required: tuple[str | tuple[str, ...], ...] = ("config.json",)
    #: what to download (huggingface_hub allow_patterns); None: the whole repo
    allow_patterns: tuple[str, ...] | None = None

    def missing_files(self, directory: Path) -> list[str]:
        out = []
        for need in self.required:
            options = (need,) if isinstance(need, str) else need
            if not any((directory / f).is_file() for f in options):
                out.append(" or ".join(options))
        return out


def search_dirs(cache_dir: str | Path | None = None) -> list[Path]:
    """Where repo ids are looked up, first match wins (duplicates removed)."""
    dirs = [cache_dir] if cache_dir else []
    if os.environ.get("HF_HUB_CACHE"):
        dirs.append(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        dirs.append(Path(os.environ["HF_HOME"]) / "hub")
    dirs.append(HOME_CACHE)
    out: list[Path] = []
    for d in dirs:
        p = Path(d).expanduser()
        if p not in out:
            out.append(p)
    return out


def resolve_checkpoint(model: str | Path, *, cache_dir: str | Path | None = None, revision: str = "main") -> Path:
    """Directory of ``model``: itself if it is a directory, else its snapshot or plain folder in
    the first of ``search_dirs(cache_dir)`` that has it. Never downloads."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    model = str(model)
    looked: list[str] = []
    if model.count("/") == 1 and not model.startswith(("/", ".", "~")):
        org, name = model.split("/")
        for root in search_dirs(cache_dir):
            repo = root / f"models--{org}--{name}"
            if repo.is_dir():
                return _snapshot(repo, revision)
            plain = root / org / name
            if plain.is_dir():
                return plain
            looked += [str(repo), str(plain)]
    raise CheckpointError(
        f"Checkpoint {model!r} not found: not a directory, nor in {', '.join(looked) or 'any cache'}. "
        f"Fetch it first, e.g. `{fetch_command(model, cache_dir)}`"
    )


def _snapshot(repo: Path, revision: str) -> Path:
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = repo / "snapshots" / commit
    if snapshot.is_dir():
        return snapshot
    have = sorted(p.name for p in (repo / "snapshots").glob("*")) if (repo / "snapshots").is_dir() else []
    raise CheckpointError(
        f"{repo}: no snapshot for revision {revision!r} (looked for {ref} and {snapshot}); "
        f"snapshots present: {have or 'none'}"
    )


def fetch_command(repo_id: str, cache_dir: str | Path | None = None, revision: str = "main") -> str:
    rev = f" --revision {revision}" if revision != "main" else ""
    where = f" --cache-dir {cache_dir}" if cache_dir else ""
    return f"hf download {repo_id}{rev}{where}"


def problem(spec: CheckpointSpec, cache_dir: str | Path | None = None) -> str | None:
    """Why ``spec`` cannot be used from this machine's caches, or None."""
    try:
        directory = resolve_checkpoint(spec.name, cache_dir=cache_dir, revision=spec.revision)
    except CheckpointError as e:
        return str(e)
    missing = spec.missing_files(directory)
    return f"{directory} lacks {', '.join(missing)}" if missing else None


class MissingCheckpoints(CheckpointError):
    """Checkpoints absent from every cache; the message names each and how to fetch it."""


def ensure(specs: Sequence[CheckpointSpec], cache_dir: str | Path | None = None, *, download: bool = False,
           model: str = "") -> list[str]:
    """Make every checkpoint of ``specs`` resolvable: those missing are downloaded when
    ``download`` (into ``cache_dir``, else the default hub cache), else MissingCheckpoints names
    them all. Returns the repo ids downloaded."""
    missing = [(s, why) for s in specs if (why := problem(s, cache_dir)) is not None]
    if not missing:
        return []
    who = f"model '{model}'" if model else "the model"
    failed: list[str] = []
    fetched: list[str] = []
    if download:
        for spec, _ in missing:
            error = _download(spec, cache_dir)
            if error is None and (error := problem(spec, cache_dir)) is None:
                fetched.append(spec.name)
            else:
                failed.append(f"  {spec.name}: download failed: {error}\n    fetch it: {_command(spec, cache_dir)}")
        if not failed:
            return fetched
    else:
        failed = [f"  {spec.name}: {why}\n    fetch it: {_command(spec, cache_dir)}" for spec, why in missing]
    hint = ("" if download else "\nor let M* download them: add --download (or set MSTAR_DOWNLOAD=1).")
    raise MissingCheckpoints(f"{who} needs {len(failed)} checkpoint(s) not on this machine:\n" + "\n".join(failed)
                             + hint + "\n(--random-weights serves a tiny random checkpoint instead, for a demo)")


def _command(spec: CheckpointSpec, cache_dir) -> str:
    if "/" not in spec.name or Path(spec.name).expanduser().is_absolute():
        return f"put the checkpoint in {spec.name}"
    return fetch_command(spec.name, cache_dir, spec.revision)


def _download(spec: CheckpointSpec, cache_dir) -> str | None:
    """Download ``spec`` with huggingface_hub's progress bars; the error as text, or None."""
    if "/" not in spec.name or Path(spec.name).expanduser().is_absolute():
        return f"{spec.name} is a local path, not a repo id"
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return "huggingface_hub is not installed (pip install huggingface_hub)"
    print(f"mstar: downloading {spec.name} ({spec.revision}) into {cache_dir or 'the Hugging Face cache'}",
          flush=True)
    try:
        snapshot_download(spec.name, revision=spec.revision, cache_dir=str(cache_dir) if cache_dir else None,
                          allow_patterns=list(spec.allow_patterns) if spec.allow_patterns else None)
    except Exception as e:  # offline, gated repo, no such repo, disk full: all reported the same way
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None
