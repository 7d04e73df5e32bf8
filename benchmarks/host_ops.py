#!/usr/bin/env python3
"""Host time per call of the pieces of a Cora GAT layer (PyG's example
model: 1433 -> 8 x 8, then 64 -> 1 x 7), beside a Linear of the same
shape: what a host-bound epoch pays per layer.

    python benchmarks/host_ops.py cuda      # or cpu

Each row is the median time until the Python call returns, over 1,500
calls after 50 of warm-up; on CUDA the device is synchronised every 50
calls, outside the timed call, so a row holds no GPU time unless the call
itself waits. The graph is a random one of Cora's size (2,708 nodes,
10,556 edges); "prepared" rows pass a :class:`PreparedGraph`, the others
the ``edge_index`` (a cache hit after the first call).
"""
import statistics
import sys
import time

import torch

import pyg_fastattn.ops as ops
from pyg_fastattn import FastGATConv, prepare


def main():
    dev = sys.argv[1] if len(sys.argv) > 1 else (
        'cuda' if torch.cuda.is_available() else 'cpu')
    sync = torch.cuda.synchronize if dev == 'cuda' else (lambda: None)

    def t(fn, n=1500):
        for _ in range(50):
            fn()
        sync()
        ts = []
        for k in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
            if k % 50 == 49:
                sync()
        sync()
        return statistics.median(ts) * 1e6

    torch.manual_seed(0)
    N, E = 2708, 10556
    ei = torch.randint(0, N, (2, E), device=dev)
    g = prepare(ei, num_nodes=N)
    print(f'device {dev}' + (f' ({torch.cuda.get_device_name()})'
                             if dev == 'cuda' else ''))
    for fin, H, C in [(1433, 8, 8), (64, 1, 7)]:
        x = torch.randn(N, fin, device=dev)
        xg = x.clone().requires_grad_()
        conv = FastGATConv(fin, C, heads=H, dropout=0.6).to(dev)
        lin = torch.nn.Linear(fin, H * C).to(dev)
        rows = {
            'empty + add_ (one launch)':
            lambda: torch.empty(N, H * C, device=dev).add_(1),
            'Linear forward': lambda: lin(x),
            'Linear forward+backward': lambda: lin(x).sum().backward(),
            'Linear forward+backward, x-grad':
            lambda: lin(xg).sum().backward(),
            'sum().backward() of a leaf': lambda: xg.sum().backward(),
        }
        for name, fn in rows.items():
            print(f'{fin}->{H}x{C} {name:44s} {t(fn):8.1f} us', flush=True)
        for train in (False, True):
            conv.train(train)
            m = 'train' if train else 'eval'
            with torch.no_grad():
                a = t(lambda: conv(x, ei))
                b = t(lambda: conv(x, g))
            rows = {f'conv forward, {m}, no grad': a,
                    f'conv forward, {m}, no grad, prepared': b,
                    f'conv forward, {m}': t(lambda: conv(x, ei)),
                    f'conv forward+backward, {m}':
                    t(lambda: conv(x, ei).sum().backward()),
                    f'conv forward+backward, {m}, x-grad':
                    t(lambda: conv(xg, ei).sum().backward())}
            for name, us in rows.items():
                print(f'{fin}->{H}x{C} {name:44s} {us:8.1f} us', flush=True)
        conv.train()
        h = torch.randn(N, H, C, device=dev)
        s = torch.randn(N, H, device=dev)
        rows = {'dropout_mask': lambda: conv.dropout_mask(E + N, H, x),
                'ops.attention (no grad)':
                lambda: ops.attention(g.rowptr, g.col, h, s, s)}
        for name, fn in rows.items():
            print(f'{fin}->{H}x{C} {name:44s} {t(fn):8.1f} us', flush=True)


if __name__ == '__main__':
    main()
