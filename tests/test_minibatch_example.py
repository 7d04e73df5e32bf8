"""examples/train_minibatch.py runs a few steps on a small graph, and its
fallback sampler gives NeighborLoader's batch structure."""
import importlib.util

import pytest
import torch

from conftest import REPO


def load():
    spec = importlib.util.spec_from_file_location(
        'train_minibatch', REPO / 'examples' / 'train_minibatch.py')
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fallback_sampler_batches():
    """Seeds first, then each hop's new nodes; local edges grouped by hop and
    by destination; every edge is an edge of the graph; fanout respected;
    no node twice."""
    mod = load()
    N = 500
    x, y, ei = mod.power_law_graph(N, 8, 4, 3, seed=1)
    fanouts = [5, 3]
    s = mod.TorchNeighborSampler(x, y, ei, N, fanouts, torch.arange(40), 16)
    edges = set(zip(ei[0].tolist(), ei[1].tolist()))
    indeg = torch.bincount(ei[1], minlength=N)
    batches = list(s)
    assert len(batches) == len(s) == 3
    for b in batches:
        n_id, loc = b.n_id, b.edge_index
        assert n_id.unique().numel() == n_id.numel()
        assert b.num_sampled_nodes[0] == b.batch_size
        assert sum(b.num_sampled_nodes) == n_id.numel()
        assert sum(b.num_sampled_edges) == loc.size(1)
        assert torch.equal(b.x, x[n_id]) and torch.equal(b.y, y[n_id])
        assert bool((loc[1][1:] >= loc[1][:-1]).all())  # grouped by dst
        g = n_id[loc]
        assert all(e in edges for e in zip(g[0].tolist(), g[1].tolist()))
        start_n = start_e = 0
        for h, k in enumerate(fanouts):
            hop = loc[:, start_e:start_e + b.num_sampled_edges[h]]
            dst_lo, dst_hi = start_n, start_n + b.num_sampled_nodes[h]
            assert bool(((hop[1] >= dst_lo) & (hop[1] < dst_hi)).all())
            cnt = torch.bincount(hop[1] - dst_lo,
                                 minlength=dst_hi - dst_lo)
            want = indeg[n_id[dst_lo:dst_hi]].clamp(max=k)
            # without replacement: min(fanout, in-degree) draws per node
            assert torch.equal(cnt, want)
            start_n, start_e = dst_hi, start_e + b.num_sampled_edges[h]
    assert s.local.eq(-1).all()


@pytest.mark.parametrize('mfg', ['bipartite', 'trim'])
def test_example_runs_both_layers(capsys, mfg):
    mod = load()
    hist = mod.run(['--nodes', '3000', '--avg-degree', '6', '--features',
                    '16', '--classes', '4', '--hidden', '8', '--heads', '2',
                    '--batch-size', '64', '--max-steps', '4', '--epochs',
                    '2', '--dropout', '0', '--layer', 'both', '--layers', '3',
                    '--mfg', mfg, '--device', 'cpu', '--sampler', 'torch',
                    '--log-every', '2'])
    out = capsys.readouterr().out
    assert 'sampler: pure-PyTorch' in out and 'loader' in out
    assert len(hist) == 2 and all(h['steps'] == 4 for h in hist)
    for h in hist:
        assert h['fast_s'] > 0 and h['pyg_s'] > 0 and h['loader_s'] > 0
        # same initial weights, same batches, no dropout: the same run
        assert abs(h['fast_loss'] - h['pyg_loss']) < 1e-4 * max(
            1.0, h['pyg_loss'])


@pytest.mark.parametrize('fanouts', [[5, 3], [4, 3, 2]])
def test_hop_counts_recovered(fanouts):
    """torch-sparse's sampler reports no per-hop counts: hop_counts recovers
    them from the batch's edges; on the fallback sampler's batches (which
    report them) the recovered counts equal the reported ones."""
    from torch_geometric.data import Data
    mod = load()
    N = 400
    x, y, ei = mod.power_law_graph(N, 6, 4, 3, seed=2)
    s = mod.TorchNeighborSampler(x, y, ei, N, fanouts, torch.arange(60), 20)
    for b in s:
        want = (list(b.num_sampled_nodes), list(b.num_sampled_edges))
        bare = Data(edge_index=b.edge_index, num_nodes=b.n_id.numel())
        bare.batch_size = b.batch_size
        assert mod.hop_counts(bare, len(fanouts)) == want
        if b.edge_index.size(1) > 1:  # edges out of hop order: refused
            flipped = Data(edge_index=b.edge_index.flip(1),
                           num_nodes=b.n_id.numel())
            flipped.batch_size = b.batch_size
            with pytest.raises(RuntimeError, match='hop by hop'):
                mod.hop_counts(flipped, len(fanouts))


def test_example_runs_with_neighbor_loader(capsys):
    """The example on PyG's NeighborLoader, where a sampler backend (pyg-lib
    or torch-sparse) is installed."""
    import torch_geometric.typing as tg
    if not (tg.WITH_PYG_LIB or tg.WITH_TORCH_SPARSE):
        pytest.skip('NeighborLoader needs pyg-lib or torch-sparse '
                    '(pip install --no-build-isolation ".[sampling]")')
    mod = load()
    hist = mod.run(['--nodes', '3000', '--avg-degree', '6', '--features',
                    '16', '--classes', '4', '--hidden', '8', '--heads', '2',
                    '--batch-size', '64', '--max-steps', '3', '--dropout',
                    '0', '--layer', 'both', '--layers', '2', '--device',
                    'cpu', '--sampler', 'pyg', '--log-every', '0'])
    assert 'NeighborLoader' in capsys.readouterr().out
    h = hist[0]
    assert h['steps'] == 3
    assert abs(h['fast_loss'] - h['pyg_loss']) < 1e-4 * max(1.0, h['pyg_loss'])
