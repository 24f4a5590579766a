"""``AsyncMStarClient``: the asyncio SDK client, over REST (the gateway) or gRPC (the conductor).

    async with AsyncMStarClient("grpc://127.0.0.1:50051") as client:
        stream = await client.generate("toy", "Hello", stream=True)
        async for chunk in stream:
            print(chunk.name, chunk.text)
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Literal, overload

import numpy as np

from mstar.client.base import (
    DEFAULT_TIMEOUT_S,
    QUICK_TIMEOUT_S,
    StreamState,
    api_key_or_env,
    chat_call,
    default_model,
    edit_kwargs,
    first_image,
    images_of,
    make_params,
    media_file,
    model_of,
    parse_address,
    pick_output,
    speech_of,
    split_kwargs,
    split_model,
)
from mstar.client.errors import Cancelled
from mstar.client.grpc_transport import AsyncGrpcTransport
from mstar.client.http_transport import AsyncHttpTransport
from mstar.client.robot import (
    Plan,
    Rollout,
    RolloutStep,
    StepPairer,
    VideoLike,
    act_params,
    plan_of,
    plan_request,
    rollout_of,
    rollout_request,
    tensor_of,
    video_file,
)
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

    def __init__(self, address: str = "http://127.0.0.1:8000", *, timeout: float = DEFAULT_TIMEOUT_S,
                 api_key: str | None = None):
        self.address = parse_address(address)
        key = api_key_or_env(api_key)  # sent as Authorization: Bearer <key> (HTTP header or gRPC metadata)
        self.timeout = timeout
        self._default: str | None = None  # the served model, once asked (the robot calls)
        self._transport = (AsyncHttpTransport(self.address.target, key) if self.address.transport == "rest"
                           else AsyncGrpcTransport(self.address.target, self.address.secure, key))

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

    async def chat(self, *args, model: str | None = None, stream: bool = False, images: Sequence[FileLike] | None = None,
                   audios: Sequence[FileLike] | None = None, videos: Sequence[FileLike] | None = None,
                   modalities: Sequence[str] | None = None, audio: Mapping[str, str] | None = None,
                   **kw) -> Result | AsyncGenerateStream:
        model, messages = split_model(args, model, "chat", "messages")
        models = await self.models()
        info = model_of(models, model or default_model(models, "chat"))
        call = chat_call(info, messages, {"images": images, "audios": audios, "videos": videos}, modalities, audio,
                         stream, split_kwargs(kw))
        return await self.generate(info.name, call.text, files=list(call.files) or None, stream=stream,
                                   model_kwargs=call.model_kwargs, **kw)

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

    async def edit_image(self, *args, image: FileLike, model: str | None = None, output: str | None = None,
                         **kw) -> bytes | list[Image]:
        explicit = len(args) == 2
        model, prompt = split_model(args, model, "edit_image", "prompt")
        models = await self.models()
        model = model or default_model(models, "edit_image")
        name = pick_output(models, model, Modality.IMAGE, output, "edit_image()")
        kwargs = edit_kwargs(model_of(models, model), split_kwargs(kw))
        result = await self.generate(model, prompt, files=[media_file("image", "image", image)], model_kwargs=kwargs, **kw)
        images = images_of(result, name)
        return images if explicit else first_image(images, model)

    # -- robot models: as MStarClient's (mstar/client/robot.py) -------------------------------
    async def _served(self, model: str | None, call: str) -> str:
        if model is None and self._default is None:
            self._default = default_model(await self.models(), call)
        return model or self._default

    async def act(self, task: str, images: Mapping[str, FileLike], state: Sequence[float], *, model: str | None = None,
                  seed: int | None = None, timeout: float | None = None, request_id: str | None = None) -> np.ndarray:
        params = act_params(await self._served(model, "act"), task, images, state, seed, timeout, request_id)
        return (await self._transport.act(params, timeout or self.timeout)).numpy().copy()

    async def encode(self, video: VideoLike, *, model: str | None = None, frame_step: int | None = None,
                     timeout: float | None = None) -> np.ndarray:
        kw = {"task": "encode", **({} if frame_step is None else {"frame_step": frame_step})}
        result = await self.generate(await self._served(model, "encode"), files={"video": video_file("video", video)},
                                     timeout=timeout, model_kwargs=kw)
        return tensor_of(result, "latents")

    async def rollout(self, frames: VideoLike, actions: object, states: object, *, model: str | None = None,
                      timeout: float | None = None) -> Rollout:
        files, kw = rollout_request(frames, actions, states)
        return rollout_of(await self.generate(await self._served(model, "rollout"), files=files, timeout=timeout,
                                              model_kwargs=kw))

    async def rollout_stream(self, frames: VideoLike, actions: object, states: object, *, model: str | None = None,
                             timeout: float | None = None) -> AsyncIterator[RolloutStep]:
        files, kw = rollout_request(frames, actions, states)
        stream = await self.generate(await self._served(model, "rollout_stream"), files=files, stream=True,
                                     timeout=timeout, model_kwargs={**kw, "stream": True})
        return _steps(stream)

    async def plan(self, frame: VideoLike, goal: VideoLike, state: object, *, model: str | None = None,
                   timeout: float | None = None, **cem) -> Plan:
        files, kw = plan_request(frame, goal, state, cem)
        return plan_of(await self.generate(await self._served(model, "plan"), files=files, timeout=timeout,
                                           model_kwargs=kw))

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


async def _steps(stream: AsyncGenerateStream) -> AsyncIterator[RolloutStep]:
    async with stream:
        pairer = StepPairer()
        async for chunk in stream:
            for step in pairer.add(chunk):
                yield step
