#!/usr/bin/env python3
"""Where a Cora epoch's time goes: the fast GAT against the floor model (each
attention layer replaced by a Linear), part by part.

    python benchmarks/epoch_breakdown.py cuda      # or cpu

Rows: training epoch (zero_grad, forward, loss, backward, Adam), the same
with attention dropout off, forward+backward, forward in training and in
eval mode, each for the fast model and the floor, and PyG's epoch. wall =
median per step with a device sync after it; host = median time until the
Python call returns (the device synchronised before the call; nothing in a
step syncs: the loss takes the training nodes by index). Then a
``torch.profiler`` table of 20 epochs of each model, by self CPU time, and
the number of CUDA kernels per epoch. Needs the Cora raw files (see
``pyg_fastattn.datasets``).
"""
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch_geometric.nn import GATConv

from pyg_fastattn import FastGATConv
from pyg_fastattn.datasets import load_planetoid

from bench_gat import GAT, FloorConv  # noqa: E402 (this folder)


def main():
    dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else
                       ('cuda' if torch.cuda.is_available() else 'cpu'))
    ds = load_planetoid('Cora', download=False)
    data = ds[0].to(dev)
    x, ei, y = data.x, data.edge_index, data.y
    # The training nodes as indices, found once: PyG's example indexes with
    # the boolean mask, whose nonzero() syncs with the host on every step
    # (then host time would include the forward's GPU time).
    idx = data.train_mask.nonzero().view(-1)
    y_train = y.index_select(0, idx)
    torch.manual_seed(0)
    nf, nc = data.num_features, int(y.max()) + 1

    def Net(conv, p_att=0.6):  # PyG's example GAT; p_att: attention dropout
        model = GAT(conv, nf, 8, nc)
        model.conv1.dropout = model.conv2.dropout = p_att
        return model

    def Floor():  # each attention layer replaced by its lin + bias
        return GAT(FloorConv, nf, 8, nc)

    def sync():
        if dev.type == 'cuda': torch.cuda.synchronize()
    def mk_step(model, what):
        opt = torch.optim.Adam(model.parameters(), lr=0.005, weight_decay=5e-4,
                               fused=dev.type == 'cuda')
        def step():
            if what == 'fwd_eval':
                with torch.no_grad(): model(x, ei)
                return
            opt.zero_grad()
            out = model(x, ei)
            loss = F.cross_entropy(out.index_select(0, idx), y_train)
            if what == 'fwd': return
            loss.backward()
            if what == 'fwdbwd': return
            opt.step()
        return step
    def measure(step, n=200):
        for _ in range(20): step()
        sync()
        hs, ws = [], []
        for _ in range(n):
            sync(); t0 = time.perf_counter(); step(); t1 = time.perf_counter(); sync(); t2 = time.perf_counter()
            hs.append((t1 - t0) * 1e3); ws.append((t2 - t0) * 1e3)
        return statistics.median(ws), statistics.median(hs)
    for name, mk, what, train in [
            ('floor epoch', Floor, 'step', True),
            ('fast epoch', lambda: Net(FastGATConv), 'step', True),
            ('fast epoch p_att=0', lambda: Net(FastGATConv, 0.0), 'step', True),
            ('fast fwd+bwd', lambda: Net(FastGATConv), 'fwdbwd', True),
            ('floor fwd+bwd', Floor, 'fwdbwd', True),
            ('fast fwd(train)', lambda: Net(FastGATConv), 'fwd', True),
            ('floor fwd(train)', Floor, 'fwd', True),
            ('fast fwd eval', lambda: Net(FastGATConv), 'fwd_eval', False),
            ('floor fwd eval', Floor, 'fwd_eval', False),
            ('pyg epoch', lambda: Net(GATConv), 'step', True)]:
        model = mk().to(dev); model.train(train)
        w, h = measure(mk_step(model, what))
        print(f'{name:24s} wall {w:7.3f} ms  host {h:7.3f} ms', flush=True)
    # profile
    from torch.profiler import profile, ProfilerActivity
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == 'cuda' else [])
    for name, mk in [('fast', lambda: Net(FastGATConv)), ('floor', Floor)]:
        model = mk().to(dev); step = mk_step(model, 'step')
        for _ in range(10): step()
        sync()
        with profile(activities=acts) as prof:
            for _ in range(20): step()
            sync()
        ka = prof.key_averages()
        print(f'===== {name}: top ops by self CPU (20 epochs)')
        print(ka.table(sort_by='self_cpu_time_total', row_limit=45, max_name_column_width=60))
        nk = sum(e.count for e in ka if e.device_type == torch.autograd.DeviceType.CUDA) if dev.type=='cuda' else 0
        print(f'{name}: CUDA kernel events per epoch: {nk/20:.1f}')


if __name__ == '__main__':
    main()
