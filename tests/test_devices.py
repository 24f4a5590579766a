"""--gpus checked against the CUDA devices torch sees (faked counts), before anything starts."""

from pathlib import Path

import pytest

from mstar.config import ConfigError, NodeGroupConfig
from mstar.devices import check_gpus, parse_gpus, placement_line, resolve_gpus

TOY = Path(__file__).resolve().parent.parent / "models" / "toy" / "configs"

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


def test_without_gpus_every_visible_gpu_is_used_and_none_means_the_cpu():
    assert resolve_gpus(None, ONE, count=2) == [0, 1]
    assert resolve_gpus(None, TP2, count=2) == [0, 1]
    assert resolve_gpus(None, ONE, count=0) is None
    assert resolve_gpus("", ONE, count=2) is None
    with pytest.raises(ConfigError, match=r"node group 'llm': ranks \[0, 1\] need 2 GPU\(s\), but this host "
                                          r"\(1 visible CUDA device\(s\)\) gives 1"):
        resolve_gpus(None, TP2, count=1)
    assert placement_line(TP2, [0, 1], None) == ("M* placement: llm -> cuda:0, cuda:1, snac -> cuda:0 (every visible "
                                                 "GPU (2); --gpus '' serves on the CPU)")
    assert placement_line(ONE, None, None) == "M* placement: every node group on the CPU (no CUDA device visible to torch)"
    assert placement_line(ONE, None, "") == "M* placement: every node group on the CPU (--gpus '')"


def serve(argv: list[str], monkeypatch, count: int):
    """`mstar serve ...` up to the mesh it would run (with ``count`` faked CUDA devices)."""
    import argparse

    from mstar import cli

    monkeypatch.setattr("mstar.devices.cuda_device_count", lambda: count)
    meshes = []
    monkeypatch.setattr(cli, "run_forever", lambda make_mesh: meshes.append(make_mesh()) or 0)
    p = argparse.ArgumentParser()
    cli._serve_args(p)
    args = p.parse_args(argv)
    code = cli._launch(args, Path(args.config))
    return code, meshes[0] if meshes else None


def devices_of(mesh) -> dict[str, str]:
    return {s.name: s.argv[s.argv.index("--device") + 1] for s in mesh.services if s.kind == "node_group"}


def test_the_launcher_places_groups_on_every_visible_gpu_by_default(tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "toy.yaml"
    cfg.write_text((TOY / "default.yaml").read_text().replace("captioner, echo]\n    ranks: [0]", "captioner, echo]\n    ranks: [1]"))
    code, mesh = serve(["--config", str(cfg)], monkeypatch, count=2)
    assert code == 0 and devices_of(mesh) == {"encoder": "cuda:0", "decoder": "cuda:0", "audio": "cuda:1"}
    assert "M* placement: encoder -> cuda:0, decoder -> cuda:0, audio -> cuda:1 (every visible GPU (2)" in \
        capsys.readouterr().err
    code, mesh = serve(["--config", str(cfg), "--gpus", ""], monkeypatch, count=2)
    assert code == 0 and set(devices_of(mesh).values()) == {"cpu"}
    code, mesh = serve(["--config", str(cfg)], monkeypatch, count=1)
    assert code == 2 and mesh is None
    assert "node group 'audio': ranks [1] need 2 GPU(s), but this host (1 visible CUDA device(s)) gives 1" in \
        capsys.readouterr().err
    code, mesh = serve(["--config", str(cfg)], monkeypatch, count=0)
    assert code == 0 and set(devices_of(mesh).values()) == {"cpu"}
