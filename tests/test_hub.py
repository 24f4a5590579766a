"""Checkpoints found the way users keep them (fake Hugging Face caches, no network), and the
launcher's check before anything starts."""

import argparse
import sys
import types
from pathlib import Path

import pytest

from mstar.models import hub
from mstar.models.hub import CheckpointError, CheckpointSpec, MissingCheckpoints, ensure, resolve_checkpoint

LLM, SNAC = "canopylabs/orpheus-3b-0.1-ft", "hubertsiuzdak/snac_24khz"
LLM_SPEC = CheckpointSpec(LLM, required=("config.json", "tokenizer.json", ("model.safetensors.index.json",
                                                                           "model.safetensors")),
                          allow_patterns=("*.json", "*.safetensors"))


@pytest.fixture(autouse=True)
def no_user_caches(tmp_path, monkeypatch):
    """Nothing of this machine's own caches: HOME is empty, HF_* unset."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("HF_HOME", raising=False)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)


def files(d: Path, names=("config.json", "tokenizer.json", "model.safetensors")) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for n in names:
        (d / n).write_text("{}")
    return d


def hub_layout(root: Path, repo: str, commit: str = "abc123", ref: str = "main", **kw) -> Path:
    org, name = repo.split("/")
    base = root / f"models--{org}--{name}"
    (base / "refs").mkdir(parents=True, exist_ok=True)
    (base / "refs" / ref).write_text(commit + "\n")
    return files(base / "snapshots" / commit, **kw)


def test_plain_directory_and_plain_org_name_folders(tmp_path):
    d = files(tmp_path / "ckpt")
    assert resolve_checkpoint(str(d)) == d
    plain = files(tmp_path / "cache" / "hubertsiuzdak" / "snac_24khz")
    assert resolve_checkpoint(SNAC, cache_dir=tmp_path / "cache") == plain


def test_hub_layout_by_ref_and_by_commit(tmp_path):
    snap = hub_layout(tmp_path, LLM)
    assert resolve_checkpoint(LLM, cache_dir=tmp_path) == snap
    assert resolve_checkpoint(LLM, cache_dir=tmp_path, revision="abc123") == snap
    with pytest.raises(CheckpointError, match=r"no snapshot for revision 'v2'.*snapshots present: \['abc123'\]"):
        resolve_checkpoint(LLM, cache_dir=tmp_path, revision="v2")


def test_the_hf_environment_and_home_cache_are_searched_after_cache_dir(tmp_path, monkeypatch):
    home = hub_layout(tmp_path / "home" / ".cache" / "huggingface" / "hub", LLM, commit="home")
    assert resolve_checkpoint(LLM) == home
    hf_home = hub_layout(tmp_path / "hfhome" / "hub", LLM, commit="hfhome")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hfhome"))
    assert resolve_checkpoint(LLM) == hf_home
    hub_cache = hub_layout(tmp_path / "hubcache", LLM, commit="hubcache")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hubcache"))
    assert resolve_checkpoint(LLM) == hub_cache
    mine = hub_layout(tmp_path / "mine", LLM, commit="mine")
    assert resolve_checkpoint(LLM, cache_dir=tmp_path / "mine") == mine
    assert resolve_checkpoint(LLM, cache_dir=tmp_path / "empty") == hub_cache  # --cache-dir first, then the rest


def test_missing_says_where_it_looked_and_how_to_fetch(tmp_path):
    with pytest.raises(CheckpointError, match=r"'org/absent' not found.*models--org--absent.*"
                                              r"`hf download org/absent --cache-dir .*c`"):
        resolve_checkpoint("org/absent", cache_dir=tmp_path / "c")


def test_offline_every_missing_checkpoint_is_named_with_its_command(tmp_path):
    hub_layout(tmp_path, LLM, names=("config.json", "model.safetensors"))  # a partial download: no tokenizer
    snac = CheckpointSpec(SNAC, required=("config.json", "pytorch_model.bin"))
    with pytest.raises(MissingCheckpoints) as e:
        ensure([LLM_SPEC, snac], tmp_path, model="orpheus")
    msg = str(e.value)
    assert msg.startswith("model 'orpheus' needs 2 checkpoint(s) not on this machine:")
    assert "lacks tokenizer.json" in msg and f"hf download {LLM} --cache-dir {tmp_path}" in msg
    assert f"{SNAC}: Checkpoint '{SNAC}' not found" in msg and f"hf download {SNAC} --cache-dir {tmp_path}" in msg
    assert "--download" in msg and "--random-weights" in msg


def fake_hub(monkeypatch, fail: Exception | None = None) -> list[dict]:
    """huggingface_hub.snapshot_download writing the hub layout (or raising ``fail``)."""
    calls: list[dict] = []

    def snapshot_download(repo_id, revision="main", cache_dir=None, allow_patterns=None):
        calls.append({"repo_id": repo_id, "revision": revision, "cache_dir": cache_dir,
                      "allow_patterns": allow_patterns})
        if fail is not None:
            raise fail
        return str(hub_layout(Path(cache_dir), repo_id, commit="fetched", names=(
            "config.json", "tokenizer.json", "model.safetensors", "pytorch_model.bin")))

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(snapshot_download=snapshot_download))
    return calls


def test_download_when_allowed_into_cache_dir(tmp_path, monkeypatch, capsys):
    calls = fake_hub(monkeypatch)
    assert ensure([LLM_SPEC], tmp_path / "c", download=True) == [LLM]
    assert calls == [{"repo_id": LLM, "revision": "main", "cache_dir": str(tmp_path / "c"),
                      "allow_patterns": ["*.json", "*.safetensors"]}]
    assert f"downloading {LLM} (main) into {tmp_path / 'c'}" in capsys.readouterr().out
    assert ensure([LLM_SPEC], tmp_path / "c", download=True) == []  # present now: nothing fetched
    assert len(calls) == 1


def test_a_failed_download_names_the_repo_the_error_and_the_command(tmp_path, monkeypatch):
    fake_hub(monkeypatch, fail=OSError("Network is unreachable"))
    with pytest.raises(MissingCheckpoints, match=rf"{LLM}: download failed: OSError: Network is unreachable\n"
                                                 rf"    fetch it: hf download {LLM} --cache-dir "):
        ensure([LLM_SPEC], tmp_path, download=True)


def serve(argv: list[str], monkeypatch):
    from mstar import cli

    started = []
    monkeypatch.setattr(cli, "run_forever", lambda make_mesh: started.append(make_mesh()) or 0)
    p = argparse.ArgumentParser()
    cli._serve_args(p)
    args = p.parse_args(argv)
    config = Path(cli.__file__).resolve().parent.parent / "models" / "orpheus" / "configs" / "default.yaml"
    return cli._launch(args, config), started


def test_serving_without_the_checkpoints_fails_before_anything_starts(tmp_path, monkeypatch, capsys):
    code, started = serve(["--cache-dir", str(tmp_path), "--gpus", ""], monkeypatch)
    err = capsys.readouterr().err
    assert code == 2 and started == []
    assert f"hf download {LLM} --cache-dir {tmp_path}" in err and f"hf download {SNAC} --cache-dir {tmp_path}" in err


def test_serving_with_download_fetches_then_checks_the_files(tmp_path, monkeypatch, capsys):
    """--download fetches both repos; the (empty) fake files then fail the model's own check,
    which names the file: the download ran before the check, nothing started."""
    calls = fake_hub(monkeypatch)
    code, started = serve(["--cache-dir", str(tmp_path), "--gpus", "", "--download"], monkeypatch)
    assert [c["repo_id"] for c in calls] == [LLM, SNAC]
    assert code == 2 and started == [] and "orpheus:" in capsys.readouterr().err
    assert hub.problem(LLM_SPEC, tmp_path) is None
