"""The SDK's robot helpers without a server: what act() sends on each transport, arrays as files,
pose rows, streamed steps paired by index, and a binary answer read back."""

import io

import numpy as np
import pytest

from mstar.client import InvalidArgument
from mstar.client.convert import act_rest_params, act_to_proto, tensor_from_headers
from mstar.client.robot import StepPairer, act_params, rows, video_file
from mstar.client.types import Chunk, Modality, Tensor


def test_act_params_become_an_actrequest_and_the_rest_form():
    p = act_params("pi05", "go", {"base_0_rgb": b"\x89PNG"}, np.float32([0.1, 2.0]), 7, 5.0, "r1")
    req = act_to_proto(p)
    assert (req.model, req.task, list(req.state), req.seed, req.request_id, req.timeout_s) == \
        ("pi05", "go", [np.float32(0.1), 2.0], 7, "r1", 5.0)
    assert [(i.name, i.data) for i in req.images] == [("base_0_rgb", b"\x89PNG")]
    assert not act_to_proto(act_params("pi05", "go", {}, [1.0], None, None, None)).HasField("seed")
    rest = act_rest_params(p)
    assert rest.text == "go" and rest.model_kwargs == {"state": list(p.state), "seed": 7}
    assert [f.name for f in rest.files] == ["base_0_rgb"]


@pytest.mark.parametrize("kw, field", [
    (dict(images=["cam.png"]), "images"), (dict(state=[[1.0, 2.0]]), "state"), (dict(state=["a"]), "state"),
    (dict(seed=-1), "seed"), (dict(seed=True), "seed"), (dict(task=3), "task")])
def test_act_params_refuse_what_the_server_would(kw, field):
    args = dict(task="go", images={}, state=[1.0], seed=None) | kw
    with pytest.raises(InvalidArgument) as e:
        act_params("pi05", args["task"], args["images"], args["state"], args["seed"], None, None)
    assert e.value.field == field


def test_arrays_travel_as_npy_and_rows_are_checked():
    arr = np.arange(24, dtype=np.uint8).reshape(1, 2, 4, 3)
    f = video_file("frames", arr)
    assert f.content_type == "application/x-npy" and np.array_equal(np.load(io.BytesIO(f.data)), arr)
    assert video_file("video", b"webm bytes").data == b"webm bytes"
    assert rows("state", [0.0] * 7) == [[0.0] * 7]
    for bad in ([0.0] * 6, [[float("nan")] * 7], []):
        with pytest.raises(InvalidArgument) as e:
            rows("actions", bad)
        assert e.value.field == "actions"


def _chunk(name: str, index: int, arr: np.ndarray) -> Chunk:
    return Chunk(name, Modality.LATENT, index, tensor=Tensor("FP32", arr.shape, arr.astype("<f4").tobytes()))


def test_streamed_frames_and_poses_pair_by_index_in_any_order():
    pairer = StepPairer()
    f0, f1, p0, p1 = np.ones((1, 4, 2)), np.zeros((1, 4, 2)), np.full((1, 7), 0.5), np.full((1, 7), 2.0)
    assert list(pairer.add(_chunk("frames", 0, f0))) == []
    assert list(pairer.add(_chunk("frames", 1, f1))) == []
    (s1,) = pairer.add(_chunk("poses", 1, p1))
    (s0,) = pairer.add(_chunk("poses", 0, p0))
    assert (s0.index, s1.index) == (0, 1) and s0.frame.shape == (4, 2) and s1.pose.tolist() == [2.0] * 7


def test_a_binary_answer_reads_back_and_missing_headers_say_so():
    arr = np.arange(6, dtype="<f4").reshape(2, 3)
    t = tensor_from_headers({"X-Tensor-Datatype": "FP32", "X-Tensor-Shape": "2,3"}, arr.tobytes())
    assert np.array_equal(t.numpy(), arr)
    with pytest.raises(Exception, match="lacks its tensor headers"):
        tensor_from_headers({"X-Tensor-Shape": "2,3"}, arr.tobytes())
