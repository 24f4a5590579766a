"""Qwen3-Omni served by M* (the real mesh: node-group, conductor and gateway processes, gRPC
streaming) against transformers' ``generate`` with audio output, on the same weights, one run.

Full-size Qwen3-Omni-30B-A3B-Instruct architecture (its config.json's shapes and ids) with random
bf16 weights made on load (``random_weights.json``: nothing large is written); transformers'
model gets the very same tensors (made by name, on the same device). Every stream runs to its
lengths (``ignore_eos``), so both sides make the same number of tokens and frames.

Memory: ~69 GB of bf16 weights; one H200, or two GPUs with ``--layout split`` (the Talker and
Code2Wav on the second); the transformers baseline loads after M* has stopped, on the first GPU.

Measured, per the issue's benchmark section:
- speech answers to text prompts at each concurrency: audio seconds per second, RTF per stream,
  time to the first audio packet (p50 / max), whether every stream is real time;
- first audio over ``--first-audio-answers`` answers one after another (a level at one stream is one answer);
- text-only answers: tokens per second; one image + audio input request;
- the baseline at the same concurrencies (batched ``generate``; its first audio is at its end).

    python bench/qwen3_omni/bench_omni.py --device cuda --out bench/results/qwen3_omni/h200.json
    python bench/qwen3_omni/bench_omni.py --device cuda --layout one --model-kwargs '{"code2wav_first_chunk_frames": 2}' ...
    python bench/qwen3_omni/bench_omni.py --device cuda --parts mstar --layout tp2 ...   # two GPUs: the Thinker at TP=2
    python bench/qwen3_omni/bench_omni.py --device cuda --parts mstar --concurrency 1,16 --torch-profile /tmp/tp ...
        # then one more answer a stream (--profile-streams, default 1) under every node group's and the conductor's
        # torch.profiler (bench/trace_gaps.py reads it)
    python bench/qwen3_omni/bench_omni.py --device cpu --tiny --out /tmp/omni-smoke.json   # checks the script
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import math
import os
import statistics
import struct
import tempfile
import time
import wave
from pathlib import Path

TEXT = "Tell me, in a few sentences, why the sky looks blue during the day and red at sunset."
SAMPLE_RATE = 24_000
FRAME_S = 0.08  # one codec frame (12.5 Hz)

# Qwen/Qwen3-Omni-30B-A3B-Instruct's config.json (shapes and ids; the released values)
_MROPE = {"rope_type": "default", "rope_theta": 1000000, "mrope_section": [24, 20, 20], "interleaved": True}
FULL_CONFIG = {
    "architectures": ["Qwen3OmniMoeForConditionalGeneration"], "model_type": "qwen3_omni_moe",
    "im_start_token_id": 151644, "im_end_token_id": 151645, "system_token_id": 8948, "user_token_id": 872,
    "assistant_token_id": 77091, "tts_pad_token_id": 151671, "tts_bos_token_id": 151672, "tts_eos_token_id": 151673,
    "enable_audio_output": True,
    "thinker_config": {
        "audio_token_id": 151675, "image_token_id": 151655, "video_token_id": 151656, "audio_start_token_id": 151669,
        "vision_start_token_id": 151652, "user_token_id": 872, "position_id_per_seconds": 13,
        "text_config": {"vocab_size": 152064, "hidden_size": 2048, "intermediate_size": 768, "num_hidden_layers": 48,
                        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
                        "max_position_embeddings": 65536, "rope_parameters": _MROPE},
        "audio_config": {"num_mel_bins": 128, "encoder_layers": 32, "encoder_attention_heads": 20,
                         "encoder_ffn_dim": 5120, "d_model": 1280, "output_dim": 2048, "n_window": 50,
                         "n_window_infer": 800, "downsample_hidden_size": 480, "max_source_positions": 1500},
        "vision_config": {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
                          "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 2048,
                          "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
                          "rope_parameters": {"rope_type": "axial", "rope_theta": 10000}}},
    "talker_config": {
        "accept_hidden_layer": 24, "num_code_groups": 16, "thinker_hidden_size": 2048, "spatial_merge_size": 2,
        "position_id_per_seconds": 13, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_pad_id": 2148,
        "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
        "audio_token_id": 151675, "image_token_id": 151655, "video_token_id": 151656, "audio_start_token_id": 151669,
        "vision_start_token_id": 151652, "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
        "text_config": {"vocab_size": 3072, "hidden_size": 1024, "intermediate_size": 2048, "num_hidden_layers": 20,
                        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128, "moe_intermediate_size": 384,
                        "shared_expert_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 6,
                        "norm_topk_prob": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 65536,
                        "rope_parameters": _MROPE},
        "code_predictor_config": {"vocab_size": 2048, "hidden_size": 1024, "intermediate_size": 3072,
                                  "num_hidden_layers": 5, "num_attention_heads": 16, "num_key_value_heads": 8,
                                  "head_dim": 128, "num_code_groups": 16, "rms_norm_eps": 1e-6,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 1000000}}},
    "code2wav_config": {"codebook_size": 2048, "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
                        "num_key_value_heads": 16, "intermediate_size": 3072, "sliding_window": 72, "num_quantizers": 16,
                        "upsample_rates": [8, 5, 4, 3], "upsampling_ratios": [2, 2], "decoder_dim": 1536,
                        "rms_norm_eps": 1e-5, "layer_scale_initial_scale": 0.01,
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000}},
}
FULL_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
                 "<|vision_end|>": 151653, "<|image_pad|>": 151655, "<|video_pad|>": 151656, "<|audio_start|>": 151669,
                 "<|audio_end|>": 151670, "<|tts_pad|>": 151671, "<|tts_bos|>": 151672, "<|tts_eos|>": 151673,
                 "<|audio_pad|>": 151675}
FULL_ROLES = {"system": 8948, "user": 872, "assistant": 77091}
CHECKPOINT = "bench/Qwen3-Omni-random"


def write_checkpoint(root: Path, tiny: bool) -> Path:
    d = root / CHECKPOINT
    if (d / "config.json").exists():
        return d
    if tiny:
        from mstar.models.qwen3_omni.tiny import write_tiny_checkpoint

        return write_tiny_checkpoint(d)
    from mstar.models.qwen3_omni.tiny import build_tokenizer
    from mstar.models.qwen3_omni.weights import RANDOM_MARKER

    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(FULL_CONFIG, indent=1))
    (d / RANDOM_MARKER).write_text(json.dumps({"seed": 0, "std": 0.02}))
    build_tokenizer(FULL_SPECIALS, FULL_ROLES).save(str(d / "tokenizer.json"))
    return d


def layouts(gpus: int) -> dict[str, list[dict]]:
    second = 1 if gpus > 1 else 0
    return {"one": [{"name": "omni", "node_names": ["audio_encoder", "vision_encoder", "thinker", "talker", "code2wav"],
                     "ranks": [0]}],
            "split": [{"name": "thinker", "node_names": ["audio_encoder", "vision_encoder", "thinker"], "ranks": [0]},
                      {"name": "talker", "node_names": ["talker"], "ranks": [second]},
                      {"name": "code2wav", "node_names": ["code2wav"], "ranks": [second]}],
            # split's, with the Thinker tensor-parallel over the first two devices (configs/tp2.yaml's)
            "tp2": [{"name": "encoders", "node_names": ["audio_encoder", "vision_encoder"], "ranks": [0]},
                    {"name": "thinker", "node_names": ["thinker"], "ranks": [0, second], "tp_size": 2},
                    {"name": "talker", "node_names": ["talker"], "ranks": [second]},
                    {"name": "code2wav", "node_names": ["code2wav"], "ranks": [second]}]}


def start_mesh(root: Path, ckpt: Path, layout: str, device: str, model_kwargs: dict, torch_profile: str | None = None):
    from mstar.config import load_config
    from mstar.launcher import LaunchOptions, Mesh

    gpus = _gpu_count() if device == "cuda" else 0
    cfg = root / f"omni-{layout}.yaml"
    cfg.write_text(json.dumps({"model": "qwen3_omni", "max_seq_len": 1024,  # prompt + 96 tokens / 125 frames
                               "model_kwargs": {"checkpoint": str(ckpt), "max_num_seqs": 64, **model_kwargs},
                               "node_groups": layouts(gpus)[layout]}))
    mesh = Mesh(load_config(cfg), LaunchOptions(cfg, port=0, grpc_port=0, gpus=list(range(gpus)) if gpus else None,
                                                cache_dir=str(root), log_level="WARNING", startup_timeout_s=900,
                                                torch_profile=torch_profile))
    mesh.start()
    return mesh


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def wav_bytes(seconds: float = 4.0, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"".join(struct.pack("<h", int(6000 * math.sin(i * 0.03))) for i in range(int(seconds * rate))))
    return buf.getvalue()


def png_bytes(w: int = 448, h: int = 336) -> bytes:
    import numpy as np
    from PIL import Image

    img = Image.fromarray((np.arange(h * w * 3).reshape(h, w, 3) % 251).astype(np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


# -- M* ----------------------------------------------------------------------------------------
async def stream(stub, kw: dict, files=()) -> dict:
    from mstar.v1 import conductor_pb2 as cpb

    req = cpb.GenerateRequest(model="qwen3_omni", text=TEXT, model_kwargs_json=json.dumps(kw),
                              files=[cpb.InputFile(name=n, content_type=t, data=d) for n, t, d in files])
    t0 = time.perf_counter()
    first_text = first_audio = None
    samples = tokens = 0
    stall = play_end = 0.0  # a client playing each chunk as it comes: silence while its buffer is empty
    async for r in stub.Generate(req, timeout=1800):
        now = time.perf_counter() - t0
        for c in r.chunks:
            if c.name == "audio" and c.data:
                first_audio = now if first_audio is None else first_audio
                samples += len(c.data) // 2
                stall += max(0.0, now - play_end) if play_end else 0.0
                play_end = max(play_end, now) + len(c.data) // 2 / SAMPLE_RATE
            elif c.name == "text":
                first_text = now if first_text is None else first_text
                tokens += len(c.token_ids)
    total = time.perf_counter() - t0
    audio_s = samples / SAMPLE_RATE
    return {"ttfa_s": first_audio, "ttft_s": first_text, "total_s": total, "audio_s": audio_s, "text_tokens": tokens,
            "rtf": total / audio_s if audio_s else None, "stall_s": stall}


@contextlib.asynccontextmanager
async def conductor(address: str):
    """A Conductor stub over a channel of its own (closed on exit)."""
    import grpc

    from mstar.services.links import CHANNEL_OPTIONS
    from mstar.v1 import conductor_pb2_grpc

    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        yield conductor_pb2_grpc.ConductorStub(ch)


async def level(address: str, streams: int, kw: dict) -> dict:
    async with conductor(address) as stub:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(stream(stub, kw) for _ in range(streams)))  # unseeded: rows sample together
        wall = time.perf_counter() - t0
    out = {"system": "mstar", "streams": streams, "wall_s": wall,
           "text_tokens_per_s": sum(r["text_tokens"] for r in res) / wall,
           "ttft_p50_s": statistics.median(r["ttft_s"] for r in res)}
    if any(r["audio_s"] for r in res):
        ttfa, rtf = sorted(r["ttfa_s"] for r in res), sorted(r["rtf"] for r in res)
        out |= {"audio_s_total": sum(r["audio_s"] for r in res), "audio_s_per_s": sum(r["audio_s"] for r in res) / wall,
                "ttfa_p50_s": statistics.median(ttfa), "ttfa_max_s": ttfa[-1], "rtf_p50": statistics.median(rtf),
                "rtf_max": rtf[-1], "all_real_time": rtf[-1] < 1.0,
                # silence after the first audio for a client playing chunks as they come
                "stall_p50_s": statistics.median(r["stall_s"] for r in res), "stall_max_s": max(r["stall_s"] for r in res)}
    return out


async def sequential_first_audio(address: str, answers: int, kw: dict) -> dict:
    """``answers`` speech answers one after another (one stream): first audio and first text over
    all of them (a level at one stream measures one answer)."""
    async with conductor(address) as stub:
        res = [await stream(stub, kw) for _ in range(answers)]
    ttfa = sorted(r["ttfa_s"] for r in res)
    return {"system": "mstar", "streams": 1, "answers": answers, "ttfa_p50_s": statistics.median(ttfa),
            "ttfa_p90_s": ttfa[min(len(ttfa) - 1, int(0.9 * len(ttfa)))], "ttfa_min_s": ttfa[0], "ttfa_max_s": ttfa[-1],
            "ttft_p50_s": statistics.median(r["ttft_s"] for r in res)}


async def media_request(address: str, kw: dict, image: tuple[int, int] = (448, 336)) -> dict:
    """One request with 4 s of audio and an image (448x336: 147 tokens at patch 16)."""
    files = [("q.wav", "audio/wav", wav_bytes()), ("pic.png", "image/png", png_bytes(*image))]
    async with conductor(address) as stub:
        return await stream(stub, kw, files)


# -- transformers --------------------------------------------------------------------------------
def hf_name(name: str) -> str:
    """transformers' in-memory parameter name -> the name our random weights are made under."""
    for a, b in (("thinker.model.language_model.", "thinker.model."), ("thinker.model.audio_tower.", "thinker.audio_tower."),
                 ("thinker.model.visual.", "thinker.visual.")):
        if name.startswith(a):
            name = b + name[len(a):]
    return name.replace(".experts.gate_up_proj", ".experts.gate_up").replace(".experts.down_proj", ".experts.down")


def reference_model(ckpt: Path, device: str):
    import torch
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    from mstar.models.qwen3_omni.weights import CheckpointReader, random_tensor

    reader = CheckpointReader(ckpt)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if reader.random is None:
        return Qwen3OmniMoeForConditionalGeneration.from_pretrained(ckpt, dtype=dtype).to(device).eval()
    with torch.device(device):  # its own init first (buffers included), then our tensors by name
        model = Qwen3OmniMoeForConditionalGeneration._from_config(Qwen3OmniMoeConfig(**reader.config()), dtype=dtype)
    with torch.no_grad():
        for name, p in list(model.named_parameters()):
            p.copy_(random_tensor(hf_name(name), tuple(p.shape), reader.random, device, dtype))
    return model.eval()


def baseline_level(model, prompt: list[int], streams: int, tokens: int, frames: int, speech: bool, device: str) -> dict:
    import torch

    ids = torch.tensor([prompt] * streams, device=device)
    kw = dict(thinker_max_new_tokens=tokens, thinker_min_new_tokens=tokens, thinker_do_sample=True,
              attention_mask=torch.ones_like(ids), return_audio=speech)
    if speech:
        kw |= dict(talker_max_new_tokens=frames, talker_min_new_tokens=frames, speaker="ethan")

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    warm = dict(kw, thinker_max_new_tokens=4, thinker_min_new_tokens=4)
    if speech:
        warm |= dict(talker_max_new_tokens=4, talker_min_new_tokens=4)
    with torch.inference_mode():
        model.generate(input_ids=ids, **warm)  # warm-up at this batch size (kernels, allocator), short
        sync()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, **kw)
        sync()
    wall = time.perf_counter() - t0
    res = {"system": "transformers", "streams": streams, "wall_s": wall, "text_tokens_per_s": streams * tokens / wall}
    if speech:
        wavs = out[1] if isinstance(out[1], list) else [out[1].reshape(-1)]
        audio = sum(w.numel() for w in wavs) / SAMPLE_RATE
        per = audio / streams
        res |= {"audio_s_total": audio, "audio_s_per_s": audio / wall, "ttfa_p50_s": wall, "rtf_p50": wall / per,
                "all_real_time": wall < per, "note": "not streaming: first audio when the whole batch is done"}
    return res


# -- main ----------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tiny random model (CPU smoke run: measures nothing)")
    ap.add_argument("--root", help="folder for the checkpoint and configs (a temporary one otherwise)")
    ap.add_argument("--layout", choices=["one", "split", "tp2"], default="split",
                    help="split: Thinker, Talker, Code2Wav in three processes (no shared GIL; one GPU or two); "
                         "tp2: split with the Thinker tensor-parallel over two GPUs (two ranks on a CPU)")
    ap.add_argument("--concurrency", default="1,4,8,16,32,64")
    ap.add_argument("--baseline-concurrency", default="1,4,16")
    ap.add_argument("--text-tokens", type=int, default=96)
    ap.add_argument("--audio-frames", type=int, default=125, help="codec frames per answer (12.5 a second)")
    ap.add_argument("--model-kwargs", default="{}", help="JSON merged into the YAML's model_kwargs")
    ap.add_argument("--torch-profile", metavar="DIR", help="every node group's and the conductor's torch.profiler trace into DIR (mstar "
                    "serve --torch-profile) over one more speech answer per stream (--profile-streams) after the "
                    "timed levels; summarise each with bench/trace_gaps.py")
    ap.add_argument("--first-audio-answers", type=int, default=10, help="after the levels, this many speech answers "
                    "one after another: first audio p50 / p90 over them (0: none)")
    ap.add_argument("--profile-streams", type=int, default=1, help="streams at once in the --torch-profile answer")
    ap.add_argument("--parts", nargs="+", choices=["mstar", "baseline"], default=["mstar", "baseline"],
                    help="one side only (e.g. each in its own process on its own GPUs, to fit one call)")
    args = ap.parse_args()
    if args.tiny:
        args.concurrency, args.baseline_concurrency = "1,2", "1"
        args.text_tokens, args.audio_frames = min(args.text_tokens, 12), min(args.audio_frames, 20)
        args.first_audio_answers = min(args.first_audio_answers, 2)
    root = Path(args.root or tempfile.mkdtemp(prefix="omni-bench-"))
    ckpt = write_checkpoint(root, args.tiny)
    knobs = {"max_tokens": args.text_tokens, "max_audio_frames": args.audio_frames, "ignore_eos": True,
             "temperature": 0.7, "talker_temperature": 0.9}
    result: dict = {"device": args.device, "tiny": args.tiny, "layout": args.layout, "knobs": knobs,
                    "model_kwargs": json.loads(args.model_kwargs), "mstar": [], "mstar_text": [], "baseline": [],
                    "baseline_text": []}
    if args.device == "cuda":
        import torch

        result["gpu"] = torch.cuda.get_device_name()

    def save() -> None:  # after every level: a run cut short keeps what it measured
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))

    if "mstar" in args.parts:
        measure_mstar(args, root, ckpt, knobs, result, save)
    if args.baseline_concurrency and "baseline" in args.parts:
        measure_baseline(args, ckpt, result, save)
    save()


def measure_mstar(args, root: Path, ckpt: Path, knobs: dict, result: dict, save) -> None:
    t = time.perf_counter()
    if args.torch_profile:  # the bench's own SIGUSR1 pair ends the recording, not a window
        os.environ.setdefault("MSTAR_TORCH_PROFILE_S", "3600")
    mesh = start_mesh(root, ckpt, args.layout, args.device, result["model_kwargs"], args.torch_profile)
    result["mesh_start_s"] = time.perf_counter() - t
    try:
        levels = [int(x) for x in args.concurrency.split(",")]
        for n in levels:  # warm-up at every concurrency, whole answers: first-use costs (the decode graphs'
            # captures, one per batch bucket and attention span reached) stay out of the measured runs
            asyncio.run(level(mesh.conductor_address, n, knobs))
        for n in levels:
            r = asyncio.run(level(mesh.conductor_address, n, knobs))
            print(json.dumps(r), flush=True)
            result["mstar"].append(r)
            save()
        for n in levels:
            r = asyncio.run(level(mesh.conductor_address, n, {**knobs, "modalities": ["text"]}))
            print(json.dumps(r), flush=True)
            result["mstar_text"].append(r)
            save()
        if args.first_audio_answers:
            result["first_audio"] = asyncio.run(sequential_first_audio(mesh.conductor_address, args.first_audio_answers, knobs))
            print(json.dumps(result["first_audio"]), flush=True)
            save()
        image = (64, 48) if args.tiny else (448, 336)  # the tiny model's patches are 4 pixels
        asyncio.run(media_request(mesh.conductor_address, {**knobs, "max_tokens": 4, "max_audio_frames": 4}, image))
        result["media_request"] = asyncio.run(media_request(mesh.conductor_address, knobs, image))
        print(json.dumps(result["media_request"]), flush=True)
        if args.torch_profile:
            from mstar.torch_profile import record_around

            r, files = record_around(list(mesh.profiled_pids().values()), Path(args.torch_profile), lambda: asyncio.run(level(mesh.conductor_address, args.profile_streams, knobs)))
            result["profiled"] = r | {"files": files}
            save()
    finally:
        mesh.stop()


def measure_baseline(args, ckpt: Path, result: dict, save) -> None:
    model = reference_model(ckpt, args.device)
    from mstar.models.qwen3_omni.config import OmniConfig
    from mstar.models.qwen3_omni.prompt import MediaTokens, build_prompt
    from mstar.models.qwen3_omni.tiny import build_tokenizer

    cfg = OmniConfig.parse(json.loads((ckpt / "config.json").read_text()))
    tok = build_tokenizer() if args.tiny else build_tokenizer(FULL_SPECIALS, FULL_ROLES)
    prompt = build_prompt(lambda s: tok.encode(s, add_special_tokens=False).ids, cfg.ids, MediaTokens(-1, -1), TEXT)
    for n in (int(x) for x in args.baseline_concurrency.split(",")):
        for speech, key in ((True, "baseline"), (False, "baseline_text")):
            r = baseline_level(model, prompt, n, args.text_tokens, args.audio_frames, speech, args.device)
            print(json.dumps(r), flush=True)
            result[key].append(r)
            save()
    ours = {r["streams"]: r for r in result.get("mstar", [])}
    result["audio_throughput_ratio"] = {n: ours[n]["audio_s_per_s"] / r["audio_s_per_s"]
                                        for n, r in ((r["streams"], r) for r in result["baseline"]) if n in ours}


if __name__ == "__main__":
    main()
