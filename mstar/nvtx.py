"""NVTX ranges, so a GPU profile (Nsight Systems) shows the graph: each node's forward (or whole
loop), each engine step, each frame batch a node group sends or receives with tensors.

Off by default. ``mstar serve --enable-nvtx`` sets MSTAR_NVTX=1 for every service; then ``span``
pushes a named range on entry and pops it on exit, also when the body raises, so ranges stay
balanced on every path. Off, ``span`` returns one shared no-op context manager: a call and a
``with`` on it, nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from mstar.env import settings

NULL = contextlib.nullcontext()  # what span() gives while ranges are off
_push: Callable[[str], object] | None = None
_pop: Callable[[], object] | None = None
#: whether ranges are on (hot paths test it before they build a range's name)
ACTIVE = False


class NvtxUnavailable(RuntimeError):
    """NVTX ranges were asked for where there is no CUDA to profile."""


def require_cuda() -> None:
    """Raise NvtxUnavailable unless torch sees a CUDA device (the launcher checks up front)."""
    import torch

    if not torch.cuda.is_available():
        raise NvtxUnavailable("--enable-nvtx needs a CUDA build of torch and a GPU (NVTX ranges go to a GPU "
                              f"profiler such as Nsight Systems); this torch is {torch.__version__} and sees no CUDA "
                              "device. Drop --enable-nvtx (and MSTAR_NVTX) here")


class _Span:
    """A range with the push / pop of the moment it was made: a span open while ranges are turned
    on, off or swapped (a profiler recording starting or ending on another thread) pops what it
    pushed."""

    __slots__ = ("name", "push", "pop")

    def __init__(self, name: str, push: Callable[[str], object], pop: Callable[[], object]):
        self.name, self.push, self.pop = name, push, pop

    def __enter__(self) -> None:
        self.push(self.name)

    def __exit__(self, *exc) -> None:
        self.pop()


def configure(enabled: bool, push: Callable[[str], object] | None = None, pop: Callable[[], object] | None = None) -> None:
    """Turn ranges on (torch.cuda.nvtx by default; tests pass recorders) or off."""
    global _push, _pop, ACTIVE
    if not enabled:
        _push = _pop = None
        ACTIVE = False
        return
    if push is None or pop is None:
        import torch

        require_cuda()
        push, pop = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    _push, _pop = push, pop
    ACTIVE = True


def span(name: str):
    """``with span("decode/llm forward"):`` a range while enabled, nothing otherwise. On a hot
    path, ``span(f"...") if nvtx.ACTIVE else nvtx.NULL`` builds no name while off."""
    push, pop = _push, _pop
    return _Span(name, push, pop) if push is not None and pop is not None else NULL


def stacked(push: Callable[[str], object], pop: Callable[[], object]):
    """(push, pop) that do the current ranges' and then these, popping in reverse (NVTX ranges and
    a profiler's at once)."""
    p0, q0 = _push, _pop
    assert p0 is not None and q0 is not None

    def both_push(name: str) -> None:
        p0(name)
        push(name)

    def both_pop() -> None:
        pop()
        q0()
    return both_push, both_pop


def from_settings() -> None:
    """Each service calls this once at start (MSTAR_NVTX)."""
    configure(settings().nvtx)
