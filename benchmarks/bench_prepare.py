#!/usr/bin/env python3
"""Graph preparation and the fresh-graph training step.

    python benchmarks/bench_prepare.py                  # CUDA if visible
    python benchmarks/bench_prepare.py --device cpu --quick

Workloads
  ``prepare``  ``pyg_fastattn.prepare`` of a new random graph (uniform
               random edges, ``add_self_loops=True``, default validation)
               at each size (``transpose=False`` unless ``+csc``), from
                 ``unsorted``   a plain [2, E] tensor in random order;
                 ``sorted``     the same edges grouped by destination,
                                ``sorted=True``;
                 ``edge_index`` a ``torch_geometric.EdgeIndex`` with
                                ``sort_order='col'`` (nothing cached);
                 ``unsorted+csc`` / ``sorted+csc``  also building the
                                transpose that the backward walks (what a
                                training step pays; ``prepare``'s default);
                 ``unsorted, validate=sync``  the exact, host-synchronising
                                check (on CPU the default does the same);
                 ``..., validate=off``  no check (the cost of validation is
                                the difference).
  ``step``     one training step of a 2-layer GAT (128 -> 8 x 16 -> 40,
               ELU, dropout 0.6, Adam) on a new graph every step, as a
               sampler gives: zero_grad, forward, cross-entropy over all
               nodes, backward, step. Providers: ``fast`` (plain tensor,
               random order), ``fast_sorted`` (``EdgeIndex`` sorted by
               destination), ``floor`` (each attention layer replaced by
               its Linear + bias: the step's cost without attention),
               ``pyg`` (GATConv eager) and ``pyg_compile`` (``torch.compile``
               of the PyG model; same shapes every step).
               The new graph is a fresh tensor (a copy of one of a few
               pre-made graphs, made outside the timed region), so no cache
               can hit.
  ``infer``    the same model's forward pass in eval mode under
               ``torch.no_grad()`` on a new graph every call (inference
               over sampled subgraphs); same providers.

Timing: ``benchmarks/_timing.py`` (CUDA events, median; ``host_ms`` = time
until the Python call returns, the device synchronised before each call).
Outputs in ``--out`` (default ``bench_out/``): ``prepare_<device>.json``,
``.csv``, ``.md``.
"""
import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import env_info, env_lines, pick_device, setup_threads  # noqa: E402
from _memory import free_memory, guarded  # noqa: E402
from _report import md_table, write_outputs  # noqa: E402
from _timing import Budget, add_timing_args, time_fn  # noqa: E402


def parse_sizes(text):
    """'100k:2M,1M:20M' -> [(100000, 2000000), (1000000, 20000000)]."""
    mult = {'k': 10**3, 'M': 10**6, 'G': 10**9}

    def num(s):
        return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)

    return [tuple(num(p) for p in item.split(':'))
            for item in text.split(',') if item]


def random_edges(N, E, dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    return torch.randint(0, N, (2, E), device=dev, generator=g)


def run(fn, dev, args, before=None):
    """time_fn with the script's options; returns the record fields."""
    t = time_fn(fn, dev, warmup=args.warmup, min_reps=args.min_reps,
                max_reps=args.max_reps, budget_s=args.rep_budget or 1.0,
                before=before, host=True)
    return {'median_ms': t['median_ms'], 'p10_ms': t['p10_ms'],
            'p90_ms': t['p90_ms'], 'host_ms': t['host_median_ms'],
            'reps': t['reps']}


def prepare_workload(N, E, dev, args):
    from torch_geometric import EdgeIndex

    from pyg_fastattn import prepare
    ei = random_edges(N, E, dev, 0)
    eis = ei[:, torch.argsort(ei[1])]
    cases = {
        'unsorted': lambda: prepare(ei, num_nodes=N, transpose=False),
        'sorted': lambda: prepare(eis, num_nodes=N, sorted=True,
                                  transpose=False),
        'edge_index': lambda: prepare(
            EdgeIndex(eis, sparse_size=(N, N), sort_order='col'),
            transpose=False),
        'unsorted+csc': lambda: prepare(ei, num_nodes=N),
        'sorted+csc': lambda: prepare(eis, num_nodes=N, sorted=True),
        'unsorted, validate=sync': lambda: prepare(
            ei, num_nodes=N, validate='sync', transpose=False),
        'unsorted, validate=off': lambda: prepare(
            ei, num_nodes=N, validate=False, transpose=False),
        'sorted, validate=off': lambda: prepare(
            eis, num_nodes=N, sorted=True, validate=False, transpose=False),
    }
    rows = []
    for name, fn in cases.items():
        rec = {'workload': 'prepare', 'nodes': N, 'edges': E, 'input': name}
        st, res, msg = guarded(lambda: run(fn, dev, args), dev)
        rec['status'] = st
        if st == 'ok':
            rec.update(res)
        elif msg:
            rec['message'] = msg
        rows.append(rec)
        print(summary(rec), flush=True)
    return rows


class GAT(torch.nn.Module):
    def __init__(self, conv, fin=128, hidden=16, heads=8, out=40, p=0.6):
        super().__init__()
        self.p = p
        self.conv1 = conv(fin, hidden, heads, dropout=p)
        self.conv2 = conv(hidden * heads, out, heads=1, concat=False,
                          dropout=p)

    def forward(self, x, edge_index):
        x = F.dropout(x, self.p, self.training)
        x = F.elu(self.conv1(x, edge_index))
        x = F.dropout(x, self.p, self.training)
        return self.conv2(x, edge_index)


def step_workload(N, E, dev, args, providers, train=True):
    """The ``step`` rows, or with ``train=False`` the ``infer`` rows."""
    from torch_geometric import EdgeIndex
    from torch_geometric.nn import GATConv

    from bench_gat import FloorConv, load_matching

    from pyg_fastattn import FastGATConv
    torch.manual_seed(0)
    x = torch.randn(N, 128, device=dev)
    y = torch.randint(0, 40, (N, ), device=dev)
    pool = [random_edges(N, E, dev, s) for s in range(4)]
    pool_sorted = [e[:, torch.argsort(e[1])] for e in pool]
    cur = {}
    it = [0]

    def fresh(sorted_):
        def before():
            i = it[0] = (it[0] + 1) % len(pool)
            if sorted_:
                cur['ei'] = EdgeIndex(pool_sorted[i].clone(),
                                      sparse_size=(N, N), sort_order='col')
            else:
                cur['ei'] = pool[i].clone()
        return before

    ref = GAT(GATConv).to(dev)
    rows = []
    for prov in providers:
        rec = {'workload': 'step' if train else 'infer', 'nodes': N,
               'edges': E, 'input': prov}
        if prov == 'pyg':
            model = ref
        elif prov == 'floor':  # attention layers replaced by their Linear
            model = GAT(FloorConv).to(dev)
            load_matching(model, ref.state_dict(), strict=False)
        else:
            model = GAT(FastGATConv if prov.startswith('fast') else
                        GATConv).to(dev)
            model.load_state_dict(ref.state_dict())
        model.train(train)
        opt = torch.optim.Adam(model.parameters(), lr=0.005)
        if prov == 'pyg_compile':
            torch._dynamo.reset()
            model = torch.compile(model)

        def step():
            if not train:
                with torch.no_grad():
                    return model(x, cur['ei'])
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x, cur['ei']), y)
            loss.backward()
            opt.step()

        before = fresh(prov == 'fast_sorted')
        before()
        st, res, msg = guarded(lambda: run(step, dev, args, before), dev)
        rec['status'] = st
        if st == 'ok':
            rec.update(res)
        elif msg:
            rec['message'] = msg[:200]
        rows.append(rec)
        print(summary(rec), flush=True)
        model = opt = None
        free_memory(dev)
    base = {r['input']: r.get('median_ms') for r in rows}
    for r in rows:
        if r.get('median_ms'):
            for b in ('pyg', 'pyg_compile'):
                if base.get(b):
                    r[f'speedup_vs_{b}'] = base[b] / r['median_ms']
            if base.get('floor'):
                r['x_floor'] = r['median_ms'] / base['floor']
    return rows


def summary(r):
    if r.get('status') != 'ok':
        return (f"{r['workload']:8s} {r['nodes']:>9d} {r['edges']:>10d} "
                f"{r['input']:26s} {r.get('status')} {r.get('message', '')}")
    return (f"{r['workload']:8s} {r['nodes']:>9d} {r['edges']:>10d} "
            f"{r['input']:26s} {r['median_ms']:9.3f} ms  host "
            f"{r['host_ms']:8.3f} ms")


def markdown(meta, rows):
    cols = [('workload', 'workload'), ('nodes', 'nodes'), ('edges', 'edges'),
            ('input / provider', 'input'), ('median ms', 'median_ms'),
            ('p10', 'p10_ms'), ('p90', 'p90_ms'), ('host ms', 'host_ms'),
            ('x pyg', 'speedup_vs_pyg'),
            ('x pyg_compile', 'speedup_vs_pyg_compile'),
            ('x floor', 'x_floor'), ('status', 'status')]
    return '\n'.join(['# Graph preparation and fresh-graph steps', ''] +
                     [f'- {line}' for line in env_lines(meta)] +
                     ['', md_table(rows, cols)])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--device', default='auto')
    ap.add_argument('--quick', action='store_true',
                    help='small sizes (CPU smoke run)')
    ap.add_argument('--sizes', default=None,
                    help='prepare sizes, nodes:edges,... '
                         '(default 100k:2M,1M:20M,2M:100M; --quick 2k:20k)')
    ap.add_argument('--step-size', default=None,
                    help='nodes:edges of the fresh-graph step '
                         '(default 60k:600k; --quick 3k:30k)')
    ap.add_argument('--providers', default='fast,fast_sorted,floor,pyg,pyg_compile')
    ap.add_argument('--skip', default='', help='prepare,step,infer')
    ap.add_argument('--out', default='bench_out')
    add_timing_args(ap)
    args = ap.parse_args(argv)
    dev = pick_device(args.device)
    setup_threads(dev)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = parse_sizes(args.sizes or ('2k:20k' if args.quick else
                                       '100k:2M,1M:20M,2M:100M'))
    (step_size, ) = parse_sizes(args.step_size or (
        '3k:30k' if args.quick else '60k:600k'))
    budget = Budget(args.budget_s)
    meta = env_info(dev)
    print('\n'.join(env_lines(meta)), flush=True)
    rows = []
    skip = set(args.skip.split(','))
    providers = [p for p in args.providers.split(',') if p]
    paths = None

    def flush():  # after every workload: a run cut short keeps its rows
        return write_outputs(Path(args.out), f'prepare_{dev.type}', meta,
                             rows, markdown(meta, rows))

    if 'prepare' not in skip:
        for N, E in sizes:
            if budget.spent():
                break
            rows += prepare_workload(N, E, dev, args)
            paths = flush()
            free_memory(dev)
    for name, train in (('step', True), ('infer', False)):
        if name not in skip and not budget.spent():
            rows += step_workload(*step_size, dev, args, providers,
                                  train=train)
            paths = flush()
    if paths is None:  # nothing ran
        paths = flush()
    print('wrote', ', '.join(paths.values()))
    return rows


if __name__ == '__main__':
    main()
