"""The SNAC decoder node: one sliding window of codes in, the PCM of the frames it
completes out.

Windows hold 28 codes (4 frames) and advance one frame. A frame is emitted once it has
two frames of right context — frame f-2 of the window ending at frame f, i.e. samples
2048:4096 of a full window, exactly what the official Orpheus decoder keeps. Unlike
the official decoder, frame 0 is emitted too, from a first window of 3 frames (21 codes,
frame 0 with the same two frames of right context as every other frame: the first audio
leaves 7 tokens earlier), and the last window (sent when generation ends) flushes the
final frames, so the audio covers every frame. ``snac_stride_frames: n`` makes windows of
n + 3 frames every n frames, each emitting n frames (fewer decoded frames per emitted one).
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from pathlib import Path

import torch

from mstar.models.base import NodeCall, NodeContext, NodeSubmodule
from mstar.models.orpheus.knobs import OrpheusConfig
from mstar.models.orpheus.snac import load_snac_decoder
from mstar.models.orpheus.tokens import RIGHT_CONTEXT_FRAMES, TOKENS_PER_FRAME, snac_codes, window_plan
from mstar.services.engines.stateless import StatelessEngine

SNAC_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def snac_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """``snac_dtype`` resolved: ``auto`` is bfloat16 on CUDA (half the codec's GPU time; its audio
    within 30 dB SNR of the float32 reference's, bench/orpheus/snac_fidelity.py) and float32, the
    reference's, elsewhere."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return SNAC_DTYPES[name]
SNAC_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
SNAC_KERNELS = ("auto", "triton", "torch")
log = logging.getLogger(__name__)


def snac_kernels(model_kwargs: dict, device: str) -> str:
    """The ``snac_kernels`` knob resolved: "triton" (the fused channels-last decode of
    ``snac_triton.py``) or "torch" (the module decoder). "auto" is triton on CUDA when triton
    imports; asking for triton where it does not import raises."""
    from mstar.services.engines.cuda_graphs import triton_unavailable_reason

    name = OrpheusConfig.parse(model_kwargs).snac_kernels
    if name == "torch" or (name == "auto" and not device.startswith("cuda")):
        return "torch"
    why = triton_unavailable_reason()
    if why is None and not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        why = f"the device is {device} (Triton kernels run on CUDA, or on a CPU under TRITON_INTERPRET=1)"
    if why is None:
        return "triton"
    if name == "triton":
        raise ValueError(f"model_kwargs.snac_kernels is triton but {why}")
    log.warning("snac_kernels auto: the module decoder, not the fused Triton one: %s", why)
    return "torch"


class SnacNode(NodeSubmodule):
    """Windows go through the stateless engine as one packed int64 row each (levels 0, 1, 2
    concatenated: F + 2F + 4F codes); on CUDA, full and first windows replay CUDA graphs
    captured per batch bucket at start (a window decode is ~320 kernels with the module
    decoder, 71 with the fused one: launch-bound when eager), on their own stream so they
    overlap the LLM's steps."""

    blocking = True

    def __init__(self, checkpoint: Path, ctx: NodeContext):
        self.device = ctx.device
        cfg = OrpheusConfig.parse(ctx.model_kwargs)
        self.decoder = load_snac_decoder(checkpoint, device=ctx.device, dtype=snac_dtype(cfg.snac_dtype, ctx.device))
        # snac_kernels: the fused Triton decode (auto on CUDA: ~71 kernels a window instead of ~320,
        # activations channels-last) or the module decoder
        self.fused = None
        if snac_kernels(ctx.model_kwargs, ctx.device) == "triton":
            from mstar.models.orpheus.snac_triton import SnacTritonDecoder

            self.fused = SnacTritonDecoder(self.decoder)
        self.samples_per_frame = self.decoder.config.samples_per_frame
        # SNAC's decoder adds fresh Gaussian noise on every decode (the reference does, so
        # we do by default); snac_noise: false leaves it out: audio then depends only on the codes
        self.noise = cfg.snac_noise
        plan = window_plan(ctx.model_kwargs)
        self.graphed_codes = {plan.window, plan.first}  # the window shapes served by CUDA graphs
        cuda = ctx.device.startswith("cuda")
        self.stream = torch.cuda.Stream(device=ctx.device) if cuda else None
        graphs = cuda and cfg.snac_cuda_graphs
        self.graphed = StatelessEngine(self._decode_packed, SNAC_BATCH_SIZES, cuda_graphs=graphs, device=ctx.device)
        self.eager = StatelessEngine(self._decode_packed, SNAC_BATCH_SIZES, device=ctx.device)  # short last windows
        if graphs:
            with torch.cuda.stream(self.stream):
                for b in SNAC_BATCH_SIZES:  # capture now, not in the middle of serving
                    for n in sorted(self.graphed_codes):
                        self.graphed.run([torch.zeros(n, dtype=torch.int64)] * b)
            self.stream.synchronize()  # type: ignore[union-attr]

    def _decode_packed(self, packed: torch.Tensor) -> torch.Tensor:
        """[B, 7F] packed codes -> [B, 1, F * samples_per_frame] audio."""
        f = packed.shape[1] // TOKENS_PER_FRAME
        levels = list(packed.split([f, 2 * f, 4 * f], dim=1))
        if self.fused is not None:
            return self.fused.decode(levels, noise=self.noise)
        return self.decoder.decode(levels, checked=True, noise=self.noise)

    def forward(self, calls: list[NodeCall]) -> list[dict[str, torch.Tensor]]:
        plans = [self._plan(c) for c in calls]
        rows: dict[int, torch.Tensor] = {}
        for i, p in enumerate(plans):
            if p is not None:  # snac_codes range-checks every code here, on the host
                levels = snac_codes(p[0]).levels
                rows[i] = torch.tensor(levels[0] + levels[1] + levels[2], dtype=torch.int64)
        spf = self.samples_per_frame
        spans = {i: (plans[i][1] * spf, plans[i][2] * spf) for i in rows}  # type: ignore[index]
        with torch.inference_mode(), (torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()):
            graphed = [i for i in rows if len(rows[i]) in self.graphed_codes]
            short = [i for i in rows if len(rows[i]) not in self.graphed_codes]
            audio = dict(zip(graphed, self.graphed.run([rows[i] for i in graphed]), strict=True))
            audio.update(zip(short, self.eager.run([rows[i] for i in short]), strict=True))
            flat = torch.cat([audio[i][0, lo:hi] for i, (lo, hi) in spans.items()]).float().cpu() if rows else None
        results, at = [], 0
        for i in range(len(plans)):
            if i not in spans:
                results.append({"audio": torch.empty(0)})
                continue
            n = spans[i][1] - spans[i][0]
            results.append({"audio": flat[at : at + n]})  # type: ignore[index]
            at += n
        return results

    @staticmethod
    def _plan(call: NodeCall) -> tuple[list[int], int, int] | None:
        """(window codes, first and end frame to emit, relative to the window) or None."""
        chunk = call.chunk
        assert chunk is not None, "snac_decoder runs in chunk walks only"
        codes = call.inputs["code"].tolist()
        skip = (-chunk.start) % TOKENS_PER_FRAME  # align a short last window on a frame boundary
        codes = codes[skip:]
        first = (chunk.start + skip) // TOKENS_PER_FRAME
        frames = len(codes) // TOKENS_PER_FRAME
        codes = codes[: frames * TOKENS_PER_FRAME]
        start = call.state.get("next_frame", 0)
        end = first + frames if chunk.final else first + frames - RIGHT_CONTEXT_FRAMES
        if frames == 0 or end <= start:
            return None
        call.state["next_frame"] = end
        return codes, start - first, end - first
