from pathlib import Path

import pytest

from mstar.config import load_config

TOY_CONFIGS = Path(__file__).resolve().parent.parent / "models" / "toy" / "configs"


@pytest.fixture
def toy_config():
    return lambda name="default": load_config(f"{TOY_CONFIGS}/{name}.yaml")
