#!/usr/bin/env python3
"""Host time of a Cora training step compiled with ``torch.compile(mode=
"reduce-overhead")`` (CUDA graphs through cudagraph trees), part by part,
for the fast GAT and for the floor model (each attention layer replaced by a
Linear) compiled the same way; the floor's time is what PyTorch's compiled
runtime costs without any attention layer.

    python benchmarks/compile_step.py          # CUDA only
    python benchmarks/compile_step.py prof     # + profiler tables

Median of 120 steps after 30 warm-up steps; inputs marked static
(``torch._dynamo.mark_static_address``) where the row says static=True;
fused Adam outside the compiled graph. Needs the Cora raw files.
"""
import time, statistics, torch, sys
import torch.nn.functional as F
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[1] / 'examples'))
import train_cora as T
from bench_gat import FloorConv  # noqa: E402
from pyg_fastattn import prepare
from pyg_fastattn.datasets import load_planetoid
dev = torch.device('cuda')
data = load_planetoid('Cora', download=False)[0].to(dev)
graph = prepare(data.edge_index, num_nodes=data.num_nodes)
idx = data.train_mask.nonzero().view(-1); ty = data.y[idx]
PROFILE = len(sys.argv) > 1
def run(static, copt, mode='reduce-overhead', floor=False):
    torch._dynamo.reset()
    torch.manual_seed(0)
    conv = FloorConv if floor else T.MODELS['gat']['fast']
    model = T.GAT(conv, data.num_features, 8, 7, 8, 0.6).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4, fused=True,
                           capturable=copt)
    def fl(x, g, i, y):
        return F.cross_entropy(model(x, g)[i], y)
    cfl = torch.compile(fl, mode=mode)
    if static:
        for t in T._tensors(data.x, graph, idx, ty):
            torch._dynamo.mark_static_address(t)
    step = opt.step
    if copt:
        step = torch.compile(opt.step, mode=None)
    parts = {'zero_grad': [], 'fwd': [], 'bwd': [], 'step': [], 'host': [], 'total': []}
    for it in range(150):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        torch.compiler.cudagraph_mark_step_begin()
        loss = cfl(data.x, graph, idx, ty)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        step()
        t4 = time.perf_counter()
        torch.cuda.synchronize()
        t5 = time.perf_counter()
        if it >= 30:
            for k, a, b in (('zero_grad', t0, t1), ('fwd', t1, t2), ('bwd', t2, t3), ('step', t3, t4), ('host', t0, t4), ('total', t0, t5)):
                parts[k].append((b - a) * 1e3)
    print(f'{"floor" if floor else "fast"} static={static} compiled_adam={copt}:', ' '.join(f'{k} {statistics.median(v):.3f}' for k, v in parts.items()), 'ms', flush=True)
    if PROFILE and static and not copt and not floor:
        import cProfile, pstats
        pr = cProfile.Profile(); pr.enable()
        for _ in range(50):
            opt.zero_grad(set_to_none=True)
            torch.compiler.cudagraph_mark_step_begin()
            cfl(data.x, graph, idx, ty).backward(); step()
        torch.cuda.synchronize()
        pr.disable()
        pstats.Stats(pr).sort_stats('tottime').print_stats(35)
    if PROFILE and not static and not floor:
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            for _ in range(10):
                opt.zero_grad(set_to_none=True)
                torch.compiler.cudagraph_mark_step_begin()
                cfl(data.x, graph, idx, ty).backward(); step()
            torch.cuda.synchronize()
        print(p.key_averages().table(sort_by='self_cpu_time_total', row_limit=30, max_name_column_width=80), flush=True)
for static, copt, floor in ((True, False, True), (True, False, False), (False, False, False)):
    try:
        run(static, copt, floor=floor)
    except Exception as e:
        print('variant failed', static, copt, repr(e)[:400], flush=True)
