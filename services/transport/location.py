"""Where a service runs: the facts a sender needs to pick a transport to it.

Two services share a *host* when they see the same kernel boot and the same network
namespace (network namespaces stand in for machines in the two-host test, and a
container's namespace is its own host as far as addresses go). They share a
*process* when their process tokens match.
"""

from __future__ import annotations

import functools
import os
import uuid

from mstar.v1 import node_group_pb2 as pb

PROCESS_TOKEN = uuid.uuid4().hex  # one per process: same token = same process


@functools.cache
def host_id() -> str:
    override = os.environ.get("MSTAR_HOST_ID")
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = os.uname().nodename
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = "-"
    return f"{boot}/{netns}"


def gpu_uuids(device: str) -> list[str]:
    """UUIDs of the GPU a service computes on ("cuda:N"); empty for CPU services."""
    if not device.startswith("cuda"):
        return []
    import torch

    if not torch.cuda.is_available():
        return []
    index = torch.device(device).index or 0
    return [str(torch.cuda.get_device_properties(index).uuid)]


def local_location(service: str, device: str = "cpu") -> pb.Location:
    """What a receiving service tells each sender first on a stream."""
    from mstar.services.transport import mooncake

    session, protocol = mooncake.advertise()
    return pb.Location(service=service, host_id=host_id(), process=PROCESS_TOKEN, gpu_uuids=gpu_uuids(device),
                       mooncake_session=session, mooncake_protocol=protocol)
