"""Tensor transports: how a tensor's bytes reach a peer service.

- inline ("TCP"): the bytes travel inside the gRPC frame. Works anywhere.
- shm: pooled host shared-memory segments; the frame carries a reference. Same host.
- cuda_ipc: pooled CUDA allocations shared by IPC handle; device-to-device. Same host.
- mooncake: pooled buffers registered with a Mooncake transfer engine, read by the
  receiver over RDMA or TCP. Any host.
- local: the tensor object handed over between services of one process.

Every pooled transport is acknowledged: the receiver returns buffer ids once it has
copied out, and the sender reuses the buffer only then. ``LinkSender`` picks one per
tensor (see ``base``).
"""

from mstar.services.transport.base import (
    PROTOCOL_HELP,
    LinkSender,
    Protocol,
    TensorReceiver,
    TensorSender,
    TransportUnavailable,
    configure_service,
    parse_protocol,
    start_transport,
)

__all__ = ["PROTOCOL_HELP", "LinkSender", "Protocol", "TensorReceiver", "TensorSender", "TransportUnavailable",
           "configure_service", "parse_protocol", "start_transport"]
