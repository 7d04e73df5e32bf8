#!/usr/bin/env python3
"""Where the time of a GAT workload goes: ``torch.profiler`` tables of the
fast layer (and PyG's, and the Linear floor's) for the training epoch, one
layer forward+backward, a training step on a fresh graph and graph
preparation.

    python benchmarks/profile_gat.py --device cuda            # all workloads
    python benchmarks/profile_gat.py --device cpu --only Cora
    python benchmarks/profile_gat.py --conv gatv2 --only layer --providers fast,fast_bf16
    python benchmarks/profile_gat.py --only layer --x-grad   # x requiring grad too

Prints, per workload and provider: median time, number of dispatched aten
ops (host overhead per op is what bounds small graphs) and the top kernels
(CUDA) or ops (CPU) by self time; the host-bound epochs and step are sorted
by self CPU (host) time on CUDA too. Not a benchmark of record; see
``bench_gat.py`` for that.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import pick_device, setup_threads  # noqa: E402
from _graphs import generator, randn, skewed_csr  # noqa: E402
from _memory import free_memory, guarded  # noqa: E402
from _timing import sync, time_fn  # noqa: E402
import bench_gat as B  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch_geometric.nn import GATConv  # noqa: E402

from pyg_fastattn import FastGATConv, prepare  # noqa: E402


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def epoch_fn(conv, name, dev):
    data, _ = B.load_dataset(name)
    x, ei, y = data.x.to(dev), data.edge_index.to(dev), data.y.to(dev)
    idx = data.train_mask.nonzero().view(-1).to(dev)
    torch.manual_seed(0)
    m = B.GAT(conv, x.size(1), 8, int(data.y.max()) + 1).to(dev).train()
    opt = torch.optim.Adam(m.parameters(), lr=0.005, weight_decay=5e-4)
    return B.train_step(m, opt, x, ei, y, idx)


def layer_fn(conv, N, E, fin, H, C, dev, graph=None, amp=False, x_grad=False):
    if graph is None:  # uniform random edges
        ei = torch.randint(N, (2, E), device=dev, generator=generator(dev, 11))
    else:  # ('power', s): as bench_gat.py's power-law workloads
        _, col, row = skewed_csr(graph[0], N, E, dev, s=graph[1], seed=11)
        ei = torch.stack([col, row])
    x = randn((N, fin), dev, 12, requires_grad=x_grad)  # x_grad: a hidden layer
    gout = randn((N, H * C), dev, 13)
    torch.manual_seed(0)
    m = conv(fin, C, heads=H).to(dev).train()
    params = list(m.parameters()) + ([x] if x_grad else [])
    if not amp:
        return lambda: torch.autograd.grad(m(x, ei), params, gout)

    def fn():
        with torch.autocast(dev.type, torch.bfloat16):
            out = m(x, ei)
        return torch.autograd.grad(out, params, gout.to(out.dtype))
    return fn


def prepare_fn(dev, N, E, is_sorted):
    """``prepare`` of a new copy of one random graph (as bench_prepare.py);
    sorted: grouped by destination, ``sorted=True``, no transpose."""
    ei = torch.randint(N, (2, E), device=dev, generator=generator(dev, 11))
    if is_sorted:
        ei = ei[:, torch.argsort(ei[1], stable=True)]
    return lambda: prepare(ei.clone(), num_nodes=N, sorted=is_sorted,
                           transpose=not is_sorted)


def step_fn(conv, dev, N=60_000, E=600_000):
    """One training step of bench_prepare.py's 2-layer GAT on a new graph
    (a fresh copy of one of 4 random graphs) every call."""
    from bench_prepare import GAT as StepGAT
    torch.manual_seed(0)
    x = torch.randn(N, 128, device=dev)
    y = torch.randint(0, 40, (N, ), device=dev)
    pool = [torch.randint(N, (2, E), device=dev, generator=generator(dev, s))
            for s in range(4)]
    m = StepGAT(conv).to(dev).train()
    opt = torch.optim.Adam(m.parameters(), lr=0.005)
    it = [0]

    def fn():
        it[0] += 1
        ei = pool[it[0] % 4].clone()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(m(x, ei), y).backward()
        opt.step()
    return fn


def profile(label, fn, dev, rows, host=False):
    t = time_fn(fn, dev, warmup=3, min_reps=5, max_reps=50, budget_s=2)
    c = OpCount()
    with c:
        fn()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == 'cuda':
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as p:
        for _ in range(3):
            fn()
        sync(dev)
    key = ('self_cuda_time_total' if dev.type == 'cuda' and not host
           else 'self_cpu_time_total')
    print(f'\n=== {label}: median {t["median_ms"]:.3f} ms, wall '
          f'{t["wall_ms"]:.3f} ms/call, {c.n} aten ops/call (3 calls below)')
    print(p.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--device', default=None)
    ap.add_argument('--only', default=None, help='substring filter')
    ap.add_argument('--providers', default='fast,pyg')
    ap.add_argument('--rows', type=int, default=18)
    ap.add_argument('--conv', default='gat', choices=sorted(B.CONVS),
                    help='the layer of the layer workloads')
    ap.add_argument('--x-grad', action='store_true',
                    help='layer workloads also differentiate x (a hidden '
                         'layer, as bench_gat.py --x-grad)')
    args = ap.parse_args()
    dev = pick_device(args.device)
    setup_threads(dev)
    import pyg_fastattn
    import torch_geometric.nn as pyg_nn
    pyg_name, fast_name = B.CONVS[args.conv]
    convs = {'fast': getattr(pyg_fastattn, fast_name),
             'fast_bf16': getattr(pyg_fastattn, fast_name),
             'pyg': getattr(pyg_nn, pyg_name)}
    if dev.type == 'cuda':
        layers = [(100_000, 2_000_000, 128, 8, 16), (1_000_000, 20_000_000, 128, 4, 32)]
    else:
        layers = [(50_000, 1_000_000, 64, 4, 16)]
    # the epochs are GAT models; the layers take --conv
    work = [(f'{n} epoch', lambda c, a, n=n: epoch_fn(c, n, dev))
            for n in ('Cora', 'CiteSeer')]
    xg = ' x-grad' if args.x_grad else ''
    work += [(f'layer {N}/{E} {fin}->{H}x{C} fwd+bwd{xg}',
              lambda c, a, s=(N, E, fin, H, C): layer_fn(
                  c, *s, dev, amp=a, x_grad=args.x_grad))
             for N, E, fin, H, C in layers]
    if dev.type == 'cuda':
        work.append((f'layer 1000000/20000000 power s=1.0 128->4x32 fwd+bwd{xg}',
                     lambda c, a: layer_fn(c, 1_000_000, 20_000_000, 128, 4,
                                           32, dev, ('power', 1.0), amp=a,
                                           x_grad=args.x_grad)))
    work.append(('step 60000/600000 fresh graph',
                 lambda c, a: step_fn(c, dev)))
    if dev.type == 'cuda':
        work += [(f'prepare 1000000/20000000 {tag}',
                  lambda c, a, s=s: prepare_fn(dev, 1_000_000, 20_000_000, s))
                 for tag, s in (('unsorted+csc', False), ('sorted', True))]
    for label, make in work:
        if args.only and not any(s in label for s in args.only.split(',')):
            continue
        for prov in args.providers.split(','):
            if label.startswith('prepare') and prov != 'fast':
                continue
            if prov == 'fast_bf16' and not label.startswith('layer'):
                continue
            if prov == 'floor' and label.startswith(('layer', 'prepare')):
                continue
            conv = convs[prov] if label.startswith('layer') else {
                'pyg': GATConv, 'floor': B.FloorConv}.get(prov, FastGATConv)
            st, _, msg = guarded(lambda: profile(
                f'{label} [{prov}, {args.conv if label.startswith("layer") else "gat"}]',
                make(conv, prov == 'fast_bf16'), dev, args.rows,
                host=label.startswith(('step', 'Cora', 'CiteSeer'))), dev)
            if st != 'ok':
                print(f'\n=== {label} [{prov}]: {st} {msg}')
            free_memory(dev)


if __name__ == '__main__':
    main()
