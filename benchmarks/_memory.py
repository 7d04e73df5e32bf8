"""Peak and resident memory of benchmark calls, and OOM-safe execution.

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
import ctypes
import gc
import re
import sys
import traceback
from typing import Callable, Optional

import torch

MiB = 1024.0 * 1024.0


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


def cuda_error(device: torch.device) -> Optional[str]:
    """The error a device sync raises once a kernel has left the CUDA context
    unusable (a sticky error such as an illegal or misaligned address: every
    later CUDA call fails too); None while the device works."""
    if device.type != 'cuda':
        return None
    try:
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001
        return f'{type(e).__name__}: {(str(e).strip().splitlines() or [""])[0][:200]}'
    return None


def free_memory(device: torch.device):
    """Collect garbage and hand cached memory back. Never raises: a lost
    CUDA context is reported by :func:`cuda_error`."""
    gc.collect()
    if device.type == 'cuda':
        if cuda_error(device) is None:
            torch.cuda.empty_cache()
    else:
        _malloc_trim()


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
