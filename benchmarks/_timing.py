"""Timing of benchmark calls, launch counts, the script-wide time budget
and the shared timing options.

Timing
  * CUDA: warm-up calls, then one pair of CUDA events around every call;
    the median over the calls is reported (plus p10/p90). ``wall_ms`` is host
    time per call over the same loop (synchronised once at the end), i.e. the
    throughput a Python loop sees.
  * CPU: ``time.perf_counter`` around every call, median.
  * Host time (``host=True``): ``time.perf_counter`` around every call until
    it returns, with the device synchronised before each call and never
    inside the timed region: the launch cost of one call (plus any wait the
    call itself forces). CUDA: a second loop after the event loop; CPU: the
    same samples as the median (host time = wall time).
  The number of timed calls adapts to a time budget per measurement
  (``reps = budget / estimate``, clamped to ``[min_reps, max_reps]``).
"""
import re
import statistics
import time
from typing import Callable, List, Optional

import torch


def sync(device: torch.device):
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def _stats(times: List[float], prefix: str = '') -> dict:
    times = sorted(times)
    q = lambda p: times[min(len(times) - 1, int(round(p * (len(times) - 1))))]  # noqa: E731
    return {f'{prefix}median_ms': statistics.median(times),
            f'{prefix}p10_ms': q(0.1), f'{prefix}p90_ms': q(0.9),
            f'{prefix}min_ms': times[0]}


def time_fn(fn: Callable, device: torch.device, warmup: int = 3,
            min_reps: int = 5, max_reps: int = 100, budget_s: float = 1.0,
            before: Optional[Callable] = None, host: bool = False,
            host_max_reps: int = 30) -> dict:
    """Median time of ``fn()`` (see the module doc). ``before`` runs before
    every call, outside the timed region. ``host=True`` adds ``host_median_ms``
    (``host_p10_ms``, ``host_p90_ms``, ``host_min_ms``, ``host_reps``): the
    time until the call returns; on CUDA from a second loop of at most
    ``host_max_reps`` calls."""
    for _ in range(max(1, warmup)):
        if before:
            before()
        fn()
    sync(device)
    # estimate from one more call
    t0 = time.perf_counter()
    if before:
        before()
    fn()
    sync(device)
    est = max(time.perf_counter() - t0, 1e-6)
    reps = int(min(max_reps, max(min_reps, budget_s / est)))
    times = []
    if device.type == 'cuda':
        evs = [(torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        wall0 = time.perf_counter()
        for a, b in evs:
            if before:
                before()
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize(device)
        wall = time.perf_counter() - wall0
        times = [a.elapsed_time(b) for a, b in evs]
    else:
        wall0 = time.perf_counter()
        for _ in range(reps):
            if before:
                before()
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        wall = time.perf_counter() - wall0
    res = _stats(times)
    res.update(reps=reps, wall_ms=wall * 1e3 / reps)
    if host:
        if device.type == 'cuda':
            hreps = min(reps, host_max_reps)
            htimes = []
            for _ in range(hreps):
                if before:
                    before()
                torch.cuda.synchronize(device)
                t = time.perf_counter()
                fn()
                htimes.append((time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize(device)
        else:
            htimes, hreps = times, reps
        res.update(_stats(htimes, 'host_'), host_reps=hreps)
    return res


def count_launches(fn: Callable, device: torch.device, calls: int = 3) -> dict:
    """Per call: CUDA kernels and memcpy/memset on the GPU (torch.profiler
    device events); on CPU, top-level dispatched ops."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU]
    if device.type == 'cuda':
        acts.append(ProfilerActivity.CUDA)
    fn()
    sync(device)
    with profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    evs = prof.events()
    res = {}
    if device.type == 'cuda':
        dev = [e for e in evs if getattr(e, 'device_type', None) is not None
               and e.device_type.name == 'CUDA']
        mem = [e for e in dev if re.search(r'memcpy|memset', e.name, re.I)]
        res['kernels'] = (len(dev) - len(mem)) / calls
        res['memops'] = len(mem) / calls
    def outermost(e):  # a dispatched op not nested in another one
        p = e.cpu_parent
        while p is not None:
            if '::' in p.name:
                return False
            p = p.cpu_parent
        return True
    top = [e for e in evs if e.device_type.name == 'CPU' and '::' in e.name
           and outermost(e)]
    res['ops'] = len(top) / calls
    return res


class Budget:
    """Wall-clock budget for a whole script: later workloads are skipped
    (recorded as such) once it is spent."""

    def __init__(self, seconds: Optional[float]):
        self.t0 = time.perf_counter()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def spent(self) -> bool:
        return self.seconds is not None and self.elapsed() > self.seconds


def add_timing_args(ap):
    """Options shared by the benchmark scripts: warm-up, repetitions, budgets."""
    ap.add_argument('--warmup', type=int, default=3)
    ap.add_argument('--min-reps', type=int, default=5)
    ap.add_argument('--max-reps', type=int, default=50)
    ap.add_argument('--rep-budget', type=float, default=None,
                    help='seconds of timed calls per measurement')
    ap.add_argument('--budget-s', type=float, default=None,
                    help='skip remaining workloads after this many seconds')
    ap.add_argument('--threads', type=int, default=None)
