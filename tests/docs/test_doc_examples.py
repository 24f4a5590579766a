"""Every shell and Python block of README.md and docs/ run as a reader would run it, on the CPU.

A block is run or says why not, in an HTML comment on the line above its fence:
``<!-- run -->``, ``<!-- run; needs: jq, base64 -->`` (skipped, saying so, where a tool is missing)
or ``<!-- not run: REASON -->``. A page's blocks run in order in one folder of their own (a later
block sees the files an earlier one wrote), bash with ``-e -o pipefail``. A block whose command is
``mstar serve ...`` starts that mesh in this process instead (the same config, on free ports, with
the gateway app in front; a random checkpoint is written once per model), and the page's next
blocks talk to it: ``localhost:8000`` and ``localhost:50051`` become its ports. One test per mesh
(and one for a page's blocks before its first mesh): a block that exits non-zero fails it, and the
examples check what they save, so a broken example fails here."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from served_gateway import ServedGateway

from mstar import auth, cli
from mstar.config import load_config
from mstar.layouts import serve_target
from mstar.models.base import Model
from mstar.models.registry import create_model

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELL, PYTHON = {"bash", "sh", "shell"}, {"python", "py"}
RUN = re.compile(r"<!--\s*run(?:;\s*needs:\s*(?P<needs>[\w.+-]+(?:\s*,\s*[\w.+-]+)*))?\s*-->")
NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<reason>\S.*?)\s*-->")
FENCE = re.compile(r"^```(\S*)\s*$")
RUN_S = 90  # one block at most
#: the serve options the in-process mesh takes; any other makes the block a "not run"
SERVE_OPTIONS = {"model", "config", "random_weights", "cache_dir", "api_keys_file", "per_key_max_inflight"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the opening fence's, 1-based
    lang: str
    code: str
    run: bool | None  # None: no marker
    needs: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def example(self) -> bool:
        return self.lang in SHELL | PYTHON

    def serve_argv(self) -> list[str] | None:
        """The block's `mstar serve` command, when that is what it is (its only command)."""
        if self.lang not in SHELL:
            return None
        lines = [line for line in self.code.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        if not any(line.split()[:2] == ["mstar", "serve"] for line in lines):
            return None
        assert len(lines) == 1, f"{self.where}: a block that serves holds one `mstar serve` line, nothing else"
        return shlex.split(lines[0], comments=True)


def blocks(page: Path, text: str | None = None) -> list[Block]:
    lines = (page.read_text() if text is None else text).splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        run = RUN.fullmatch(before)
        found.append(Block(page, i + 1, m.group(1), "\n".join(lines[i + 1:end]),
                           True if run else False if NOT_RUN.fullmatch(before) else None,
                           tuple(n.strip() for n in (run.group("needs") or "").split(",") if n.strip()) if run else ()))
        i = end + 1
    return found


def segments() -> list[tuple[str, list[Block]]]:
    """Each page's run blocks as (test id, blocks), cut so that each group holds at most one block that
    serves: the blocks before it (which make its inputs, such as a keys file), it, and the blocks
    after it up to the next group's."""
    out = []
    for page in PAGES:
        group: list[Block] = []
        for b in blocks(page):
            if not b.run:
                continue
            if b.serve_argv() is not None and any(x.serve_argv() is not None for x in group):
                out.append((group[0].where, group))
                group = []
            group.append(b)
        if group:
            out.append((group[0].where, group))
    return out


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mstar serve", exit_on_error=False)
    p.add_argument("model")
    cli._serve_args(p)
    return p


def mesh_of(block: Block, workdir: Path, weights) -> ServedGateway:
    """The block's `mstar serve` line as an in-process mesh with the gateway in front."""
    parser = serve_parser()
    args = parser.parse_args(block.serve_argv()[2:])
    defaults = vars(parser.parse_args([args.model]))
    other = sorted(k for k, v in vars(args).items() if v != defaults[k] and k not in SERVE_OPTIONS)
    assert not other, f"{block.where}: the test serves no {other} in-process: mark the block not run, saying why"
    model, config_path = serve_target(args.model, args.config)
    config = load_config(config_path)
    if type(create_model(model, config.model_kwargs)).write_random_weights is not Model.write_random_weights:
        assert args.random_weights, f"{block.where}: '{model}' needs its real weights here: serve --random-weights"
    keys = auth.ApiKeys.load(str(workdir / args.api_keys_file) if args.api_keys_file else None, env_value="")
    return ServedGateway(config, weights(model), api_keys=keys,
                         conductor_kw={"api_keys": keys, "per_key_max_inflight": args.per_key_max_inflight})


def with_ports(code: str, gateway: ServedGateway | None) -> str:
    if gateway is None:
        return code
    port = gateway.url.rsplit(":", 1)[1]
    code = re.sub(r"\b(localhost|127\.0\.0\.1):8000\b", f"127.0.0.1:{port}", code)
    return re.sub(r"\b(localhost|127\.0\.0\.1):50051\b", gateway.mesh.address, code)


def run_block(block: Block, workdir: Path, gateway: ServedGateway | None = None) -> str:
    """Run one block; fails the test, showing the block and its output, unless it exits 0."""
    code = with_ports(block.code, gateway)
    cmd = ["bash", "-e", "-o", "pipefail", "-c", code] if block.lang in SHELL else [sys.executable, "-c", code]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("MSTAR_API_KEY", None)
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=RUN_S)
    if proc.returncode != 0:
        pytest.fail(f"{block.where} exited {proc.returncode}:\n{code}\n--- stdout\n{proc.stdout[-3000:]}"
                    f"\n--- stderr\n{proc.stderr[-3000:]}", pytrace=False)
    print(f"{block.where}:\n{proc.stdout}")  # shown with -s, or with a later block's failure
    return proc.stdout


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    """One folder per page, with the repository's models/ beside it (examples name its configs)."""
    made: dict[Path, Path] = {}

    def get(page: Path) -> Path:
        if page not in made:
            made[page] = tmp_path_factory.mktemp(page.stem)
            (made[page] / "models").symlink_to(ROOT / "models")
        return made[page]
    return get


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """model -> a --cache-dir holding its random checkpoint, written once."""
    made: dict[str, str] = {}

    def get(model: str) -> str:
        if model not in made:
            made[model] = str(tmp_path_factory.mktemp(f"{model}-weights"))
            create_model(model, {}, made[model]).write_random_weights(made[model])
        return made[model]
    return get


SEGMENTS = segments()


@pytest.mark.parametrize("first", [s[0] for s in SEGMENTS])
def test_examples_run(first, workdirs, weights):
    group = dict(SEGMENTS)[first]
    missing = sorted({n for b in group for n in b.needs if shutil.which(n) is None})
    if missing:
        pytest.skip(f"the examples from {first} need {', '.join(missing)} on PATH")
    workdir = workdirs(group[0].page)
    serving = next((i for i, b in enumerate(group) if b.serve_argv() is not None), len(group))
    for b in group[:serving]:
        run_block(b, workdir)
    if serving < len(group):
        with mesh_of(group[serving], workdir, weights) as gateway:
            for b in group[serving + 1:]:
                run_block(b, workdir, gateway)


def test_every_example_is_run_or_says_why_not():
    unmarked = [b.where for page in PAGES for b in blocks(page) if b.example and b.run is None]
    assert not unmarked, f"shell or Python blocks without <!-- run --> or <!-- not run: REASON -->: {unmarked}"
    readme = [b.serve_argv()[2] for b in blocks(ROOT / "README.md") if b.run and b.serve_argv() is not None]
    assert sorted(readme) == ["bagel", "orpheus", "pi05", "qwen3_omni", "toy", "vjepa2"]  # one example per family


def test_a_failing_example_fails_and_an_unmarked_one_is_found(tmp_path):
    text = "<!-- run -->\n```bash\ntrue\nfalse\necho unreached\n```\n\n```python\nprint(1)\n```\n"
    run, unmarked = blocks(ROOT / "README.md", text)
    assert (run.run, run.line, unmarked.run, unmarked.example) == (True, 2, None, True)
    with pytest.raises(pytest.fail.Exception, match=r"README.md:2 exited 1"):
        run_block(run, tmp_path)


def test_a_serve_line_the_test_cannot_serve_is_refused(tmp_path):
    block = blocks(ROOT / "README.md", "<!-- run -->\n```bash\nmstar serve toy --envoy\n```\n")[0]
    with pytest.raises(AssertionError, match=r"serves no \['envoy'\]"):
        mesh_of(block, tmp_path, lambda model: str(tmp_path))
    block = blocks(ROOT / "README.md", "<!-- run -->\n```bash\nmstar serve pi05\n```\n")[0]
    with pytest.raises(AssertionError, match="needs its real weights"):
        mesh_of(block, tmp_path, lambda model: str(tmp_path))
