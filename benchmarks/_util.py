"""Shared helpers of the benchmark scripts: environment record, timing,
peak memory, kernel-launch counts, random graphs, OOM guards and output
writers (JSON, CSV, markdown).

Timing
  * CUDA: warm-up calls, then one pair of CUDA events around every call;
    the median over the calls is reported (plus p10/p90). ``wall_ms`` is host
    time per call over the same loop (synchronised once at the end), i.e. the
    throughput a Python loop sees.
  * CPU: ``time.perf_counter`` around every call, median.
  The number of timed calls adapts to a time budget per measurement
  (``reps = budget / estimate``, clamped to ``[min_reps, max_reps]``).

Peak memory of one call (a steady-state call, after warm-up)
  * CUDA: ``torch.cuda.max_memory_allocated()`` after
    ``reset_peak_memory_stats()``, minus ``memory_allocated()`` before the
    call: what the call allocates on top of what already lives (inputs,
    parameters, cached graph structures). Caching-allocator slack excluded.
  * CPU: growth of the process' peak resident set. Before the call: gc,
    ``malloc_trim(0)`` (hands freed heap pages back to the OS so they are not
    silently reused), then the peak (VmHWM) is reset through
    ``/proc/self/clear_refs``; after the call: ``VmHWM - VmRSS(before)``.
    Includes allocator slack and page granularity; excludes what lived before
    the call. ``None`` where ``/proc/self/clear_refs`` is not writable.
"""
import csv
import ctypes
import datetime as _dt
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

MiB = 1024.0 * 1024.0

# Vendor datasheet HBM/GDDR bandwidth (GB/s), matched on the device name.
_NOMINAL_GBS = [
    ('H200', 4800.0), ('H100 NVL', 3900.0), ('H100 PCIe', 2000.0),
    ('H100', 3350.0), ('GH200', 4000.0), ('A100-SXM4-80GB', 2039.0),
    ('A100 80GB PCIe', 1935.0), ('A100', 1555.0), ('L40S', 864.0),
    ('L40', 864.0), ('L4', 300.0), ('A10G', 600.0), ('A10', 600.0),
    ('V100', 900.0), ('T4', 320.0), ('RTX 4090', 1008.0),
    ('RTX 3090', 936.0), ('B200', 8000.0),
]


# ----------------------------------------------------------------------------
# environment
# ----------------------------------------------------------------------------
def cpu_name() -> str:
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                if line.lower().startswith('model name'):
                    return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _loadavg() -> Optional[str]:
    try:
        return ' '.join(f'{v:.2f}' for v in os.getloadavg())
    except OSError:
        return None


def _git(*args) -> Optional[str]:
    try:
        r = subprocess.run(['git', '-C', str(REPO)] + list(args),
                           capture_output=True, text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 else None
    except Exception:  # noqa: BLE001
        return None


def env_info(device: torch.device) -> dict:
    """Everything that identifies a run: hardware, versions, date, backend."""
    import torch_geometric
    info = {
        'date': _dt.datetime.now(_dt.timezone.utc).strftime(
            '%Y-%m-%d %H:%M:%S UTC'),
        'device': device.type,
        'device_name': None,
        'cpu': cpu_name(),
        'cpu_threads': torch.get_num_threads(),
        'cpu_count': os.cpu_count(),
        'python': platform.python_version(),
        'torch': torch.__version__,
        'torch_cuda': torch.version.cuda,
        'pyg': torch_geometric.__version__,
        'host': platform.node(),
        'loadavg': _loadavg(),
        'git': None,
    }
    commit = _git('rev-parse', '--short', 'HEAD')
    if commit:
        dirty = _git('status', '--porcelain', '--untracked-files=no')
        info['git'] = commit + ('+dirty' if dirty else '')
    if device.type == 'cuda':
        p = torch.cuda.get_device_properties(device)
        info['device_name'] = p.name
        info['gpu_mem_gib'] = round(p.total_memory / 2**30, 1)
        info['gpu_sms'] = p.multi_processor_count
        try:
            out = subprocess.run(
                ['nvidia-smi', '--query-gpu=driver_version',
                 '--format=csv,noheader'], capture_output=True, text=True,
                timeout=20).stdout.strip().splitlines()
            info['driver'] = out[0] if out else None
        except Exception:  # noqa: BLE001
            info['driver'] = None
    else:
        info['device_name'] = info['cpu']
    try:
        import pyg_fastattn
        from pyg_fastattn import _build
        b = _build.info()
        info['pyg_fastattn'] = getattr(pyg_fastattn, '__version__', None)
        info['backend_native_cpu'] = b.get('native_cpu')
        info['backend_native_cuda'] = b.get('native_cuda')
        info['backend_reason'] = (b.get('reason') or '').splitlines()[0][:300] \
            if b.get('reason') else None
        native = b.get('native_cuda') if device.type == 'cuda' else \
            b.get('native_cpu')
        info['backend'] = 'native' if native else 'reference'
    except Exception as e:  # noqa: BLE001
        info['backend'] = f'unavailable ({type(e).__name__}: {e})'
    return info


def env_lines(info: dict) -> List[str]:
    """A few human lines for markdown headers and console."""
    lines = [
        f"date: {info['date']}",
        f"device: {info['device']} ({info['device_name']})",
    ]
    if info['device'] == 'cuda':
        lines.append(f"GPU memory {info.get('gpu_mem_gib')} GiB, "
                     f"{info.get('gpu_sms')} SMs, driver {info.get('driver')}")
        if info.get('bw_nominal_gbs') or info.get('bw_copy_gbs'):
            lines.append(f"bandwidth: nominal {info.get('bw_nominal_gbs')} GB/s"
                         f", measured D2D copy {info.get('bw_copy_gbs')} GB/s")
    lines.append(f"CPU: {info['cpu']} ({info['cpu_threads']} torch threads, "
                 f"{info['cpu_count']} cpus)")
    load = info.get('loadavg')
    if info['device'] == 'cpu' and load:
        busy = float(load.split()[0]) > 0.75 * (info['cpu_count'] or 1)
        end = info.get('loadavg_end')
        lines.append(f"load average at start: {load}"
                     + (f', at end: {end}' if end else '')
                     + (' (machine busy: CPU timings are noisy)' if busy else ''))
    lines.append(f"torch {info['torch']} (CUDA {info['torch_cuda']}), "
                 f"PyG {info['pyg']}, python {info['python']}")
    lines.append(f"pyg_fastattn {info.get('pyg_fastattn')} backend: "
                 f"{info.get('backend')}, git {info.get('git')}")
    if info.get('backend') == 'reference' and info.get('backend_reason'):
        lines.append(f"native kernels unavailable: {info['backend_reason']}")
    return lines


def bandwidth(device: torch.device) -> dict:
    """Nominal (datasheet) and measured device-to-device copy bandwidth."""
    res = {'bw_nominal_gbs': None, 'bw_copy_gbs': None}
    if device.type != 'cuda':
        return res
    name = torch.cuda.get_device_name(device)
    for key, gbs in _NOMINAL_GBS:
        if key in name:
            res['bw_nominal_gbs'] = gbs
            break
    try:
        n = 256 * 2**20  # 1 GiB of fp32
        src = torch.empty(n, device=device).uniform_()
        dst = torch.empty_like(src)
        t = time_fn(lambda: dst.copy_(src), device, warmup=3, min_reps=10,
                    max_reps=20, budget_s=0.5)
        res['bw_copy_gbs'] = round(2 * n * 4 / (t['median_ms'] * 1e-3) / 1e9, 1)
        del src, dst
        torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass
    return res


def setup_threads(device: torch.device):
    if device.type == 'cpu':
        torch.set_num_threads(os.cpu_count() or 1)


def pick_device(name: Optional[str]) -> torch.device:
    if name in (None, 'auto'):
        name = 'cuda' if torch.cuda.is_available() else 'cpu'
    if name == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('--device cuda: no CUDA device is visible')
    return torch.device(name)


# ----------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------
def sync(device: torch.device):
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def time_fn(fn: Callable, device: torch.device, warmup: int = 3,
            min_reps: int = 5, max_reps: int = 100, budget_s: float = 1.0,
            before: Optional[Callable] = None) -> dict:
    """Median time of ``fn()`` (see the module doc). ``before`` runs before
    every call, outside the timed region."""
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
    times.sort()
    q = lambda p: times[min(len(times) - 1, int(round(p * (len(times) - 1))))]  # noqa: E731
    return {
        'median_ms': statistics.median(times),
        'p10_ms': q(0.1),
        'p90_ms': q(0.9),
        'min_ms': times[0],
        'reps': reps,
        'wall_ms': wall * 1e3 / reps,
    }


# ----------------------------------------------------------------------------
# memory
# ----------------------------------------------------------------------------
def _proc_status_kib(key: str) -> Optional[int]:
    try:
        with open('/proc/self/status') as f:
            m = re.search(rf'^{key}:\s+(\d+)\s*kB', f.read(), re.M)
        return int(m.group(1)) if m else None
    except OSError:
        return None


_libc = None


def _malloc_trim():
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL('libc.so.6')
        _libc.malloc_trim(0)
    except Exception:  # noqa: BLE001
        pass


def _reset_hwm() -> bool:
    try:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
        return True
    except OSError:
        return False


def rss_mib() -> Optional[float]:
    kib = _proc_status_kib('VmRSS')
    return None if kib is None else kib / 1024.0


def peak_memory_mib(fn: Callable, device: torch.device) -> Optional[float]:
    """Peak memory that one call of ``fn`` adds (see the module doc)."""
    gc.collect()
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        del out
        return (peak - base) / MiB
    _malloc_trim()
    if not _reset_hwm():
        return None
    base = _proc_status_kib('VmRSS')
    out = fn()
    peak = _proc_status_kib('VmHWM')
    del out
    if base is None or peak is None:
        return None
    return max(0.0, (peak - base) / 1024.0)


def resident_mib(device: torch.device) -> Optional[float]:
    """Memory that lives now: allocated CUDA memory, or the CPU resident set
    after gc + malloc_trim."""
    gc.collect()
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device) / MiB
    _malloc_trim()
    return rss_mib()


def free_memory(device: torch.device):
    gc.collect()
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    else:
        _malloc_trim()


# ----------------------------------------------------------------------------
# launch counting
# ----------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------
# guards
# ----------------------------------------------------------------------------
def is_oom(e: BaseException) -> bool:
    if isinstance(e, getattr(torch.cuda, 'OutOfMemoryError', ())):
        return True
    msg = str(e).lower()
    return isinstance(e, (RuntimeError, MemoryError)) and (
        'out of memory' in msg or "can't allocate memory" in msg or
        'cannot allocate memory' in msg or isinstance(e, MemoryError))


def guarded(fn: Callable, device: torch.device):
    """Run ``fn``; returns (status, value, message) with status 'ok', 'OOM'
    or 'error'. Memory is released after a failure; never raises (except
    KeyboardInterrupt)."""
    status, value, msg = 'ok', None, None
    try:
        value = fn()
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, SystemExit):
            raise
        if is_oom(e):
            status, msg = 'OOM', str(e).splitlines()[0][:300]
        else:
            status = 'error'
            msg = f'{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ""}'
            tb = traceback.format_exc(limit=6)
            print(tb, file=sys.stderr)
        e = None  # drop the traceback (it holds frames with big tensors)
    if status != 'ok':
        free_memory(device)
    return status, value, msg


# ----------------------------------------------------------------------------
# random graphs and data
# ----------------------------------------------------------------------------
def generator(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def random_csr(num_rows: int, device: torch.device, *, deg: Optional[int] = None,
               deg_range: Optional[Sequence[int]] = None,
               num_edges: Optional[int] = None, num_cols: Optional[int] = None,
               seed: int = 0, index_dtype: torch.dtype = torch.long):
    """A random CSR graph built on ``device`` (rows = destinations).

    Exactly one of ``deg`` (fixed degree), ``deg_range`` (uniform degrees in
    ``[lo, hi]``) or ``num_edges`` (uniformly random edges, sorted by row).
    Columns are uniform in ``[0, num_cols)``. Returns (rowptr, col, row).
    """
    g = generator(device, seed)
    N = num_rows
    num_cols = num_cols or N
    if deg is not None:
        E = N * deg
        rowptr = torch.arange(0, E + 1, deg, device=device)
        row = torch.arange(N, device=device).repeat_interleave(deg)
    else:
        if deg_range is not None:
            lo, hi = deg_range
            counts = torch.randint(lo, hi + 1, (N, ), device=device, generator=g)
            row = torch.repeat_interleave(torch.arange(N, device=device), counts)
        else:
            row = torch.randint(N, (num_edges, ), device=device, generator=g)
            row = row.sort().values
            counts = torch.bincount(row, minlength=N)
        rowptr = torch.zeros(N + 1, dtype=torch.long, device=device)
        rowptr[1:] = counts.cumsum(0)
    E = row.numel()
    col = torch.randint(num_cols, (E, ), device=device, generator=g)
    return rowptr.to(index_dtype), col.to(index_dtype), row.to(index_dtype)


def randn(shape, device, seed, requires_grad=False, dtype=torch.float32):
    t = torch.randn(shape, device=device, generator=generator(device, seed),
                    dtype=dtype)
    return t.requires_grad_(requires_grad)


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


# ----------------------------------------------------------------------------
# formatting and output
# ----------------------------------------------------------------------------
def fmt(v, digits=3) -> str:
    if v is None:
        return '-'
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return 'yes' if v else 'no'
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return 'nan'
        if v == 0:
            return '0'
        a = abs(v)
        if a >= 1000:
            return f'{v:,.0f}'
        if a >= 100:
            return f'{v:.1f}'
        if a >= 1:
            return f'{v:.{digits - 1}f}'
        if a >= 1e-3:
            return f'{v:.{digits}f}'
        return f'{v:.1e}'
    return str(v)


def fmt_count(n: int) -> str:
    """100000 -> '100k', 2000000 -> '2M'."""
    for div, suf in ((10**9, 'G'), (10**6, 'M'), (10**3, 'k')):
        if n >= div and n % (div // 10) == 0:
            v = n / div
            return f'{v:g}{suf}'
    return str(n)


def md_table(rows: List[dict], columns: List[tuple]) -> str:
    """``columns``: (header, key or callable(row))."""
    head = '| ' + ' | '.join(h for h, _ in columns) + ' |'
    sep = '|' + '|'.join('---' for _ in columns) + '|'
    lines = [head, sep]
    for r in rows:
        cells = []
        for _, k in columns:
            v = k(r) if callable(k) else r.get(k)
            cells.append(fmt(v).replace('|', '/'))
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def write_outputs(out_dir: Path, stem: str, meta: dict, records: List[dict],
                  markdown: str) -> Dict[str, str]:
    """``stem``.json (meta + records), ``stem``.csv (records, environment
    columns repeated on every row) and ``stem``.md."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    p = out_dir / f'{stem}.json'
    with open(p, 'w') as f:
        json.dump({'meta': meta, 'results': records}, f, indent=1,
                  default=str)
    paths['json'] = str(p)
    env_cols = ['date', 'device_name', 'torch', 'torch_cuda', 'pyg', 'backend',
                'git']
    keys: List[str] = []
    for r in records:
        for k in r:
            if k not in keys:
                keys.append(k)
    p = out_dir / f'{stem}.csv'
    with open(p, 'w', newline='') as f:
        w = csv.writer(f)
        w.writerow(keys + env_cols)
        for r in records:
            w.writerow([r.get(k) for k in keys] + [meta.get(k) for k in env_cols])
    paths['csv'] = str(p)
    p = out_dir / f'{stem}.md'
    with open(p, 'w') as f:
        f.write(markdown if markdown.endswith('\n') else markdown + '\n')
    paths['md'] = str(p)
    return paths


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
