"""Every environment variable M* reads, in one typed place (prefix MSTAR_)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache


@dataclass(frozen=True)
class Settings:
    #: prefix of shared-memory segment names; the launcher sets a per-launch one
    shm_prefix: str
    #: seconds a service waits for a peer before calling it unreachable
    connect_timeout_s: float
    #: node groups' sys.setswitchinterval: how long a thread may hold the GIL while another waits
    gil_switch_interval_s: float
    #: node groups without engines: the longest back-to-back rounds run before yielding to the
    #: event loop (NodeGroupRuntime.round_budget_s); 0 yields after every round
    round_budget_s: float
    #: NVTX ranges around node forwards, engine steps and tensor transfers (mstar serve --enable-nvtx)
    nvtx: bool
    #: node groups and the conductor record torch.profiler traces into this folder, each from one
    #: SIGUSR1 to the next (mstar serve --torch-profile; mstar.torch_profile); "" off
    torch_profile: str
    #: how long one such recording lasts at most (seconds)
    torch_profile_s: float
    #: torch's intra-op threads in the conductor and GPU node groups (None: their default, 1; CPU
    #: node groups keep torch's one per core unless this is set)
    torch_threads: int | None
    #: the launcher may download checkpoints missing from the local caches (as --download)
    download: bool
    #: API keys of the public surfaces, comma-separated (mstar.auth; with --api-keys-file). Never logged.
    api_keys: str = field(default="", repr=False)


@lru_cache(maxsize=1)
def settings() -> Settings:
    return Settings(
        shm_prefix=os.environ.get("MSTAR_SHM_PREFIX", f"mstar-{os.getpid()}-"),
        connect_timeout_s=float(os.environ.get("MSTAR_CONNECT_TIMEOUT_S", "5")),
        gil_switch_interval_s=_positive("MSTAR_GIL_SWITCH_INTERVAL_S", "0.0005"),
        round_budget_s=_seconds("MSTAR_ROUND_BUDGET_S", "0", allow_zero=True),
        nvtx=_flag("MSTAR_NVTX"),
        torch_profile=os.environ.get("MSTAR_TORCH_PROFILE", ""),
        torch_threads=_count("MSTAR_TORCH_THREADS"),
        torch_profile_s=_positive("MSTAR_TORCH_PROFILE_S", "10"),
        download=_flag("MSTAR_DOWNLOAD"),
        api_keys=os.environ.get("MSTAR_API_KEYS", ""),
    )


def _count(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"environment variable {name} must be a positive integer, got {raw!r}")
    return int(raw)


def apply_torch_threads(default: int | None) -> None:
    """Set this service's torch intra-op thread count: MSTAR_TORCH_THREADS, else ``default`` (None:
    leave torch's, one per core).

    A service whose heavy work runs on a GPU (or one that only reads requests) does small CPU ops
    from several threads: each thread that runs a parallel op gets its own OpenMP team of one
    thread per core, and the teams of the services on one host spin against each other. On an
    H100 host a 450 kB uint8 stack in π0.5's node group took 7-12 ms that way (bench/trace_gaps.py
    on its served trace); on one thread it is a plain copy."""
    n = settings().torch_threads or default
    if n is not None:
        import torch

        torch.set_num_threads(n)


def _flag(name: str) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise ValueError(f"environment variable {name} must be 1/true/yes or 0/false/no, got {raw!r}")


def _positive(name: str, default: str) -> float:
    return _seconds(name, default, allow_zero=False)


def _seconds(name: str, default: str, allow_zero: bool) -> float:
    raw = os.environ.get(name, default)
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value >= 0 if allow_zero else value > 0) or value == float("inf"):
        what = "a number of seconds >= 0" if allow_zero else "a positive number of seconds"
        raise ValueError(f"environment variable {name} must be {what}, got {raw!r}")
    return value
