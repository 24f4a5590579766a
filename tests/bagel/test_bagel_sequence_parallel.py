"""BAGEL with its LLM sequence-parallel (the group's ranks as real processes on the CPU over gloo):
three ranks in one pipeline, and two in a launched mesh (configs/sequence_parallel_2gpu.yaml).
Each image block and flow step is split by rows, the ranks exchange K/V every layer, and
text-to-image, editing, understanding and think mode give what the reference gave (the same
checks as the one-group mesh). Also: a pass's query rows split over ranks attend exactly as the
whole pass does; a pass too small for every rank to have rows runs whole; the routing's shortcut
for a few understanding rows among many generation rows gives what routing each row does."""

import asyncio
from pathlib import Path

import grpc
import pytest
import torch
import yaml
from test_bagel_mesh import check, scenario_request

from mstar.config import load_config
from mstar.launcher import LaunchOptions, Mesh
from mstar.services.engines.attention import AttentionBatch, HeadShape, TorchPagedAttention
from mstar.services.engines.pages import build_csr
from mstar.services.links import CHANNEL_OPTIONS
from mstar.v1 import conductor_pb2_grpc

from helpers import collect, run

CONFIGS = Path("models/bagel/configs")


def test_query_rows_attend_as_the_whole_pass():
    heads, ps = HeadShape(4, 2, 8), 4
    kv_lens, pages = (9, 6, 11), [[0, 1, 2], [3, 4], [5, 6, 7]]  # three sequences' keys (new rows included)
    qo = torch.tensor([0, 5, 8, 15], dtype=torch.int32)  # and their 5, 3, 7 new rows
    batch = AttentionBatch(qo, build_csr(pages, kv_lens, ps), torch.arange(15), causal=False)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(8, ps, 2, 8, generator=g) for _ in range(2))
    q = torch.randn(15, 4, 8, generator=g)
    attn = TorchPagedAttention(heads)
    attn.plan(batch)
    whole = attn.run(q, k, v)
    for lo, hi in ((0, 5), (3, 10), (4, 6), (9, 15), (0, 15)):
        part = batch.query_rows(lo, hi)
        assert part.slots.tolist() == list(range(lo, hi))
        attn.plan(part)
        torch.testing.assert_close(attn.run(q[lo:hi], k, v), whole[lo:hi], rtol=0, atol=1e-6)
    assert batch.query_rows(6, 8).table.kv_lens == (6,)  # sequences without rows there drop out
    for lo, hi in ((3, 3), (-1, 4), (10, 16)):
        with pytest.raises(ValueError, match="outside the pass's 15"):
            batch.query_rows(lo, hi)
    with pytest.raises(ValueError, match="non-causal"):
        AttentionBatch(qo, batch.table, batch.slots, causal=True).query_rows(0, 5)


def test_a_pass_splits_only_when_every_rank_has_rows():
    from types import SimpleNamespace

    from mstar.models.bagel.llm import BagelLLM

    qo = torch.tensor([0, 4], dtype=torch.int32)
    four = AttentionBatch(qo, build_csr([[0, 1]], (8,), 4), torch.arange(4), causal=False)
    five = AttentionBatch(torch.tensor([0, 5], dtype=torch.int32), build_csr([[0, 1]], (8,), 4), torch.arange(5),
                          causal=False)
    for rank in range(3):
        llm = SimpleNamespace(sequence_parallel=SimpleNamespace(size=3, rank=rank))
        assert BagelLLM._split(llm, four) is None  # 2 rows a rank: the third would have none
        assert BagelLLM._split(llm, five) == (2, 2 * rank, min(5, 2 * rank + 2))
        causal = AttentionBatch(qo, four.table, four.slots, causal=True)
        assert BagelLLM._split(llm, causal) is None and BagelLLM._split(llm, None) is None
        llm._split = lambda attn, llm=llm: BagelLLM._split(llm, attn)
        assert BagelLLM.attention_share(llm, four) is four
        assert BagelLLM.attention_share(llm, five).num_tokens == min(5, 2 * rank + 2) - 2 * rank


def test_few_understanding_rows_route_as_each_row_does():
    from mstar.models.bagel.llm import MINORITY, Routing

    gen = torch.ones(2 * MINORITY + 1, dtype=torch.bool)
    gen[[0, 7]] = False
    route = Routing(gen, torch.device("cpu"))
    assert route.few_und
    x = torch.randn(gen.shape[0], 6, generator=torch.Generator().manual_seed(1))
    und, generate = (lambda t: t * 2 + 1), (lambda t: t.flip(-1) - 3)
    fast = route.apply(x, und, generate)
    route.few_und = False
    torch.testing.assert_close(fast, route.apply(x, und, generate), rtol=0, atol=0)


def _rank_main(rank: int, ckpt: str, fits: tuple, init: str, out: str) -> None:
    from test_bagel_reference import scenario_image

    from mstar.models.bagel.flow import FlowParams
    from mstar.models.bagel.media import Fit
    from mstar.models.bagel.pipeline import BagelPipeline
    from mstar.services.engines.tensor_parallel import TensorParallel, TPSpec

    torch.set_num_threads(1)
    group = TensorParallel(TPSpec(rank, 3, init), "cpu")
    pipe = BagelPipeline(ckpt, vae_fit=Fit(*fits[0]), vit_fit=Fit(*fits[1]), sequence_parallel=group)
    split, sharded = [], pipe.lm.llm._sharded
    pipe.lm.llm._sharded = lambda embeds, *a: split.append((embeds.shape[0], *a[-2:])) or sharded(embeds, *a)
    if rank == 0:
        p = FlowParams(48, 80, num_timesteps=6, cfg_text=4.0, cfg_img=2.0, interval=(0.0, 1.0))
        res = {"t2i": pipe.run("text_to_image", "a red cube", params=p, seed=3).latent,
               "edit": pipe.run("edit", "make it blue", scenario_image([40, 56, 1]), params=p, seed=4).latent,
               "text": pipe.run("understand", "describe it", scenario_image([40, 56, 1]), max_tokens=6).token_ids}
        pipe.lm.close()
        torch.save({**res, "split": split, "held": pipe.lm.engine.cache.request_ids()}, out)
    else:
        pipe.lm.follow()
        torch.save({"split": split, "held": pipe.lm.engine.cache.request_ids()}, f"{out}.{rank}")
    torch.distributed.barrier()
    group.close()


def test_three_ranks_give_the_one_rank_results(ckpt_dir, reference, pipeline, tmp_path):
    """Three CPU ranks (gloo) against the one-process pipeline: latents within 1e-5 of the largest
    magnitude (fp32: the rows are the same sums, in GEMMs of other shapes), tokens equal; every
    image block and flow step went through the split path, on each rank; no rank holds pages after."""
    from bagel_checks import rel_err
    from test_bagel_reference import scenario_image

    from mstar.models.bagel.flow import FlowParams

    from helpers import run_ranks

    meta = reference[1]
    out = str(tmp_path / "rank0.pt")
    run_ranks(_rank_main, (str(ckpt_dir), (meta["vae_fit"], meta["vit_fit"]), f"file://{tmp_path}/store",
                           out), 240, size=3)
    got = torch.load(out)
    p = FlowParams(48, 80, num_timesteps=6, cfg_text=4.0, cfg_img=2.0, interval=(0.0, 1.0))
    want = {"t2i": pipeline.run("text_to_image", "a red cube", params=p, seed=3).latent,
            "edit": pipeline.run("edit", "make it blue", scenario_image([40, 56, 1]), params=p, seed=4).latent}
    for name, latent in want.items():
        assert rel_err(got[name], latent) < 1e-5, name
    assert got["text"] == pipeline.run("understand", "describe it", scenario_image([40, 56, 1]), max_tokens=6).token_ids
    # t2i: 5 flow steps of 3 branches, 3·5 latents + 2 markers an item; edit: its ViT and VAE blocks, then 5
    # steps of 3 branches (the fitted image's 2·3 latents + 2); understanding: its ViT block
    splits = [got["split"]] + [torch.load(f"{out}.{r}")["split"] for r in (1, 2)]
    rows = [n for n, _, _ in splits[0]]
    assert all([n for n, _, _ in s] == rows for s in splits)
    assert len(rows) == 5 + 2 + 5 + 1 and rows[:5] == [3 * 17] * 5 and rows[7:12] == [3 * 8] * 5
    for i, n in enumerate(rows):  # the ranks' shares of each pass tile its rows, in rank order, none empty
        shares = [s[i][1:] for s in splits]
        assert shares[0][0] == 0 and shares[-1][1] == n and all(lo < hi for lo, hi in shares)
        assert all(a[1] == b[0] for a, b in zip(shares, shares[1:], strict=False))
    assert got["held"] == [] and all(torch.load(f"{out}.{r}")["held"] == [] for r in (1, 2))


@pytest.mark.e2e
def test_two_ranks_serve_the_reference(bagel_cache, reference, tmp_path):
    tensors, meta = reference
    raw = yaml.safe_load((CONFIGS / "sequence_parallel_2gpu.yaml").read_text())
    raw["model_kwargs"] = {"vae_image": meta["vae_fit"][:2], "vit_image": meta["vit_fit"][:2]}
    path = tmp_path / "sequence_parallel_2gpu.yaml"
    path.write_text(yaml.safe_dump(raw))
    mesh = Mesh(load_config(path), LaunchOptions(path, port=0, grpc_port=0, cache_dir=bagel_cache, log_level="WARNING",
                                                  startup_timeout_s=180))
    scenarios = ("t2i", "edit", "understand", "think")
    mesh.start()
    try:
        async def go():
            async with grpc.aio.insecure_channel(mesh.conductor_address, options=CHANNEL_OPTIONS) as ch:
                stub = conductor_pb2_grpc.ConductorStub(ch)
                return await asyncio.gather(*(collect(stub, scenario_request(meta, n), timeout=120) for n in scenarios))

        res = run(go(), timeout=180)
    finally:
        mesh.stop()
    for name, (out, final) in zip(scenarios, res, strict=True):
        check(name, meta, tensors, out)
        assert final.usage.prompt_tokens > 0
