"""``Conductor.Act`` <-> the model's own request: the one place where a typed ActRequest becomes the
Prompt a policy model reads (``Model.act_output``: text = the task, files = the camera images by
name, model_kwargs {"state", "seed"}), where the model's field names in an INVALID_ARGUMENT become
the ActRequest's, and where the model's action output becomes an ActResponse."""

from __future__ import annotations

import math

from mstar.models.base import InputFile, InvalidArgument, Prompt
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import tensor_pb2


def prompt_from_act(req: cpb.ActRequest) -> Prompt:
    bad = next((i for i, x in enumerate(req.state) if not math.isfinite(x)), None)
    if bad is not None:
        raise InvalidArgument("model_kwargs.state", f"state[{bad}] is {req.state[bad]}; every value must be finite")
    files = [InputFile(img.name, img.mime_type, img.data) for img in req.images]
    # float32 on the wire: the model sees exactly those values (as Python floats)
    kwargs: dict = {"state": list(req.state)}
    if req.HasField("seed"):
        kwargs["seed"] = req.seed
    return Prompt(req.task, files, kwargs)


def act_field(field: str) -> str:
    """The ActRequest field behind a field of the model's request: ``model_kwargs.state`` -> ``state``,
    ``files[1].data`` -> ``images[1].data``, ``text`` -> ``task``."""
    if field.startswith("model_kwargs."):
        return field.removeprefix("model_kwargs.")
    if field == "files" or field.startswith("files["):
        return "images" + field.removeprefix("files")
    return "task" if field == "text" else field


def act_response(request_id: str, actions: tensor_pb2.Tensor, final: cpb.FinalEvent) -> cpb.ActResponse:
    return cpb.ActResponse(request_id=request_id, actions=actions, usage=final.usage, timings=final.timings)
