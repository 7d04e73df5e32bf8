"""JIT build of ``csrc/`` and choice of backend.

The extension is compiled with ``torch.utils.cpp_extension.load`` (ninja) on
first use, into a cache folder keyed by the torch version, the CUDA version
and a hash of the sources, so later imports just load it.

* ``PYG_FASTATTN_BACKEND=reference`` forces the pure-PyTorch reference,
  ``native`` forces the compiled kernels (a build failure then raises);
  unset (``auto``) builds and falls back to the reference with one warning.
* ``PYG_FASTATTN_CACHE`` sets the cache folder (default
  ``~/.cache/pyg_fastattn``); ``PYG_FASTATTN_VERBOSE=1`` shows the compiler.
* ``PYG_FASTATTN_CUDA=0`` skips the CUDA kernels even when nvcc is found.
* ``PYG_FASTATTN_CPU_ARCH=0`` builds the CPU kernels for baseline x86-64
  rather than x86-64-v3 (AVX2) where the CPU has it (same results).

A build prints one line when it starts and, every 30 seconds, how many of
its source files are compiled (``PYG_FASTATTN_VERBOSE=1`` shows the compiler
instead).

Concurrent builds are serialized with an ``flock`` on the cache folder (it is
released by the OS if a process dies), so two processes importing at once
both end up loading one good build.
"""
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import List, Optional

import torch

NAME = 'pyg_fastattn_C'
_CSRC_CANDIDATES = (
    Path(__file__).resolve().parent.parent / 'csrc',  # source checkout
    Path(__file__).resolve().parent / '_csrc',  # installed package data
)


class _State:
    loaded = False  # load() ran (successfully or not)
    native = False  # the extension is loaded
    cuda = False  # ... with CUDA kernels
    error: Optional[str] = None  # why native is unavailable
    build_dir: Optional[str] = None


_state = _State()
_lock = threading.Lock()


def _csrc() -> Optional[Path]:
    for p in _CSRC_CANDIDATES:
        if (p / 'common.h').exists():
            return p
    return None


def _want_cuda() -> bool:
    if os.environ.get('PYG_FASTATTN_CUDA', '1') == '0':
        return False
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    from torch.utils.cpp_extension import CUDA_HOME
    return CUDA_HOME is not None


def _sources(root: Path, with_cuda: bool) -> List[str]:
    # CUDA files first: ninja starts jobs in this order, and each .cu takes
    # several times as long as a .cpp.
    srcs = sorted(glob.glob(str(root / 'cuda' / '*.cu'))) if with_cuda else []
    srcs += sorted(glob.glob(str(root / 'ops' / '*.cpp')))
    srcs += sorted(glob.glob(str(root / 'cpu' / '*.cpp')))
    return srcs


_X86_64_V3 = {'avx', 'avx2', 'bmi1', 'bmi2', 'f16c', 'fma', 'abm', 'movbe',
              'xsave'}
_cpu_arch: Optional[List[str]] = None


def _cpu_arch_flags() -> List[str]:
    """``-march=x86-64-v3`` (AVX2, FMA) where this CPU has its features and
    the compiler takes the flag, else none (also with
    ``PYG_FASTATTN_CPU_ARCH=0``). Without FMA contraction the kernels give
    the baseline build's results bit for bit. The flags are in the build
    key, so a CPU without them never loads such a build from a shared
    cache."""
    global _cpu_arch
    if _cpu_arch is not None:
        return _cpu_arch
    _cpu_arch = []
    if (os.environ.get('PYG_FASTATTN_CPU_ARCH', '1') == '0'
            or not sys.platform.startswith('linux')
            or os.uname().machine != 'x86_64'):
        return _cpu_arch
    try:
        with open('/proc/cpuinfo') as f:
            have = next((line.split(':', 1)[1].split() for line in f
                         if line.startswith('flags')), [])
    except OSError:
        return _cpu_arch
    flags = ['-march=x86-64-v3', '-ffp-contract=off']
    if _X86_64_V3 <= set(have):
        try:  # GCC >= 11, clang >= 12
            r = subprocess.run([os.environ.get('CXX', 'c++'), *flags, '-E',
                                '-x', 'c++', os.devnull],
                               capture_output=True, timeout=60)
            if r.returncode == 0:
                _cpu_arch = flags
        except (OSError, subprocess.SubprocessError):
            pass
    return _cpu_arch


def _flags(with_cuda: bool):
    cflags = ['-O3', *_cpu_arch_flags()]
    ldflags = []
    if sys.platform.startswith('linux'):
        cflags.append('-fopenmp')  # at::parallel_for runs serially without it
        ldflags.append('-fopenmp')
    if with_cuda:
        cflags.append('-DPFA_WITH_CUDA')  # CUDA registrations in csrc/ops
    cuda_flags = ['-O3', '--expt-relaxed-constexpr', '-lineinfo'] if with_cuda else []
    return cflags, ldflags, cuda_flags


def _version(cmd: List[str]) -> str:
    """``cmd --version``'s whole output (nvcc's first line names no
    version)."""
    try:
        r = subprocess.run(cmd + ['--version'], capture_output=True, text=True,
                           timeout=30)
        return (r.stdout or r.stderr).strip() or 'unknown'
    except (OSError, subprocess.SubprocessError):
        return 'unknown'


def _toolchain(with_cuda: bool) -> tuple:
    """What a build depends on besides the sources: the torch installation
    (two environments with one torch version would otherwise share a folder
    and rebuild each other's objects: cpp_extension writes its include
    paths into the folder's build.ninja), the C++ compiler, and with CUDA
    nvcc and the target architectures (TORCH_CUDA_ARCH_LIST, or the visible
    GPUs' that cpp_extension builds for when it is unset)."""
    parts = [os.path.dirname(os.path.realpath(torch.__file__)),
             _version([os.environ.get('CXX', 'c++')])]
    if with_cuda:
        from torch.utils.cpp_extension import CUDA_HOME
        parts.append(_version([os.path.join(CUDA_HOME, 'bin', 'nvcc')]))
        archs = os.environ.get('TORCH_CUDA_ARCH_LIST') or ';'.join(sorted({
            '%d.%d' % torch.cuda.get_device_capability(i)
            for i in range(torch.cuda.device_count())}))
        parts.append(archs)  # '9.0' whether set or detected: one build
    return tuple(parts)


def _build_dir(root: Path, srcs: List[str], with_cuda: bool, flags) -> Path:
    h = hashlib.sha256()
    headers = glob.glob(str(root / '**' / '*.h'), recursive=True)
    if with_cuda:
        headers += glob.glob(str(root / '**' / '*.cuh'), recursive=True)
    for f in sorted(srcs + headers):
        h.update(os.path.relpath(f, root).encode())
        h.update(Path(f).read_bytes())
    h.update(repr((flags, _toolchain(with_cuda))).encode())
    tag = f'cu{torch.version.cuda}' if with_cuda else 'cpu'
    base = os.environ.get('PYG_FASTATTN_CACHE') or os.path.join(
        os.path.expanduser('~'), '.cache', 'pyg_fastattn')
    return Path(base) / f'torch{torch.__version__}-{tag}-{h.hexdigest()[:12]}'


def _build_dir_for(root: Path, with_cuda: bool) -> Path:
    """The build folder of the sources under ``root``, with or without the
    CUDA kernels (a CPU-only build: ``with_cuda=False``)."""
    return _build_dir(root, _sources(root, with_cuda), with_cuda,
                      _flags(with_cuda))


class _Progress(threading.Thread):
    """While a build runs: every ``interval`` seconds, one stderr line with
    the object files in ``bdir`` out of ``total`` sources (ninja writes an
    object when its file is compiled)."""
    def __init__(self, bdir: Path, total: int, interval: float = 30.0):
        super().__init__(daemon=True)
        self.bdir, self.total, self.interval = bdir, total, interval
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def compiled(self) -> int:
        return min(len(list(self.bdir.glob('*.o'))), self.total)

    def run(self):
        while not self.stop.wait(self.interval):
            print(f'pyg_fastattn: {self.compiled()} of {self.total} files '
                  f'compiled ({time.monotonic() - self.t0:.0f} s)',
                  file=sys.stderr, flush=True)


def _load_built(so: Path) -> bool:
    """Load a library built earlier into its hashed folder (the name covers
    the sources, flags and toolchain), without running ninja; False if it
    does not load (a half-written file), and then the build runs."""
    try:
        torch.ops.load_library(str(so))
        return True
    except OSError:
        return False


def _compile_and_load(root: Path, with_cuda: bool) -> str:
    from torch.utils.cpp_extension import load
    srcs = _sources(root, with_cuda)
    flags = _flags(with_cuda)
    bdir = _build_dir(root, srcs, with_cuda, flags)
    bdir.mkdir(parents=True, exist_ok=True)
    verbose = os.environ.get('PYG_FASTATTN_VERBOSE', '0') == '1'
    import fcntl
    with open(bdir.parent / f'{bdir.name}.lock', 'w') as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)  # serialize builds across processes
        try:
            # cpp_extension's own lock file: with our flock held no other
            # build runs here, so one left by a killed build is stale (and
            # cpp_extension would wait for it forever).
            (bdir / 'lock').unlink(missing_ok=True)
            so = bdir / f'{NAME}.so'
            if so.exists() and _load_built(so):
                return str(bdir)
            for attempt in range(2):
                progress = None
                if not so.exists():
                    took = ('a few minutes with CUDA' if with_cuda else
                            'about a minute')
                    print(f'building pyg_fastattn kernels (first use: '
                          f'{len(srcs)} files, {took}, cached for later '
                          'imports)...', file=sys.stderr, flush=True)
                    if not verbose:
                        progress = _Progress(bdir, len(srcs))
                        progress.start()
                try:
                    load(name=NAME, sources=srcs, build_directory=str(bdir),
                         extra_cflags=flags[0], extra_ldflags=flags[1],
                         extra_cuda_cflags=flags[2], with_cuda=with_cuda,
                         is_python_module=False, verbose=verbose)
                    return str(bdir)
                except Exception:
                    if attempt == 1:
                        raise
                    # A broken cache (half-written objects, a stale lock, a
                    # corrupt .so): wipe it and build once more.
                    shutil.rmtree(bdir, ignore_errors=True)
                    bdir.mkdir(parents=True, exist_ok=True)
                finally:
                    if progress is not None:
                        progress.stop.set()
        finally:
            fcntl.flock(lockf, fcntl.LOCK_UN)
    raise AssertionError('unreachable')


def load() -> _State:
    """Build (if needed) and load the extension once; never raises in auto."""
    if _state.loaded:
        return _state
    with _lock:
        if _state.loaded:
            return _state
        mode = os.environ.get('PYG_FASTATTN_BACKEND', 'auto').lower()
        if mode not in ('auto', 'native', 'reference'):
            raise ValueError(
                "PYG_FASTATTN_BACKEND must be 'auto', 'native' or "
                f"'reference', got {mode!r}")
        if mode == 'reference':
            _state.error = 'PYG_FASTATTN_BACKEND=reference'
        else:
            root = _csrc()
            try:
                if root is None:
                    raise RuntimeError('the csrc/ sources were not found')
                with_cuda = _want_cuda()
                _state.build_dir = _compile_and_load(root, with_cuda)
                _state.native, _state.cuda = True, with_cuda
            except Exception as e:  # noqa: BLE001
                if mode == 'native':
                    raise
                _state.error = f'{type(e).__name__}: {e}'.strip()
                warnings.warn(
                    'pyg_fastattn: could not build the native kernels, using '
                    'the pure-PyTorch reference instead (slower). Reason: ' +
                    _state.error.splitlines()[0][:500], RuntimeWarning,
                    stacklevel=3)
        _state.loaded = True
        return _state


def native_available(device: torch.device) -> bool:
    """Whether compiled kernels exist for tensors on ``device``."""
    st = load()
    if not st.native:
        return False
    if device.type == 'cpu':
        return True
    return device.type == 'cuda' and st.cuda


def info() -> dict:
    st = load()
    return {
        'native_cpu': st.native,
        'native_cuda': st.cuda,
        'build_dir': st.build_dir,
        'reason': st.error,
        'torch': torch.__version__,
        'cuda': torch.version.cuda,
        'cuda_available': torch.cuda.is_available(),
    }
