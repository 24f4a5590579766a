"""Tensor parallelism for the KV-cache engine: one engine, its weights split over ranks.

Megatron-style split of a decoder: q/k/v and gate/up are column-parallel (each rank holds
``1/size`` of the heads and of the MLP's intermediate rows), o_proj and down_proj are
row-parallel (the matching input columns) and end in an all-reduce, so every rank holds
the full hidden state after each block. Embeddings and the LM head are replicated; only
rank 0 computes logits.

Rank 0 (the *leader*) is the engine the node group drives: it schedules, owns the page
tables and samples. Ranks 1.. (*followers*) hold their shard of the weights and of every
KV page (same page ids, their heads), and mirror each forward pass: the leader broadcasts
the pass's host inputs (positions, page tables, slots) on a CPU group and its token ids or
embeddings on the device group, then all ranks run the same layers. Collectives are
stream-ordered, so a pipelined decode step never waits for the host; on CUDA the
all-reduces are part of the captured decode graphs, which every rank captures in the same
order at start.

CPU ranks use gloo (tests check TP=2 against TP=1 that way); CUDA ranks use NCCL for
tensors and gloo for commands.

Every rank is a process of one host (rank 0's service starts the others), so nothing of the
group is reachable from outside it: the ranks meet in a file store in a private directory
(``Rendezvous``: torch's TCP store would listen on every interface, whatever host it is
given, and take any local process that connects), and gloo's and NCCL's own sockets bind the
loopback interface (``loopback_sockets``).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

INIT_TIMEOUT_S = 120.0  # every rank must join within this long
LOOPBACK_IFNAME = "lo"
#: the interface gloo's pairs and NCCL's bootstrap and proxy sockets bind (both libraries'
#: own variables; without them gloo binds the address the host name resolves to, and NCCL the
#: first interface that is not loopback)
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class TPSpec:
    """Where this process sits in a tensor-parallel group (from the node-group service)."""

    rank: int
    size: int
    init_method: str  # where the ranks meet: file://<Rendezvous dir>/store (a tcp:// store listens on every interface)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} outside [0, {self.size})")


class Rendezvous:
    """Where one group's ranks meet: torch's file store in a new directory only this user may
    enter (mode 0700), made by rank 0's service and removed by ``close()`` (when the followers
    have stopped, when the service fails, and at interpreter exit; idempotent).

    A service killed outright (SIGKILL) leaves the directory behind: the store then holds the
    loopback addresses and ports of ranks that are gone (gloo), or the id of a communicator
    whose processes are gone (NCCL), nothing that opens anything still running."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="mstar-tp-")
        self.init_method = f"file://{self.dir}/store"
        atexit.register(self.close)

    def close(self) -> None:
        atexit.unregister(self.close)
        shutil.rmtree(self.dir, ignore_errors=True)


def loopback_sockets() -> None:
    """Bind the collectives' sockets of this process's groups to the loopback interface (before
    ``init_process_group``; each group reads them as it is made). A value set to another
    interface is overridden, with a warning: every rank runs on this host."""
    for name in SOCKET_IFNAME_VARS:
        given = os.environ.get(name, LOOPBACK_IFNAME)
        if given != LOOPBACK_IFNAME:
            log.warning("%s=%s overridden with %s: tensor-parallel ranks talk over loopback only", name, given,
                        LOOPBACK_IFNAME)
        os.environ[name] = LOOPBACK_IFNAME


class TensorParallel:
    """This process's rank: collectives over the device group, commands over a CPU group."""

    def __init__(self, spec: TPSpec, device: torch.device | str):
        self.rank, self.size = spec.rank, spec.size
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.set_device(self.device)
        timeout = datetime.timedelta(seconds=INIT_TIMEOUT_S)
        loopback_sockets()
        dist.init_process_group("nccl" if cuda else "gloo", init_method=spec.init_method, rank=spec.rank,
                                world_size=spec.size, timeout=timeout, **({"device_id": self.device} if cuda else {}))
        self.group = dist.group.WORLD
        self.commands = dist.new_group(backend="gloo", timeout=timeout) if cuda else self.group
        log.info("tensor-parallel rank %d/%d on %s joined", self.rank, self.size, self.device)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` (same shape), concatenated in rank order along ``dim``."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype), stream-ordered."""
        dist.broadcast(x, 0, group=self.group)
        return x

    def send(self, command: object) -> None:
        """Leader: a picklable command to every follower (they wait in ``receive``)."""
        dist.broadcast_object_list([command], 0, group=self.commands)

    def receive(self) -> object:
        box = [None]
        dist.broadcast_object_list(box, 0, group=self.commands)
        return box[0]

    def follow(self, run: Callable[[tuple], object], what: str = "pass") -> None:
        """A follower rank: ``run`` each command the leader sends until it sends ``stop``. A
        command that fails is logged and the rank keeps following (the leader's pass failed the
        same way: same inputs)."""
        if self.leader:
            raise RuntimeError("follow() is for tensor-parallel ranks past 0")
        with torch.inference_mode():
            while True:
                command = self.receive()
                if command[0] == "stop":
                    return
                try:
                    run(command)
                except Exception:
                    log.exception("tensor-parallel rank %d: a mirrored %s failed", self.rank, what)

    def send_call(self, name: str, args: tuple) -> None:
        """Leader: have every follower call its ``name(*args)`` (``follow_calls``). Tensors in
        ``args`` (nested in tuples, lists and dicts) cross on the device group, stream-ordered;
        the rest is pickled on the command group."""
        tensors: list[torch.Tensor] = []
        self.send(("call", name, _strip(args, tensors)))
        for t in tensors:
            self.broadcast(t.to(self.device).contiguous())

    def follow_calls(self, target: object) -> None:
        """A follower rank: make each call the leader's ``send_call`` names on ``target`` (its
        tensors on this rank's device) until the leader sends ``stop``."""
        def run(command: tuple) -> None:
            _, name, args = command
            getattr(target, name)(*_fill(args, lambda slot: self.broadcast(
                torch.empty(slot.shape, dtype=slot.dtype, device=self.device))))

        self.follow(run, "call")

    def stop_followers(self) -> None:
        """Leader: the followers' last command (their ``follow`` returns)."""
        if self.leader:
            self.send(("stop",))

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.commands)
        return int(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        # drop our references too: the groups' C++ objects (and gloo's worker threads) are then
        # destroyed here, not during interpreter teardown, where a still-joinable thread aborts
        # the process ("terminate called without an active exception", exit -6)
        self.group = self.commands = None


@dataclass(frozen=True)
class _Slot:
    """A tensor of a mirrored call, sent on the device group after the command."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _strip(value, tensors: list[torch.Tensor]):
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Slot(tuple(value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_strip(v, tensors) for v in value)
    if isinstance(value, dict):
        return {k: _strip(v, tensors) for k, v in value.items()}
    return value


def _fill(value, receive: Callable[[_Slot], torch.Tensor]):
    """``_strip`` undone, receiving the tensors in the order it listed them."""
    if isinstance(value, _Slot):
        return receive(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_fill(v, receive) for v in value)
    if isinstance(value, dict):
        return {k: _fill(v, receive) for k, v in value.items()}
    return value
