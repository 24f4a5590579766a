"""EngineProcess: a KV-cache engine in a child process gives the tokens the in-process
engine gives, ends a refused request alone, never waits on released work, reports a failed
start with the child's traceback, and stops with ``close``."""

import time
from pathlib import Path

import pytest

from mstar.models.orpheus.demo_checkpoint import DemoSpec, write_random_llm
from mstar.models.orpheus.llm_node import build_engine
from mstar.services.engines.engine_process import EngineProcess
from mstar.services.engines.kv_engine import EngineConfig
from mstar.services.engines.sampling import SamplingParams
from mstar.services.engines.seq_engine import StartSeq
from mstar.services.engines.sequence import SeqStatus

CONFIG = EngineConfig(kv_cache_bytes=16 << 20, max_num_seqs=8)
PROMPTS = {"a": [5, 9, 200, 31, 7], "b": [11, 12, 13]}
PARAMS = SamplingParams(temperature=0.7, seed=3, max_tokens=12)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ep-llm")
    write_random_llm(d, DemoSpec())
    return d


def broken_factory(path):
    raise FileNotFoundError(f"no checkpoint at {path}")


def drain(ep: EngineProcess, deadline_s: float = 60.0) -> tuple[dict[str, list[int]], dict[str, SeqStatus]]:
    tokens: dict[str, list[int]] = {}
    status: dict[str, SeqStatus] = {}
    end = time.monotonic() + deadline_s
    while ep.has_work:
        assert time.monotonic() < end, "engine process never finished its requests"
        for ev in ep.step():
            if ev.token_id is not None:
                tokens.setdefault(ev.request_id, []).append(ev.token_id)
            status[ev.request_id] = ev.status
    return tokens, status


def no_pages_used(ep: EngineProcess, within_s: float = 2.0) -> bool:
    """The child counts its pages after each command: wait briefly for the release to land."""
    end = time.monotonic() + within_s
    while ep.kv_stats().pages_used != 0 and time.monotonic() < end:
        time.sleep(0.02)
    return ep.kv_stats().pages_used == 0


def test_same_tokens_as_the_engine_in_this_process(ckpt):
    want = build_engine(ckpt, "cpu", CONFIG).generate(PROMPTS, PARAMS)
    ep = EngineProcess("llm", build_engine, (ckpt, "cpu", CONFIG))
    try:
        assert ep.proc.is_alive() and ep.kv_stats().pages_used == 0
        for rid, ids in PROMPTS.items():
            ep.submit(rid, StartSeq(ids, PARAMS))
        got, status = drain(ep)
        assert got == want and all(len(t) == PARAMS.max_tokens for t in got.values())
        assert set(status.values()) == {SeqStatus.FINISHED_LENGTH}
        for rid in PROMPTS:  # finished sequences hold their pages until released
            ep.release(rid)
        assert no_pages_used(ep)

        # a refused request (its id is already in the engine) ends that id alone: the first
        # "c" may have drawn a token before the refusal reached the child (timing), never
        # its full length, and it frees its pages; "d" runs on
        ep.submit("c", StartSeq([1, 2, 3], PARAMS))
        ep.submit("c", StartSeq([4, 5], PARAMS))
        ep.submit("d", StartSeq([6, 7], PARAMS))
        got, status = drain(ep)
        assert status["d"] == SeqStatus.FINISHED_LENGTH and len(got["d"]) == PARAMS.max_tokens
        assert status["c"] == SeqStatus.FINISHED_ABORTED and len(got.get("c", [])) < PARAMS.max_tokens
        ep.release("d")
        assert no_pages_used(ep)

        # work released before it produced anything: step does not wait for it
        ep.submit("e", StartSeq([1, 2], SamplingParams(max_tokens=10_000)))
        ep.release("e")
        t0 = time.monotonic()
        assert ep.step() == [] or not ep.has_work
        assert time.monotonic() - t0 < 5 and not ep.has_work
        assert ep.exit_reason() is None
    finally:
        ep.close()
    assert not ep.proc.is_alive() and ep.exit_reason() is None  # closed, not died


def test_a_failed_start_reports_the_childs_error(tmp_path):
    with pytest.raises(RuntimeError, match="failed to start(.|\n)*FileNotFoundError: no checkpoint at"):
        EngineProcess("llm", broken_factory, (str(tmp_path / "missing"),))


def test_a_killed_child_fails_the_waiting_step_and_names_itself(ckpt):
    ep = EngineProcess("llm", build_engine, (ckpt, "cpu", CONFIG))
    try:
        ep.submit("a", StartSeq(PROMPTS["a"], SamplingParams(max_tokens=10_000)))
        ep.proc.kill()
        with pytest.raises(RuntimeError, match="engine process of node 'llm'.*killed by signal 9"):
            while True:
                ep.step()
        assert "killed by signal 9" in ep.exit_reason()
        assert not ep.has_work
        with pytest.raises(RuntimeError, match="killed by signal 9"):
            ep.submit("b", StartSeq([1], PARAMS))
    finally:
        ep.close()
