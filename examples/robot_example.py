"""The SDK's robot calls against a running mesh: a policy (``mstar serve pi05 --random-weights``) or a
video world model (``mstar serve vjepa2 --random-weights``), over REST or gRPC; it asks the server
which one it serves.

    python examples/robot_example.py [--url http://127.0.0.1:8000 | grpc://127.0.0.1:50051]
"""

from __future__ import annotations

import argparse
import io

import numpy as np

from mstar import InvalidArgument, MStarClient


def camera_png(seed: int) -> bytes:
    """A stand-in camera frame (a robot sends its camera's PNG or JPEG bytes, or a path)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (224, 224, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def policy(client: MStarClient) -> None:
    images = {"base_0_rgb": camera_png(0), "left_wrist_0_rgb": camera_png(1)}  # a missing camera is masked
    state = [0.1, -0.3, 0.7, 0.0, 1.2, -1.1, 0.4, 0.25]  # the robot's state, in its own units
    actions = client.act("pick up the red cube", images=images, state=state, seed=0)
    print("actions:", actions.dtype, list(actions.shape))
    try:
        client.act("pick up the red cube", images=images, state=state[:3])
    except InvalidArgument as e:
        print("error:", f"InvalidArgument field={e.field}")


def world_model(client: MStarClient) -> None:
    frames = (np.random.default_rng(0).random((2, 64, 64, 3)) * 255).astype(np.uint8)  # uint8 [T, H, W, 3]
    print("latents:", list(client.encode(frames).shape))  # or a path / bytes of an mp4, webm, .npy
    move = [[0.01, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]] * 4  # xyz, xyz-Euler angles, gripper
    rollout = client.rollout(frames[:1], actions=move, states=[[0.0] * 7])
    print("rollout:", list(rollout.frames.shape), list(rollout.poses.shape))
    for step in client.rollout_stream(frames[:1], actions=move, states=[[0.0] * 7]):
        print(f"step {step.index}:", list(step.frame.shape), np.round(step.pose[:3], 3).tolist())
    plan = client.plan(frames[0], frames[1], state=[0.0] * 7, samples=16, topk=4, cem_steps=2, seed=0)
    print("plan:", list(plan.actions.shape), "energies", list(plan.energies.shape))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="http(s):// gateway or grpc(s):// conductor")
    args = p.parse_args()
    with MStarClient(args.url, timeout=60) as client:
        (model,) = client.models()
        print("model:", model.name)
        if model.name == "pi05":
            policy(client)
        elif model.name == "vjepa2":
            world_model(client)
        else:
            raise SystemExit(f"serve pi05 or vjepa2 for this example, not {model.name}")


if __name__ == "__main__":
    main()
