"""Which CUDA devices a mesh's node groups run on, decided before anything starts: without
``--gpus`` every GPU torch sees (none: the CPU); ``--gpus ''`` the CPU; ``--gpus 0,1`` those,
checked against what torch sees. YAML ranks index the resulting list."""

from __future__ import annotations

from collections.abc import Sequence

from mstar.config import ConfigError, NodeGroupConfig


def cuda_device_count() -> int:
    """CUDA devices torch can use here (0 with a CPU-only torch or no driver)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _no_cuda_reason() -> str:
    import torch

    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build; install a CUDA build (`make setup` on a host "
                f"where nvidia-smi works does)")
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device (driver, CUDA_VISIBLE_DEVICES?)"


def parse_gpus(spec: str) -> list[int]:
    """``--gpus 0,1`` -> [0, 1]; ``''`` -> [] (the CPU)."""
    try:
        ids = [int(x) for x in spec.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ConfigError(f"--gpus {spec!r}: expected comma-separated CUDA device ids, e.g. --gpus 0,1 "
                          f"(--gpus '' serves on the CPU)") from None
    if any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ConfigError(f"--gpus {spec!r}: device ids must be distinct and >= 0")
    return ids


def check_gpus(spec: str, groups: Sequence[NodeGroupConfig], count: int | None = None) -> list[int] | None:
    """The device ids YAML ranks map onto for an explicit ``--gpus``; None: the CPU (``''``).
    Raises ConfigError, saying what to change, for ids torch cannot use or a group with more
    ranks than ids."""
    ids = parse_gpus(spec)
    if not ids:
        return None
    count = cuda_device_count() if count is None else count
    if count == 0:
        raise ConfigError(f"--gpus {spec}: no CUDA here: {_no_cuda_reason()}. Serve on the CPU with --gpus ''")
    bad = [i for i in ids if i >= count]
    if bad:
        raise ConfigError(f"--gpus {spec}: device(s) {bad} do not exist; torch sees {count} CUDA device(s) "
                          f"(ids 0..{count - 1})")
    check_ranks(groups, ids, f"--gpus {spec}")
    return ids


def check_ranks(groups: Sequence[NodeGroupConfig], ids: list[int], where: str) -> None:
    for g in groups:
        bad = [r for r in g.ranks if r >= len(ids)]
        if bad:
            raise ConfigError(f"node group '{g.name}': ranks {list(g.ranks)} need {max(g.ranks) + 1} GPU(s), but "
                              f"{where} gives {len(ids)}; use a config with fewer ranks or more GPUs")


def resolve_gpus(spec: str | None, groups: Sequence[NodeGroupConfig], count: int | None = None) -> list[int] | None:
    """The device ids YAML ranks map onto, or None for the CPU. ``spec`` is ``--gpus`` (None:
    not given: every visible GPU, or the CPU where torch sees none)."""
    if spec is not None:
        return check_gpus(spec, groups, count)
    count = cuda_device_count() if count is None else count
    if count == 0:
        return None
    ids = list(range(count))
    check_ranks(groups, ids, f"this host ({count} visible CUDA device(s))")
    return ids


def placement_line(groups: Sequence[NodeGroupConfig], gpus: list[int] | None, spec: str | None) -> str:
    """One line saying where each node group runs and why."""
    if gpus is None:
        why = "--gpus ''" if spec is not None else "no CUDA device visible to torch"
        return f"M* placement: every node group on the CPU ({why})"
    where = ", ".join(f"{g.name} -> {', '.join(f'cuda:{gpus[r]}' for r in g.ranks)}" for g in groups)
    why = f"--gpus {spec}" if spec is not None else f"every visible GPU ({len(gpus)}); --gpus '' serves on the CPU"
    return f"M* placement: {where} ({why})"
