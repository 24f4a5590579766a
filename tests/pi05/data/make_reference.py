# ruff: noqa
"""Run openpi's PI0Pytorch (pi05=True) on M*'s tiny checkpoint and save its outputs (see README.md).
Run it outside this repository, in a venv with transformers 4.53.2 + openpi's transformers_replace,
with openpi's src/ at $OPENPI_SRC; the tests never import it."""
import sys, types, dataclasses, json
import os
sys.path.insert(0, os.environ.get("OPENPI_SRC", "src"))
import numpy as np
import torch

# openpi.models.gemma imports jax/flax; PI0Pytorch needs only its get_config (shapes)
@dataclasses.dataclass
class Config:
    width: int; depth: int; mlp_dim: int; num_heads: int; num_kv_heads: int; head_dim: int

ckpt = sys.argv[1]
out_path = sys.argv[2]
cfg = json.load(open(f"{ckpt}/config.json"))
P, E, V = cfg["paligemma_config"], cfg["action_expert_config"], cfg["vision_config"]
variants = {"tiny_prefix": Config(P["width"], P["depth"], P["mlp"], P["heads"], P["kv_heads"], P["head_dim"]),
            "tiny_expert": Config(E["width"], E["depth"], E["mlp"], E["heads"], E["kv_heads"], E["head_dim"])}
gemma_stub = types.ModuleType("openpi.models.gemma")
gemma_stub.get_config = lambda name: variants[name]
sys.modules["openpi.models.gemma"] = gemma_stub
import openpi.models  # noqa: E402
openpi.models.gemma = gemma_stub
sys.modules["openpi.models_pytorch.preprocessing_pytorch"] = types.ModuleType("openpi.models_pytorch.preprocessing_pytorch")

import openpi.models_pytorch.gemma_pytorch as gp  # noqa: E402
from openpi.models_pytorch.pi0_pytorch import PI0Pytorch  # noqa: E402

# shrink the hard-coded So400m vision tower and the 257152-token vocabulary to the checkpoint's
_Pali, _Gemma = gp.PaliGemmaForConditionalGeneration, gp.GemmaForCausalLM
def pali(config):
    vc = config.vision_config
    vc.hidden_size, vc.num_hidden_layers, vc.num_attention_heads = V["hidden"], V["layers"], V["heads"]
    vc.intermediate_size, vc.image_size, vc.patch_size = V["mlp"], V["image_size"], V["patch"]
    vc.projection_dim = P["width"]
    config.text_config.vocab_size = cfg["vocab_size"]
    return _Pali(config=config)
def expert(config):
    config.vocab_size = cfg["vocab_size"]
    return _Gemma(config=config)
gp.PaliGemmaForConditionalGeneration, gp.GemmaForCausalLM = pali, expert

mc = types.SimpleNamespace(pi05=True, paligemma_variant="tiny_prefix", action_expert_variant="tiny_expert",
                           dtype="float32", action_dim=cfg["max_action_dim"], action_horizon=cfg["chunk_size"],
                           pytorch_compile_mode=None)
model = PI0Pytorch(mc).eval()
from safetensors.torch import load_file  # noqa: E402
sd = load_file(f"{ckpt}/model.safetensors")
missing, unexpected = model.load_state_dict(sd, strict=False)
print("missing", missing, "unexpected", unexpected)
assert set(missing) <= {"paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"} and not unexpected
pg = model.paligemma_with_expert.paligemma
assert pg.model.language_model.embed_tokens.weight.data_ptr() == pg.lm_head.weight.data_ptr()  # tied

# inputs: a batch of 2; request 1 has no right-wrist camera and a shorter prompt
g = torch.Generator().manual_seed(1234)
B, S, L, H = 2, V["image_size"], cfg["tokenizer_max_length"], cfg["chunk_size"]
images = torch.randint(0, 256, (B, 3, 3, S, S), generator=g, dtype=torch.uint8)
image_mask = torch.tensor([[True, True, True], [True, True, False]])
lengths = [20, 33]
tokens = torch.randint(4, cfg["vocab_size"], (B, L), generator=g)
token_mask = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
tokens = tokens * token_mask
noise = torch.randn(B, H, cfg["max_action_dim"], generator=g)
pixels = images.float() / 255.0 * 2.0 - 1.0
model._preprocess_observation = lambda obs, train: ([pixels[:, c] for c in range(3)], [image_mask[:, c] for c in range(3)],
                                                    tokens, token_mask, None)
captured = {"times": [], "v": []}
_fwd = model.paligemma_with_expert.forward
def fwd(*a, **kw):
    out = _fwd(*a, **kw)
    if kw["inputs_embeds"][1] is None:
        captured["kv"] = out[1]
    return out
model.paligemma_with_expert.forward = fwd
_den = model.denoise_step
def den(state, prefix_pad_masks, pkv, x_t, timestep):
    v = _den(state, prefix_pad_masks, pkv, x_t, timestep)
    captured["times"].append(float(timestep[0])); captured["v"].append(v.clone())
    captured["prefix_valid"] = prefix_pad_masks
    return v
model.denoise_step = den
obs = types.SimpleNamespace(state=torch.zeros(B, 32))
with torch.no_grad():
    actions = model.sample_actions(torch.device("cpu"), obs, noise=noise.clone(), num_steps=cfg["num_inference_steps"])
    # the time embedding / time MLP and the first expert layer's adaRMS on a fixed input
    t = torch.tensor(captured["times"], dtype=torch.float32)
    from openpi.models_pytorch.pi0_pytorch import create_sinusoidal_pos_embedding
    temb = create_sinusoidal_pos_embedding(t, E["width"], min_period=4e-3, max_period=4.0, device=t.device).float()
    cond = torch.nn.functional.silu(model.time_mlp_out(torch.nn.functional.silu(model.time_mlp_in(temb))))
    x_norm = torch.randn(B, H, E["width"], generator=g)
    normed, gate = model.paligemma_with_expert.gemma_expert.model.layers[0].input_layernorm(x_norm, cond=cond[:B])

valid = captured["prefix_valid"]
kv = torch.stack([torch.stack([captured["kv"][l][0], captured["kv"][l][1]]) for l in range(P["depth"])])  # [L,2,B,1,P,D]
np.savez_compressed(out_path,
    image_checksum=np.int64(images.long().sum()), token_checksum=np.int64(tokens.sum()),
    noise=noise.numpy(), times=t.numpy(),
    kv_valid_b0=kv[:, :, 0, :, valid[0]].numpy(), kv_valid_b1=kv[:, :, 1, :, valid[1]].numpy(),
    velocity0=captured["v"][0].numpy(), actions=actions.numpy(),
    time_embedding=temb.numpy(), time_cond=cond.numpy(), adarms_x=x_norm.numpy(),
    adarms_out=normed.numpy(), adarms_gate=gate.numpy())
print("steps", len(captured["times"]), captured["times"])
print("actions", actions.shape, float(actions.abs().mean()), "v0", float(captured["v"][0].abs().mean()))
