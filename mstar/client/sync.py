"""``MStarClient``: the blocking SDK client, over REST (the gateway) or gRPC (the conductor).

    client = MStarClient("http://127.0.0.1:8000")      # or "grpc://127.0.0.1:50051"
    for chunk in client.generate("toy", "Hello", stream=True, max_tokens=16):
        print(chunk.name, chunk.text)
    result = client.generate("toy", "Hello")           # one-shot: Result
    client.tts("toy", "Hello").to_wav("hello.wav")
    client.chat("What is the capital of France?").text  # the model the server serves
    client.act("pick up the cube", images={"base_0_rgb": "cam.png"}, state=[...])  # [horizon, dim] float32
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
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
from mstar.client.grpc_transport import GrpcTransport
from mstar.client.http_transport import HttpTransport
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

    def __init__(self, address: str = "http://127.0.0.1:8000", *, timeout: float = DEFAULT_TIMEOUT_S,
                 api_key: str | None = None):
        self.address = parse_address(address)
        key = api_key_or_env(api_key)  # sent as Authorization: Bearer <key> (HTTP header or gRPC metadata)
        self.timeout = timeout
        self._default: str | None = None  # the served model, once asked (the robot calls)
        self._transport = (HttpTransport(self.address.target, key) if self.address.transport == "rest"
                           else GrpcTransport(self.address.target, self.address.secure, key))

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

    def chat(self, *args, model: str | None = None, stream: bool = False, images: Sequence[FileLike] | None = None,
             audios: Sequence[FileLike] | None = None, videos: Sequence[FileLike] | None = None,
             modalities: Sequence[str] | None = None, audio: Mapping[str, str] | None = None,
             **kw) -> Result | GenerateStream:
        """``chat("What is the capital of France?").text``, ``chat(messages)`` or ``chat(model,
        messages)``: ``generate`` on the prompt that a string or OpenAI chat ``messages`` make (the
        rule is in mstar.client.messages: the last message, a user message, is the prompt; its
        ``image_url`` / ``input_audio`` / ``video_url`` data: parts are sent as files). ``images``,
        ``audios``, ``videos``: more inputs (paths, bytes or File), for the kinds the model's api
        takes (BAGEL: images; Qwen3-Omni: all three). ``modalities=["text", "audio"]`` with
        ``audio={"voice": "ethan"}``: a spoken answer too, for a model that declares chat audio
        (``result.audio`` is its Speech; streamed, audio chunks come between the text ones). The
        model's chat kwargs go along, as on /v1/chat/completions. Without a model, the one the
        server serves (InvalidArgument listing them when it serves several)."""
        model, messages = split_model(args, model, "chat", "messages")
        models = self.models()
        info = model_of(models, model or default_model(models, "chat"))
        call = chat_call(info, messages, {"images": images, "audios": audios, "videos": videos}, modalities, audio,
                         stream, split_kwargs(kw))
        return self.generate(info.name, call.text, files=list(call.files) or None, stream=stream,
                             model_kwargs=call.model_kwargs, **kw)

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

    def edit_image(self, *args, image: FileLike, model: str | None = None, output: str | None = None,
                   **kw) -> bytes | list[Image]:
        """``edit_image("make it blue", image="cat.png")`` -> the edited image's PNG bytes;
        ``edit_image(model, prompt, image=...)`` -> every image as ``Image``. ``image``: a path, bytes or
        File (PNG, JPEG, WebP). The model's edit kwargs go along (BAGEL: mode edit; its edits keep the
        input's size); knobs as keywords (``seed=3, steps=30, cfg_text=4.0``). InvalidArgument (field
        ``model``) for a model that does not edit images."""
        explicit = len(args) == 2
        model, prompt = split_model(args, model, "edit_image", "prompt")
        models = self.models()
        model = model or default_model(models, "edit_image")
        name = pick_output(models, model, Modality.IMAGE, output, "edit_image()")
        kwargs = edit_kwargs(model_of(models, model), split_kwargs(kw))
        result = self.generate(model, prompt, files=[media_file("image", "image", image)], model_kwargs=kwargs, **kw)
        images = images_of(result, name)
        return images if explicit else first_image(images, model)

    # -- robot models (mstar/client/robot.py) ------------------------------------------------
    def _served(self, model: str | None, call: str) -> str:
        """``model``, else the one the server serves (asked once per client: a policy loop pays no extra call)."""
        if model is None and self._default is None:
            self._default = default_model(self.models(), call)
        return model or self._default

    def act(self, task: str, images: Mapping[str, FileLike], state: Sequence[float], *, model: str | None = None,
            seed: int | None = None, timeout: float | None = None, request_id: str | None = None) -> np.ndarray:
        """A policy's action chunk, float32 ``[horizon, action_dim]`` in the robot's units:
        ``act("pick up the cube", images={"base_0_rgb": "cam.png"}, state=[...])``. ``images``: camera
        name -> encoded image (bytes, path or File); ``state``: the robot's state, one value per
        dimension; ``seed``: the noise seed (same seed, same actions). gRPC calls Conductor.Act (errors
        name ActRequest fields: ``state``, ``images[0].data``); REST posts /generate for raw float32
        bytes (errors name its fields: ``model_kwargs.state``, ``files[0].data``)."""
        params = act_params(self._served(model, "act"), task, images, state, seed, timeout, request_id)
        return self._transport.act(params, timeout or self.timeout).numpy().copy()

    def encode(self, video: VideoLike, *, model: str | None = None, frame_step: int | None = None,
               timeout: float | None = None) -> np.ndarray:
        """A video world model's latents of a clip, ``[tokens, dim]`` (V-JEPA 2's ``encode``)."""
        kw = {"task": "encode", **({} if frame_step is None else {"frame_step": frame_step})}
        result = self.generate(self._served(model, "encode"), files={"video": video_file("video", video)},
                               timeout=timeout, model_kwargs=kw)
        return tensor_of(result, "latents")

    def rollout(self, frames: VideoLike, actions: object, states: object, *, model: str | None = None,
                timeout: float | None = None) -> Rollout:
        """V-JEPA 2-AC's prediction from T context ``frames`` with their poses ``states`` ``[T, 7]``
        under ``actions`` ``[T - 1 + steps, 7]``: ``Rollout(frames [steps, tokens, dim], poses [steps, 7])``."""
        files, kw = rollout_request(frames, actions, states)
        return rollout_of(self.generate(self._served(model, "rollout"), files=files, timeout=timeout, model_kwargs=kw))

    def rollout_stream(self, frames: VideoLike, actions: object, states: object, *, model: str | None = None,
                       timeout: float | None = None) -> Iterator[RolloutStep]:
        """``rollout`` yielding each ``RolloutStep(index, frame, pose)`` as it is predicted; closing the
        iterator early cancels the request."""
        files, kw = rollout_request(frames, actions, states)
        stream = self.generate(self._served(model, "rollout_stream"), files=files, stream=True, timeout=timeout,
                               model_kwargs={**kw, "stream": True})
        return _steps(stream)

    def plan(self, frame: VideoLike, goal: VideoLike, state: object, *, model: str | None = None,
             timeout: float | None = None, **cem) -> Plan:
        """V-JEPA 2-AC's CEM plan from the context ``frame`` and its pose ``state`` ``[7]`` towards the
        ``goal`` image: ``Plan(actions [rollout, 7], energies)``. Knobs (``samples``, ``topk``,
        ``cem_steps``, ``rollout``, ``seed``, ...) as models/vjepa2/requests.py."""
        files, kw = plan_request(frame, goal, state, cem)
        return plan_of(self.generate(self._served(model, "plan"), files=files, timeout=timeout, model_kwargs=kw))

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



def _steps(stream: GenerateStream) -> Iterator[RolloutStep]:
    with stream:
        pairer = StepPairer()
        for chunk in stream:
            yield from pairer.add(chunk)
