"""Qwen3-Omni served by the in-process mesh (real gRPC on loopback), in one node group and split
over three: the text and audio streamed to the client equal the direct call's on the same tiny
checkpoint; a text-only request never starts the Talker; bad input is INVALID_ARGUMENT naming
the field."""

import asyncio
import dataclasses
import io
import json
import math
import struct
import wave

import numpy as np
import pytest
import torch

from mstar.config import load_config
from mstar.models.qwen3_omni.direct import generate
from mstar.models.qwen3_omni.media import MediaDecoder
from mstar.models.qwen3_omni.prompt import MediaTokens, build_prompt
from mstar.models.qwen3_omni.sampling import Sampling
from mstar.v1 import conductor_pb2 as cpb

from helpers import collect, run, wait_released
from inprocess import inprocess_mesh

CONFIGS = "models/qwen3_omni/configs"
GREEDY = dict(temperature=0.0, talker_temperature=0.0)


def ask(text, files=(), request_id="", **kw):
    return cpb.GenerateRequest(model="qwen3_omni", text=text, model_kwargs_json=json.dumps(kw), request_id=request_id,
                               files=[cpb.InputFile(name=n, content_type=t, data=d) for n, t, d in files])


def wav_bytes(seconds=1.3, rate=16000):
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        n = int(seconds * rate)
        w.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(i * 0.05))) for i in range(n)))
    return buf.getvalue()


def mp3_bytes(seconds=1.3, rate=44100, freq=440.0):
    """A tone as MP3 (LAME through PyAV), at CD rate: the decoder resamples it."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp3") as out:
        s = out.add_stream("libmp3lame", rate=rate, layout="mono")
        x = (0.3 * np.sin(2 * np.pi * freq * np.arange(int(seconds * rate)) / rate)).astype(np.float32)
        n = s.codec_context.frame_size or 1152
        for i in range(0, len(x), n):
            frame = av.AudioFrame.from_ndarray(x[None, i : i + n], format="fltp", layout="mono")
            frame.sample_rate, frame.pts = rate, i
            for packet in s.encode(frame):
                out.mux(packet)
        for packet in s.encode(None):
            out.mux(packet)
    return buf.getvalue()


def png_bytes():
    from PIL import Image

    img = Image.fromarray((np.arange(32 * 48 * 3).reshape(32, 48, 3) % 251).astype(np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def mp4_bytes(frames=6, fps=4, w=64, h=48):
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        s = out.add_stream("mpeg4", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for k in range(frames):
            img = ((np.arange(h * w * 3).reshape(h, w, 3) * (k + 1)) % 251).astype(np.uint8)
            for packet in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                out.mux(packet)
        for packet in s.encode():
            out.mux(packet)
    return buf.getvalue()


def config(name, checkpoint):
    c = load_config(f"{CONFIGS}/{name}.yaml")
    return dataclasses.replace(c, model_kwargs={**c.model_kwargs, "checkpoint": checkpoint})


def direct(parts, tokenizer, text, max_tokens, frames, files=(), seed=None, policy=None):
    """The direct call on what the conductor makes of the request (prompt ids, media rows)."""
    i = parts.cfg.ids
    ends = [tokenizer.token_to_id(t) for t in ("<|audio_end|>", "<|vision_end|>")]
    media = MediaDecoder(parts.cfg, parts.reader.directory, 300, 1280 * 28 * 28 * 4, 1 << 26).decode(
        [type("F", (), {"name": n, "content_type": t, "data": d})() for n, t, d in files])
    ids = build_prompt(lambda s: tokenizer.encode(s, add_special_tokens=False).ids, i, MediaTokens(*ends), text,
                       None, media.audio_rows, media.image_rows, media.video_rows)
    kw = {}
    with torch.no_grad():
        if media.audio_lengths:
            kw |= dict(audio_embeds=parts.audio(media.audio_features, torch.tensor(media.audio_lengths)),
                       audio_rows=media.audio_rows)
        if media.grids or media.video_grids:
            merged, deep = parts.vision(media.pixels, torch.tensor(media.grids + media.video_grids))
            n = sum(media.image_rows)
            kw |= dict(image_embeds=merged[:n], video_embeds=merged[n:], deepstack=deep, image_grids=media.grids,
                       video_grids=media.video_grids, video_seconds=media.video_seconds)
    if seed is not None:  # the request knobs' defaults
        kw |= dict(thinker_sampling=Sampling(0.7, 20, 0.8), talker_sampling=Sampling(0.9, 50, 1.0), seed=seed)
    return generate(parts, ids, max_tokens=max_tokens, talker_max_tokens=frames, chunk=10, left_context=25,
                    policy=policy, **kw)


def pcm_of(chunks):
    return np.frombuffer(b"".join(c.data for c in chunks), dtype=np.int16)


def expected_pcm(audio: torch.Tensor):
    return np.rint(np.clip(audio.numpy(), -1, 1) * np.float32(32767)).astype(np.int16)


@pytest.mark.parametrize("layout", ["default", "split"])
def test_served_stream_equals_direct_call(checkpoint, parts, tokenizer, layout):
    """Four requests at once (their steps batch): greedy text, greedy text with an early end,
    WAV + PNG input, and a sampled one with a seed (each request draws from its own generator)."""
    prompts = [("Hello there, how are you?", 20, 40), ("Tell me a story.", 6, 30)]
    files = [("clip.wav", "audio/wav", wav_bytes()), ("pic.png", "image/png", png_bytes()),
             ("clip.mp4", "video/mp4", mp4_bytes())]

    async def go():
        async with inprocess_mesh(config(layout, checkpoint)) as mesh:
            reqs = [ask(t, max_tokens=n, max_audio_frames=f, **GREEDY) for t, n, f in prompts]
            reqs.append(ask("What is this?", files, max_tokens=8, max_audio_frames=20, **GREEDY))
            reqs.append(ask("Sampled, seeded.", max_tokens=10, max_audio_frames=30, seed=7))  # default sampling knobs
            res = await asyncio.gather(*(collect(mesh.stub, r, timeout=120) for r in reqs))  # served together
            await wait_released(mesh)
            return res

    res = run(go(), timeout=240)
    cases = [(t, n, f, (), None) for t, n, f in prompts] + [("What is this?", 8, 20, files, None),
                                                            ("Sampled, seeded.", 10, 30, (), 7)]
    for (out, final), (text, n, frames, fl, seed) in zip(res, cases, strict=True):
        want = direct(parts, tokenizer, text, n, frames, fl, seed)
        got_ids = [t for c in out["text"] for t in c.token_ids]
        assert got_ids == want.tokens[: len(got_ids)] and len(got_ids) == len(want.tokens)
        assert final.usage.completion_tokens == len(want.tokens)
        pcm, ref = pcm_of(out["audio"]), expected_pcm(want.audio)
        assert out["audio"] and pcm.shape == ref.shape  # every sample there
        assert np.abs(pcm.astype(np.int32) - ref).max() <= 3, (text, np.abs(pcm.astype(np.int32) - ref).max())
        assert final.usage.audio_seconds == pytest.approx(len(ref) / 24000)
        assert {c.sample_rate_hz for c in out["audio"]} == {24000}
    # 40 frames as the default policy cuts them (4, 4, 8, 10, 10, the last 4): streamed as decoded, not at the end
    assert len(res[0][0]["audio"]) == 6


def test_text_only_never_starts_the_talker(checkpoint):
    async def go():
        async with inprocess_mesh(config("default", checkpoint)) as mesh:
            out, final = await collect(mesh.stub, ask("Hi", modalities=["text"], max_tokens=5, **GREEDY), timeout=60)
            talker = mesh.runtime("omni").submodules["talker"].engine
            assert talker.steps == 0 and "audio" not in out
            assert len([t for c in out["text"] for t in c.token_ids]) == 5 and final.finish_reason == "length"
            await wait_released(mesh)

    run(go(), timeout=120)


BAD = [
    ({"voice": "nobody"}, (), "model_kwargs.voice"),
    ({"modalities": ["audio"]}, (), "model_kwargs.modalities"),
    ({"max_tokens": 0}, (), "model_kwargs.max_tokens"),
    ({"temprature": 0.5}, (), "model_kwargs.temprature"),
    ({}, (("x.wav", "audio/wav", b"RIFF-not-a-wav"),), "files[0]"),
    ({}, (("x.png", "image/png", b"\x89PNG broken"),), "files[0]"),
    ({}, (("x.mp4", "video/mp4", b"\x00\x00\x00\x18ftypmp42 broken"),), "files[0]"),
    ({}, (("a.wav", "audio/wav", wav_bytes(0.5)), ("x.bin", "application/octet-stream", b"?")), "files[1]"),
    ({}, (("long.wav", "audio/wav", wav_bytes(3.0, rate=8000)),), "files[0]"),  # over max_audio_seconds
]


def test_bad_input_is_invalid_argument_naming_the_field(checkpoint):
    import grpc

    async def go():
        cfg = config("default", checkpoint)
        cfg = dataclasses.replace(cfg, model_kwargs={**cfg.model_kwargs, "max_audio_seconds": 2.0})
        async with inprocess_mesh(cfg) as mesh:
            for kw, files, field in BAD:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await collect(mesh.stub, ask("Hello", files, **kw), timeout=30)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, e.value.details())
                assert e.value.details().startswith(field + ":"), e.value.details()
            await wait_released(mesh)

    run(go(), timeout=60)


def test_talker_speaks_while_the_thinker_writes_and_cancel_frees_the_caches(checkpoint):
    """The Talker's loop runs beside the Thinker's, held to it by back-pressure: with
    ``talker_max_ahead: 2`` the Thinker's loop never gets more than a few iterations ahead of the
    Talker's (counted at the nodes, not timed; the Thinker's engine itself decodes on ahead, its
    tokens held by the driver). A cancelled request frees every KV slot of both engines."""
    from helpers import cancel_and_drain

    async def go():
        cfg = config("split", checkpoint)
        cfg = dataclasses.replace(cfg, model_kwargs={**cfg.model_kwargs, "talker_max_ahead": 2,
                                                     "code2wav_chunk_frames": 2})
        async with inprocess_mesh(cfg) as mesh:
            thinker = mesh.runtime("thinker").submodules["thinker"].engine
            talker = mesh.runtime("talker").submodules["talker"].engine
            node_t, node_k = mesh.runtime("thinker").submodules["thinker"], mesh.runtime("talker").submodules["talker"]
            calls, lead = {"thinker": 0, "talker": 0}, []  # per Thinker iteration: its lead over the Talker's

            def counted(sub, name):
                inner = sub.outputs

                def outputs(call, out):
                    if call.walk == "speak":
                        calls[name] += 1
                        if name == "thinker":
                            lead.append(calls["thinker"] - calls["talker"])
                    return inner(call, out)
                sub.outputs = outputs

            counted(node_t, "thinker")
            counted(node_k, "talker")
            out, _ = await collect(mesh.stub, ask("Hi", max_tokens=60, max_audio_frames=64, ignore_eos=True, **GREEDY),
                                   timeout=120)
            assert len([t for c in out["text"] for t in c.token_ids]) == 60 and len(out["audio"]) >= 30
            assert len(lead) == 59 and max(lead) <= 4, lead  # 2 untaken rows + the iterations in flight
            call = mesh.stub.Generate(ask("Hi", request_id="long", max_tokens=2000, max_audio_frames=4000,
                                          ignore_eos=True, **GREEDY), timeout=60)
            while not any(c.name == "audio" for c in (await call.read()).chunks):  # cancel once audio flows
                pass
            await cancel_and_drain(mesh, call, "long")
            for eng in (thinker, talker):
                deadline = asyncio.get_running_loop().time() + 5
                while eng.cache.num_free != eng.cache.num_slots and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.02)
                assert eng.cache.num_free == eng.cache.num_slots, type(eng).__name__

    run(go(), timeout=120)


def test_more_requests_than_slots_wait_their_turn(checkpoint, parts, tokenizer):
    """max_num_seqs: 1: three speech requests at once queue for the Thinker's and the Talker's one
    slot each and all complete, equal to the direct call. Code2Wav's first chunk is shorter here
    (code2wav_first_chunk_frames: 3 of 5): the direct call cuts the same chunks."""
    from mstar.models.qwen3_omni.knobs import OmniServeConfig
    from mstar.models.qwen3_omni.model import codec_policy

    cfg = config("default", checkpoint)
    cfg = dataclasses.replace(cfg, model_kwargs={**cfg.model_kwargs, "max_num_seqs": 1, "code2wav_chunk_frames": 5,
                                                 "code2wav_first_chunk_frames": 3})
    policy = codec_policy(OmniServeConfig.parse(cfg.model_kwargs))

    async def go():
        async with inprocess_mesh(cfg) as mesh:
            res = await asyncio.gather(*(collect(mesh.stub, ask(t, max_tokens=6, max_audio_frames=12, **GREEDY), timeout=120)
                                         for t in ("One.", "Two.", "Three.")))
            await wait_released(mesh)
            return res

    for (out, _), text in zip(run(go(), timeout=120), ("One.", "Two.", "Three."), strict=True):
        want = direct(parts, tokenizer, text, 6, 12, policy=policy)
        assert out["audio"][0].data and len(out["audio"][0].data) // 2 < 5 * parts.cfg.code2wav.samples_per_frame
        assert [t for c in out["text"] for t in c.token_ids] == want.tokens
        assert np.array_equal(pcm_of(out["audio"]), expected_pcm(want.audio))
