"""--gpus checked against the CUDA devices torch sees (faked counts), before anything starts."""

import pytest

from mstar.config import ConfigError, NodeGroupConfig
from mstar.devices import check_gpus, parse_gpus

ONE = (NodeGroupConfig("llm", ("llm",)), NodeGroupConfig("snac", ("snac_decoder",)))
TP2 = (NodeGroupConfig("llm", ("llm",), ranks=(0, 1), tp_size=2), NodeGroupConfig("snac", ("snac_decoder",)))


def test_parse_gpus():
    assert parse_gpus("0,1") == [0, 1] and parse_gpus("") == [] and parse_gpus(" 2 ") == [2]
    with pytest.raises(ConfigError, match="comma-separated CUDA device ids"):
        parse_gpus("a")
    with pytest.raises(ConfigError, match="distinct"):
        parse_gpus("0,0")


def test_explicit_gpus_are_checked_against_the_devices_there():
    assert check_gpus("", ONE, count=4) is None  # the CPU
    assert check_gpus("1", ONE, count=2) == [1]
    assert check_gpus("2,3", TP2, count=4) == [2, 3]
    with pytest.raises(ConfigError, match=r"--gpus 2: device\(s\) \[2\] do not exist; torch sees 2 CUDA"):
        check_gpus("2", ONE, count=2)
    with pytest.raises(ConfigError, match=r"node group 'llm': ranks \[0, 1\] need 2 GPU\(s\), but --gpus 0 gives 1"):
        check_gpus("0", TP2, count=4)
    with pytest.raises(ConfigError, match="--gpus 0: no CUDA here: .*--gpus ''"):
        check_gpus("0", ONE, count=0)
