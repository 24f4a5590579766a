"""Message-size limits: one setting for every M* server and channel.

A client's request is bounded once: the gateway's body limit and the conductor's public gRPC
API (Generate, Act, ...) take the same ``MAX_REQUEST_BYTES`` (plus the protobuf envelope around
a body of that size), and the channels that send requests (the gateway's, the Python SDK's) do
not send more. Messages between M*'s own services (frame streams with tensors inline) and
responses (outputs) keep the large ``MAX_FRAME_MESSAGE_BYTES``.
"""

from __future__ import annotations

#: the largest client request body: the gateway's default --max-upload-mb and its ceiling
MAX_REQUEST_BYTES = 32 << 20
#: what protobuf adds around a request body of MAX_REQUEST_BYTES (field tags, lengths, the other fields)
ENVELOPE_BYTES = 1 << 20
#: the largest request message the conductor's public API reads (larger: RESOURCE_EXHAUSTED, unparsed)
MAX_PUBLIC_MESSAGE_BYTES = MAX_REQUEST_BYTES + ENVELOPE_BYTES
#: frames between services and responses to clients
MAX_FRAME_MESSAGE_BYTES = 1 << 30
#: the most pixels an input image (or video frame) may declare, checked from its header before it
#: is decoded: a small compressed file can declare a huge image, and its RGB bytes and resize cost
#: memory and CPU in proportion (8192 x 8192)
MAX_INPUT_PIXELS = 64 * 1024 * 1024

#: a channel that sends client requests to the conductor and reads its answers
REQUEST_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_PUBLIC_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_FRAME_MESSAGE_BYTES),
]
