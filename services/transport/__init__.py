"""Tensor transports: how a tensor's bytes reach a peer service.

- TCP ("inline"): the bytes travel inside the gRPC frame. Works across hosts.
- SHM: the sender writes into a pooled host shared-memory segment and the frame
  carries only a reference; the receiver copies out and acknowledges so the
  sender can reuse the buffer. Same host only. Tensors under SHM_MIN_BYTES stay
  inline (a reference costs more than copying them).
"""

from mstar.services.transport.base import Protocol, TensorReceiver, TensorSender, make_sender, parse_protocol

__all__ = ["Protocol", "TensorReceiver", "TensorSender", "make_sender", "parse_protocol"]
