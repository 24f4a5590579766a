"""The end-effector pose update after each rollout step, on the device (no host round trip).

A pose and an action are 7 numbers: xyz, xyz-Euler angles (extrinsic, radians), gripper. The new
pose adds xyz, composes the rotations (R_action @ R_pose, back to xyz-Euler) and clips the gripper
sum to [0, 1], as the reference's ``compute_new_pose`` does with scipy. The angles are computed
in float64 (as scipy does) and the result cast back to the pose's dtype.
"""

from __future__ import annotations

import torch


def euler_xyz_to_matrix(angles: torch.Tensor) -> torch.Tensor:
    """Extrinsic x, then y, then z: R = Rz(c) @ Ry(b) @ Rx(a). ``[..., 3]`` -> ``[..., 3, 3]``."""
    a, b, c = angles.unbind(-1)
    ca, sa, cb, sb, cc, sc = a.cos(), a.sin(), b.cos(), b.sin(), c.cos(), c.sin()
    rows = [
        cc * cb, cc * sb * sa - sc * ca, cc * sb * ca + sc * sa,
        sc * cb, sc * sb * sa + cc * ca, sc * sb * ca - cc * sa,
        -sb, cb * sa, cb * ca,
    ]
    return torch.stack(rows, -1).unflatten(-1, (3, 3))


def matrix_to_euler_xyz(m: torch.Tensor) -> torch.Tensor:
    """The inverse of ``euler_xyz_to_matrix`` with b in [-pi/2, pi/2] (scipy's range)."""
    b = torch.asin((-m[..., 2, 0]).clamp(-1.0, 1.0))
    a = torch.atan2(m[..., 2, 1], m[..., 2, 2])
    c = torch.atan2(m[..., 1, 0], m[..., 0, 0])
    return torch.stack([a, b, c], -1)


def new_pose(pose: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """``[..., 7]`` pose and action -> the pose after the action."""
    xyz = pose[..., :3] + action[..., :3]
    rot = euler_xyz_to_matrix(action[..., 3:6].double()) @ euler_xyz_to_matrix(pose[..., 3:6].double())
    angles = matrix_to_euler_xyz(rot).to(pose.dtype)
    grip = (pose[..., 6:] + action[..., 6:]).clamp(0.0, 1.0)
    return torch.cat([xyz, angles, grip], -1)
