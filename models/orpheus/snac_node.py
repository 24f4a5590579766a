"""The SNAC decoder node: one sliding window of codes in, the PCM of the frames it
completes out.

Windows hold 28 codes (4 frames) and advance one frame. A frame is emitted once it has
two frames of right context — frame f-2 of the window ending at frame f, i.e. samples
2048:4096 of a full window, exactly what the official Orpheus decoder keeps. Unlike
the official decoder, the first window also emits frame 0, and the last window (sent
when generation ends) flushes the final frames, so the audio covers every frame.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from mstar.models.base import NodeCall, NodeContext, NodeSubmodule
from mstar.models.orpheus.snac import load_snac_decoder
from mstar.models.orpheus.tokens import TOKENS_PER_FRAME, snac_codes
from mstar.services.engines.batch import h2d

RIGHT_CONTEXT_FRAMES = 2


class SnacNode(NodeSubmodule):
    blocking = True

    def __init__(self, checkpoint: Path, ctx: NodeContext):
        self.device = ctx.device
        self.decoder = load_snac_decoder(checkpoint, device=ctx.device)
        self.samples_per_frame = self.decoder.config.samples_per_frame
        # its own CUDA stream: window decodes overlap the LLM's steps instead of queueing
        # behind them (and the host copy of the audio waits for SNAC's kernels only)
        self.stream = torch.cuda.Stream(device=ctx.device) if ctx.device.startswith("cuda") else None

    def forward(self, calls: list[NodeCall]) -> list[dict[str, torch.Tensor]]:
        plans = [self._plan(c) for c in calls]
        # windows with the same number of frames decode together in one batch
        by_frames: dict[int, list[int]] = {}
        for i, p in enumerate(plans):
            if p is not None:
                by_frames.setdefault(len(p[0]) // TOKENS_PER_FRAME, []).append(i)
        audio: dict[int, torch.Tensor] = {}
        with torch.inference_mode(), (torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()):
            for idx in by_frames.values():
                levels = [snac_codes(plans[i][0]).levels for i in idx]  # type: ignore[index]
                batch = [torch.tensor([lv[k] for lv in levels], dtype=torch.int64) for k in range(3)]
                self.decoder.check_codes(batch)
                out = self.decoder.decode([h2d(b, torch.device(self.device)) for b in batch], checked=True)
                for row, i in enumerate(idx):
                    audio[i] = out[row, 0]
            spf = self.samples_per_frame
            spans = {i: (plans[i][1] * spf, plans[i][2] * spf) for i in audio}  # type: ignore[index]
            flat = torch.cat([audio[i][lo:hi] for i, (lo, hi) in spans.items()]).float().cpu() if audio else None
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
