#!/usr/bin/env python3
"""Mini-batch GAT training with neighbor sampling, FastGATConv against
GATConv on the same batches.

    python examples/train_minibatch.py                         # 1M nodes
    python examples/train_minibatch.py --nodes 20000 --max-steps 20 --layer both
    python examples/train_minibatch.py --device cuda --layers 3 --fanout 15,10,5

The graph is synthetic (``power_law_graph``): ``--nodes`` nodes (default
1M), ``--avg-degree`` x nodes directed edges whose endpoints are drawn from a
Zipf-like weight ``(rank + 1) ** -0.75`` over randomly permuted ids (a
power-law degree distribution with hubs); with probability
``--homophily`` an edge's destination is moved to the nearest id of the
source's class. Features are noise plus a class signal, so both the node
and the graph carry information.

Batches follow PyG's recipe: ``NeighborLoader`` (needs pyg-lib or
torch-sparse) samples ``--fanout`` in-neighbours per hop around a batch of
training nodes; nodes come seeds first, then each hop's new nodes, edges
grouped by hop. Each layer runs on its bipartite message-flow graph
(``--mfg bipartite``, default: only the nodes a later layer reads are
computed) or, with ``--mfg trim``, on the graph that PyG's
``trim_to_layer`` leaves (see ``GAT``). The fast layers get the edges as a
``torch_geometric.EdgeIndex`` sorted by destination (PyG's loaders expect
their samplers' edges sorted by destination, CSC layout; a wrong order is
caught by the graph validation), which skips the sort when the graph is
prepared. Without pyg-lib and
torch-sparse a small pure-PyTorch sampler here (``TorchNeighborSampler``)
gives batches of the same structure, and the script says so.

Per epoch it prints the loader's time (sampling, slicing features, copying
to the device) apart from each model's time (forward, loss, backward,
optimizer step; with ``--layer both`` both models train on the same
batches, from the same initial weights).
"""
import argparse
import time
from types import SimpleNamespace
from typing import List

import torch
import torch.nn.functional as F

from torch_geometric import EdgeIndex
from torch_geometric.nn import GATConv
from torch_geometric.utils import trim_to_layer

from pyg_fastattn import FastGATConv


def power_law_graph(num_nodes: int, avg_degree: float, num_features: int,
                    num_classes: int, homophily: float = 0.7, seed: int = 0):
    """(x, y, edge_index) of the synthetic graph described above."""
    g = torch.Generator().manual_seed(seed)
    N, E = num_nodes, int(num_nodes * avg_degree)
    weight = torch.arange(1, N + 1, dtype=torch.float64).pow(-0.75)
    cdf = weight.cumsum(0)
    cdf /= cdf[-1].clone()
    ids = torch.randperm(N, generator=g)  # rank -> node id

    def draw(n):
        r = torch.rand(n, generator=g, dtype=torch.float64)
        return ids[torch.searchsorted(cdf, r).clamp_(max=N - 1)]

    y = torch.randint(0, num_classes, (N, ), generator=g)
    src, dst = draw(E), draw(E)
    # Homophily: move dst to the nearest node (by id) of src's class.
    by_class = [torch.nonzero(y == c).flatten() for c in range(num_classes)]
    move = torch.rand(E, generator=g) < homophily
    for c in range(num_classes):
        sel = move & (y[src] == c)
        if by_class[c].numel() and sel.any():
            pos = torch.searchsorted(by_class[c], dst[sel])
            dst[sel] = by_class[c][pos.clamp_(max=by_class[c].numel() - 1)]
    signal = torch.randn(num_classes, num_features, generator=g)
    x = torch.randn(N, num_features, generator=g) + 0.5 * signal[y]
    return x, y, torch.stack([src, dst])


class TorchNeighborSampler:
    """Neighbor sampling in plain PyTorch, for when neither pyg-lib nor
    torch-sparse is installed: batches shaped as ``NeighborLoader``'s
    (``n_id`` seeds first, then each hop's new nodes; local ``edge_index``
    grouped by hop and, within a hop, by destination; ``batch_size``,
    ``num_sampled_nodes``, ``num_sampled_edges``, ``x``, ``y``).
    Each node draws up to ``fanout`` of its in-neighbours without
    replacement. Slower than the compiled samplers; correct, not tuned."""

    def __init__(self, x, y, edge_index, num_nodes, fanouts: List[int],
                 input_nodes, batch_size, shuffle=True, seed=0):
        self.x, self.y, self.N = x, y, num_nodes
        self.fanouts, self.batch_size, self.shuffle = fanouts, batch_size, shuffle
        self.input_nodes = input_nodes
        src, dst = edge_index
        perm = torch.argsort(dst, stable=True)
        self.row = src[perm]  # in-neighbours, grouped by destination
        self.colptr = torch.searchsorted(dst[perm], torch.arange(num_nodes + 1))
        self.local = torch.full((num_nodes, ), -1, dtype=torch.long)
        self.gen = torch.Generator().manual_seed(seed)

    def __len__(self):
        return -(-self.input_nodes.numel() // self.batch_size)

    def __iter__(self):
        nodes = self.input_nodes
        if self.shuffle:
            nodes = nodes[torch.randperm(nodes.numel(), generator=self.gen)]
        for i in range(0, nodes.numel(), self.batch_size):
            yield self.sample(nodes[i:i + self.batch_size])

    def _hop(self, frontier, k):
        """(src global, dst position in frontier) of up to k in-neighbours
        per frontier node, drawn without replacement."""
        start = self.colptr[frontier]
        deg = self.colptr[frontier + 1] - start
        total = int(deg.sum())
        seg = torch.repeat_interleave(torch.arange(frontier.numel()), deg,
                                      output_size=total)
        first = torch.cumsum(deg, 0) - deg
        off = torch.arange(total) - first[seg]
        key = torch.rand(total, generator=self.gen)
        order = torch.argsort(key)  # random order ...
        order = order[torch.argsort(seg[order], stable=True)]  # ... per node
        rank = torch.arange(total) - first[seg[order]]
        take = order[rank < k]
        return self.row[start[seg[take]] + off[take]], seg[take]

    def sample(self, seeds):
        local = self.local
        local[seeds] = torch.arange(seeds.numel())
        n_id, frontier = [seeds], seeds
        rows, cols, n_nodes, n_edges = [], [], [seeds.numel()], []
        count = seeds.numel()
        for k in self.fanouts:
            src, seg = self._hop(frontier, k)
            new = torch.unique(src[local[src] < 0])
            local[new] = torch.arange(count, count + new.numel())
            count += new.numel()
            rows.append(local[src])
            cols.append(local[frontier][seg])
            n_id.append(new)
            n_nodes.append(new.numel())
            n_edges.append(src.numel())
            frontier = new
        n_id = torch.cat(n_id)
        local[n_id] = -1
        return SimpleNamespace(
            x=self.x[n_id], y=self.y[n_id], n_id=n_id,
            edge_index=torch.stack([torch.cat(rows), torch.cat(cols)]),
            batch_size=seeds.numel(), num_sampled_nodes=n_nodes,
            num_sampled_edges=n_edges)


def make_loader(x, y, edge_index, num_nodes, fanouts, train_idx, batch_size,
                which='auto', seed=0):
    """PyG's NeighborLoader when a sampler backend is installed, else
    :class:`TorchNeighborSampler`. Returns (loader, name)."""
    import torch_geometric.typing as tg
    have = tg.WITH_PYG_LIB or tg.WITH_TORCH_SPARSE
    if which == 'pyg' and not have:
        raise SystemExit('--sampler pyg: NeighborLoader needs pyg-lib or '
                         'torch-sparse (pip install ".[sampling]")')
    if which == 'torch' or not have:
        return (TorchNeighborSampler(x, y, edge_index, num_nodes, fanouts,
                                     train_idx, batch_size, seed=seed),
                'pure-PyTorch fallback sampler (pyg-lib / torch-sparse '
                'not installed)' if not have else 'pure-PyTorch sampler')
    from torch_geometric.data import Data
    from torch_geometric.loader import NeighborLoader
    torch.manual_seed(seed)
    data = Data(x=x, y=y, edge_index=edge_index, num_nodes=num_nodes)
    loader = NeighborLoader(data, num_neighbors=fanouts, batch_size=batch_size,
                            input_nodes=train_idx, shuffle=True)
    backend = 'pyg-lib' if tg.WITH_PYG_LIB else 'torch-sparse'
    return loader, f'torch_geometric.loader.NeighborLoader ({backend})'


def hop_counts(batch, num_hops: int):
    """``(num_sampled_nodes, num_sampled_edges)`` of a sampled batch, as
    lists. pyg-lib's sampler reports them; torch-sparse's does not, so they
    are recovered here: a node's hop is its BFS distance from the seeds over
    the batch's edges, and hop ``k``'s edges are those into hop ``k - 1``.
    Both samplers list nodes and edges hop by hop, which is checked."""
    if getattr(batch, 'num_sampled_nodes', None) is not None:
        return list(batch.num_sampled_nodes), list(batch.num_sampled_edges)
    src, dst = batch.edge_index
    n = batch.num_nodes
    hop = torch.full((n, ), num_hops + 1, dtype=torch.long)
    hop[:batch.batch_size] = 0
    for k in range(num_hops):
        into = hop[dst] == k
        hop.scatter_reduce_(0, src[into], torch.full_like(src[into], k + 1),
                            'amin')
    dst_hop = hop[dst]
    if (hop[1:] < hop[:-1]).any() or (dst_hop[1:] < dst_hop[:-1]).any() \
            or (n > 0 and int(hop.max()) > num_hops):
        raise RuntimeError('the sampler did not list nodes and edges hop by '
                           'hop; cannot build per-layer graphs')
    nodes = torch.bincount(hop, minlength=num_hops + 1).tolist()
    edges = torch.bincount(dst_hop, minlength=num_hops).tolist()
    return nodes[:num_hops + 1], edges[:num_hops]


class GAT(torch.nn.Module):
    """``layers`` GAT layers (ELU between them, heads averaged in the last)
    on a sampled batch, in one of two layouts:

    * ``'bipartite'``: layer ``i`` runs on its message-flow graph: sources
      = the nodes of hops ``0..K-i``, targets = those of hops ``0..K-i-1``
      (the rows a later layer reads), edges = hops ``1..K-i`` (a prefix of
      the batch's edges), called ``conv((x, x[:n_dst]), edge_index,
      size=(n_src, n_dst))``. Its output has exactly the next layer's
      source rows.
    * ``'trim'``: PyG's recipe verbatim: ``trim_to_layer`` drops the last
      hop's nodes and edges before each layer, which then runs on the
      trimmed graph (``conv(x, edge_index)``).

    The fast layers get the edges as an ``EdgeIndex`` sorted by destination
    (both layouts keep the sampler's order), so preparation skips the sort.
    """

    def __init__(self, conv, in_channels, hidden, heads, out_channels,
                 layers=2, dropout=0.2, mfg='bipartite'):
        super().__init__()
        self.fast = conv is FastGATConv
        self.dropout, self.mfg = dropout, mfg
        self.convs = torch.nn.ModuleList()
        for i in range(layers):
            last = i == layers - 1
            self.convs.append(conv(in_channels if i == 0 else hidden * heads,
                                   out_channels if last else hidden,
                                   heads=1 if last else heads,
                                   concat=not last, dropout=dropout))

    def forward(self, x, edge_index, num_sampled_nodes, num_sampled_edges):
        K = len(self.convs)
        for i, conv in enumerate(self.convs):
            if self.mfg == 'trim':
                x, edge_index, _ = trim_to_layer(
                    i, num_sampled_nodes, num_sampled_edges, x, edge_index)
                n_src = n_dst = x.size(0)
                ei = edge_index
            else:
                n_src = sum(num_sampled_nodes[:K - i + 1])
                n_dst = sum(num_sampled_nodes[:K - i])
                ei = edge_index[:, :sum(num_sampled_edges[:K - i])]
            if self.fast:  # sampler output is grouped by destination
                ei = EdgeIndex(ei, sparse_size=(n_src, n_dst),
                               sort_order='col')
            x = F.dropout(x, self.dropout, self.training)
            if self.mfg == 'trim':
                x = conv(x, ei)
            else:
                x = conv((x, x[:n_dst]), ei, size=(n_src, n_dst))
            if i < K - 1:
                x = F.elu(x)
        return x[:num_sampled_nodes[0]]


def sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def run(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--nodes', type=int, default=1_000_000)
    ap.add_argument('--avg-degree', type=float, default=10.0)
    ap.add_argument('--features', type=int, default=128)
    ap.add_argument('--classes', type=int, default=16)
    ap.add_argument('--homophily', type=float, default=0.7)
    ap.add_argument('--train-frac', type=float, default=0.1)
    ap.add_argument('--layers', type=int, default=2, choices=[2, 3])
    ap.add_argument('--fanout', default=None,
                    help='neighbours per hop, e.g. 15,10 (default 10 per layer)')
    ap.add_argument('--hidden', type=int, default=16)
    ap.add_argument('--heads', type=int, default=8)
    ap.add_argument('--batch-size', type=int, default=1024)
    ap.add_argument('--epochs', type=int, default=1)
    ap.add_argument('--max-steps', type=int, default=None,
                    help='stop each epoch after this many batches')
    ap.add_argument('--lr', type=float, default=0.005)
    ap.add_argument('--dropout', type=float, default=0.2)
    ap.add_argument('--mfg', choices=['bipartite', 'trim'],
                    default='bipartite', help='per-layer graph layout (GAT)')
    ap.add_argument('--layer', choices=['fast', 'pyg', 'both'], default='both')
    ap.add_argument('--sampler', choices=['auto', 'pyg', 'torch'],
                    default='auto')
    ap.add_argument('--device', default='auto')
    ap.add_argument('--log-every', type=int, default=20)
    ap.add_argument('--seed', type=int, default=0)
    args = ap.parse_args(argv)
    dev = torch.device(args.device if args.device != 'auto' else
                       'cuda' if torch.cuda.is_available() else 'cpu')
    fanouts = ([int(f) for f in args.fanout.split(',')] if args.fanout
               else [10] * args.layers)
    if len(fanouts) != args.layers:
        raise SystemExit('--fanout needs one number per layer')

    t0 = time.perf_counter()
    x, y, edge_index = power_law_graph(args.nodes, args.avg_degree,
                                       args.features, args.classes,
                                       args.homophily, args.seed)
    N = args.nodes
    deg = torch.bincount(edge_index[1], minlength=N)
    print(f'graph: {N} nodes, {edge_index.size(1)} edges, in-degree max '
          f'{int(deg.max())}, median {int(deg.median())} '
          f'({time.perf_counter() - t0:.1f} s to generate)', flush=True)
    g = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(N, generator=g)
    n_train = max(1, int(args.train_frac * N))
    train_idx = perm[:n_train]
    t0 = time.perf_counter()
    loader, sampler_name = make_loader(x, y, edge_index, N, fanouts,
                                       train_idx, args.batch_size,
                                       args.sampler, args.seed)
    print(f'sampler: {sampler_name} (set up in '
          f'{time.perf_counter() - t0:.1f} s), fanout {fanouts}, batch size '
          f'{args.batch_size}, {len(loader)} batches per epoch', flush=True)

    torch.manual_seed(args.seed)
    names = ['fast', 'pyg'] if args.layer == 'both' else [args.layer]
    init = GAT(GATConv, args.features, args.hidden, args.heads, args.classes,
               args.layers, args.dropout, args.mfg).to(dev)
    models, opts = {}, {}
    for name in names:
        m = GAT(FastGATConv if name == 'fast' else GATConv, args.features,
                args.hidden, args.heads, args.classes, args.layers,
                args.dropout, args.mfg).to(dev)
        m.load_state_dict(init.state_dict())
        models[name] = m
        opts[name] = torch.optim.Adam(m.parameters(), lr=args.lr)

    history = []
    for epoch in range(1, args.epochs + 1):
        t_load = 0.0
        t_model = {n: 0.0 for n in names}
        loss_sum = {n: 0.0 for n in names}
        correct = {n: 0 for n in names}
        seen = steps = edges = 0
        it = iter(loader)
        while args.max_steps is None or steps < args.max_steps:
            t = time.perf_counter()
            batch = next(it, None)
            if batch is None:
                break
            bx, by = batch.x.to(dev), batch.y[:batch.batch_size].to(dev)
            ei = batch.edge_index.to(dev)
            sync(dev)
            t_load += time.perf_counter() - t
            nn_, ne = hop_counts(batch, args.layers)
            for n in names:
                m, opt = models[n], opts[n]
                m.train()
                t = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                out = m(bx, ei, nn_, ne)
                loss = F.cross_entropy(out, by)
                loss.backward()
                opt.step()
                sync(dev)
                t_model[n] += time.perf_counter() - t
                loss_sum[n] += float(loss.detach()) * by.numel()
                correct[n] += int((out.argmax(-1) == by).sum())
            seen += by.numel()
            steps += 1
            edges += ei.size(1)
            if args.log_every and steps % args.log_every == 0:
                print(f'  epoch {epoch} step {steps}: ' + ', '.join(
                    f'{n} loss {loss_sum[n] / seen:.4f}' for n in names),
                    flush=True)
        rec = {'epoch': epoch, 'steps': steps, 'loader_s': t_load,
               'edges_per_batch': edges / max(steps, 1)}
        parts = [f'epoch {epoch}: {steps} batches ({edges / max(steps, 1):.0f} '
                 f'edges each), loader {t_load:.2f} s']
        for n in names:
            rec[f'{n}_s'] = t_model[n]
            rec[f'{n}_loss'] = loss_sum[n] / max(seen, 1)
            rec[f'{n}_train_acc'] = correct[n] / max(seen, 1)
            parts.append(f'{n} {t_model[n]:.2f} s (loss '
                         f'{rec[f"{n}_loss"]:.4f}, train acc '
                         f'{rec[f"{n}_train_acc"]:.3f})')
        if 'fast' in t_model and 'pyg' in t_model and t_model['fast'] > 0:
            rec['speedup'] = t_model['pyg'] / t_model['fast']
            parts.append(f'fast {rec["speedup"]:.2f}x pyg')
        print(', '.join(parts), flush=True)
        history.append(rec)
    return history


if __name__ == '__main__':
    run()
