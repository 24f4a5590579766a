"""BAGEL's graph nodes.

- ``VitNode`` / ``VaeEncoderNode`` / ``VaeDecoderNode``: stateless, one batch of requests a call;
- ``LLMNode`` (``llm``): context blocks, greedy decoding and flow steps over the group's ``BagelLM``
  (the KV-cache engine's direct passes over labelled caches); batches requests into one pass;
- ``BranchNode`` (``llm_cfg_text`` / ``llm_cfg_img``): one unconditional CFG branch of
  ``image_gen_cfg``, over its context handed over once from the prefill group (or shared with
  ``llm`` when placed beside it);
- ``CombineNode`` (``combine_cfg``): the guided velocity and the Euler step of ``image_gen_cfg``.
"""

from __future__ import annotations

import functools

import torch

from mstar.models.bagel.engine import BagelLM
from mstar.models.bagel.flow import (
    FlowParams,
    cfg_combine,
    decode_pixels,
    patchify_latent,
    schedule,
    unpatchify_latent,
)
from mstar.models.bagel.media import encode_png, normalize
from mstar.models.bagel.requests import CFG_IMG, CFG_TEXT, LABELS, MAIN
from mstar.models.base import NodeCall, NodeContext, NodeSubmodule

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EMPTY = torch.empty(0)


def node_dtype(model, ctx: NodeContext) -> torch.dtype:
    return DTYPES[model.settings.dtype or ("bfloat16" if ctx.device.startswith("cuda") else "float32")]


def load_lm(model, ctx: NodeContext) -> BagelLM:
    """The group's engine; in a group of several ranks (``tp_size``), this rank's, joined to the
    others: they split its image blocks and flow steps by rows (``BagelLM``'s sequence_parallel)."""
    from mstar.models.bagel.pipeline import engine_config
    from mstar.models.bagel.pipeline import load_lm as load

    group = None
    if ctx.tp is not None:
        from mstar.services.engines.tensor_parallel import TensorParallel

        group = TensorParallel(ctx.tp, ctx.device)
    s = model.settings
    config = engine_config(ctx.device, model.max_seq_len, s.kv_cache_bytes, s.gpu_memory_fraction, s.prefill_attention)
    return load(model.checkpoint_dir(), model.config(), ctx.device, node_dtype(model, ctx), config, group)


@functools.lru_cache(maxsize=64)
def _schedule(steps: int, shift: float) -> tuple[list[float], list[float]]:
    t, dt = schedule(steps, shift)
    return t.tolist(), dt.tolist()


def flow_of(call: NodeCall) -> tuple[FlowParams, list[float], list[float]]:
    p = FlowParams.from_tensor(call.inputs["gen"])
    return (p, *_schedule(p.num_timesteps, p.shift))


def needed(p: FlowParams, t: float) -> tuple[str, ...]:
    """The contexts whose velocity the step at t uses (the image CFG only on top of the text CFG)."""
    s_text, s_img = p.scales(t)
    if s_text <= 1.0:
        return (MAIN,)
    return (MAIN, CFG_TEXT, *((CFG_IMG,) if s_img > 1.0 else ()))


class _Module(NodeSubmodule):
    blocking = True
    max_batch = 8

    def __init__(self, model, ctx: NodeContext):
        from mstar.models.bagel.weights import build

        self.cfg, self.device, self.dtype = model.config(), ctx.device, node_dtype(model, ctx)
        self._build = functools.partial(build, directory=model.checkpoint_dir(), device=ctx.device, dtype=self.dtype)


class VitNode(_Module):
    def __init__(self, model, ctx: NodeContext):
        from mstar.models.bagel.vit import VisionEncoder

        super().__init__(model, ctx)
        self.vit = self._build(VisionEncoder, self.cfg, which="vit")

    @torch.inference_mode()
    def forward(self, calls: list[NodeCall]) -> list[dict[str, torch.Tensor]]:
        images = [normalize(c.inputs["pixels"]).to(self.device) for c in calls]
        return [{"vit_embeds": e} for e in self.vit(images)]


class _VaeNode(_Module):
    def __init__(self, model, ctx: NodeContext):
        from mstar.models.bagel.vae import AutoEncoder

        super().__init__(model, ctx)
        self.vae = self._build(AutoEncoder, self.cfg.vae, which="vae")


class VaeEncoderNode(_VaeNode):

    @torch.inference_mode()
    def forward(self, calls: list[NodeCall]) -> list[dict[str, torch.Tensor]]:
        out = []
        for c in calls:
            x = normalize(c.inputs["pixels"])[None].to(self.device, self.dtype)
            z = self.vae.encode(x, c.inputs["eps"].to(self.device))[0]
            out.append({"latent": patchify_latent(z, self.cfg.latent_patch_size),
                        "latent_hw": torch.tensor([z.shape[1] // 2, z.shape[2] // 2])})
        return out


class VaeDecoderNode(_VaeNode):
    @torch.inference_mode()
    def forward(self, calls: list[NodeCall]) -> list[dict[str, torch.Tensor]]:
        out = []
        for c in calls:
            p = FlowParams.from_tensor(c.inputs["gen"])
            h, w = p.latent_hw(self.cfg.latent_downsample)
            x = c.inputs["x"] if "x" in c.inputs else c.inputs["latent"]
            z = unpatchify_latent(x.to(self.device, self.dtype), h, w, self.cfg.latent_patch_size)[None]
            png = encode_png(decode_pixels(self.vae.decode(z)[0]))
            out.append({"image": torch.frombuffer(bytearray(png), dtype=torch.uint8)})
        return out


class _LMNode(NodeSubmodule):
    blocking = True
    max_batch = 16

    def __init__(self, model, lm: BagelLM, ctx: NodeContext):
        self.model, self.lm, self.walks = model, lm, ctx.walks
        self.eos = lm.cfg.tokens.eos
        #: the ranks of a group with tp_size > 1 (the node group starts ranks 1.., which ``follow``)
        self.tensor_parallel = lm.group

    def follow(self) -> None:
        self.lm.follow()

    def close(self) -> None:
        self.lm.close()

    def forward(self, calls: list[NodeCall]) -> list[dict[str, torch.Tensor]]:
        with self.lm.session():
            return getattr(self, f"_{calls[0].walk}")(calls)

    def _take(self, call: NodeCall, kv: str, meta: str) -> None:
        """The first iteration of a loop on another group than prefill: import the contexts."""
        if call.iteration == 0 and kv in call.inputs and call.inputs[meta].numel():
            self.lm.import_(call.request_id, call.inputs[kv], call.inputs[meta])

    def release(self, request_id: str) -> None:
        self.lm.release_soon(request_id)


class LLMNode(_LMNode):
    def _labels(self, call: NodeCall) -> tuple[str, ...]:
        return tuple(label for label, on in zip(LABELS, call.inputs["labels"].tolist(), strict=True) if on)

    def _rewind(self, calls: list[NodeCall]) -> None:
        for c in calls:
            if int(c.inputs["flags"][0]):
                self.lm.rewind(c.request_id)

    def _prefill_text(self, calls):
        self._rewind(calls)
        self.lm.prefill_text([(c.request_id, self._labels(c), c.inputs["ids"]) for c in calls])
        return [{} for _ in calls]

    def _prefill_vit(self, calls):
        self._rewind(calls)
        self.lm.prefill_image([(c.request_id, self._labels(c), c.inputs["vit_embeds"]) for c in calls], generation=False)
        return [{} for _ in calls]

    def _prefill_vae(self, calls):
        self._rewind(calls)
        blocks = [(c.request_id, self._labels(c), self.lm.vae_tokens(c.inputs["latent"], *c.inputs["latent_hw"].tolist()))
                  for c in calls]
        self.lm.prefill_image(blocks, generation=True)
        return [{} for _ in calls]

    def _export_kv(self, calls):
        return [self._export(c) for c in calls]

    def _export(self, call: NodeCall) -> dict[str, torch.Tensor]:
        """The contexts for the generation loop's group: empty where it is this one (the engine,
        or the branch nodes sharing it, already hold them)."""
        rid, labels = call.request_id, self._labels(call)
        if not self.model.settings.cfg_parallel:
            here = not self.walks or "image_gen" in self.walks
            kv, meta = (EMPTY, EMPTY) if here else self.lm.export(rid, labels)
            return {"ctx_kv": kv, "ctx_meta": meta}
        out = {}
        for node, (label, kv_name, meta_name) in {"llm_cfg_text": (CFG_TEXT, "kv_text", "meta_text"),
                                                   "llm_cfg_img": (CFG_IMG, "kv_img", "meta_img")}.items():
            far = node not in self.model.hosted and label in labels
            out[kv_name], out[meta_name] = self.lm.export(rid, (label,)) if far else (EMPTY, EMPTY)
        return out

    def _decode(self, calls):
        nxt = self.lm.decode([(c.request_id, int(c.inputs["token"].reshape(-1)[0]), c.iteration == 0) for c in calls])
        return [{"token": torch.tensor([t]), "text": torch.tensor([t])} for t in nxt]

    def _image_gen(self, calls):
        from mstar.models.bagel.pipeline import flow_step

        steps = []
        for c in calls:
            self._take(c, "ctx_kv", "ctx_meta")
            p, ts, dts = flow_of(c)
            labels = (MAIN, *((CFG_TEXT,) if p.cfg_text > 1.0 else ()), *((CFG_IMG,) if p.cfg_img > 1.0 else ()))
            steps.append((c.request_id, c.inputs["x"], ts[c.iteration], dts[c.iteration], p, labels))
        return [{"x": x} for x in flow_step(self.lm, steps)]

    def _image_gen_cfg(self, calls):
        return branch_velocities(self.lm, calls, MAIN, "v_cond")

    def check_stop(self, call: NodeCall, outputs: dict[str, torch.Tensor]) -> bool:
        if call.walk == "decode":
            token = int(outputs["token"][0])
            at_eos = token == self.eos and bool(call.inputs["stop_eos"][0])
            return at_eos or call.iteration + 1 >= int(call.inputs["max_new"][0])
        if call.walk == "image_gen":
            return call.iteration + 1 >= len(flow_of(call)[1])
        return False


def branch_velocities(lm: BagelLM, calls: list[NodeCall], label: str, out: str, x_name: str = "x",
                      ) -> list[dict[str, torch.Tensor]]:
    """One CFG branch of a flow step for each call (empty where the step does not use it, or once
    the loop has no step left)."""
    asks, which = [], []
    for i, c in enumerate(calls):
        x = c.inputs[x_name]
        p, ts, _ = flow_of(c)
        if x.numel() and label in needed(p, ts[c.iteration]):
            asks.append((c.request_id, x, ts[c.iteration], p, (label,)))
            which.append(i)
    result = [{out: EMPTY} for _ in calls]
    for i, v in zip(which, lm.velocities(asks) if asks else [], strict=True):
        result[i] = {out: v[label]}
    return result


class BranchNode(_LMNode):
    def __init__(self, model, lm: BagelLM, ctx: NodeContext, label: str):
        super().__init__(model, lm, ctx)
        self.label = label
        self.names = {"cfg_text": ("kv_text", "meta_text", "v_text", "x_text"),
                      "cfg_img": ("kv_img", "meta_img", "v_img", "x_img")}[label]

    def _image_gen_cfg(self, calls):
        kv, meta, out, x = self.names
        for c in calls:
            self._take(c, kv, meta)
        return branch_velocities(self.lm, calls, self.label, out, x)


class CombineNode(NodeSubmodule):
    """Iteration i applies step i-1 (its velocities came from the branches) to the carried x and
    sends x_i to the branches that step i uses (``x_text``, ``x_img``: empty for a branch the
    step skips, so nothing crosses to it); after the last step it sends an empty x and stops."""

    max_batch = 64

    def __init__(self, model, ctx: NodeContext):
        self.device = ctx.device

    def forward(self, calls: list[NodeCall]) -> list[dict[str, torch.Tensor]]:
        out = []
        for c in calls:
            p, ts, dts = flow_of(c)
            # a branch group's velocities (and the first x, from the conductor) arrive in host memory
            # unless they crossed by CUDA IPC: all on this group's device
            x, i = c.inputs["x"].to(self.device, torch.float32), c.iteration
            if i > 0:
                s_text, s_img = p.scales(ts[i - 1])
                v = {k: c.inputs[k].to(self.device, torch.float32)
                     if c.inputs.get(k) is not None and c.inputs[k].numel() else None for k in ("v_cond", "v_text", "v_img")}
                x = x - cfg_combine(v["v_cond"], v["v_text"], v["v_img"], s_text, s_img, p.renorm, p.renorm_min) * dts[i - 1]
            uses = needed(p, ts[i]) if i < len(ts) else ()
            out.append({"x": EMPTY if i >= len(ts) else x, "latent": x,
                        "x_text": x if CFG_TEXT in uses else EMPTY, "x_img": x if CFG_IMG in uses else EMPTY})
        return out

    def check_stop(self, call: NodeCall, outputs: dict[str, torch.Tensor]) -> bool:
        return call.iteration >= len(flow_of(call)[1])
