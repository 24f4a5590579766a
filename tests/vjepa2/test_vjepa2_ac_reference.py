"""The AC predictor, the cached rollout and CEM against outputs of the public reference code
(facebookresearch/vjepa2) on the same tiny checkpoint: data/ac_reference.safetensors, made as
data/README.md says. The reference recomputes the whole context every rollout step; ours feeds
each frame once through a K/V cache."""

from pathlib import Path

import pytest
import torch

from mstar.models.vjepa2 import cem, rollout, weights
from mstar.models.vjepa2.pose import new_pose

DATA = Path(__file__).resolve().parent / "data"  # this folder's reference outputs

P, E = 9, 32


@pytest.fixture(scope="module")
def ref():
    from safetensors.torch import load_file

    return load_file(str(DATA / "ac_reference.safetensors"))


@pytest.fixture(scope="module")
def model(ac_checkpoint, ref):
    raw = torch.load(ac_checkpoint, weights_only=True)
    checksum = [sum(float(v.double().abs().sum()) for v in raw[part].values()) for part in ("encoder", "predictor")]
    # the checkpoint is regenerated from its seed: it must be the one the reference ran
    torch.testing.assert_close(torch.tensor(checksum, dtype=torch.float64), ref["checksum"], rtol=1e-12, atol=0)
    enc, pred, ac = weights.build(weights.read(ac_checkpoint))
    assert pred is None and ac is not None
    return enc, ac


def encode_frames(enc, images):
    """Robot frames one at a time, each doubled into one tubelet, layer-normed without affine."""
    with torch.no_grad():
        tokens = enc(images.unsqueeze(2))  # [T, C, 1, H, W]: a single frame is repeated into a tubelet
    return rollout.normalize(tokens)


def test_encoder_frames_match_reference(model, ref):
    enc, _ = model
    got = encode_frames(enc, ref["images"][:3]).reshape(1, 3 * P, E)
    torch.testing.assert_close(got, ref["reps"], atol=1e-5, rtol=0)


def test_forward_over_three_frames_matches_reference(model, ref):
    _, ac = model
    with torch.no_grad():
        got = ac(ref["reps"], ref["actions"][:, :3], ref["states"])
    torch.testing.assert_close(got, ref["forward3"], atol=1e-5, rtol=0)


def test_frame_causality_and_cached_steps_equal_the_full_forward(model, ref):
    _, ac = model
    reps, actions, states = ref["reps"], ref["actions"][:, :3], ref["states"]
    with torch.no_grad():
        full = ac(reps, actions, states)
        bumped = reps.clone()
        bumped[:, 2 * P:] += 1.0
        moved = ac(bumped, actions, states)
        later = actions.clone()
        later[:, 2] += 0.5
        acted = ac(reps, later, states)
        cache = ac.new_cache(1, 3)
        steps = [ac.step(reps[:, t * P:(t + 1) * P], actions[:, t], states[:, t], cache, t) for t in range(3)]
    assert torch.equal(moved[:, :2 * P], full[:, :2 * P])  # frames 0, 1 never see frame 2
    assert not torch.allclose(moved[:, 2 * P:], full[:, 2 * P:])
    # nor its action token (equal up to CPU SDPA rounding: a leak would move them by ~0.1)
    torch.testing.assert_close(acted[:, :2 * P], full[:, :2 * P], atol=1e-5, rtol=0)
    assert (acted[:, 2 * P:] - full[:, 2 * P:]).abs().max() > 1e-2
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=0)


def test_cached_rollout_matches_the_reference_recompute_loop(model, ref):
    _, ac = model
    context = ref["reps"][:, :2 * P].view(1, 2, P, E)
    with torch.no_grad():
        frames, poses = rollout.rollout(ac, context, ref["actions"][:, :7], ref["states"][:, :2])
    assert frames.shape == (1, 6, P, E) and poses.shape == (1, 6, 7)
    for h in range(6):  # every predicted frame
        torch.testing.assert_close(frames[0, h], ref["rollout_frames"][h], atol=1e-4, rtol=0, msg=f"frame {h}")
    torch.testing.assert_close(poses[0], ref["rollout_poses"], atol=1e-6, rtol=0)


def test_pose_update_matches_scipy_on_its_own():
    """Rotations composed in xyz-Euler, gripper clipped to [0, 1]; expected values printed by the
    reference's compute_new_pose (scipy) for these inputs, the second wrapping past pi."""
    pose = torch.tensor([[0.1, -0.2, 0.3, 0.4, -0.5, 0.6, 0.9], [0.0, 0.0, 0.0, 3.0, 1.2, -2.9, 0.1]])
    action = torch.tensor([[0.01, 0.02, -0.03, 0.2, 0.1, -0.3, 0.4], [0.0, 0.0, 0.0, 0.5, 0.3, 0.4, -0.3]])
    want = torch.tensor([[0.1099999994, -0.1800000072, 0.2700000107, 0.6550981402, -0.5157243013, 0.1653817445, 1.0],
                         [0.0, 0.0, 0.0, 2.1675949097, 0.7996925712, 2.9806368351, 0.0]])
    torch.testing.assert_close(new_pose(pose, action), want, atol=1e-6, rtol=0)


def test_cem_energies_topk_and_plan_match_reference(model, ref):
    _, ac = model
    cfg = cem.CEMConfig(rollout=2, samples=16, topk=4, cem_steps=3)
    context = ref["reps"][:, :P]
    state = ref["states"][:, 0]

    def world_model(actions):  # every sample rolled from the one context frame
        S = actions.shape[0]
        with torch.no_grad():
            frames, _ = rollout.rollout(ac, context.view(1, 1, P, E).expand(S, -1, -1, -1), actions,
                                        state.unsqueeze(1).expand(S, -1, -1))
        return frames[:, -1]

    trace: list = []
    plan = cem.plan(cfg, world_model, ref["goal"].view(P, E), noise=ref["cem_noise"], trace=trace)
    for it, (energies, top) in enumerate(trace):
        torch.testing.assert_close(energies, ref["cem_energies"][it], atol=1e-5, rtol=0)
        assert torch.equal(top, ref["cem_topk"][it]), it
    torch.testing.assert_close(plan, ref["cem_plan"], atol=1e-5, rtol=0)


def test_rollouts_at_different_frames_batch_into_one_step(model, ref):
    """Requests in one served batch sit at different frames of their own rollouts: one batched
    step (attention per request) gives each what its own step gives."""
    _, ac = model
    reps, acts, states = ref["reps"].view(1, 3, P, E), ref["actions"], ref["states"]

    def fresh():
        a = rollout.start(ac, reps[:, :2], acts, states[:, :2], 3)  # at frame 1 of 4
        b = rollout.start(ac, reps[:, 2:].expand(2, -1, -1, -1), acts.expand(2, -1, -1), states[:, 2:].expand(2, -1, -1), 4)
        rollout.advance(ac, b, acts[:, 3].expand(2, -1))  # now at frame 1 of 4, its own history
        rollout.advance(ac, b, acts[:, 4].expand(2, -1))  # frame 2
        return a, b

    with torch.no_grad():
        a, b = fresh()
        one = [rollout.advance(ac, a, acts[:, 1]), rollout.advance(ac, b, acts[:, 5].expand(2, -1))]
        a, b = fresh()
        both = rollout.advance_many(ac, [a, b], [acts[:, 1], acts[:, 5].expand(2, -1)])
    for (f1, p1), (f2, p2) in zip(one, both, strict=True):
        torch.testing.assert_close(f2, f1, atol=1e-5, rtol=0)
        torch.testing.assert_close(p2, p1, atol=0, rtol=0)
    assert (a.t, b.t) == (2, 3)
