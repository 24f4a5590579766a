"""torch.compile for the pieces of a model's layer between its kernels (norms, RoPE, residuals,
routing): each piece a function of tensors, not of modules, so one compilation serves every layer
of a shape.

``compiled`` compiles a function once per backend, traced whole (``fullgraph``: a graph break
fails instead of running part of it eagerly) with sizes symbolic from the first call (``dynamic``:
a new batch size or sequence length reuses the kernels). ``owned`` gives such a piece a tensor
that is not a view: dynamo guards a view's base, so a view and a fresh tensor of the same shape
would be two compilations of one piece.

torch.compile is not thread-safe (its FX tracing patches ``nn.Module.__call__`` for the whole
process): a node whose engines step on threads of their own compiles its pieces before they start.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: Dynamo's compilations per function: its default, 8, is less than one deployment may need (two
#: models' widths, one row and more, inference mode and no_grad), and past it dynamo would run the
#: piece eagerly with only a warning
RECOMPILE_LIMIT = 64

_COMPILED: dict[tuple[Callable, Any], Callable] = {}


def compiled(fn: Callable, backend: Any) -> Callable:
    """``fn`` under torch.compile with ``backend`` (made once per function and backend)."""
    key = (fn, backend)
    got = _COMPILED.get(key)
    if got is None:
        import torch._dynamo.config as dynamo

        dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
        got = _COMPILED[key] = torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)
    return got


def owned(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy of it when it is a view."""
    return x.clone() if x._base is not None else x
