"""π0.5 checkpoints: openpi ``PI0Pytorch`` tensor names in one safetensors file, read into the
three node modules, and tiny random ones written in that layout.

Accepted spellings of a name (all mapped to the canonical one below): a leading ``model.`` (lerobot's
``PI05Policy`` wraps the network in ``model``); the PaliGemma parts under ``paligemma.model.*``
(transformers >= 4.52) or ``paligemma.*`` / ``paligemma.language_model.model.*`` (older); SigLIP under
``vision_tower.vision_model.*`` or ``vision_tower.*``. ``embed_tokens`` is usually absent: it is tied to
the PaliGemma ``lm_head``. The expert's ``lm_head`` is present and unused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from mstar.models.pi05.config import Pi05Config
from mstar.models.pi05.layers import rope_inv_freq
from mstar.models.pi05.policy import ActionExpert, Pi05, PrefixLM, VisionTower
from mstar.services.engines.layers import fuse_projections

WEIGHTS_FILE = "model.safetensors"
PG = "paligemma_with_expert.paligemma."
EXPERT = "paligemma_with_expert.gemma_expert."
LM_HEAD = PG + "lm_head.weight"
EMBED = PG + "model.language_model.embed_tokens.weight"

# module -> (its parameter-name prefix, the canonical checkpoint prefix)
PREFIXES: dict[type[nn.Module], tuple[tuple[str, str], ...]] = {
    VisionTower: (("vision.", PG + "model.vision_tower.vision_model."),
                  ("projector.", PG + "model.multi_modal_projector.linear.")),
    PrefixLM: (("layers.", PG + "model.language_model.layers."), ("embed_tokens.weight", EMBED)),
    ActionExpert: (("layers.", EXPERT + "model.layers."), ("norm.", EXPERT + "model.norm."), ("", "")),
}


class WeightsError(Exception):
    """A checkpoint file or tensor is missing or misshapen; the message names it."""


def canonical(name: str) -> str:
    """A checkpoint tensor name in the canonical (transformers 4.53 ``PI0Pytorch``) spelling."""
    if name.startswith("model."):
        name = name[len("model."):]
    for old, new in ((PG + "language_model.model.", PG + "model.language_model."),
                     (PG + "language_model.", PG + "model.language_model."),
                     (PG + "vision_tower.", PG + "model.vision_tower."),
                     (PG + "multi_modal_projector.", PG + "model.multi_modal_projector.")):
        if name.startswith(old) and not name.startswith(new):
            name = new + name[len(old):]
            break
    tower = PG + "model.vision_tower."
    if name.startswith(tower) and not name.startswith(tower + "vision_model."):
        name = tower + "vision_model." + name[len(tower):]
    return name


def checkpoint_name(module: nn.Module, param: str) -> str:
    for ours, theirs in PREFIXES[type(module)]:
        if param.startswith(ours):
            return theirs + param[len(ours):]
    raise KeyError(param)


class CheckpointFile:
    """The tensors of one safetensors file, by canonical name (headers only until ``load``)."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        if not self.path.is_file():
            raise WeightsError(f"missing file {self.path}")
        with safe_open(self.path, "pt") as f:
            self.names = {canonical(n): n for n in f.keys()}

    def resolve(self, name: str) -> str:
        """The stored name of canonical ``name`` (the embedding falls back to the tied lm_head)."""
        if name in self.names:
            return self.names[name]
        if name == EMBED and LM_HEAD in self.names:
            return self.names[LM_HEAD]
        raise WeightsError(f"{self.path}: missing tensor {name!r}")

    def load(self, module: nn.Module, device: str | torch.device = "cpu") -> None:
        """Fill every parameter of a node module from the file (shapes checked, names reported)."""
        from safetensors import safe_open

        params = dict(module.named_parameters())
        stored = {p: self.resolve(checkpoint_name(module, p)) for p in params}
        with safe_open(self.path, "pt", device=str(device)) as f, torch.no_grad():
            for p, name in stored.items():
                t = f.get_tensor(name)
                if tuple(t.shape) != tuple(params[p].shape):
                    raise WeightsError(f"{self.path}: tensor {name!r} has shape {tuple(t.shape)}, expected "
                                       f"{tuple(params[p].shape)}")
                params[p].copy_(t)


def load_module(cls: type[nn.Module], cfg: Pi05Config, path: str | Path, device: str, dtype: torch.dtype) -> nn.Module:
    """A node module with its weights from ``path``, on ``device`` in ``dtype`` (the expert keeps its
    action projections in fp32 and tabulates its adaRMS modulation in fp32 first), its projections
    fused (``fuse_projections``)."""
    with torch.device("meta"):
        module = cls(cfg)
    module = module.to_empty(device=device)
    if isinstance(module, PrefixLM | ActionExpert):  # the non-persistent RoPE frequencies, rebuilt
        module.inv_freq = rope_inv_freq(cfg.prefix if isinstance(module, PrefixLM) else cfg.expert, device)
    CheckpointFile(path).load(module, device)
    if isinstance(module, ActionExpert):
        module.tabulate()
        _expert_dtypes(module, dtype)
    else:
        module.to(dtype)
    return fuse_projections(module.eval())


def layout(cfg: Pi05Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of a checkpoint in the real layout (canonical names) and its shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    with torch.device("meta"):
        for cls in (VisionTower, PrefixLM, ActionExpert):
            m = cls(cfg)
            shapes |= {checkpoint_name(m, p): tuple(t.shape) for p, t in m.named_parameters()}
    del shapes[EMBED]  # tied: the file holds the lm_head only
    shapes[LM_HEAD] = (cfg.vocab, cfg.prefix.width)
    shapes[PG + "model.language_model.norm.weight"] = (cfg.prefix.width,)
    shapes[EXPERT + "lm_head.weight"] = (cfg.vocab, cfg.expert.width)
    return dict(sorted(shapes.items()))


def _scaled(name: str, x: torch.Tensor) -> torch.Tensor:
    """Standard-normal ``x`` scaled for tensor ``name`` so activations stay O(1): fan-in scaling; norm
    weights and the adaRMS modulation away from their init, so a loader that ignored them would not match."""
    shape = x.shape
    if name.endswith("layernorm.weight") and "vision" in name:
        return 1.0 + 0.1 * x  # LayerNorm gains
    if name.endswith(("layernorm.weight", "norm.weight")) or name.endswith(".bias"):
        return 0.1 * x  # Gemma's (1 + w) gains, biases
    if ".dense.weight" in name:
        return x * 0.5 / shape[1] ** 0.5  # adaRMS: scale / shift / gate of order 0.5
    if name.endswith("position_embedding.weight"):
        return 0.5 * x
    if len(shape) == 4:
        return x / (shape[1] * shape[2] * shape[3]) ** 0.5
    if len(shape) == 2:
        return x / shape[1] ** 0.5
    return x


def random_tensors(cfg: Pi05Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights for every tensor of ``layout(cfg)``; deterministic for a seed on a CPU."""
    g = torch.Generator().manual_seed(seed)
    return {name: _scaled(name, torch.randn(shape, generator=g)).contiguous() for name, shape in layout(cfg).items()}


def random_policy(cfg: Pi05Config, device: str, dtype: torch.dtype, seed: int = 0) -> Pi05:
    """A whole policy with random weights made on ``device`` (the full-size benchmark: no file)."""
    with torch.device("meta"):
        policy = Pi05(cfg)
    policy = policy.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for module in (policy.vision, policy.prefix, policy.expert):
            for p, t in module.named_parameters():
                t.copy_(_scaled(checkpoint_name(module, p), torch.randn(t.shape, generator=g, device=device)))
    policy.prefix.inv_freq = rope_inv_freq(cfg.prefix, device)
    policy.expert.inv_freq = rope_inv_freq(cfg.expert, device)
    policy.expert.tabulate()
    policy.vision.to(dtype), policy.prefix.to(dtype)
    _expert_dtypes(policy.expert, dtype)
    return fuse_projections(policy.eval())


def _expert_dtypes(expert: ActionExpert, dtype: torch.dtype) -> None:
    """The expert in ``dtype``, its action projections and adaRMS table in fp32 (as the reference)."""
    modulation = expert.modulation.float()
    expert.to(dtype)
    for lin in (expert.action_in_proj, expert.action_out_proj):
        lin.float()
    expert.modulation = modulation


def write_checkpoint(directory: str | Path, cfg: Pi05Config, seed: int = 0, prefix: str = "",
                     dtype: torch.dtype = torch.float32) -> Path:
    """``model.safetensors`` (names prefixed by ``prefix``, e.g. ``model.``; tensors in ``dtype``) and
    ``config.json``."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({prefix + k: v.to(dtype) for k, v in random_tensors(cfg, seed).items()}, str(directory / WEIGHTS_FILE))
    (directory / "config.json").write_text(json.dumps(cfg.to_json(), indent=1))
    return directory


def load_policy(directory: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Pi05:
    """The whole policy from a checkpoint directory (tests, benchmarks; serving loads per node)."""
    from mstar.models.pi05.config import config_from_json

    directory = Path(directory)
    cfg = config_from_json(json.loads((directory / "config.json").read_text()))
    with torch.device("meta"):
        policy = Pi05(cfg)
    path = directory / WEIGHTS_FILE
    policy.vision, policy.prefix, policy.expert = (load_module(c, cfg, path, device, dtype)
                                                   for c in (VisionTower, PrefixLM, ActionExpert))
    return policy
