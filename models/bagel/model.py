"""BAGEL (ByteDance-Seed/BAGEL-7B-MoT): one graph, three paths. A SigLIP NaViT (``vit_encoder``),
a FLUX VAE (``vae_encoder`` / ``vae_decoder``) and a Qwen2.5-7B Mixture-of-Transformers (``llm``)
that both writes text and, as a flow model, denoises image latents.

Walks (each request is a sequence of them, ``requests.plan``):
- ``prefill_text`` / ``prefill_vit`` / ``prefill_vae``: one context block into the labelled caches
  (``labels``) of the request's CFG contexts;
- ``export_kv``: before generating, the contexts' K/V for the group that generates (persisted
  values: empty where it is this group; a walk of its own so that only generating requests send);
- ``decode``: greedy decoding after the context (understanding; think mode's plan);
- ``image_gen``: a Loop of flow steps on ``llm`` (the three CFG passes of a step in one batched
  engine pass), then ``vae_decoder``;
- ``image_gen_cfg`` (``model_kwargs.cfg_parallel``): a Loop of ``combine_cfg`` (the Euler step) then
  Parallel[``llm``, ``llm_cfg_text``, ``llm_cfg_img``] (one CFG branch each, placeable on their own
  groups, their contexts handed over once), then ``vae_decoder``.

Request: ``text`` = the prompt; ``files`` = one input image (editing, understanding);
``model_kwargs`` = ``knobs.REQUEST_KEYS`` (mode, think, height, width, steps, cfg_*, seed, n, ...).
Outputs: ``text`` (TEXT: the answer, or think mode's plan) and ``image`` (IMAGE, PNG bytes).
"""

from __future__ import annotations

from typing import Any

import torch

from mstar.models.bagel.knobs import MAX_NEW_TOKENS, MAX_STEPS, Settings, flow_params, validate
from mstar.models.bagel.requests import LABELS, MAIN, Block, think_text
from mstar.models.bagel.schema import BagelRequest, BagelSettings
from mstar.models.base import (
    Emit,
    InvalidArgument,
    MissingAssets,
    Model,
    ModelApi,
    NodeContext,
    NodeSubmodule,
    Output,
    Prompt,
    RequestState,
    WalkSeed,
)
from mstar.models.graph import (
    EMIT_TO_CLIENT,
    INPUT,
    EngineType,
    GraphEdge,
    GraphNode,
    Loop,
    Modality,
    Parallel,
    Sequential,
    Walk,
)

BRANCHES = {"llm_cfg_text": "cfg_text", "llm_cfg_img": "cfg_img"}  # CFG branch node -> its context
BRANCH_X = {"llm_cfg_text": "x_text", "llm_cfg_img": "x_img"}  # the x each branch node reads in image_gen_cfg
HELP = ("put ByteDance-Seed/BAGEL-7B-MoT (ema.safetensors, ae.safetensors, llm_config.json, vit_config.json, "
        "tokenizer.json) in --cache-dir (HF cache layout or <cache-dir>/ByteDance-Seed/BAGEL-7B-MoT), or serve "
        "with --random-weights for a tiny random demo checkpoint")


def _handoff(dst: str, kv: str, meta: str) -> list[GraphEdge]:
    return [GraphEdge("llm", dst, kv, persist=True), GraphEdge("llm", dst, meta, persist=True)]


class BagelModel(Model):
    name = "bagel"
    config_schema = BagelSettings
    request_schema = BagelRequest
    # the LLM nodes keep each request's context K/V in the group's engine between walks (KV_CACHE): a
    # walk of theirs placed on another group than the prefills must receive it (export_kv's hand-off)
    nodes = (GraphNode("vit_encoder"), GraphNode("vae_encoder"), GraphNode("vae_decoder"),
             GraphNode("llm", EngineType.KV_CACHE), GraphNode("llm_cfg_text", EngineType.KV_CACHE),
             GraphNode("llm_cfg_img", EngineType.KV_CACHE), GraphNode("combine_cfg"))

    def __init__(self, model_kwargs: dict[str, Any] | None = None, cache_dir: str | None = None):
        self.settings = Settings.from_kwargs(dict(model_kwargs or {}))
        super().__init__(model_kwargs, cache_dir)
        self._lm = None  # the group's LLM engine, shared by its llm / branch nodes
        self.hosted: set[str] = set()  # nodes created in this group

    # -- graph ---------------------------------------------------------------------------
    def build_walks(self) -> list[Walk]:
        cfg_par = self.settings.cfg_parallel
        handoff = (_handoff("llm_cfg_text", "kv_text", "meta_text") + _handoff("llm_cfg_img", "kv_img", "meta_img")
                   if cfg_par else _handoff("llm", "ctx_kv", "ctx_meta"))
        ctx = [GraphEdge(INPUT, "llm", "labels"), GraphEdge(INPUT, "llm", "flags")]
        image = GraphEdge("vae_decoder", EMIT_TO_CLIENT, "image", modality=Modality.IMAGE)
        walks = [
            Walk("prefill_text", "llm", [GraphEdge(INPUT, "llm", "ids"), *ctx]),
            Walk("prefill_vit", Sequential("vit_encoder", "llm"), [
                GraphEdge(INPUT, "vit_encoder", "pixels"), GraphEdge("vit_encoder", "llm", "vit_embeds"), *ctx]),
            Walk("prefill_vae", Sequential("vae_encoder", "llm"), [
                GraphEdge(INPUT, "vae_encoder", "pixels"), GraphEdge(INPUT, "vae_encoder", "eps"),
                GraphEdge("vae_encoder", "llm", "latent"), GraphEdge("vae_encoder", "llm", "latent_hw"), *ctx]),
            Walk("export_kv", "llm", [GraphEdge(INPUT, "llm", "labels"), *handoff]),
            Walk("decode", Loop("llm", MAX_NEW_TOKENS, stop_node="llm", name="decode"), [
                GraphEdge(INPUT, "llm", "token"), GraphEdge(INPUT, "llm", "max_new"), GraphEdge(INPUT, "llm", "stop_eos"),
                GraphEdge("llm", "llm", "token"),
                GraphEdge("llm", EMIT_TO_CLIENT, "text", modality=Modality.TEXT)]),
        ]
        if not cfg_par:
            walks.append(Walk("image_gen", Sequential(Loop("llm", MAX_STEPS, stop_node="llm", name="flow"), "vae_decoder"), [
                GraphEdge(INPUT, "llm", "x"), GraphEdge(INPUT, "llm", "gen"), GraphEdge("llm", "llm", "x"),
                GraphEdge(INPUT, "llm", "ctx_kv", once=True), GraphEdge(INPUT, "llm", "ctx_meta", once=True),
                GraphEdge("llm", "vae_decoder", "x"), GraphEdge(INPUT, "vae_decoder", "gen"), image]))
            return walks
        branches = ("llm", *BRANCHES)
        body = Sequential("combine_cfg", Parallel(*branches))
        walks.append(Walk("image_gen_cfg", Sequential(Loop(body, MAX_STEPS + 1, stop_node="combine_cfg", name="flow"),
                                                      "vae_decoder"), [
            GraphEdge(INPUT, "combine_cfg", "x"), GraphEdge("combine_cfg", "combine_cfg", "x"),
            GraphEdge(INPUT, "combine_cfg", "gen"), GraphEdge("combine_cfg", "vae_decoder", "latent"),
            # each branch gets x only for the steps that use it (else an empty tensor: no bytes cross)
            *(GraphEdge("combine_cfg", b, BRANCH_X.get(b, "x")) for b in branches),
            *(GraphEdge(INPUT, b, "gen") for b in branches),
            GraphEdge("llm", "combine_cfg", "v_cond"), GraphEdge("llm_cfg_text", "combine_cfg", "v_text"),
            GraphEdge("llm_cfg_img", "combine_cfg", "v_img"),
            GraphEdge(INPUT, "llm_cfg_text", "kv_text", once=True), GraphEdge(INPUT, "llm_cfg_text", "meta_text", once=True),
            GraphEdge(INPUT, "llm_cfg_img", "kv_img", once=True), GraphEdge(INPUT, "llm_cfg_img", "meta_img", once=True),
            GraphEdge(INPUT, "vae_decoder", "gen"), image]))
        return walks

    # -- assets --------------------------------------------------------------------------
    def checkpoint_dir(self):
        from mstar.models.hub import resolve_checkpoint

        return resolve_checkpoint(self.settings.checkpoint, cache_dir=self.cache_dir)

    def checkpoints(self) -> list[Any]:
        from mstar.models.bagel.config import REQUIRED_FILES
        from mstar.models.hub import CheckpointSpec

        return [CheckpointSpec(self.settings.checkpoint, required=REQUIRED_FILES,
                               allow_patterns=("*.json", "*.safetensors", "*.txt"))]

    def config(self):
        from mstar.models.bagel.config import config_from_dir

        if not hasattr(self, "_cfg"):
            self._cfg = config_from_dir(self.checkpoint_dir())
        return self._cfg

    def check_assets(self) -> None:
        from mstar.models.hub import CheckpointError

        try:
            self.config()
        except CheckpointError as e:
            raise MissingAssets(f"bagel: {e}; {HELP}") from None

    def write_random_weights(self, directory: str) -> list[str]:
        from pathlib import Path

        from mstar.models.bagel.demo import write_checkpoint

        target = Path(directory) / self.settings.checkpoint
        if (target / "ema.safetensors").exists():
            return []
        write_checkpoint(target)
        return [str(target)]

    def prepare_conductor(self) -> None:
        from tokenizers import Tokenizer

        self._tokenizer = Tokenizer.from_file(str(self.checkpoint_dir() / "tokenizer.json"))
        self.config()

    def api(self) -> ModelApi:
        """Chat is understanding (of an attached image, or of the text alone); an image edit is mode edit."""
        return ModelApi(chat_media=("image",), chat_kwargs={"mode": "understand"}, edit_kwargs={"mode": "edit"})

    # -- conductor side ------------------------------------------------------------------
    def validate_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return dict(kwargs)  # checked with the files in process_prompt (defaults depend on the mode)

    def process_prompt(self, prompt: Prompt) -> RequestState:
        from mstar.models.bagel.conductor import prepare

        if not hasattr(self, "_tokenizer"):
            self.prepare_conductor()
        kw = validate(prompt.kwargs, self.settings, bool(prompt.files), self.max_seq_len)
        return prepare(self, prompt, kw)

    def text_ids(self, text: str) -> torch.Tensor:
        t = self._cfg.tokens
        return torch.tensor([t.bos, *self._tokenizer.encode(text, add_special_tokens=False).ids, t.eos])

    def next_walk(self, state: RequestState, finished: str | None) -> WalkSeed | None:
        d = state.data
        blocks = d["blocks"]
        if finished is not None:
            if finished == "decode" and blocks[d["at"]].kind == "think":  # the plan goes into main as a text block
                decoded = self._tokenizer.decode(d["ids"], skip_special_tokens=False)
                blocks.insert(d["at"] + 1, Block("text", (MAIN,), think_text(decoded)))
            if finished in ("image_gen", "image_gen_cfg"):
                d["images"] += 1
                if d["images"] < d["kw"]["n"]:
                    return self._seed(state, blocks[d["at"]])  # another image from the same contexts
            d["at"] += 1
        return self._seed(state, blocks[d["at"]]) if d["at"] < len(blocks) else None

    def _seed(self, state: RequestState, block: Block) -> WalkSeed:
        d = state.data
        rewind = block.kind == "text" and d["at"] > 0 and d["blocks"][d["at"] - 1].kind == "think"
        labels = torch.tensor([label in block.labels for label in LABELS])
        ctx = {"labels": labels, "flags": torch.tensor([int(rewind)])}
        if block.kind == "export":
            return WalkSeed("export_kv", {"labels": labels})
        if block.kind == "text":
            ids = self.text_ids(block.text)
            state.prompt_tokens += len(ids)
            return WalkSeed("prefill_text", {"ids": ids, **ctx})
        if block.kind == "vit":
            return WalkSeed("prefill_vit", {"pixels": d["vit_pixels"], **ctx})
        if block.kind == "vae":
            return WalkSeed("prefill_vae", {"pixels": d["vae_pixels"], "eps": d["eps"], **ctx})
        if block.kind in ("decode", "think"):
            d["ids"], d["sent"] = [], ""
            limit = d["kw"]["max_tokens" if block.kind == "decode" else "think_max_tokens"]
            return WalkSeed("decode", {"token": torch.tensor([self._cfg.tokens.bos]), "max_new": torch.tensor([limit]),
                                       "stop_eos": torch.tensor([0 if d["kw"]["ignore_eos"] else 1])})
        from mstar.models.bagel.conductor import noise

        params = flow_params(d["kw"], *d["size"])
        walk = "image_gen_cfg" if self.settings.cfg_parallel else "image_gen"
        return WalkSeed(walk, {"x": noise(self, state, d["images"]), "gen": params.as_tensor()})

    def postprocess(self, state: RequestState, emit: Emit) -> list[Output]:
        from mstar.models.bagel.conductor import image_output, text_output

        if emit.name == "image":
            return image_output(state, emit)
        return text_output(self, state, emit)

    # -- node-group side -----------------------------------------------------------------
    def create_submodule(self, ctx: NodeContext) -> NodeSubmodule:
        from mstar.models.bagel import nodes

        self.hosted.add(ctx.node)
        if ctx.node in ("llm", *BRANCHES):
            if self._lm is None:
                self._lm = nodes.load_lm(self, ctx)
            if ctx.node == "llm":
                return nodes.LLMNode(self, self._lm, ctx)
            return nodes.BranchNode(self, self._lm, ctx, BRANCHES[ctx.node])
        cls = {"vit_encoder": nodes.VitNode, "vae_encoder": nodes.VaeEncoderNode, "vae_decoder": nodes.VaeDecoderNode,
               "combine_cfg": nodes.CombineNode}.get(ctx.node)
        if cls is None:
            raise InvalidArgument("node", f"unknown node {ctx.node!r}")
        return cls(self, ctx)
