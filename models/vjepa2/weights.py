"""Checkpoints: where they are, both layouts, and tiny random ones in the real layouts.

- Hugging Face (``facebook/vjepa2-vitl-fpc64-256``): ``config.json`` + ``model.safetensors``
  (or a sharded index); separate query/key/value, ``encoder.layer.N``, ``predictor.layer.N``,
  keys optionally under ``vjepa2.`` (the classification model); pooler / classifier ignored.
- Official ``.pt`` (``vitl.pt``, ``vjepa2-ac-vitg.pt``): a dict with ``encoder`` and ``predictor``
  state dicts, fused ``qkv``, keys possibly prefixed ``module.`` / ``backbone.``. Shapes are read
  from the tensors; head counts from ``config.json`` beside the file (our schema, see
  ``VJepa2Config.to_json``) or ``PRESET_HEADS``.

Our modules use the official names, so only the Hugging Face layout is renamed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from mstar.models.vjepa2.config import PRESET_HEADS, ACConfig, EncoderConfig, PredictorConfig, VJepa2Config
from mstar.models.vjepa2.modules import ACPredictor, Encoder, MaskedPredictor

#: tensors a checkpoint may hold that this model does not use
IGNORED = re.compile(r"^(pos_embed|predictor_pos_embed|pooler\..*|classifier\..*)$")


class CheckpointError(RuntimeError):
    pass


def resolve(name: str, cache_dir: str | None) -> Path:
    """A path (file or directory) as is; ``org/name`` in ``cache_dir`` (HF cache layout
    ``models--org--name/snapshots/*``, or a plain ``org/name`` directory); else a file name there."""
    p = Path(name).expanduser()
    if p.exists():
        return p
    cache = Path(cache_dir or "~/.cache/huggingface/hub").expanduser()
    looked = []
    if name.count("/") == 1:
        org, repo = name.split("/")
        hub = cache / f"models--{org}--{repo}"
        ref = hub / "refs" / "main"
        if hub.is_dir():
            snaps = sorted((hub / "snapshots").glob("*"))
            want = hub / "snapshots" / ref.read_text().strip() if ref.is_file() else None
            if want is not None and want.is_dir():
                return want
            if snaps:
                return snaps[-1]
        looked.append(str(hub))
    if (cache / name).exists():
        return cache / name
    looked.append(str(cache / name))
    raise CheckpointError(f"checkpoint {name!r} not found (looked in {', '.join(looked)}); nothing is downloaded")


@dataclass
class Loaded:
    config: VJepa2Config
    encoder: dict[str, torch.Tensor]
    predictor: dict[str, torch.Tensor] | None
    ac: dict[str, torch.Tensor] | None


def _strip(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in sd.items():
        while k.startswith(("module.", "backbone.")):
            k = k.partition(".")[2]
        out[k] = v
    return out


def _count(sd, prefix: str) -> int:
    return len({k.split(".")[1] for k in sd if k.startswith(prefix + ".")})


def _heads(dim: int, where: str, given: int | None) -> int:
    if given:
        return given
    if dim not in PRESET_HEADS:
        raise CheckpointError(f"{where}: width {dim} has no preset head count; put a config.json beside the "
                              f"checkpoint (format mstar-vjepa2)")
    return PRESET_HEADS[dim]


def _read_pt(path: Path) -> Loaded:
    raw = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(raw, dict) or "encoder" not in raw:
        raise CheckpointError(f"{path}: not an official V-JEPA 2 checkpoint (no 'encoder' state dict; "
                              f"keys: {list(raw)[:8] if isinstance(raw, dict) else type(raw).__name__})")
    enc, pred = _strip(raw["encoder"]), _strip(raw.get("predictor") or {})
    side = path.parent / "config.json"
    given = VJepa2Config.from_json(json.loads(side.read_text())) if side.is_file() else None
    try:
        w = enc["patch_embed.proj.weight"]
        dim = w.shape[0]
        base = given.encoder if given else EncoderConfig()
        ecfg = replace(base, dim=dim, depth=_count(enc, "blocks"), heads=_heads(dim, "encoder", given and base.heads),
                       mlp_dim=enc["blocks.0.mlp.fc1.weight"].shape[0], patch=w.shape[3], tubelet=w.shape[2],
                       in_chans=w.shape[1])
        pcfg = acfg = None
        if "action_encoder.weight" in pred:
            d = pred["predictor_embed.weight"].shape[0]
            base_ac = given.ac if given and given.ac else ACConfig()
            acfg = replace(base_ac, dim=d, depth=_count(pred, "predictor_blocks"),
                           heads=_heads(d, "ac_predictor", given and given.ac and base_ac.heads),
                           mlp_dim=pred["predictor_blocks.0.mlp.fc1.weight"].shape[0],
                           action_dim=pred["action_encoder.weight"].shape[1])
        elif pred:
            d = pred["predictor_embed.weight"].shape[0]
            base_p = given.predictor if given and given.predictor else PredictorConfig()
            pcfg = replace(base_p, dim=d, depth=_count(pred, "predictor_blocks"),
                           heads=_heads(d, "predictor", given and given.predictor and base_p.heads),
                           mlp_dim=pred["predictor_blocks.0.mlp.fc1.weight"].shape[0],
                           num_mask_tokens=_count(pred, "mask_tokens"))
            tokens = [pred.pop(f"mask_tokens.{i}") for i in range(pcfg.num_mask_tokens)]
            pred["mask_tokens"] = torch.cat([t.reshape(1, -1) for t in tokens])
    except KeyError as e:
        raise CheckpointError(f"{path}: missing tensor {e.args[0]!r}") from None
    return Loaded(VJepa2Config(ecfg, pcfg, acfg), enc, pred if pcfg else None, pred if acfg else None)


_HF_BLOCK = {"norm1": "norm1", "norm2": "norm2", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2", "attention.proj": "attn.proj"}


def _hf_blocks(sd: dict[str, torch.Tensor], src: str, dst: str, out: dict[str, torch.Tensor]) -> None:
    n = len({k.split(".")[2] for k in sd if k.startswith(src + ".layer.")})
    for i in range(n):
        s, d = f"{src}.layer.{i}", f"{dst}.{i}"
        for a, b in _HF_BLOCK.items():
            for p in ("weight", "bias"):
                if f"{s}.{a}.{p}" in sd:
                    out[f"{d}.{b}.{p}"] = sd[f"{s}.{a}.{p}"]
        for p in ("weight", "bias"):
            parts = [sd.get(f"{s}.attention.{x}.{p}") for x in ("query", "key", "value")]
            if all(t is not None for t in parts):
                out[f"{d}.attn.qkv.{p}"] = torch.cat(parts)  # type: ignore[arg-type]


def _read_hf(directory: Path) -> Loaded:
    from safetensors.torch import load_file

    cfg = VJepa2Config.from_hf(json.loads((directory / "config.json").read_text()))
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        if not (directory / f).is_file():
            raise CheckpointError(f"{directory}: missing weights file {f}")
        sd.update(load_file(str(directory / f)))
    return from_hf(sd, cfg)


def from_hf(sd: dict[str, torch.Tensor], cfg: VJepa2Config) -> Loaded:
    """A Hugging Face state dict (``VJEPA2Model`` / ``VJEPA2ForVideoClassification``) in our names."""
    sd = {k.removeprefix("vjepa2."): v for k, v in sd.items()}
    enc: dict[str, torch.Tensor] = {}
    for p in ("weight", "bias"):
        for a, b in (("encoder.embeddings.patch_embeddings.proj", "patch_embed.proj"), ("encoder.layernorm", "norm")):
            if f"{a}.{p}" in sd:
                enc[f"{b}.{p}"] = sd[f"{a}.{p}"]
    _hf_blocks(sd, "encoder", "blocks", enc)
    pred: dict[str, torch.Tensor] = {}
    for p in ("weight", "bias"):
        for a, b in (("predictor.embeddings.predictor_embeddings", "predictor_embed"),
                     ("predictor.layernorm", "predictor_norm"), ("predictor.proj", "predictor_proj")):
            if f"{a}.{p}" in sd:
                pred[f"{b}.{p}"] = sd[f"{a}.{p}"]
    if "predictor.embeddings.mask_tokens" in sd:
        mt = sd["predictor.embeddings.mask_tokens"]
        pred["mask_tokens"] = mt.reshape(mt.shape[0], -1)
    _hf_blocks(sd, "predictor", "predictor_blocks", pred)
    return Loaded(cfg if pred else replace(cfg, predictor=None), enc, pred or None, None)


def read(path: Path) -> Loaded:
    """The tensors and shapes of a checkpoint in either layout (a directory or a ``.pt`` file)."""
    if path.is_dir():
        if (path / "config.json").is_file() and any(path.glob("*.safetensors*")):
            return _read_hf(path)
        pts = sorted(path.glob("*.pt")) + sorted(path.glob("*.pth*"))
        if len(pts) == 1:
            return _read_pt(pts[0])
        raise CheckpointError(f"{path}: neither a Hugging Face checkpoint (config.json + *.safetensors) nor a "
                              f"directory with one .pt file (found {[p.name for p in pts]})")
    return _read_pt(path)


def load_into(module: torch.nn.Module, sd: dict[str, torch.Tensor], what: str) -> None:
    """Strict by name, but a checkpoint's unused extras (``IGNORED``) pass; missing tensors are
    reported by name."""
    want = module.state_dict()
    missing = sorted(set(want) - set(sd))
    if missing:
        raise CheckpointError(f"{what}: {len(missing)} tensors missing from the checkpoint: {', '.join(missing[:12])}"
                              + (" ..." if len(missing) > 12 else ""))
    extra = sorted(k for k in set(sd) - set(want) if not IGNORED.match(k) and not k.startswith("extrinsics_encoder."))
    if extra:
        raise CheckpointError(f"{what}: unexpected tensors {', '.join(extra[:12])}")
    for k, t in want.items():
        if sd[k].shape != t.shape:
            raise CheckpointError(f"{what}: tensor {k} has shape {list(sd[k].shape)}, the config wants {list(t.shape)}")
    module.load_state_dict({k: sd[k] for k in want}, strict=True)


def build(loaded: Loaded, device="cpu", dtype=torch.float32):
    """(encoder, masked predictor or None, AC predictor or None), in eval mode."""
    cfg = loaded.config
    enc = Encoder(cfg.encoder)
    load_into(enc, loaded.encoder, "encoder")
    pred = ac = None
    if cfg.predictor is not None and loaded.predictor is not None:
        pred = MaskedPredictor(cfg.predictor, cfg.encoder)
        load_into(pred, loaded.predictor, "predictor")
    if cfg.ac is not None and loaded.ac is not None:
        ac = ACPredictor(cfg.ac, cfg.encoder, use_extrinsics=False)
        load_into(ac, loaded.ac, "ac_predictor")
    return tuple(None if m is None else m.to(device=device, dtype=dtype).eval() for m in (enc, pred, ac))


# -- tiny random checkpoints in the real layouts ------------------------------------------------

def random_state(module: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic random tensors for every parameter (norms near 1, weights ~ 1/sqrt(fan_in),
    biases and mask tokens non-zero: a loader that dropped any of them would show)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in sorted(module.state_dict().items()):
        r = torch.randn(t.shape, generator=g)
        if "norm" in name and name.endswith("weight"):
            r = 1.0 + 0.1 * r
        elif name.endswith("bias"):
            r = 0.1 * r
        elif t.dim() >= 2 and "mask_tokens" not in name:
            r = r / t[0].numel() ** 0.5
        out[name] = r.contiguous()
    return out


def write_pt(path: Path, cfg: VJepa2Config, encoder: dict, predictor: dict, prefix: str = "module.backbone.") -> None:
    """The official layout: ``{"encoder": ..., "predictor": ...}`` (mask tokens as ``mask_tokens.i``
    ``[1, 1, dim]``), every key under ``prefix``; ``config.json`` beside it."""
    pred = dict(predictor)
    if "mask_tokens" in pred:
        for i, row in enumerate(pred.pop("mask_tokens")):
            pred[f"mask_tokens.{i}"] = row.reshape(1, 1, -1).clone()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"encoder": {prefix + k: v for k, v in encoder.items()},
                "predictor": {prefix + k: v for k, v in pred.items()}, "epoch": 0}, path)
    (path.parent / "config.json").write_text(json.dumps(cfg.to_json(), indent=1))


def write_hf(directory: Path, cfg: VJepa2Config, encoder: dict, predictor: dict) -> None:
    """The Hugging Face layout (``VJEPA2Model``): separate query/key/value."""
    from safetensors.torch import save_file

    assert cfg.predictor is not None
    e, p = cfg.encoder, cfg.predictor
    sd: dict[str, torch.Tensor] = {}
    for src, prefix, blocks in ((encoder, "encoder", "blocks"), (predictor, "predictor", "predictor_blocks")):
        for k, v in src.items():
            m = re.match(rf"{blocks}\.(\d+)\.(.*)", k)
            if m is None:
                continue
            i, rest = m.groups()
            base = f"{prefix}.layer.{i}."
            if rest.startswith("attn.qkv."):
                for name, part in zip(("query", "key", "value"), v.chunk(3), strict=True):
                    sd[base + f"attention.{name}.{rest.rsplit('.', 1)[1]}"] = part.clone()
            else:
                sd[base + rest.replace("attn.proj", "attention.proj")] = v
    for p_ in ("weight", "bias"):
        sd[f"encoder.embeddings.patch_embeddings.proj.{p_}"] = encoder[f"patch_embed.proj.{p_}"]
        sd[f"encoder.layernorm.{p_}"] = encoder[f"norm.{p_}"]
        sd[f"predictor.embeddings.predictor_embeddings.{p_}"] = predictor[f"predictor_embed.{p_}"]
        sd[f"predictor.layernorm.{p_}"] = predictor[f"predictor_norm.{p_}"]
        sd[f"predictor.proj.{p_}"] = predictor[f"predictor_proj.{p_}"]
    sd["predictor.embeddings.mask_tokens"] = predictor["mask_tokens"].reshape(p.num_mask_tokens, 1, 1, -1)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(directory / "model.safetensors"))
    hf = {"model_type": "vjepa2", "architectures": ["VJEPA2Model"], "hidden_size": e.dim, "num_hidden_layers": e.depth,
          "num_attention_heads": e.heads, "mlp_ratio": e.mlp_dim / e.dim, "patch_size": e.patch,
          "tubelet_size": e.tubelet, "crop_size": e.crop, "frames_per_clip": e.frames, "in_chans": e.in_chans,
          "layer_norm_eps": e.eps, "pred_hidden_size": p.dim, "pred_num_hidden_layers": p.depth,
          "pred_num_attention_heads": p.heads, "pred_mlp_ratio": p.mlp_dim / p.dim,
          "pred_num_mask_tokens": p.num_mask_tokens, "qkv_bias": True, "hidden_act": "gelu"}
    (directory / "config.json").write_text(json.dumps(hf, indent=1))


def write_random(target: Path, cfg: VJepa2Config, layout: str, seed: int = 0) -> None:
    """A random checkpoint of ``cfg``: ``layout`` "hf" (a directory; encoder + masked predictor)
    or "pt" (a ``.pt`` file; encoder + the masked or the AC predictor)."""
    enc = random_state(Encoder(cfg.encoder), seed)
    if cfg.ac is not None:
        pred = random_state(ACPredictor(cfg.ac, cfg.encoder, use_extrinsics=True), seed + 1)
    else:
        assert cfg.predictor is not None
        pred = random_state(MaskedPredictor(cfg.predictor, cfg.encoder), seed + 1)
    if layout == "hf":
        write_hf(target, cfg, enc, pred)
    else:
        write_pt(target, cfg, enc, pred)
