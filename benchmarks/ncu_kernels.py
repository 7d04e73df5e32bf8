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
"""
import argparse
import csv
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _graphs import generator, randn, random_csr  # noqa: E402

DEV = torch.device('cuda')


def gat(N, E, H, C, amp):
    from pyg_fastattn import FastGATConv, prepare
    dev = DEV
    ei = torch.randint(N, (2, E), device=dev, generator=generator(dev, 11))
    graph = prepare(ei, num_nodes=N)
    x = randn((N, 128), dev, 12, requires_grad=True)
    gout = randn((N, H * C), dev, 13)
    torch.manual_seed(0)
    conv = FastGATConv(128, C, heads=H).to(dev).train()
    params = list(conv.parameters()) + [x]
    if amp:
        gout = gout.to(torch.bfloat16)

    def fn():
        with torch.autocast(dev.type, torch.bfloat16, enabled=amp):
            out = conv(x, graph)
        return torch.autograd.grad(out, params, gout)
    return fn


def softmax_aggregate(N, deg, H, C):
    from pyg_fastattn.ops import csr_to_csc
    from pyg_fastattn.ops import softmax_aggregate as op
    dev = DEV
    rowptr, col, _ = random_csr(N, dev, deg=deg, seed=11)
    csc = csr_to_csc(rowptr, col, N)
    scores = randn((col.numel(), H), dev, 12, requires_grad=True)
    values = randn((N, H, C), dev, 13, requires_grad=True)
    gout = randn((N, H, C), dev, 14)

    def fn():
        out = op(rowptr, col, scores, values, csc=csc, validate=False)
        return torch.autograd.grad(out, (scores, values), gout)
    return fn


WORKLOADS = {
    'gat_1m': lambda: gat(1_000_000, 20_000_000, 4, 32, False),
    'gat_1m_bf16': lambda: gat(1_000_000, 20_000_000, 4, 32, True),
    'gat_100k': lambda: gat(100_000, 2_000_000, 8, 16, False),
    'sa_1m': lambda: softmax_aggregate(1_000_000, 20, 8, 16),
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
