#!/usr/bin/env python3
"""Where a fresh-graph training step's host time goes (CUDA): the pieces of
graph preparation one by one, then the step phase by phase for the fast
GAT and the floor model (each attention layer replaced by its Linear).

    python benchmarks/fresh_step_breakdown.py [nodes edges]   # 60000 600000

Model and graphs as ``bench_prepare.py``'s step (2-layer GAT 128 -> 8 x 16
-> 40, a new uniformly random graph every step, a clone of one of four made
up front). Pieces: median host time of 200 calls, the device synchronised
before each, a fresh graph made before each. Phases: median of 100 steps,
host time of each phase, and the step's wall time with a sync at its end.
"""
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gat import FloorConv, load_matching  # noqa: E402
from bench_prepare import GAT, random_edges  # noqa: E402


def main():
    from torch_geometric.nn import GATConv

    from pyg_fastattn import FastGATConv, prepare
    dev = torch.device('cuda')
    N, E = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (60000, 600000)
    pool = [random_edges(N, E, dev, s) for s in range(4)]
    it = [0]

    def fresh():
        it[0] = (it[0] + 1) % len(pool)
        return pool[it[0]].clone()

    def host_us(fn, before=lambda: None, n=200):
        hs = []
        for i in range(n + 20):
            a = before()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(a)
            t1 = time.perf_counter()
            if i >= 20:
                hs.append((t1 - t0) * 1e6)
        torch.cuda.synchronize()
        return statistics.median(hs)

    def graph():
        return prepare(fresh(), num_nodes=N, transpose=False)

    def graph_csc():
        return prepare(fresh(), num_nodes=N)

    op = torch.ops.pyg_fastattn
    status = torch.zeros(1, dtype=torch.int32, device=dev)
    pieces = [
        ('prepare(transpose=False)',
         lambda ei: prepare(ei, num_nodes=N, transpose=False), fresh),
        ('prepare(transpose=False, validate=False)',
         lambda ei: prepare(ei, num_nodes=N, transpose=False, validate=False),
         fresh),
        ('csr_build op', lambda ei: op.csr_build(ei[0], ei[1], N, N, True,
                                                 False), fresh),
        ('torch._assert_async(status.eq(0))',
         lambda _: torch._assert_async(status.eq(0), 'bad'), lambda: None),
        ('graph.csc (csc_build + Python)', lambda g: g.csc, graph),
        ('csc_build op', lambda g: op.csc_build(g.rowptr, g.col, N), graph),
        ('max_lengths, first access', lambda g: g.max_lengths, graph_csc),
        ('graph_lengths op', lambda g: op.graph_lengths(g.rowptr, g.csc.colptr),
         graph_csc),
    ]
    print(f'# fresh {N:,} / {E:,} random graphs: host us per call (median)')
    for name, fn, before in pieces:
        print(f'{name:45s} {host_us(fn, before):8.1f}', flush=True)

    torch.manual_seed(0)
    x = torch.randn(N, 128, device=dev)
    y = torch.randint(0, 40, (N, ), device=dev)
    ref = GAT(GATConv).to(dev)
    print('# step phases: host ms (median of 100 steps), wall ms')
    for kind in ('floor', 'fast'):
        if kind == 'floor':
            model = load_matching(GAT(FloorConv).to(dev), ref.state_dict(),
                                  strict=False)
        else:
            model = GAT(FastGATConv).to(dev)
            model.load_state_dict(ref.state_dict())
        opt = torch.optim.Adam(model.parameters(), lr=0.005)
        names = ('prepare', 'csc', 'forward', 'backward', 'adam', 'host',
                 'wall')
        rec = {k: [] for k in names}
        for i in range(120):
            ei = fresh()
            torch.cuda.synchronize()
            t = [time.perf_counter()]
            g = prepare(ei, num_nodes=N, transpose=False) if kind == 'fast' else ei
            t.append(time.perf_counter())
            if kind == 'fast':
                g.csc  # noqa: B018
            t.append(time.perf_counter())
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x, g), y)
            t.append(time.perf_counter())
            loss.backward()
            t.append(time.perf_counter())
            opt.step()
            t.append(time.perf_counter())
            torch.cuda.synchronize()
            t.append(time.perf_counter())
            if i >= 20:
                for k, (a, b) in zip(names[:5], zip(t[:5], t[1:6])):
                    rec[k].append((b - a) * 1e3)
                rec['host'].append((t[5] - t[0]) * 1e3)
                rec['wall'].append((t[6] - t[0]) * 1e3)
        print(f'{kind:6s} ' + ' '.join(
            f'{k} {statistics.median(v):.3f}' for k, v in rec.items()),
            flush=True)


if __name__ == '__main__':
    main()
