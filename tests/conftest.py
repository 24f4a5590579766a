from pathlib import Path

from mstar import grpc_env

grpc_env.apply()  # the services' grpc settings for in-process meshes too, before grpc is imported

import os

import pytest
import torch

from mstar.config import load_config


def _triton_library_for_the_interpreter() -> None:
    """On a machine without CUDA the Triton tests run their kernels under the interpreter
    (``TRITON_INTERPRET=1``, set by each such test module before it imports its kernels). Triton's
    own helpers (``tl.zeros``, ``tl.sum``, ``tl.max``...) are jit functions too, decorated when
    triton is first imported: if torch.compile imported it first, without the variable, a kernel
    calling them fails under the interpreter ("Cannot call @triton.jit'd outside of the scope of a
    kernel"), so a test's result would depend on which test files ran before it in its worker.
    Import triton now with the variable set, then put it back as it was: modules that read it
    (the Orpheus SNAC node's path choice) see what they saw before."""
    if torch.cuda.is_available():
        return
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401
    except ImportError:
        pass
    finally:
        if before is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = before


_triton_library_for_the_interpreter()

TOY_CONFIGS = Path(__file__).resolve().parent.parent / "models" / "toy" / "configs"


@pytest.fixture
def toy_config():
    return lambda name="default": load_config(f"{TOY_CONFIGS}/{name}.yaml")
