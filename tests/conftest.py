from pathlib import Path

from mstar import grpc_env

grpc_env.apply()  # the services' grpc settings for in-process meshes too, before grpc is imported

import pytest

from mstar.config import load_config

TOY_CONFIGS = Path(__file__).resolve().parent.parent / "models" / "toy" / "configs"


@pytest.fixture
def toy_config():
    return lambda name="default": load_config(f"{TOY_CONFIGS}/{name}.yaml")
