"""Orpheus TTS on one GPU: M* (the real mesh: node group + conductor processes, gRPC
streaming) against transformers `generate` (static cache) + SNAC decode, in one run.
``--served``: M* as shipped instead, `mstar serve orpheus --cache-dir DIR` with no other flag,
its streams through the REST gateway (`/v1/audio/speech`, pcm, all opened at once).

Full-size architectures with random bf16 weights (Llama-3.2-3B shape, Orpheus vocab
156940; SNAC 24 kHz). Both sides sample with the same knobs and the same SNAC
code-position constraint, so every token is a valid code and audio = tokens / 7 frames.

    python bench/orpheus/bench_orpheus.py --out $OUT/orpheus.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import grpc
import torch

from mstar.config import load_config
from mstar.launcher import LaunchOptions, Mesh
from mstar.models.orpheus.demo_checkpoint import write_random_snac
from mstar.models.orpheus.demo_tokenizer import build_demo_tokenizer
from mstar.models.orpheus.llm_node import CODE_CYCLE
from mstar.models.orpheus.snac import load_snac_decoder
from mstar.models.orpheus.snac_config import SnacConfig
from mstar.models.orpheus.streaming import code_tensors
from mstar.models.orpheus.tokens import AUDIO_TOKEN_OFFSET, CODES_PER_POSITION, TOKENS_PER_FRAME
from mstar.services.links import CHANNEL_OPTIONS
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc

SNAC_24K = SnacConfig(sampling_rate=24000, encoder_dim=48, encoder_rates=(2, 4, 8, 8), decoder_dim=1024,
                      decoder_rates=(8, 8, 4, 2), attn_window_size=None, codebook_size=4096, codebook_dim=8,
                      vq_strides=(4, 2, 1), noise=True, depthwise=True)
KNOBS = {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.1, "voice": "tara"}
TEXT = "Hey there, this is a quick test of streaming speech synthesis on one GPU."
REAL_TIME_TOKENS_PER_S = 24000 / 2048 * TOKENS_PER_FRAME  # 82.03
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}  # --tiny: a CPU smoke run of this script


def write_checkpoints(root: Path, tiny: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = TINY if tiny else {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
                               "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128}
    cfg = LlamaConfig(vocab_size=156940, **shape, rope_theta=500000.0,
                      rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                      max_position_embeddings=131072, tie_word_embeddings=True, rms_norm_eps=1e-5,
                      bos_token_id=128000, eos_token_id=128258)
    llm = root / "canopylabs" / "orpheus-3b-0.1-ft"
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(llm, safe_serialization=True)
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    build_demo_tokenizer().save(str(llm / "tokenizer.json"))
    snac = SNAC_24K if not tiny else SnacConfig(**{**SNAC_24K.to_dict(), "decoder_dim": 64, "encoder_dim": 4})
    write_random_snac(root / "hubertsiuzdak" / "snac_24khz", snac)


# -- M* ------------------------------------------------------------------------------------
#: both on the one GPU; "split" runs the LLM and the SNAC decoder as two node-group processes
#: (models/orpheus/configs/disaggregated.yaml with both on rank 0), "one" as one process
PLACEMENTS = {"one": [{"name": "orpheus", "node_names": ["llm", "snac_decoder"], "ranks": [0]}],
              "split": [{"name": "llm", "node_names": ["llm"], "ranks": [0]},
                        {"name": "codec", "node_names": ["snac_decoder"], "ranks": [0]}],
              "tp2": [{"name": "llm", "node_names": ["llm"], "ranks": [0, 1], "tp_size": 2},  # two GPUs
                      {"name": "codec", "node_names": ["snac_decoder"], "ranks": [0]}]}


class Served:
    """`mstar serve orpheus --cache-dir ROOT` as a user starts it (ports picked free): its REST URL
    and its node groups' metrics URLs, read off its ready lines."""

    def __init__(self, root: Path, timeout_s: float = 600):
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-m", "mstar.cli", "serve", "orpheus", "--cache-dir", str(root),
                                      "--port", "0", "--grpc-port", "0", "--log-level", "WARNING"],
                                     stdout=subprocess.PIPE, text=True)
        deadline, self.url = time.monotonic() + timeout_s, None
        for line in self.proc.stdout:
            if line.startswith("M* ready:"):
                self.url = line.split(" at ", 1)[1].split()[0]
            elif line.startswith("M* metrics:"):
                urls = json.loads(line.partition(":")[2])
                self.groups = {k: v for k, v in urls.items() if k not in ("conductor", "gateway")}
                return
            if time.monotonic() > deadline:
                break
        self.stop()
        raise RuntimeError("mstar serve orpheus did not print its ready lines")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def start_mesh(root: Path, placement: str, model_kwargs: dict | None = None) -> Mesh:
    cfg_path = root / f"orpheus-{placement}.yaml"
    cfg_path.write_text(json.dumps({"model": "orpheus", "max_seq_len": 4096,
                                    "model_kwargs": {"gpu_memory_fraction": 0.8, "max_num_seqs": 256,
                                                     **({"kv_cache_bytes": 64 << 20} if DEVICE == "cpu" else {}),
                                                     **(model_kwargs or {})},
                                    "node_groups": PLACEMENTS[placement]}))
    mesh = Mesh(load_config(cfg_path), LaunchOptions(cfg_path, port=0, grpc_port=0, gpus=list(range(torch.cuda.device_count())) if DEVICE == "cuda" else None,
                                                     cache_dir=str(root), log_level="WARNING", startup_timeout_s=300))
    mesh.start()
    return mesh


def buffer_needed_s(arrivals: list[tuple[float, float]]) -> float:
    """How long after the first audio a listener must start playback at 1x to never run dry:
    chunks (arrival s, audio s) in order; chunk k must arrive before the audio ahead of it has
    played out."""
    if not arrivals:
        return 0.0
    first, ahead, need = arrivals[0][0], 0.0, 0.0
    for t, d in arrivals:
        need = max(need, t - first - ahead)
        ahead += d
    return need


async def stream(stub, i: int, max_tokens: int) -> dict:
    req = cpb.GenerateRequest(model="orpheus", text=TEXT, model_kwargs_json=json.dumps({**KNOBS, "max_tokens": max_tokens, "seed": i}))
    t0 = time.perf_counter()
    arrivals, samples, finish = [], 0, ""
    async for r in stub.Generate(req, timeout=600):
        now = time.perf_counter() - t0
        for c in r.chunks:
            if c.name == "audio" and c.data:
                arrivals.append((now, len(c.data) // 2 / 24000))
                samples += len(c.data) // 2
        if r.HasField("final"):
            finish = r.final.finish_reason
    return summary(arrivals, samples, time.perf_counter() - t0, finish, max_tokens)


async def rest_stream(session, url: str, i: int, max_tokens: int) -> dict:
    """One stream through the gateway: /v1/audio/speech, raw PCM16 bytes as they are made."""
    body = {"model": "orpheus", "input": TEXT, "voice": KNOBS["voice"], "response_format": "pcm", "seed": i,
            "temperature": KNOBS["temperature"], "top_p": KNOBS["top_p"], "max_tokens": max_tokens,
            "model_kwargs": {"repetition_penalty": KNOBS["repetition_penalty"]}}
    t0 = time.perf_counter()
    arrivals, size = [], 0
    async with session.post(f"{url}/v1/audio/speech", json=body) as r:
        assert r.status == 200, (r.status, await r.text())
        async for data in r.content.iter_any():
            arrivals.append((time.perf_counter() - t0, len(data) / 2 / 24000))
            size += len(data)
    # the gateway's stream carries no finish reason: a stream short of max_tokens' audio stopped early
    return summary(arrivals, size // 2, time.perf_counter() - t0, "", max_tokens)


def summary(arrivals: list[tuple[float, float]], samples: int, total: float, finish: str, max_tokens: int) -> dict:
    audio_s = samples / 24000
    return {"ttfa_s": arrivals[0][0] if arrivals else None, "total_s": total, "audio_s": audio_s,
            "rtf": total / audio_s if audio_s else None, "buffer_needed_s": buffer_needed_s(arrivals),
            "finish_reason": finish,  # "stop": the stream sampled end-of-speech before max_tokens
            "full_length": samples >= max_tokens // TOKENS_PER_FRAME * 2048}


def group_counters(urls: dict[str, str]) -> dict[str, float]:
    """Node-group step counters, summed over the node-group services (``urls``: name -> metrics
    URL): per node the calls and batches (``batch_size`` sum / count) and the step seconds, per
    group the busy seconds."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for url in urls.values():
        with urlopen(url, timeout=10) as r:
            text = r.read().decode()
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                if smp.name in ("mstar_node_group_batch_size_sum", "mstar_node_group_batch_size_count",
                                "mstar_node_group_step_seconds_sum"):
                    key = f"{smp.labels['node']}.{smp.name.removeprefix('mstar_node_group_')}"
                elif smp.name == "mstar_node_group_busy_seconds_total":
                    key = f"{smp.labels['group']}.busy_seconds"
                else:
                    continue
                out[key] = out.get(key, 0.0) + smp.value
    return out


def level_counters(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict:
    """Per node over one level: batches/s, mean calls per batch, mean step ms; per group busy fraction."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    res: dict = {}
    for key in d:
        node, _, metric = key.partition(".")
        if metric == "batch_size_count" and d[key]:
            res[node] = {"batches_per_s": d[key] / wall_s, "mean_batch": d[f"{node}.batch_size_sum"] / d[key],
                         "mean_step_ms": 1e3 * d.get(f"{node}.step_seconds_sum", 0.0) / d[key]}
        elif metric == "busy_seconds":
            res[f"{node}_busy_fraction"] = d[key] / wall_s
    return res


async def mstar_level(address: str, streams: int, max_tokens: int) -> dict:
    """``streams`` at once over gRPC (``address``: host:port) or REST (``address``: http://...)."""
    t0 = time.perf_counter()
    if address.startswith("http"):
        import aiohttp

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=600)) as session:
            res = await asyncio.gather(*(rest_stream(session, address, i, max_tokens) for i in range(streams)))
    else:
        async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
            stub = conductor_pb2_grpc.ConductorStub(ch)
            res = await asyncio.gather(*(stream(stub, i, max_tokens) for i in range(streams)))
    wall = time.perf_counter() - t0
    ttfa = sorted(r["ttfa_s"] for r in res)
    rtf = sorted(r["rtf"] for r in res)
    audio = sum(r["audio_s"] for r in res)
    full = [r for r in res if r["full_length"]]
    buffers = sorted(r["buffer_needed_s"] for r in res)
    # real time: every stream that ran to max_tokens has RTF < 1. A stream that sampled
    # end-of-speech early is left out: its RTF is mostly the wait for its first audio (a stream
    # of 0.25 s of audio that took 0.33 s reads RTF 1.3); the playback-buffer figures cover every stream
    return {"system": "mstar", "streams": streams, "wall_s": wall, "audio_s_total": audio,
            "audio_s_per_s": audio / wall, "ttfa_p50_s": statistics.median(ttfa), "ttfa_max_s": ttfa[-1],
            "rtf_p50": statistics.median(rtf), "rtf_max": rtf[-1],
            "rtf_max_full_length": max((r["rtf"] for r in full), default=None),
            "stopped_early": len(res) - len(full), "finish_stop": sum(r["finish_reason"] == "stop" for r in res),
            "audio_s_min": min(r["audio_s"] for r in res),
            "playback_buffer_p50_s": statistics.median(buffers), "playback_buffer_max_s": buffers[-1],
            "all_real_time": bool(full) and max(r["rtf"] for r in full) < 1.0}


# -- baseline --------------------------------------------------------------------------------
class CycleMask:
    """The same SNAC code-position constraint, as a transformers logits processor."""

    def __init__(self, prompt_len: int, vocab: int):
        self.prompt_len = prompt_len
        self.masks = []
        for ranges in CODE_CYCLE:
            keep = torch.zeros(vocab, dtype=torch.bool, device=DEVICE)
            a, b = ranges[0]  # the code block only: eos_token_id=None, so an end-of-speech would not end the row
            keep[a:b] = True
            self.masks.append(~keep)

    def __call__(self, input_ids, scores):
        return scores.masked_fill(self.masks[(input_ids.shape[1] - self.prompt_len) % TOKENS_PER_FRAME], float("-inf"))


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def baseline_level(model, snac, prompt_ids: list[int], streams: int, max_tokens: int) -> dict:
    from transformers import LogitsProcessorList

    ids = torch.tensor([prompt_ids] * streams, device=DEVICE)
    kw = dict(do_sample=True, temperature=KNOBS["temperature"], top_p=KNOBS["top_p"],
              repetition_penalty=KNOBS["repetition_penalty"], cache_implementation="static", eos_token_id=None,
              pad_token_id=0, attention_mask=torch.ones_like(ids))
    # warm-up of the very shapes timed below (batch and static-cache length): the static cache's
    # compile, and any recompile for a new batch size or cache length, stays out of the timing
    model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                   logits_processor=LogitsProcessorList([CycleMask(ids.shape[1], 156940)]), **kw)
    sync()
    t0 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                         logits_processor=LogitsProcessorList([CycleMask(ids.shape[1], 156940)]), **kw)
    sync()
    t_gen = time.perf_counter() - t0
    new = out[:, ids.shape[1]:].tolist()
    frames = max_tokens // TOKENS_PER_FRAME
    codes = [[t - AUDIO_TOKEN_OFFSET - (j % 7) * CODES_PER_POSITION for j, t in enumerate(row[: frames * 7])] for row in new]
    assert all(0 <= c < CODES_PER_POSITION for row in codes for c in row), "baseline produced invalid codes"
    with torch.inference_mode():
        levels = [code_tensors(row, DEVICE) for row in codes]
        audio = snac.decode([torch.cat([lv[k] for lv in levels]) for k in range(3)])
    sync()
    total = time.perf_counter() - t0
    audio_s = audio.shape[-1] / 24000
    return {"system": "transformers_static+snac", "streams": streams, "wall_s": total, "generate_s": t_gen,
            "audio_s_total": audio_s * streams, "audio_s_per_s": audio_s * streams / total,
            "ttfa_p50_s": total, "rtf_p50": total / audio_s, "all_real_time": total / audio_s < 1.0,
            "note": "not streaming: first audio arrives when the whole batch is done"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=434)  # 62 frames, 5.3 s of audio per stream
    ap.add_argument("--streams", default="1,8,16,32,64,96,128,160")
    ap.add_argument("--baseline-streams", default="1,8,16,32,64")
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU: checks this script, measures nothing")
    ap.add_argument("--root", help="checkpoint folder to reuse (written there if missing)")
    ap.add_argument("--placement", choices=PLACEMENTS, default="split")
    ap.add_argument("--model-kwargs", default="{}", help="JSON merged into the config's model_kwargs (e.g. snac_dtype)")
    ap.add_argument("--served", action="store_true", help="`mstar serve orpheus` as shipped, streams over REST "
                                                           "(--placement and --model-kwargs do not apply)")
    args = ap.parse_args()
    result = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__, "knobs": KNOBS,
              "max_tokens": args.max_tokens, "real_time_tokens_per_s": REAL_TIME_TOKENS_PER_S, "mstar": [], "baseline": []}
    root = Path(args.root or tempfile.mkdtemp(prefix="orpheus-bench-"))
    t = time.perf_counter()
    if not (root / "hubertsiuzdak").exists():
        write_checkpoints(root, args.tiny)
    result["checkpoint_write_s"] = time.perf_counter() - t
    if args.served:
        result["placement"], result["model_kwargs"] = "mstar serve orpheus (models/orpheus/configs/default.yaml)", {}
    else:
        result["placement"], result["model_kwargs"] = args.placement, json.loads(args.model_kwargs)
    t = time.perf_counter()
    if args.served:
        mesh = Served(root)
        address, groups = mesh.url, mesh.groups
    else:
        mesh = start_mesh(root, args.placement, result["model_kwargs"])
        address = mesh.conductor_address
        groups = {n: u for n, u in mesh.metrics_urls().items() if n in {s.name for s in mesh.services
                                                                          if s.kind == "node_group"}}
    result["mesh_start_s"] = time.perf_counter() - t
    try:
        levels = [int(x) for x in args.streams.split(",")]
        for n in levels:  # warm-up at every level's concurrency: one-off costs of a new batch size stay out
            asyncio.run(mstar_level(address, n, 32))
        for n in levels:
            before = group_counters(groups)
            r = asyncio.run(mstar_level(address, n, args.max_tokens))
            r["node_groups"] = level_counters(before, group_counters(groups), r["wall_s"])
            print(json.dumps(r), flush=True)
            result["mstar"].append(r)
    finally:
        mesh.stop()
    if not args.baseline_streams:
        Path(args.out).write_text(json.dumps(result, indent=2))
        return
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(root / "canopylabs" / "orpheus-3b-0.1-ft", dtype=torch.bfloat16).to(DEVICE).eval()
    snac = load_snac_decoder(root / "hubertsiuzdak" / "snac_24khz", device=DEVICE)
    tok = build_demo_tokenizer()
    from mstar.models.orpheus.tokens import build_prompt_ids

    prompt = build_prompt_ids(lambda s: tok.encode(s).ids, TEXT, KNOBS["voice"])
    for n in [int(x) for x in args.baseline_streams.split(",") if x]:
        r = baseline_level(model, snac, prompt, n, args.max_tokens)
        print(json.dumps(r), flush=True)
        result["baseline"].append(r)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
