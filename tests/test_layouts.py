"""Shipped layouts under the names the original M*'s docs use, and `mstar models` listing them."""

import subprocess
import sys

import pytest

from mstar.config import ConfigError
from mstar.layouts import layouts, resolve, serve_target
from mstar.models.registry import UnknownModel, configs_dir


@pytest.mark.parametrize("name,model,want", [
    ("orpheus_single_gpu", None, "orpheus/default.yaml"),
    ("orpheus_single_gpu", "orpheus", "orpheus/default.yaml"),
    ("orpheus_colocated", None, "orpheus/default.yaml"),
    ("orpheus_pd_disaggregated", None, "orpheus/pd_disaggregated.yaml"),
    ("pd_disaggregated", "orpheus", "orpheus/pd_disaggregated.yaml"),
    ("orpheus_tp2", None, "orpheus/tp2.yaml"),
    ("orpheus", None, "orpheus/default.yaml"),
    ("toy_colocated", None, "toy/colocated.yaml"),  # our own colocated.yaml wins over the original's meaning
    ("toy_single_gpu", "toy", "toy/default.yaml"),
    ("vision_split", "pi05", "pi05/vision_split.yaml"),
    ("bagel_cfg_parallel", None, "bagel/cfg_parallel.yaml"),  # the original's names for BAGEL's layouts
    ("bagel_single_gpu", None, "bagel/default.yaml"),
])
def test_layout_names_resolve_to_shipped_files(name, model, want):
    path = resolve(name, model)
    assert path.is_file() and path.as_posix().endswith(want.replace("/", "/configs/"))


def test_a_path_is_taken_as_is(tmp_path):
    f = tmp_path / "mine.yaml"
    assert resolve(str(f), "toy") == f  # not checked here: load_config says when it is missing
    assert resolve("some/dir/orpheus_single_gpu", "orpheus").as_posix() == "some/dir/orpheus_single_gpu"


@pytest.mark.parametrize("name,model,words", [
    ("orpheus_cfg_parallel", None, ["model 'orpheus' has no layout 'cfg_parallel'", "the original M* names a layout so",
                                    "Its layouts: default (1 device; also orpheus_single_gpu, orpheus_colocated)",
                                    "pd_disaggregated (1 device; also orpheus_pd_disaggregated)", "tp2 (2 devices)"]),
    ("toy_pd_disaggregated", "toy", ["model 'toy' has no layout 'pd_disaggregated'", "two_hosts (1 device)"]),
    ("bogus", "vjepa2", ["model 'vjepa2' has no layout 'bogus'", "default (1 device; also vjepa2_single_gpu"]),
    ("qwen3omni_colocated", None, ["no such file, and not a layout name", "bagel, ", "orpheus, ", "toy, ",
                                   "mstar models"]),  # other test modules register models of their own
])
def test_an_alias_that_names_no_layout_is_an_error_listing_the_layouts(name, model, words):
    with pytest.raises(ConfigError) as e:
        resolve(name, model)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_single_gpu_is_offered_only_where_the_default_uses_one_device(tmp_path, monkeypatch):
    """A model whose default spans two devices has no *_single_gpu alias."""
    import mstar.layouts as lay

    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "default.yaml").write_text((configs_dir("orpheus") / "tp2.yaml").read_text())
    monkeypatch.setattr(lay, "configs_dir", lambda model: folder)
    [default] = layouts("orpheus")
    assert (default.devices, default.aliases) == (2, ())
    with pytest.raises(ConfigError, match="does not ship as a one-device layout"):
        resolve("orpheus_single_gpu")


def test_serve_target_takes_a_layout_name_in_place_of_the_model():
    assert serve_target("orpheus_pd_disaggregated", None) == ("orpheus", configs_dir("orpheus") / "pd_disaggregated.yaml")
    assert serve_target("toy", None) == ("toy", configs_dir("toy") / "default.yaml")
    assert serve_target("toy", "colocated") == ("toy", configs_dir("toy") / "colocated.yaml")
    with pytest.raises(UnknownModel, match="Unknown model 'tyo'. Known: "):
        serve_target("tyo", None)


def test_mstar_models_lists_each_model_with_its_layouts():
    r = subprocess.run([sys.executable, "-m", "mstar.cli", "models"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()  # a fresh process: only the models the package ships (tests register others)
    assert [x for x in lines if not x.startswith(" ")] == ["bagel", "orpheus", "pi05", "qwen3_omni", "toy", "vjepa2"]
    orpheus = lines[lines.index("orpheus") + 1:lines.index("pi05")]
    assert [x.split()[0] for x in orpheus] == sorted(p.stem for p in configs_dir("orpheus").glob("*.yaml"))
    assert "  pd_disaggregated (1 device; also orpheus_pd_disaggregated)" in orpheus


def test_serve_with_an_unknown_layout_exits_2_listing_the_layouts():
    r = subprocess.run([sys.executable, "-m", "mstar.cli", "serve", "orpheus", "--config", "orpheus_cfg_parallel"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "has no layout 'cfg_parallel'" in r.stderr and "tp2 (2 devices)" in r.stderr
    r = subprocess.run([sys.executable, "-m", "mstar.cli", "serve", "toy", "--config", "orpheus_single_gpu"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "default.yaml serves model 'orpheus', not 'toy'" in r.stderr, r.stderr
