"""The layers on NeighborLoader-shaped mini-batches (no sampler needed): seeds
first, then each hop's new nodes; edges grouped by hop; trimmed per layer
with PyG's ``trim_to_layer``, or fed as bipartite message-flow graphs."""
import pytest
import torch
import torch.nn.functional as F
from torch_geometric.nn import GATConv
from torch_geometric.utils import trim_to_layer

from pyg_fastattn import FastGATConv


def sample_batch(edge_index, num_nodes, seeds, fanouts, gen):
    """What NeighborLoader returns for ``seeds``: local node ids (seeds first,
    then each hop's new nodes), local edges (src, dst) in hop order, and the
    node and edge counts per hop."""
    src, dst = edge_index
    local = {int(n): i for i, n in enumerate(seeds.tolist())}
    frontier = seeds.tolist()
    edges, n_nodes, n_edges = [], [len(frontier)], []
    for k in fanouts:
        new, hop_edges = [], []
        for v in frontier:
            nbrs = src[dst == v]
            if nbrs.numel() > k:
                nbrs = nbrs[torch.randperm(nbrs.numel(), generator=gen)[:k]]
            for u in nbrs.tolist():
                if u not in local:
                    local[u] = len(local)
                    new.append(u)
                hop_edges.append((local[u], local[v]))
        edges += hop_edges
        n_nodes.append(len(new))
        n_edges.append(len(hop_edges))
        frontier = new
    n_id = torch.tensor(sorted(local, key=local.get))
    ei = torch.tensor(edges, dtype=torch.long).t().reshape(2, -1)
    return n_id, ei, n_nodes, n_edges


class Net(torch.nn.Module):
    def __init__(self, conv, heads=4):
        super().__init__()
        self.convs = torch.nn.ModuleList([
            conv(12, 8, heads=heads), conv(8 * heads, 8, heads=heads),
            conv(8 * heads, 5, heads=1, concat=False)])

    def forward(self, x, edge_index, n_nodes, n_edges, bipartite):
        for i, conv in enumerate(self.convs):
            if bipartite:  # message-flow graph of layer i, targets first
                L = len(self.convs) - i
                n_dst = sum(n_nodes[:L])  # nodes still needed after layer i
                x_src = x[:sum(n_nodes[:L + 1])]
                ei = edge_index[:, :sum(n_edges[:L])]
                x = conv((x_src, x_src[:n_dst]), ei,
                         size=(x_src.size(0), n_dst))
            else:
                x, edge_index, _ = trim_to_layer(i, n_nodes, n_edges, x,
                                                 edge_index)
                x = conv(x, edge_index)
            if i < len(self.convs) - 1:
                x = F.elu(x)
        return x[:n_nodes[0]]


@pytest.mark.parametrize('bipartite', [False, True])
def test_neighbor_batches_match_gatconv(backend, bipartite):
    """Three batches of a 3-layer GAT on sampled subgraphs: seed outputs and
    parameter gradients equal GATConv's with the same weights."""
    gen = torch.Generator().manual_seed(0)
    N, E = 300, 3000
    edge_index = torch.randint(0, N, (2, E), generator=gen)
    x_all = torch.randn(N, 12, generator=gen, dtype=torch.float64)
    torch.manual_seed(0)
    ref = Net(GATConv).double()
    fast = Net(FastGATConv).double()
    fast.load_state_dict(ref.state_dict())
    for b in range(3):
        seeds = torch.randperm(N, generator=gen)[:16]
        n_id, ei, n_nodes, n_edges = sample_batch(edge_index, N, seeds,
                                                  [5, 4, 3], gen)
        x = x_all[n_id]
        outs, grads = [], []
        for model in (ref, fast):
            model.zero_grad(set_to_none=True)
            out = model(x, ei, n_nodes, n_edges, bipartite)
            (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype)
             .view_as(out)).sum().backward()
            outs.append(out)
            grads.append([p.grad for p in model.parameters()])
        assert outs[0].shape == (16, 5)
        torch.testing.assert_close(outs[1], outs[0], atol=1e-10, rtol=1e-9)
        for (name, _), g_fast, g_ref in zip(ref.named_parameters(), grads[1],
                                            grads[0]):
            torch.testing.assert_close(g_fast, g_ref, atol=1e-10, rtol=1e-9,
                                       msg=f'batch {b}: {name}')
