"""``AsyncMStarClient``: the asyncio SDK client, over REST (the gateway) or gRPC (the conductor).

    async with AsyncMStarClient("grpc://127.0.0.1:50051") as client:
        stream = await client.generate("toy", "Hello", stream=True)
        async for chunk in stream:
            print(chunk.name, chunk.text)
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
from mstar.client.grpc_transport import AsyncGrpcTransport
from mstar.client.http_transport import AsyncHttpTransport
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


class AsyncGenerateStream:
    """``async for`` over a request's chunks; ``final`` is set once the stream ends. Leaving an
    ``async with`` block (or ``cancel()``) before the end cancels the request on the server."""

    def __init__(self, call, state: StreamState, pending: Sequence[Chunk]):
        self._call, self._state = call, state
        self._pending = deque(pending)
        self._cancelled = False
        self._finished = False

    @property
    def request_id(self) -> str:
        return self._state.request_id

    @property
    def final(self) -> Final | None:
        return self._state.final

    def __aiter__(self) -> AsyncGenerateStream:
        return self

    async def __anext__(self) -> Chunk:
        while not self._pending:
            if self._state.final is not None:
                await self._finish()
                raise StopAsyncIteration
            if self._cancelled:
                raise Cancelled("this client cancelled the request", request_id=self.request_id)
            self._pending.extend(self._state.take(await self._call.next()))
        return self._pending.popleft()

    async def _finish(self) -> None:
        if not self._finished:
            self._finished = True
            await self._call.finish()

    async def collect(self) -> Result:
        """Read to the end; the Result holds every chunk, those already iterated included."""
        async for _ in self:
            pass
        return self._state.result()

    def cancel(self) -> None:
        if self._state.final is None and not self._cancelled:
            self._cancelled = True
            self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> AsyncGenerateStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


class AsyncMStarClient:
    """The asyncio twin of MStarClient: same arguments, same results, awaited."""

    def __init__(self, address: str = "http://127.0.0.1:8000", *, timeout: float = DEFAULT_TIMEOUT_S):
        self.address = parse_address(address)
        self.timeout = timeout
        self._transport = (AsyncHttpTransport(self.address.target) if self.address.transport == "rest"
                           else AsyncGrpcTransport(self.address.target, self.address.secure))

    @property
    def transport(self) -> str:
        return self.address.transport

    def __repr__(self) -> str:
        return f"AsyncMStarClient({self.address.transport}: {self.address.target})"

    @overload
    async def generate(self, model: str, text: str = ..., *, files: Files = ..., stream: Literal[False] = ...,
                       timeout: float | None = ..., request_id: str | None = ..., model_kwargs: dict | None = ...,
                       **kwargs) -> Result: ...

    @overload
    async def generate(self, model: str, text: str = ..., *, files: Files = ..., stream: Literal[True],
                       timeout: float | None = ..., request_id: str | None = ..., model_kwargs: dict | None = ...,
                       **kwargs) -> AsyncGenerateStream: ...

    async def generate(self, model: str, text: str = "", *, files: Files = None, stream: bool = False,
                       timeout: float | None = None, request_id: str | None = None, model_kwargs: dict | None = None,
                       **kwargs) -> Result | AsyncGenerateStream:
        params = make_params(model, text, files=files, timeout=timeout, request_id=request_id,
                             model_kwargs=model_kwargs, kwargs=kwargs)
        call = await self._transport.generate(params, timeout or self.timeout)
        state = StreamState()
        try:
            first = state.take(await call.next())
        except BaseException:
            call.cancel()
            raise
        s = AsyncGenerateStream(call, state, first)
        if stream:
            return s
        async with s:
            return await s.collect()

    async def chat(self, *args, model: str | None = None, stream: bool = False,
                   **kw) -> Result | AsyncGenerateStream:
        model, messages = split_model(args, model, "chat", "messages")
        model = model or default_model(await self.models(), "chat")
        return await self.generate(model, chat_prompt(messages), stream=stream, **kw)

    async def tts(self, *args, model: str | None = None, voice: str | None = None, output: str | None = None,
                  **kw) -> Speech:
        model, text = split_model(args, model, "tts", "text")
        models = await self.models()
        model = model or default_model(models, "tts")
        name = pick_output(models, model, Modality.AUDIO, output, "tts()")
        if voice is not None:
            kw["voice"] = voice
        return speech_of(await self.generate(model, text, **kw), name)

    async def generate_image(self, *args, model: str | None = None, output: str | None = None,
                             **kw) -> bytes | list[Image]:
        explicit = len(args) == 2
        model, prompt = split_model(args, model, "generate_image", "prompt")
        models = await self.models()
        model = model or default_model(models, "generate_image")
        name = pick_output(models, model, Modality.IMAGE, output, "generate_image()")
        images = images_of(await self.generate(model, prompt, **kw), name)
        return images if explicit else first_image(images, model)

    async def models(self, *, timeout: float = QUICK_TIMEOUT_S) -> list[ModelInfo]:
        return await self._transport.models(timeout)

    async def health(self, *, timeout: float = QUICK_TIMEOUT_S) -> Health:
        return await self._transport.health(timeout)

    async def close(self) -> None:
        await self._transport.close()

    async def __aenter__(self) -> AsyncMStarClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
