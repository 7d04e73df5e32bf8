#!/usr/bin/env python3
"""Error of bfloat16 autocast: each drop-in under autocast against PyG's
layer in float32, beside PyG's own layer under the same autocast.

    python benchmarks/amp_error.py                       # CPU, 20k / 400k
    python benchmarks/amp_error.py --device cuda --nodes 1000000 --edges 20000000

One layer 128 -> 4 x 32 with the same state_dict, x requiring grad; the
error is ``bench_gat.rel_err`` (max |a - b| / max |b| per tensor, the worst
over the output or over the gradients of every parameter and of x). A
drop-in whose bf16 error is near PyG's bf16 error rounds no worse than PyG.
Graphs: ``uniform`` (random edges) and ``power`` (each edge's destination
drawn with weight 1 / (i + 1), sources uniform: a hub row).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _env import pick_device  # noqa: E402
from _graphs import generator, randn, skewed_csr  # noqa: E402
from bench_gat import CONVS, rel_err  # noqa: E402

import torch  # noqa: E402
import torch_geometric.nn as pyg_nn  # noqa: E402

import pyg_fastattn  # noqa: E402


def run(layer, x, ei, gout, amp, backward):
    """The output, or the gradients of the parameters and of x."""
    xx = x.detach().clone().requires_grad_(backward)
    with torch.autocast(x.device.type, torch.bfloat16, enabled=amp):
        out = layer(xx, ei)
    if not backward:
        return out.float()
    grads = torch.autograd.grad(out, list(layer.parameters()) + [xx],
                                gout.to(out.dtype))
    return tuple(g.float() for g in grads)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--device', default='cpu')
    ap.add_argument('--nodes', type=int, default=20_000)
    ap.add_argument('--edges', type=int, default=400_000)
    ap.add_argument('--graphs', default='uniform,power')
    ap.add_argument('--convs', default='gat,gatv2,transformer')
    args = ap.parse_args()
    dev = pick_device(args.device)
    N, E = args.nodes, args.edges
    x, gout = randn((N, 128), dev, 12), randn((N, 128), dev, 13)
    print(f'device {dev}, {N} nodes, {E} edges, 128 -> 4 x 32, '
          f'torch {torch.__version__}\n')
    print('| layer | graph | pass | PyG bf16 | fast bf16 | fast fp32 |')
    print('|---|---|---|---|---|---|')
    for graph in args.graphs.split(','):
        if graph == 'uniform':
            ei = torch.randint(N, (2, E), device=dev,
                               generator=generator(dev, 11))
        else:
            _, col, row = skewed_csr('power', N, E, dev, s=1.0, seed=11)
            ei = torch.stack([col, row])
        for conv in args.convs.split(','):
            pyg_name, fast_name = CONVS[conv]
            torch.manual_seed(0)
            ref = getattr(pyg_nn, pyg_name)(128, 32, heads=4).to(dev)
            fast = getattr(pyg_fastattn, fast_name)(128, 32, heads=4).to(dev)
            fast.load_state_dict(ref.state_dict())
            for backward in (False, True):
                r32 = run(ref, x, ei, gout, False, backward)
                errs = [rel_err(run(m, x, ei, gout, amp, backward), r32)
                        for m, amp in ((ref, True), (fast, True), (fast, False))]
                print(f'| {pyg_name} | {graph} | '
                      f'{"fwd+bwd" if backward else "fwd"} | '
                      + ' | '.join(f'{e:.3g}' for e in errs) + ' |', flush=True)


if __name__ == '__main__':
    main()
