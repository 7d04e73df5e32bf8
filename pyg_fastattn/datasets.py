"""Datasets for the examples and benchmarks: local files, else PyG's download.

* :func:`load_planetoid` finds the Planetoid raw files (``ind.<name>.*``) in
  a root folder and lets PyG process them in a writable cache, so a read-only
  root holding only ``raw/`` works.
* :func:`synthetic_pubmed` builds a PubMed-sized random graph for benchmarks
  when the PubMed files are not available.
"""
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import List, Optional, Tuple

import torch

__all__ = ['load_planetoid', 'synthetic_pubmed', 'DatasetNotFoundError',
           'PLANETOID_NAMES']

PLANETOID_NAMES = {'cora': 'Cora', 'citeseer': 'CiteSeer', 'pubmed': 'PubMed'}
_RAW_SUFFIXES = ['x', 'tx', 'allx', 'y', 'ty', 'ally', 'graph', 'test.index']
_REPO = Path(__file__).resolve().parent.parent


class DatasetNotFoundError(FileNotFoundError):
    """The dataset's files were not found; the message says where we looked
    and how to provide them."""


def _raw_files(name: str) -> List[str]:
    return [f'ind.{name.lower()}.{s}' for s in _RAW_SUFFIXES]


def _candidate_roots(root) -> List[Tuple[Path, str]]:
    """(root, where it came from), in search order."""
    if root is not None:
        return [(Path(root).expanduser(), 'the root argument (--root)')]
    out = []
    env = os.environ.get('PYG_FASTATTN_DATA')
    if env:
        out.append((Path(env).expanduser(), '$PYG_FASTATTN_DATA'))
    out.append((Path('data') / 'Planetoid', 'the default ./data/Planetoid'))
    shared = _REPO.parent / 'shared' / 'data' / 'Planetoid'
    if shared.is_dir():
        out.append((shared, "the checkout's ../shared/data/Planetoid"))
    return out


def _find_raw(root: Path, name: str) -> Optional[Path]:
    """The folder under ``root`` holding all raw files of ``name``."""
    files = _raw_files(name)
    for d in (root / name / 'raw', root / name.lower() / 'raw', root / 'raw',
              root):
        if all((d / f).is_file() for f in files):
            return d
    return None


def _cache_root() -> Path:
    base = os.environ.get('PYG_FASTATTN_CACHE') or os.path.join(
        os.path.expanduser('~'), '.cache', 'pyg_fastattn')
    path = Path(base) / 'data' / 'Planetoid'
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError:  # no writable home: fall back to the temp folder
        path = Path(tempfile.gettempdir()) / 'pyg_fastattn' / 'data' / 'Planetoid'
        path.mkdir(parents=True, exist_ok=True)
    return path


def _sync_raw(src: Path, dst: Path, name: str) -> bool:
    """Copy raw files into the cache; True when anything changed."""
    dst.mkdir(parents=True, exist_ok=True)
    changed = False
    for f in _raw_files(name):
        a, b = src / f, dst / f
        sa = a.stat()
        if b.is_file():
            sb = b.stat()
            if sb.st_size == sa.st_size and int(sb.st_mtime) == int(sa.st_mtime):
                continue
        shutil.copyfile(a, b)
        os.utime(b, (sa.st_atime, sa.st_mtime))
        changed = True
    return changed


def not_found_message(name: str, root=None, download_error=None) -> str:
    looked = '\n'.join(f'  - {p}  ({why})' for p, why in _candidate_roots(root))
    files = ','.join(_RAW_SUFFIXES)
    msg = (f'Planetoid dataset {name!r} not found. Looked in:\n{looked}\n'
           f'Provide the raw files with --root DIR (or the environment '
           f'variable PYG_FASTATTN_DATA=DIR), where DIR/{name}/raw/ holds '
           f'ind.{name.lower()}.{{{files}}} (the Planetoid files, e.g. from '
           f'github.com/kimiyoung/planetoid).')
    msg += (' Downloading them through PyG failed: '
            f'{download_error}' if download_error else ' Nothing was '
            'downloaded.')
    if name == 'PubMed':
        msg += ('\nPubMed is not bundled with this checkout; use --synthetic '
                'for a PubMed-sized random graph (timings and memory only; '
                'its accuracy means nothing).')
    return msg


def _download(name: str, root, transform):
    """PyG's own download into the first candidate root (never ../shared);
    (dataset, None) or (None, why it failed). Sockets time out after 60 s."""
    import socket
    from torch_geometric.datasets import Planetoid
    target = _candidate_roots(root)[0][0]
    existed = (target / name).exists()
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(60)
    try:
        return Planetoid(str(target), name, transform=transform), None
    except Exception as e:  # noqa: BLE001 (offline: URLError, OSError, ...)
        # leave no half-downloaded folder behind
        shutil.rmtree(target / name if not existed else target / name / 'raw',
                      ignore_errors=True)
        return None, f'{type(e).__name__}: {e}'.splitlines()[0][:300]
    finally:
        socket.setdefaulttimeout(old)


def load_planetoid(name: str, root=None, download: bool = True):
    """Load a Planetoid dataset (Cora, CiteSeer, PubMed; public split) with
    ``NormalizeFeatures``, from local files, or downloaded through PyG into
    the first root (``root``, else ``$PYG_FASTATTN_DATA``, else
    ``./data/Planetoid``) when none holds them and ``download`` is True.

    The root is ``root`` if given, else ``$PYG_FASTATTN_DATA``, else
    ``./data/Planetoid``, then the checkout's ``../shared/data/Planetoid``
    when it exists. A root needs ``<Name>/raw/ind.<name>.*`` (or processed PyG
    files under ``<Name>/processed``). Raw-only roots are never written to:
    the raw files are copied to ``~/.cache/pyg_fastattn/data/Planetoid``
    (``$PYG_FASTATTN_CACHE`` moves it) and processed there.

    Returns:
        the ``torch_geometric.datasets.Planetoid`` dataset.

    Raises:
        DatasetNotFoundError: no root holds the files (the message lists
            where it looked and how to provide them).
    """
    from torch_geometric.datasets import Planetoid
    import torch_geometric.transforms as T

    key = name.lower()
    if key not in PLANETOID_NAMES:
        raise ValueError(f'unknown Planetoid dataset {name!r}; choose one of '
                         f'{", ".join(PLANETOID_NAMES.values())}')
    name = PLANETOID_NAMES[key]
    transform = T.NormalizeFeatures()

    for root_path, _ in _candidate_roots(root):
        processed = root_path / name / 'processed' / 'data.pt'
        if processed.is_file() and _find_raw(root_path, name) == (
                root_path / name / 'raw'):
            # Already processed by PyG: loading writes nothing.
            return Planetoid(str(root_path), name, transform=transform)
        raw = _find_raw(root_path, name)
        if raw is None:
            continue
        cache = _cache_root()
        with open(cache / f'{name}.lock', 'w') as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one process prepares at once
            try:
                if _sync_raw(raw, cache / name / 'raw', name):
                    shutil.rmtree(cache / name / 'processed', ignore_errors=True)
                return Planetoid(str(cache), name, transform=transform)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    why = None
    if download:
        ds, why = _download(name, root, transform)
        if ds is not None:
            return ds
    raise DatasetNotFoundError(not_found_message(name, root, why))


def synthetic_pubmed(seed: int = 0):
    """A PubMed-sized random graph for benchmarks (not for accuracy claims).

    19717 nodes, 88648 directed edges (44324 undirected pairs, no
    self-loops, about 80% within a class as in PubMed, skewed degrees), 500
    non-negative TF-IDF-like features with about 50 non-zeros per node
    (row-normalized, as ``NormalizeFeatures``), 3 classes in PubMed's
    proportions, and PubMed's public split: 20 training nodes per class,
    500 validation and 1000 test nodes.

    Returns:
        a ``torch_geometric.data.Data`` with ``x``, ``edge_index``, ``y``,
        ``train_mask``, ``val_mask``, ``test_mask``; deterministic in
        ``seed``.
    """
    from torch_geometric.data import Data

    N, F, C, pairs, nnz = 19717, 500, 3, 44324, 50
    g = torch.Generator().manual_seed(seed)
    y = torch.multinomial(torch.tensor([0.208, 0.393, 0.399]), N,
                          replacement=True, generator=g)

    # Features: words drawn from class topics (3x weight on 150 words).
    topic = torch.ones(C, F)
    for c in range(C):
        topic[c, c * 150:(c + 1) * 150] = 3.0
    words = torch.multinomial(topic[y], nnz, replacement=False, generator=g)
    tfidf = -torch.log(torch.rand(N, nnz, generator=g).clamp(min=1e-6))
    x = torch.zeros(N, F).scatter_(1, words, tfidf)
    x = x / x.sum(dim=1, keepdim=True).clamp(min=1e-12)

    # Edges: skewed sources, 80% same-class destinations.
    weight = torch.rand(N, generator=g).pow(-0.45)  # heavy-tailed degrees
    by_class = torch.argsort(y, stable=True)
    count = torch.bincount(y, minlength=C)
    start = torch.cumsum(count, 0) - count
    M = int(pairs * 1.3)
    src = torch.multinomial(weight, M, replacement=True, generator=g)
    same = torch.rand(M, generator=g) < 0.7
    c = y[src]
    within = by_class[start[c] + (torch.rand(M, generator=g) *
                                  count[c]).long().clamp(max=N - 1)]
    anywhere = torch.randint(0, N, (M, ), generator=g)
    dst = torch.where(same, within, anywhere)
    keep = src != dst
    a, b = torch.minimum(src, dst)[keep], torch.maximum(src, dst)[keep]
    key = torch.unique(a * N + b)
    key = key[torch.randperm(key.numel(), generator=g)[:pairs]]
    assert key.numel() == pairs
    a, b = key // N, key % N
    row, col = torch.cat([a, b]), torch.cat([b, a])
    order = torch.argsort(row * N + col)
    edge_index = torch.stack([row[order], col[order]])

    # PubMed's public split sizes.
    perm = torch.randperm(N, generator=g)
    train = torch.cat([perm[y[perm] == k][:20] for k in range(C)])
    rest = perm[~torch.isin(perm, train)]
    masks = []
    for idx in (train, rest[:500], rest[500:1500]):
        m = torch.zeros(N, dtype=torch.bool)
        m[idx] = True
        masks.append(m)
    return Data(x=x, edge_index=edge_index, y=y, train_mask=masks[0],
                val_mask=masks[1], test_mask=masks[2])
