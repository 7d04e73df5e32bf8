#!/usr/bin/env python3
"""What is alive at the memory peak of one layer forward+backward on CUDA:
the allocations live at the peak, largest first, with the Python frame that
made each (none: made inside the autograd engine, i.e. in a backward).

    python benchmarks/memory_peak.py                      # GAT, 1M/20M, fp32 and bf16
    python benchmarks/memory_peak.py --conv gatv2 --nodes 100000 --edges 2000000

The graph is uniformly random (``torch.randint``); x requires grad (a hidden
layer), the upstream gradient is made outside the measured call, and bf16
runs the forward under ``torch.autocast``. Peaks are above the memory
allocated before the call (inputs, parameters, the cached graph).
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _graphs import generator, randn  # noqa: E402
from _memory import MiB  # noqa: E402
from bench_gat import CONVS  # noqa: E402

import torch  # noqa: E402

import pyg_fastattn  # noqa: E402


def live_at_peak(trace):
    """Replays the allocator trace: (peak bytes, blocks live at the peak)."""
    live, cur, best, best_live = {}, 0, -1, {}
    for ev in trace:
        if ev['action'] == 'alloc':
            live[ev['addr']] = ev
            cur += ev['size']
        elif ev['action'] == 'free_requested' and ev['addr'] in live:
            cur -= live.pop(ev['addr'])['size']
        if cur > best:
            best, best_live = cur, dict(live)
    return best, sorted(best_live.values(), key=lambda e: -e['size'])


def frame_of(ev) -> str:
    """The innermost frames outside torch's own modules."""
    fr = [f"{Path(f['filename']).name}:{f['line']}:{f['name']}"
          for f in ev.get('frames', []) if '/torch/' not in f['filename']]
    return ' < '.join(fr[:3]) or '(backward)'


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--conv', default='gat', choices=sorted(CONVS))
    ap.add_argument('--nodes', type=int, default=1_000_000)
    ap.add_argument('--edges', type=int, default=20_000_000)
    ap.add_argument('--channels', default='128,4,32', help='F,H,C')
    ap.add_argument('--min-mib', type=float, default=1.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit('memory_peak.py needs a CUDA device (it reads the CUDA '
                 'caching allocator\'s trace)')
    dev = torch.device('cuda')
    N, E = args.nodes, args.edges
    F, H, C = (int(v) for v in args.channels.split(','))
    ei = torch.randint(N, (2, E), device=dev, generator=generator(dev, 11))
    x = randn((N, F), dev, 12, requires_grad=True)
    torch.manual_seed(0)
    name = CONVS[args.conv][1]
    conv = getattr(pyg_fastattn, name)(F, C, heads=H).to(dev)
    params = list(conv.parameters()) + [x]
    print(f'{name} {F}->{H}x{C}, {N:,} nodes, {E:,} random '
          f'edges, x requires grad; {torch.cuda.get_device_name()}')
    for amp in (False, True):
        gout = randn((N, H * C), dev, 13).to(
            torch.bfloat16 if amp else torch.float32)

        def run():
            with torch.autocast('cuda', torch.bfloat16, enabled=amp):
                out = conv(x, ei)
            return torch.autograd.grad(out, params, gout)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        torch.cuda.memory._record_memory_history(max_entries=100_000,
                                                 stacks='python')
        r = run()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        del r
        peak, blocks = live_at_peak(snap['device_traces'][0])
        print(f'\n{"bf16 autocast" if amp else "fp32"}: peak {peak / MiB:.1f}'
              f' MiB above the call\'s start; live blocks at the peak:')
        for ev in blocks:
            if ev['size'] >= args.min_mib * MiB:
                print(f"  {ev['size'] / MiB:9.1f} MiB  {frame_of(ev)}")
        gout = None


if __name__ == '__main__':
    main()
