"""π0.5 against openpi's own PyTorch implementation (``PI0Pytorch``, pi05=True), run outside this
repository on the same tiny checkpoint (the one ``write_random_weights`` writes: seed 0) and the same
inputs and noise (seed 1234); its outputs are in data/openpi_pi05_tiny.npz (how: data/README.md).

fp32 on a CPU: prefix K / V and the first step's velocity atol 1e-5, actions after 10 steps 1e-4. The
flow time is openpi's: t accumulated in fp32 (1.0, 0.9, 0.8000001, ...)."""

from pathlib import Path

import numpy as np
import pytest
import torch

from mstar.models.pi05.layers import euler_times, time_embedding
from mstar.models.pi05.policy import pixels_from_uint8

DATA = Path(__file__).parent / "data" / "openpi_pi05_tiny.npz"


@pytest.fixture(scope="module")
def ref():
    return dict(np.load(DATA))


@pytest.fixture(scope="module")
def inputs(policy, ref):
    """The reference run's inputs: a batch of 2; request 1 without its right-wrist camera and with a
    shorter prompt (padding and a masked camera inside the batch)."""
    cfg = policy.cfg
    g = torch.Generator().manual_seed(1234)
    b, s, n = 2, cfg.vision.image_size, cfg.max_token_len
    images = torch.randint(0, 256, (b, 3, 3, s, s), generator=g, dtype=torch.uint8)
    image_mask = torch.tensor([[True, True, True], [True, True, False]])
    token_mask = torch.arange(n)[None, :] < torch.tensor([20, 33])[:, None]
    tokens = torch.randint(4, cfg.vocab, (b, n), generator=g) * token_mask
    noise = torch.randn(b, cfg.action_horizon, cfg.action_dim, generator=g)
    adarms_x = torch.randn(b, cfg.action_horizon, cfg.expert.width, generator=g)
    # the same draws as the reference's (a torch upgrade that changed them would fail here, not later)
    assert int(images.long().sum()) == ref["image_checksum"] and int(tokens.sum()) == ref["token_checksum"]
    torch.testing.assert_close(noise, torch.from_numpy(ref["noise"]), atol=0, rtol=0)
    return pixels_from_uint8(images, torch.float32), image_mask, tokens, token_mask, noise, adarms_x


@pytest.fixture(scope="module")
def prefix(policy, inputs):
    pixels, image_mask, tokens, token_mask, _, _ = inputs
    with torch.no_grad():
        return policy.prefix(policy.embed_images(pixels, image_mask), image_mask, tokens, token_mask)


def test_flow_times_are_openpis(ref):
    assert euler_times(10) == ref["times"].tolist()


def test_time_embedding_and_time_mlp(policy, ref):
    t = torch.from_numpy(ref["times"])
    torch.testing.assert_close(time_embedding(t, policy.cfg.expert.width, 4e-3, 4.0), torch.from_numpy(ref["time_embedding"]),
                               atol=1e-6, rtol=0)
    # the tabulated adaRMS modulation of step i = the first norm's dense of the reference's time condition at t_i
    dense = policy.expert.layers[0].input_layernorm.dense
    with torch.no_grad():
        want = dense(torch.from_numpy(ref["time_cond"]))
    torch.testing.assert_close(policy.expert.modulation[:, 0], want, atol=1e-5, rtol=0)


def test_adarms(policy, ref, inputs):
    norm = policy.expert.layers[0].input_layernorm
    with torch.no_grad():
        out, gate = norm(inputs[5], norm.dense(torch.from_numpy(ref["time_cond"][:2])))
    torch.testing.assert_close(out, torch.from_numpy(ref["adarms_out"]), atol=1e-5, rtol=0)
    torch.testing.assert_close(gate, torch.from_numpy(ref["adarms_gate"]), atol=1e-6, rtol=0)


def test_prefix_kv(prefix, ref):
    kv, valid = prefix
    assert valid.sum(1).tolist() == [3 * 16 + 20, 2 * 16 + 33]
    for b in range(2):
        want = torch.from_numpy(ref[f"kv_valid_b{b}"])  # [layers, 2, kv_heads, valid tokens, head_dim]
        assert want.abs().mean() > 0.1
        torch.testing.assert_close(kv[b][:, :, :, valid[b]], want, atol=1e-5, rtol=0)


def test_first_step_velocity_joint_attention(policy, prefix, inputs, ref):
    with torch.no_grad():
        v = policy.expert.velocity(inputs[4], *prefix, 0)
    torch.testing.assert_close(v, torch.from_numpy(ref["velocity0"]), atol=1e-5, rtol=0)


def test_ten_step_flow(policy, inputs, ref):
    pixels, image_mask, tokens, token_mask, noise, _ = inputs
    actions = policy.sample_actions(pixels, image_mask, tokens, token_mask, noise)
    want = torch.from_numpy(ref["actions"])
    assert (actions - noise).abs().mean() > 0.1  # the flow moved the noise
    torch.testing.assert_close(actions, want, atol=1e-4, rtol=0)
