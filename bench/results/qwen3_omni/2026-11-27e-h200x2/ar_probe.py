"""Probe: 96 all-reduces of [rows, 2048] bf16 in one CUDA graph, NCCL against torch's symmetric-memory
one-shot all-reduce, 2 ranks. Prints one JSON line from rank 0."""
import json, os, statistics, sys, time
import torch, torch.distributed as dist, torch.multiprocessing as mp

N = 96

def timed(fn, iters=20):
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        out = fn()
    ts = []
    for _ in range(iters):
        dist.barrier(device_ids=[torch.cuda.current_device()])
        torch.cuda.synchronize()
        t = time.perf_counter(); g.replay(); torch.cuda.synchronize(); ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts), out

def rank_main(rank, world, q):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=rank, world_size=world,
                            device_id=torch.device(f"cuda:{rank}"))
    import torch.distributed._symmetric_memory as sm
    gname = dist.group.WORLD.group_name
    res = {"torch": torch.__version__, "ops": [o for o in dir(torch.ops.symm_mem) if "reduce" in o]}
    for rows in (1, 16, 32):
        x0 = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(rank))
        x = x0.clone()
        def nccl():
            for _ in range(N):
                dist.all_reduce(x)
            return x
        x.copy_(x0)
        t_nccl, _ = timed(nccl)
        buf = sm.empty(rows, 2048, dtype=torch.bfloat16, device="cuda")
        sm.rendezvous(buf, gname)
        y0 = x0.clone()
        def one_shot():
            y = y0
            for _ in range(N):
                buf.copy_(y)
                y = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", gname)
            return y
        try:
            t_one, _ = timed(one_shot)
            # correctness, eager: one all-reduce each way
            a = x0.clone(); dist.all_reduce(a); buf.copy_(x0); b = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", gname)
            torch.cuda.synchronize()
            err = float((a.float() - b.float()).abs().max())
        except Exception as e:
            t_one, err = None, f"{type(e).__name__}: {e}"[:300]
        res[rows] = {"nccl_ms": t_nccl, "one_shot_ms": t_one, "max_err": err}
    if rank == 0:
        q.put(res)
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    ctx = mp.get_context("spawn"); q = ctx.Queue()
    ps = [ctx.Process(target=rank_main, args=(r, 2, q)) for r in range(2)]
    [p.start() for p in ps]
    print(json.dumps(q.get(timeout=240)))
    [p.join(60) for p in ps]
