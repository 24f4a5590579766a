"""The Orpheus LLM node: a KV-cache engine behind the EngineNode interface.

A ``prefill`` call starts the request's sequence and completes with the first sampled
token. Each ``decode`` iteration completes with the next token; the engine decodes every
running request each step (continuous batching), so a token may be ready before its
iteration asks for it (the node group's EngineDriver holds it meanwhile). Each iteration also
streams the audio code of the token it was given, validated for its frame position;
tokens that are not a valid code there are dropped without advancing the position, as
the official Orpheus decoder does.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from mstar.models.base import EngineNode, NodeCall, NodeContext
from mstar.models.orpheus.knobs import OrpheusConfig
from mstar.models.orpheus.tokens import (
    AUDIO_TOKEN_OFFSET,
    CODES_PER_POSITION,
    END_OF_SPEECH,
    FINISH_LENGTH,
    FINISH_NONE,
    FINISH_STOP,
    TOKENS_PER_FRAME,
)
from mstar.services.engines.engine_process import EngineProcess
from mstar.services.engines.kv_engine import EngineConfig, KVCacheEngine
from mstar.services.engines.llama import LlamaForCausalLM
from mstar.services.engines.sampling import SamplingParams
from mstar.services.engines.seq_engine import ImportSeq, LocalSeqEngine, SeqOutput, StartSeq
from mstar.services.engines.tensor_parallel import TensorParallel

log = logging.getLogger(__name__)
NO_CODE = torch.empty(0, dtype=torch.int64)  # also the empty K/V hand-off (decode runs in this group)
_SCALARS: dict[int, torch.Tensor] = {}  # shared one-element tensors: nothing downstream writes to them
_MAX_SCALARS = 1 << 16


def scalar(v: int) -> torch.Tensor:
    """``torch.tensor([v])``, cached: building a tensor costs microseconds, and each token
    of each stream makes two (its token and its code)."""
    t = _SCALARS.get(v)
    if t is None:
        t = torch.tensor([v], dtype=torch.int64)
        if len(_SCALARS) < _MAX_SCALARS:
            _SCALARS[v] = t
    return t

# Sampling follows SNAC's interleaving: output i is a code of frame position i % 7, or the
# end of speech. A trained Orpheus nearly always picks such a token anyway; this makes
# every token count (and random demo weights produce audio at the token rate).
CODE_CYCLE = tuple(((AUDIO_TOKEN_OFFSET + p * CODES_PER_POSITION, AUDIO_TOKEN_OFFSET + (p + 1) * CODES_PER_POSITION),
                    (END_OF_SPEECH, END_OF_SPEECH + 1)) for p in range(TOKENS_PER_FRAME))


#: sequences decoded together unless model_kwargs say otherwise: a GPU's engine takes every stream
#: the conductor admits at once (its decode graphs go up to it); a CPU keeps 128
CUDA_MAX_NUM_SEQS, CPU_MAX_NUM_SEQS = 512, 128


def union_ranges(cycle) -> tuple[tuple[int, int], ...]:
    """Every id some position of the cycle allows, as ascending disjoint ranges."""
    out: list[list[int]] = []
    for a, b in sorted({r for ranges in cycle for r in ranges}):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def engine_config(ctx: NodeContext, max_seq_len: int | None = None) -> EngineConfig:
    """The KV-cache engine's settings from the YAML's model_kwargs (``OrpheusConfig``)."""
    kw = OrpheusConfig.parse(ctx.model_kwargs)
    cpu = not ctx.device.startswith("cuda")
    return EngineConfig(
        # logits only for the SNAC codes and end-of-speech (29k of 157k ids) while sampling is
        # constrained to them
        head_ranges=union_ranges(CODE_CYCLE) if kw.constrain_codes else (),
        page_size=kw.page_size,
        kv_cache_bytes=kw.kv_cache_bytes if kw.kv_cache_bytes is not None else (256 << 20 if cpu else None),
        gpu_memory_fraction=kw.gpu_memory_fraction,
        max_num_seqs=kw.max_num_seqs or (CPU_MAX_NUM_SEQS if cpu else CUDA_MAX_NUM_SEQS),
        max_num_batched_tokens=kw.max_num_batched_tokens,
        max_seq_len=max_seq_len,
        cuda_graphs=kw.cuda_graphs,
        graph_attention=kw.graph_attention,
        fused_sampler=kw.fused_sampler,
        fused_norms=kw.fused_norms,
        down_gemm=kw.down_gemm,
        proj_gemm=kw.proj_gemm,
        pdl=kw.pdl,
    )


def use_engine_process(ctx: NodeContext) -> bool:
    """``model_kwargs.engine_process``: True runs the KV-cache engine in a child process
    (no GIL shared with the service's event loop); "auto" (default) does so on CUDA without
    tensor parallelism, where the engine's host work is the bottleneck."""
    v = OrpheusConfig.parse(ctx.model_kwargs).engine_process
    if v == "auto":
        return ctx.device.startswith("cuda") and ctx.tp is None
    if v and ctx.tp is not None:
        raise ValueError("model_kwargs.engine_process: true is not supported with tp_size > 1 (rank 0's engine leads "
                         "its followers from the service's process); set it to false or \"auto\"")
    return bool(v)


def build_engine(checkpoint: Path, device: str, config: EngineConfig, tp=None) -> KVCacheEngine:
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = LlamaForCausalLM.from_pretrained(checkpoint, dtype=dtype, device=device, tp=tp)
    engine = KVCacheEngine(model, config, tp=tp)
    if config.head_ranges:  # the code positions' sampling kernels compile now, not on the first request
        cycle = SamplingParams(seed=0, allowed_token_cycle=CODE_CYCLE)
        engine.warm_sampler([cycle.at_output(i) for i in range(len(CODE_CYCLE))])
    return engine


class OrpheusLLM(EngineNode):
    def __init__(self, checkpoint: Path, ctx: NodeContext, max_seq_len: int | None = None):
        config = engine_config(ctx, max_seq_len)
        if use_engine_process(ctx):
            self.engine: LocalSeqEngine | EngineProcess = EngineProcess(ctx.node, build_engine, (checkpoint, ctx.device, config))
            where = f"engine process pid {self.engine.proc.pid}"
        else:
            tp = self.tensor_parallel = TensorParallel(ctx.tp, ctx.device) if ctx.tp is not None else None
            self.engine = LocalSeqEngine(build_engine(checkpoint, ctx.device, config, tp))
            where = "in process"
        self.cycle = CODE_CYCLE if OrpheusConfig.parse(ctx.model_kwargs).constrain_codes else ()
        # prefill here, decode in another node group: the sequence's K/V leave with its first token
        self.hands_off = "prefill" in ctx.walks and "decode" not in ctx.walks
        log.info("orpheus llm loaded from %s on %s (%s%s)", checkpoint, ctx.device, where,
                 "; prefill only: K/V handed to the decode group" if self.hands_off else "")

    # -- EngineNode ----------------------------------------------------------------------
    def prepare(self, call: NodeCall) -> StartSeq | ImportSeq | None:
        """A prefill call starts the request's sequence; each decode call takes its next token.
        The first decode call of a request whose prefill ran in another node group imports the
        K/V it handed over (unless prefill already drew end-of-speech)."""
        if call.walk == "prefill":
            return StartSeq(call.inputs["prompt_ids"].tolist(), self._params(call.kwargs), key=("llm", "prefill"),
                            handoff=self.hands_off)
        kv = call.inputs.get("kv")
        if kv is None or kv.numel() == 0 or call.inputs["token"].item() == END_OF_SPEECH:
            return None
        tokens = [*call.inputs["kv_tokens"].tolist(), call.inputs["token"].item()]
        return ImportSeq(tokens, kv, self._params(call.kwargs), num_output_tokens=1, key=("llm", "decode"))

    def _params(self, kw: dict) -> SamplingParams:
        return SamplingParams(temperature=float(kw["temperature"]), top_p=float(kw["top_p"]),
                              repetition_penalty=float(kw["repetition_penalty"]), seed=kw["seed"],
                              stop_token_ids=(END_OF_SPEECH,), max_tokens=int(kw["max_tokens"]),
                              allowed_token_cycle=self.cycle)

    def outputs(self, call: NodeCall, output: SeqOutput | None) -> dict[str, torch.Tensor]:
        """A call's outputs: the next ``token``; for decode also the code of the token it was
        given and, read once at the loop's end, ``finish``: [why the stream ends (FINISH_*),
        tokens the LLM sampled in all]. Once the engine finished the sequence (at end-of-speech
        or max_tokens) and its tokens are taken, the next decode call answers END_OF_SPEECH:
        that iteration streams the last real token, and the loop stops."""
        ended = output is None
        token = END_OF_SPEECH if ended else output.token_id
        out = {"token": scalar(token)}
        if call.walk == "prefill":
            handed = output is not None and output.kv is not None
            out["kv"] = output.kv if handed else NO_CODE
            out["kv_tokens"] = call.inputs["prompt_ids"] if handed else NO_CODE
            return out
        if call.walk == "decode":
            given = call.inputs["token"].item()
            out["code"] = self._code(call, given)
            # iteration i was given the (i+1)-th sampled token (prefill sampled the first)
            if given == END_OF_SPEECH:  # prefill sampled the stop token: the loop ends at once
                out["finish"] = torch.tensor([FINISH_STOP, call.iteration + 1])
            elif ended:
                out["finish"] = torch.tensor([FINISH_LENGTH, call.iteration + 1])
            elif token == END_OF_SPEECH:
                out["finish"] = torch.tensor([FINISH_STOP, call.iteration + 2])
            else:
                out["finish"] = scalar(FINISH_NONE)  # not the last iteration: never read
        return out

    def check_stop(self, call: NodeCall, outputs: dict[str, torch.Tensor]) -> bool:
        # Iteration i streams the token it was given and returns the next one (see outputs)
        return outputs["token"].item() == END_OF_SPEECH

    # -- helpers -------------------------------------------------------------------------
    @staticmethod
    def _code(call: NodeCall, token: int) -> torch.Tensor:
        n = call.state.get("codes", 0)
        code = token - AUDIO_TOKEN_OFFSET - (n % TOKENS_PER_FRAME) * CODES_PER_POSITION
        if not 0 <= code < CODES_PER_POSITION:
            return NO_CODE
        call.state["codes"] = n + 1
        return scalar(code)
