#!/usr/bin/env python3
"""Hardware counters of the layer's kernels with Nsight Compute (CUDA).

One workload runs a few warm-up calls, then exactly one call between
``cudaProfilerStart`` and ``cudaProfilerStop``, so ``ncu
--profile-from-start off`` sees that call's kernels only (the graph is
prepared before, outside the range):

    ncu --profile-from-start off --clock-control none --set full -o rep \\
        python benchmarks/ncu_kernels.py gat_1m
    ncu --import rep.ncu-rep --page source --csv --print-source sass \\
        --kernel-name regex:attention_bwd > bwd.csv
    python benchmarks/ncu_kernels.py --hotspots bwd.csv   # hottest SASS lines

Workloads (uniformly random edges, x requiring grad as in a hidden layer):
  gat_1m       FastGATConv 128 -> 4 x 32, 1M nodes / 20M edges, fp32 fwd+bwd
  gat_1m_bf16  the same under torch.autocast(bfloat16)
  gat_100k     FastGATConv 128 -> 8 x 16, 100k nodes / 2M edges, fp32 fwd+bwd
  sa_1m        softmax_aggregate, 1M rows x 20 edges x 8 heads x 16 channels,
               fp32 fwd+bwd (scores and values require grad)
  sa_1m_bf16   the same in bfloat16
"""
import argparse
import csv
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def gat(N, E, H, C, amp):
    """profile_gat's layer forward+backward, x requiring grad (the layer's
    prepared-graph cache serves the edge_index after the warm-up)."""
    from pyg_fastattn import FastGATConv
    from profile_gat import layer_fn
    return layer_fn(FastGATConv, N, E, 128, H, C, torch.device('cuda'),
                    amp=amp, x_grad=True)


def softmax_aggregate(N, deg, H, C, dtype=torch.float32):
    """bench_ops.py's softmax_aggregate data (int64 indices), forward+backward."""
    from bench_ops import _aggregate_data
    from pyg_fastattn.ops import softmax_aggregate as op
    rowptr, col, _, _, s, v, g, csc = _aggregate_data(torch.device('cuda'), N, deg, H, C)
    s, v = (t.detach().to(dtype).requires_grad_(True) for t in (s, v))
    g = g.to(dtype)
    return lambda: torch.autograd.grad(
        op(rowptr, col, s, v, csc=csc, validate=False), (s, v), g)


WORKLOADS = {
    'gat_1m': lambda: gat(1_000_000, 20_000_000, 4, 32, False),
    'gat_1m_bf16': lambda: gat(1_000_000, 20_000_000, 4, 32, True),
    'gat_100k': lambda: gat(100_000, 2_000_000, 8, 16, False),
    'sa_1m': lambda: softmax_aggregate(1_000_000, 20, 8, 16),
    'sa_1m_bf16': lambda: softmax_aggregate(1_000_000, 20, 8, 16, torch.bfloat16),
}


def run(name, warmup):
    fn = WORKLOADS[name]()
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f'{name}: one call profiled after {warmup} warm-up calls')


def hotspots(path, top):
    """The SASS lines of an ``ncu --page source --csv`` export with the most
    stall samples, with every sampling and executed-count column."""
    with open(path, newline='') as f:
        lines = [l for l in f if l.strip() and not l.startswith('==')]
    # the table starts at its header (ncu may print other lines before it)
    start = next((n for n, l in enumerate(lines)
                  if 'Address' in l and 'Source' in l), 0)
    rows = [{k: v for k, v in r.items() if k is not None}
            for r in csv.DictReader(lines[start:])]
    if not rows:
        print(f'{path}: no rows')
        return

    def num(v):
        try:
            return float(str(v).replace(',', ''))
        except ValueError:
            return 0.0
    keys = list(rows[0].keys())
    samples = next((k for k in keys if 'Sampling' in k and 'All' in k),
                   next((k for k in keys if 'Sampling' in k), None))
    if samples is None:
        print(f'{path}: no stall-sampling column among {keys}')
        return
    shown = [k for k in keys if any(s in k for s in ('Sampling', 'Executed', 'stall', 'Stall'))]
    total = sum(num(r[samples]) for r in rows) or 1.0
    src = next((k for k in keys if k.strip().lower() == 'source'), keys[min(1, len(keys) - 1)])
    addr = keys[0]
    print(f'# {path}: {len(rows)} SASS lines, {total:.0f} samples ({samples})')
    execd = next((k for k in keys if k.startswith('Instructions Executed')), None)

    def opcode(text):  # '@!P0 LDG.E.128 R4, ...' -> 'LDG'
        words = [w for w in text.split() if not w.startswith('@')]
        return words[0].split('.')[0] if words else ''
    for op in ('LDL', 'STL', 'LDG', 'STG', 'SHFL', 'MUFU', 'BAR'):
        sel = [r for r in rows if opcode(r[src]) == op]
        if sel:
            ex = sum(num(r[execd]) for r in sel) if execd else 0
            print(f'# {op:5s} {len(sel):4d} lines, {sum(num(r[samples]) for r in sel) / total:6.1%}'
                  f' of samples, {ex:,.0f} executed')
    print('# ' + ' | '.join(['share', addr, src] + shown))
    for r in sorted(rows, key=lambda r: -num(r[samples]))[:top]:
        print(' | '.join([f'{num(r[samples]) / total:6.1%}', r[addr], r[src].strip()] +
                         [r[k] for k in shown]))


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('workload', nargs='?', choices=sorted(WORKLOADS))
    p.add_argument('--warmup', type=int, default=3)
    p.add_argument('--hotspots', metavar='CSV', help='summarize a source-page export')
    p.add_argument('--top', type=int, default=40)
    a = p.parse_args()
    if a.hotspots:
        hotspots(a.hotspots, a.top)
    elif a.workload:
        run(a.workload, a.warmup)
    else:
        p.error('a workload or --hotspots')


if __name__ == '__main__':
    main()
