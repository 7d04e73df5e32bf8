#!/usr/bin/env python3
"""Same-process A/B of the kernels' environment switches (CUDA).

Each workload of ``ncu_kernels.py`` runs under every setting in turn (a
variable that a setting does not name is unset), in interleaved rounds, so
that clock and thermal drift hit all settings alike; the switches are read
at every launch, so one process serves all settings. A round of a setting
is ``_timing.time_fn`` (a warm-up call, then CUDA events around each
timed call); per setting, the median of the rounds' medians.

    python benchmarks/ab_env.py gat_1m gat_1m_bf16 \\
        --set PYG_FASTATTN_BWD_NARROW=1 --set PYG_FASTATTN_BWD_NARROW=0
"""
import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import time_fn  # noqa: E402
from ncu_kernels import WORKLOADS  # noqa: E402


def parse(setting):
    return dict(kv.partition('=')[::2] for kv in setting.split(',') if kv)


def apply(setting, names):
    """Set the setting's variables and unset the other settings' ones."""
    for k in names:
        os.environ.pop(k, None)
    os.environ.update(parse(setting))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('workloads', nargs='+', choices=sorted(WORKLOADS))
    ap.add_argument('--set', action='append', required=True, dest='settings',
                    help='NAME=VALUE[,NAME=VALUE...]: one setting (repeat)')
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--calls', type=int, default=10, help='timed calls a round')
    args = ap.parse_args()
    print(f'# {torch.cuda.get_device_name()}, torch {torch.__version__}; '
          f'{args.rounds} rounds x {args.calls} calls, medians (ms)', flush=True)
    names = {k for st in args.settings for k in parse(st)}
    dev = torch.device('cuda')
    for w in args.workloads:
        fn = WORKLOADS[w]()
        med = {s: [] for s in args.settings}
        for _ in range(args.rounds):
            for s in args.settings:
                apply(s, names)
                med[s].append(time_fn(fn, dev, warmup=1, min_reps=args.calls,
                                      max_reps=args.calls)['median_ms'])
        base = statistics.median(med[args.settings[0]])
        for s in args.settings:
            m = statistics.median(med[s])
            print(f'{w:12s} {s:40s} {m:8.3f} ms  {m / base:.3f}x  '
                  f'rounds {" ".join(f"{t:.3f}" for t in med[s])}', flush=True)
        del fn
        torch.cuda.empty_cache()


if __name__ == '__main__':
    main()
