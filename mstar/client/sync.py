"""``MStarClient``: the blocking SDK client, over REST (the gateway) or gRPC (the conductor).

    client = MStarClient("http://127.0.0.1:8000")      # or "grpc://127.0.0.1:50051"
    for chunk in client.generate("toy", "Hello", stream=True, max_tokens=16):
        print(chunk.name, chunk.text)
    result = client.generate("toy", "Hello")           # one-shot: Result
    client.tts("toy", "Hello").to_wav("hello.wav")
    client.chat("What is the capital of France?").text  # the model the server serves
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Literal, overload

from mstar.client.base import (
    DEFAULT_TIMEOUT_S,
    QUICK_TIMEOUT_S,
    StreamState,
    chat_prompt,
    default_model,
    first_image,
    images_of,
    make_params,
    parse_address,
    pick_output,
    speech_of,
    split_model,
)
from mstar.client.errors import Cancelled
from mstar.client.grpc_transport import GrpcTransport
from mstar.client.http_transport import HttpTransport
from mstar.client.types import (
    Chunk,
    File,
    FileLike,
    Final,
    Health,
    Image,
    Modality,
    ModelInfo,
    Result,
    Speech,
)

Files = Mapping[str, FileLike] | Sequence[File] | None


class GenerateStream:
    """Iterates a request's chunks as they arrive; ``final`` is set once the stream ends.
    Leaving a ``with`` block (or ``cancel()``) before the end cancels the request on the server."""

    def __init__(self, call, state: StreamState, pending: Sequence[Chunk]):
        self._call, self._state = call, state
        self._pending = deque(pending)
        self._cancelled = False
        if state.final is not None:
            call.finish()

    @property
    def request_id(self) -> str:
        return self._state.request_id

    @property
    def final(self) -> Final | None:
        return self._state.final

    def __iter__(self) -> GenerateStream:
        return self

    def __next__(self) -> Chunk:
        while not self._pending:
            if self._state.final is not None:
                raise StopIteration
            if self._cancelled:
                raise Cancelled("this client cancelled the request", request_id=self.request_id)
            self._pending.extend(self._state.take(self._call.next()))
            if self._state.final is not None:
                self._call.finish()
        return self._pending.popleft()

    def collect(self) -> Result:
        """Read to the end; the Result holds every chunk, those already iterated included."""
        for _ in self:
            pass
        return self._state.result()

    def cancel(self) -> None:
        if self._state.final is None and not self._cancelled:
            self._cancelled = True
            self._call.cancel()

    close = cancel

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class MStarClient:
    """``address``: ``http(s)://host:port`` for the REST gateway, ``grpc(s)://host:port`` for the
    conductor. ``timeout``: default seconds a generate call may take (each call may pass its own,
    which the server then enforces too)."""

    def __init__(self, address: str = "http://127.0.0.1:8000", *, timeout: float = DEFAULT_TIMEOUT_S):
        self.address = parse_address(address)
        self.timeout = timeout
        self._transport = (HttpTransport(self.address.target) if self.address.transport == "rest"
                           else GrpcTransport(self.address.target, self.address.secure))

    @property
    def transport(self) -> str:
        return self.address.transport

    def __repr__(self) -> str:
        return f"MStarClient({self.address.transport}: {self.address.target})"

    @overload
    def generate(self, model: str, text: str = ..., *, files: Files = ..., stream: Literal[False] = ...,
                 timeout: float | None = ..., request_id: str | None = ..., model_kwargs: dict | None = ...,
                 **kwargs) -> Result: ...

    @overload
    def generate(self, model: str, text: str = ..., *, files: Files = ..., stream: Literal[True],
                 timeout: float | None = ..., request_id: str | None = ..., model_kwargs: dict | None = ...,
                 **kwargs) -> GenerateStream: ...

    def generate(self, model: str, text: str = "", *, files: Files = None, stream: bool = False,
                 timeout: float | None = None, request_id: str | None = None, model_kwargs: dict | None = None,
                 **kwargs) -> Result | GenerateStream:
        """Run one request. Extra keywords are model kwargs (``max_tokens=16``); ``model_kwargs=``
        takes the same as a dict. Errors before the first output raise here, typed."""
        params = make_params(model, text, files=files, timeout=timeout, request_id=request_id,
                             model_kwargs=model_kwargs, kwargs=kwargs)
        call = self._transport.generate(params, timeout or self.timeout)
        state = StreamState()
        try:
            first = state.take(call.next())
        except BaseException:
            call.cancel()
            raise
        s = GenerateStream(call, state, first)
        if stream:
            return s
        with s:
            return s.collect()

    def chat(self, *args, model: str | None = None, stream: bool = False, **kw) -> Result | GenerateStream:
        """``chat("What is the capital of France?").text``, ``chat(messages)`` or ``chat(model,
        messages)``: ``generate`` on the prompt that a string or OpenAI chat ``messages`` make (the
        rule is in mstar.client.messages: the last message, a user message, is the prompt). Without
        a model, the one the server serves (InvalidArgument listing them when it serves several)."""
        model, messages = split_model(args, model, "chat", "messages")
        return self.generate(model or default_model(self.models(), "chat"), chat_prompt(messages), stream=stream, **kw)

    def tts(self, *args, model: str | None = None, voice: str | None = None, output: str | None = None,
            **kw) -> Speech:
        """``tts("Hello there", voice="tara").to_wav("out.wav")`` or ``tts(model, text)``: speech from
        a model with an audio output. ``voice`` goes to the model as ``model_kwargs.voice``."""
        model, text = split_model(args, model, "tts", "text")
        models = self.models()
        model = model or default_model(models, "tts")
        name = pick_output(models, model, Modality.AUDIO, output, "tts()")
        if voice is not None:
            kw["voice"] = voice
        return speech_of(self.generate(model, text, **kw), name)

    def generate_image(self, *args, model: str | None = None, output: str | None = None, **kw) -> bytes | list[Image]:
        """``generate_image("a cat in a hat")`` -> the image's PNG bytes; ``generate_image(model,
        prompt)`` -> every image as ``Image``. InvalidArgument (field ``model``) for a model without
        an image output."""
        explicit = len(args) == 2
        model, prompt = split_model(args, model, "generate_image", "prompt")
        models = self.models()
        model = model or default_model(models, "generate_image")
        name = pick_output(models, model, Modality.IMAGE, output, "generate_image()")
        images = images_of(self.generate(model, prompt, **kw), name)
        return images if explicit else first_image(images, model)

    def models(self, *, timeout: float = QUICK_TIMEOUT_S) -> list[ModelInfo]:
        return self._transport.models(timeout)

    def health(self, *, timeout: float = QUICK_TIMEOUT_S) -> Health:
        """Never raises: an unreachable server is ``Health(ok=False, status="unreachable")``."""
        return self._transport.health(timeout)

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> MStarClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

