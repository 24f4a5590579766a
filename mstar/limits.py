"""Message-size limits: one setting for every M* server and channel.

A client's request is bounded once: the gateway's body limit and the conductor's public gRPC
API (Generate, Act, ...) take the same ``MAX_REQUEST_BYTES`` (plus the protobuf envelope around
a body of that size), and the channels that send requests (the gateway's, the Python SDK's) do
not send more. Messages between M*'s own services (frame streams with tensors inline) and
responses (outputs) keep the large ``MAX_FRAME_MESSAGE_BYTES``.

Below them: what one JSON body may hold (its structure, not its bytes), where the gateway parses
it, and the smallest timeout a client may ask for.
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

# --- A request body's structure. Reading JSON costs about a microsecond of CPU and a hundred bytes of
# memory per value, whatever the byte count: 29 MiB of one-character chat messages (2.7M values) held the
# gateway's event loop 3.2 s. Each bound below refuses (HTTP 400 / INVALID_ARGUMENT naming the field)
# what no real client sends, before the cost is paid; the gateway enforces them on every JSON body.

#: deepest nesting of arrays and objects: a chat with images nests 5 deep ({messages: [{content:
#: [{image_url: {url}}]}]}), model_kwargs are flat knobs; Python's parser gives up near 1,000
MAX_JSON_DEPTH = 32
#: most values (objects, arrays, strings, numbers, literals) in one JSON document; the largest real
#: bodies: V-JEPA 2 predict's token ids (up to 2 x 8,192), a 2,048-message chat (~12k values)
MAX_JSON_VALUES = 65_536
#: most messages in a chat: a 1,024-turn conversation; M* prompts with the last message only, so the
#: earlier ones cost reading and nothing else
MAX_CHAT_MESSAGES = 2048
#: most content parts in one message: room for hundreds of images between text parts (chat requests
#: attach a handful)
MAX_CONTENT_PARTS = 512
#: most characters of text in a request's text fields (chat: all messages' text): 16x the longest
#: prompt any served model reads (BAGEL: 16,384 tokens x the conductor's 16-characters-a-token bound),
#: and about what a 1M-token conversation holds; base64 media are not text
MAX_TEXT_CHARS = 4 << 20

# --- Where a body is parsed. json.loads holds the GIL for its whole run, so a thread would stall the
# loop as much: a large body is parsed in a worker process.

#: JSON bodies up to this size are parsed on the event loop: at most ~32k values, 4.4 ms at worst (an
#: array of zeros) on the 2-core CI VM, and every request but those carrying media is smaller; larger
#: ones go to a worker process
INLINE_JSON_BYTES = 64 << 10
#: worker processes parsing large bodies: one caller has at most one of them (below), so with two a
#: flood from one caller leaves the other to everyone else
JSON_WORKERS = 2
#: a caller's (API key, or client address without keys) large bodies beyond the one being read and
#: parsed wait, unread, in a queue this long; past it: 429 with Retry-After
MAX_WAITING_BODIES = 4
#: a worker process whose memory after a parse stays above this is replaced (its RSS at rest is ~60 MiB;
#: a 29 MiB chat with one image peaks near 210 MiB, handed back to the OS after the parse)
JSON_WORKER_MAX_RSS = 384 << 20
#: an idle worker (~60 MiB) is stopped after this long without a body, so that the gateway's memory
#: goes back to where it was before a flood; the next large body waits for a new one's start (~0.5 s)
JSON_WORKER_IDLE_S = 60.0
#: longest a worker may take for one body (the bounds keep the worst under 1 s on the CI VM); past it the
#: worker is killed and the request answered 503
JSON_PARSE_TIMEOUT_S = 30.0

#: the smallest ``timeout_s`` a client may ask for (0 keeps the server's default): a request's timer in
#: uvloop has 1 ms resolution, so a shorter timeout cannot be kept and would end as DEADLINE_EXCEEDED
#: (504), blaming the server for the client's value
MIN_TIMEOUT_S = 1e-3
