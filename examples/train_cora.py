#!/usr/bin/env python
"""Train PyG's standard GAT on Cora / CiteSeer / PubMed, with pyg_fastattn's
FastGATConv, PyG's GATConv, or both side by side.

The model is PyG's examples/gat.py: dropout 0.6 on features and attention,
GATConv(F, 8, heads=8) -> ELU -> GATConv(64, classes, heads=1,
concat=False); Adam (lr 0.005, weight decay 5e-4); NormalizeFeatures; the
public split. We report test accuracy at the epoch of best validation
accuracy and the median time of a training step (forward, loss, backward,
optimizer step; evaluation excluded) after the warm-up epochs, whose time
(compilation, CUDA-graph capture) is reported separately.

    python examples/train_cora.py                       # FastGATConv on Cora
    python examples/train_cora.py --layer both --runs 5 # side-by-side table
    python examples/train_cora.py --dataset PubMed --synthetic --layer both
    python examples/train_cora.py --device cuda --cuda-graph
    python examples/train_cora.py --layer both --amp bf16
    python examples/train_cora.py --compile reduce-overhead --device cuda

--amp runs forward and loss under torch.autocast (fp16 adds a GradScaler);
--compile wraps the model in torch.compile. From Python:
``run(layer='fast', amp='bf16', compile='default')['test_acc']``.

Data: DIR/Cora/raw/ind.cora.* under --root DIR or PYG_FASTATTN_DATA=DIR
(``pyg_fastattn.datasets.load_planetoid``); when no root holds them, PyG
downloads them into the first root (offline: a clear message, exit 2).
--model gatv2|transformer trains the same model with GATv2Conv or
TransformerConv layers (and their drop-ins).
"""
import argparse
import copy
import dataclasses
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import pyg_fastattn
except ImportError:  # running from a source checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import pyg_fastattn

from torch_geometric.nn import GATConv, GATv2Conv, TransformerConv

from pyg_fastattn import (FastGATConv, FastGATv2Conv, FastTransformerConv,
                          prepare)
from pyg_fastattn.datasets import (DatasetNotFoundError, load_planetoid,
                                   synthetic_pubmed)

LAYERS = {'fast': FastGATConv, 'pyg': GATConv}
# --model: the layer family, {layer: class} as LAYERS
MODELS = {'gat': LAYERS,
          'gatv2': {'fast': FastGATv2Conv, 'pyg': GATv2Conv},
          'transformer': {'fast': FastTransformerConv, 'pyg': TransformerConv}}


class GAT(torch.nn.Module):
    """PyG's examples/gat.py model."""
    def __init__(self, conv, in_channels, hidden, out_channels, heads=8,
                 dropout=0.6):
        super().__init__()
        self.dropout = dropout
        self.conv1 = conv(in_channels, hidden, heads, dropout=dropout)
        self.conv2 = conv(hidden * heads, out_channels, heads=1, concat=False,
                          dropout=dropout)

    def forward(self, x, edge_index):
        x = F.dropout(x, p=self.dropout, training=self.training)
        x = F.elu(self.conv1(x, edge_index))
        x = F.dropout(x, p=self.dropout, training=self.training)
        return self.conv2(x, edge_index)


# Memory ######################################################################


class PeakTensorMemory(torch.utils._python_dispatch.TorchDispatchMode):
    """Peak bytes of live tensor storages seen by the ops run under it (a
    CPU stand-in for ``torch.cuda.max_memory_allocated``: parameters, data,
    activations, gradients and optimizer state that the step touches;
    scratch memory inside a kernel is not seen)."""
    def __init__(self):
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef
        self._ref = StorageWeakRef
        self.live = {}
        self.current = self.peak = 0

    def _add(self, t):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return
        ref = self._ref(t.untyped_storage())
        if ref.cdata not in self.live:
            n = t.untyped_storage().nbytes()
            self.live[ref.cdata] = (ref, n)
            self.current += n

    def _sweep(self):
        for k in [k for k, (r, _) in self.live.items() if r.expired()]:
            self.current -= self.live.pop(k)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = torch.utils._pytree.tree_leaves
        for t in leaves((args, kwargs)):
            self._add(t)
        out = func(*args, **kwargs)
        self._sweep()
        for t in leaves(out):
            self._add(t)
        self.peak = max(self.peak, self.current)
        return out


# Training ####################################################################

AMP_DTYPES = {'none': None, 'bf16': torch.bfloat16, 'fp16': torch.float16}
COMPILE_MODES = ('none', 'default', 'reduce-overhead')


def _check_options(amp, compile, cuda_graph):
    """Normalized ``(amp, compile)``; ValueError for unknown values and for
    combinations that cannot work."""
    amp = 'none' if amp is None else str(amp).lower()
    amp = {'bfloat16': 'bf16', 'float16': 'fp16', 'half': 'fp16'}.get(amp, amp)
    compile = ('none' if compile in (None, False) else
               'default' if compile is True else str(compile))
    if amp not in AMP_DTYPES:
        raise ValueError(f'amp must be one of {list(AMP_DTYPES)}, '
                         f'got {amp!r}')
    if compile not in COMPILE_MODES:
        raise ValueError(f'compile must be one of {list(COMPILE_MODES)}, '
                         f'got {compile!r}')
    if cuda_graph and compile != 'none':
        raise ValueError(
            f'--cuda-graph cannot be combined with --compile {compile}: the '
            f'manual capture would record a torch.compile graph; use '
            f'--compile reduce-overhead (compiled CUDA graphs) instead')
    if cuda_graph and amp == 'fp16':
        raise ValueError(
            '--cuda-graph cannot be combined with --amp fp16: GradScaler '
            'checks gradients for inf/NaN on the host every step, which a '
            'CUDA graph cannot capture; use --amp bf16 (no scaler)')
    return amp, compile


def _autocast(device, amp, cache_enabled=True):
    """torch.autocast for ``amp`` ('none': disabled)."""
    dtype = AMP_DTYPES[amp]
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None,
                          cache_enabled=cache_enabled)


def _accuracy(model, data, graph, amp='none'):
    model.eval()
    with torch.no_grad(), _autocast(data.x.device, amp):
        pred = model(data.x, graph).argmax(dim=-1)
    return [float((pred[m] == data.y[m]).float().mean())
            for m in (data.train_mask, data.val_mask, data.test_mask)]


def _tensors(*objs):
    """The tensors in ``objs`` (tensors, tuples, a PreparedGraph's fields)."""
    for o in objs:
        if isinstance(o, torch.Tensor):
            yield o
        elif isinstance(o, (tuple, list)):
            yield from _tensors(*o)
        elif dataclasses.is_dataclass(o):
            yield from _tensors(*(getattr(o, f.name)
                                  for f in dataclasses.fields(o)))


def _sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


_SIDE_STREAMS = {}


def _side_stream(device):
    """One side stream per device for warm-up and capture, reused by every
    run: cuBLAS keeps a workspace per stream it has seen (32 MiB on this
    GPU), so new streams per run showed as 64 MiB more memory each run."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def train(data, layer='fast', epochs=200, lr=0.005, weight_decay=5e-4,
          hidden=8, heads=8, dropout=0.6, device=None, seed=0, log_every=0,
          cuda_graph=False, measure_memory=True, log=print, amp='none',
          compile='none', family='gat', compile_rng='inductor'):
    """Train one GAT (``family``: 'gat', 'gatv2' or 'transformer' layers) and
    return a dict: ``test_acc`` (at the best validation
    epoch), ``final_test_acc`` (at the last epoch), ``best_val_acc``,
    ``best_epoch``, ``epoch_times`` (seconds per training step, warm-up
    included), ``warmup_epochs``, ``warmup_s`` (training steps and
    evaluations of the warm-up epochs: compilation, CUDA-graph capture),
    ``median_epoch_ms`` (training steps after the warm-up), ``losses`` (the
    training loss of each epoch), ``peak_memory``
    (bytes or None), ``memory_method``, ``amp`` and ``compile``.

    ``amp``: 'none', 'bf16' or 'fp16' (forward and loss under
    ``torch.autocast``; fp16 adds a ``torch.amp.GradScaler``). ``compile``:
    'none', 'default' or 'reduce-overhead' (``torch.compile(model, mode=...)``;
    resets torch._dynamo first so that every run compiles afresh).
    ``compile_rng``: 'inductor' (compiled dropout draws from inductor's own
    random streams, so a seed gives other masks than eager) or 'eager'
    (``torch._inductor.config.fallback_random``: eager's masks, to compare
    compiled training with eager's run by run). ``cuda_graph`` refuses
    ``compile`` and ``amp='fp16'`` (ValueError)."""
    amp, compile = _check_options(amp, compile, cuda_graph)
    if compile_rng not in ('inductor', 'eager'):
        raise ValueError(f"compile_rng must be 'inductor' or 'eager', got "
                         f'{compile_rng!r}')
    if compile != 'none' and compile_rng == 'eager':
        import torch._inductor.config as inductor_config
        with inductor_config.patch(fallback_random=True):
            return train(data, layer, epochs=epochs, lr=lr,
                         weight_decay=weight_decay, hidden=hidden,
                         heads=heads, dropout=dropout, device=device,
                         seed=seed, log_every=log_every,
                         cuda_graph=cuda_graph, measure_memory=measure_memory,
                         log=log, amp=amp, compile=compile, family=family)
    device = torch.device(device or ('cuda' if torch.cuda.is_available()
                                     else 'cpu'))
    num_classes = int(data.y.max()) + 1
    data = data.to(device)
    torch.manual_seed(seed)
    conv = MODELS[family][layer]
    model = GAT(conv, data.num_features, hidden, num_classes, heads,
                dropout).to(device)
    use_graph = (cuda_graph and device.type == 'cuda' and layer == 'fast'
                 and family == 'gat')
    if cuda_graph and not use_graph:
        log(f'[{layer}] --cuda-graph needs CUDA and the fast layer (GATConv '
            f'syncs with the host while removing self-loops); running eagerly')
    # In a CUDA graph the step's launches cost nothing on the host but their
    # kernels still run: the fused Adam (one kernel) replaces ~10 foreach
    # kernels. Same update rule. Compiled steps use it too: it is the one
    # launch of the step that the compiled graphs do not cover.
    fused = use_graph or (compile != 'none' and device.type == 'cuda')
    opt = torch.optim.Adam(model.parameters(), lr=lr,
                           weight_decay=weight_decay, capturable=use_graph,
                           fused=True if fused else None)
    scaler = torch.amp.GradScaler(device.type) if amp == 'fp16' else None
    net = model

    def forward_loss(x, graph, train_idx, train_y):
        return F.cross_entropy(model(x, graph)[train_idx], train_y)

    if compile != 'none':
        torch._dynamo.reset()  # no recompile limit across runs; fair timing
        net = torch.compile(model, mode=compile)  # evaluation
        # the loss inside the compiled graph: one graph (and with
        # reduce-overhead one CUDA graph) per direction
        forward_loss = torch.compile(forward_loss, mode=compile)
    # cudagraph trees: each call starts a new iteration (outputs of the last
    # one are dead by then)
    mark_step = (torch.compiler.cudagraph_mark_step_begin
                 if compile == 'reduce-overhead' else lambda: None)
    # FastGATConv caches the prepared graph by itself; preparing it up front
    # keeps host syncs out of the timed steps and the CUDA graph.
    graph = prepare(data.edge_index, num_nodes=data.num_nodes,
                    add_self_loops=family != 'transformer') \
        if layer == 'fast' else data.edge_index

    train_idx = data.train_mask.nonzero().view(-1)  # no sync inside steps
    train_y = data.y[train_idx]
    if compile == 'reduce-overhead' and device.type == 'cuda':
        # CUDA-graph replays copy every input that is not a parameter into
        # the graph's own buffers (Cora's features: 15 MB a step); these
        # never change, so they can keep their addresses.
        for t in _tensors(data.x, graph, train_idx, train_y):
            torch._dynamo.mark_static_address(t)

    def step(module=None):
        # autocast's weight-cast cache must be off while capturing
        with _autocast(device, amp, cache_enabled=not use_graph):
            if module is None:
                loss = forward_loss(data.x, graph, train_idx, train_y)
            else:
                loss = F.cross_entropy(module(data.x, graph)[train_idx],
                                       train_y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return loss

    if device.type == 'cuda':
        gc.collect()  # free an earlier run's model before the peak reset
        torch.cuda.reset_peak_memory_stats(device)
    captured, static_loss, warmup = None, None, 3
    side = _side_stream(device) if use_graph else None
    # epochs left out of the median: the first eager step prepares; the
    # compiled ones compile (and record cudagraph trees); capture is one more
    warmup_epochs = min(epochs, warmup + 1 if use_graph else
                        3 if compile != 'none' else 1)

    best_val, test_acc, best_epoch, times, losses = -1.0, 0.0, 0, [], []
    warmup_s = 0.0
    for epoch in range(1, epochs + 1):
        model.train()
        _sync(device)
        t0 = time.perf_counter()
        if not use_graph:
            opt.zero_grad(set_to_none=True)
            mark_step()
            loss = step()
        elif epoch <= warmup:  # warm up on a side stream before capture
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                opt.zero_grad(set_to_none=True)
                # detached: a live autograd graph would keep this stream's
                # AccumulateGrad nodes for the captured backward
                loss = step().detach()
            torch.cuda.current_stream(device).wait_stream(side)
        else:
            if captured is None:
                opt.zero_grad(set_to_none=True)
                captured = torch.cuda.CUDAGraph()
                with torch.cuda.graph(captured, stream=side):
                    static_loss = step()
            captured.replay()  # fresh dropout: torch.rand is graph-safe
            loss = static_loss
        _sync(device)
        times.append(time.perf_counter() - t0)

        losses.append(float(loss.detach()))
        mark_step()
        train_acc, val_acc, tmp_test = _accuracy(net, data, graph, amp)
        if epoch <= warmup_epochs:
            _sync(device)
            warmup_s += time.perf_counter() - t0
        if val_acc > best_val:
            best_val, test_acc, best_epoch = val_acc, tmp_test, epoch
        if log_every and (epoch % log_every == 0 or epoch == epochs):
            log(f'[{layer}] epoch {epoch:3d}  loss {losses[-1]:.4f}  '
                f'train {train_acc:.3f}  val {val_acc:.3f}  test {tmp_test:.3f}'
                f'  step {1e3 * times[-1]:.1f} ms')

    peak, method = None, None
    if device.type == 'cuda':
        peak, method = torch.cuda.max_memory_allocated(device), \
            'torch.cuda.max_memory_allocated over training'
    elif measure_memory:
        # eager model: the dispatch tracker does not see inside compiled code
        peak, method = _cpu_step_memory(model, opt, lambda: step(model)), \
            'peak live tensor bytes in one training step (dispatch tracker' \
            + (', eager model)' if compile != 'none' else ')')
    if captured is not None:
        captured.reset()  # free the graph's private pool before the next run
    steady = times[warmup_epochs:] or times
    return {
        'layer': layer, 'test_acc': test_acc, 'final_test_acc': tmp_test,
        'best_val_acc': best_val, 'best_epoch': best_epoch,
        'epoch_times': times, 'losses': losses,
        'warmup_epochs': warmup_epochs,
        'warmup_s': warmup_s,
        'median_epoch_ms': 1e3 * statistics.median(steady),
        'peak_memory': peak, 'memory_method': method, 'amp': amp,
        'compile': compile,
    }


def run(layer='fast', dataset='Cora', root=None, synthetic=False, data=None,
        epochs=200, device=None, seed=0, amp='none', compile='none',
        **kwargs):
    """Load ``dataset`` (unless ``data`` is given) and :func:`train` one
    model; returns train's dict (``run(...)['test_acc']``: test accuracy at
    the best validation epoch). ``kwargs`` go to :func:`train`."""
    if data is None:
        data, _ = load_data(dataset, root, synthetic)
    return train(data, layer, epochs=epochs, device=device, seed=seed,
                 amp=amp, compile=compile, **kwargs)


def _cpu_step_memory(model, opt, step_fn):
    """Peak tensor memory of one training step, on copies of the model and
    optimizer (the trained ones are left as they are)."""
    saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    model.train()
    tracker = PeakTensorMemory()
    try:
        opt.zero_grad(set_to_none=True)
        with tracker:
            step_fn()
    finally:
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
        opt.zero_grad(set_to_none=True)
    return tracker.peak


# Command line ################################################################


def _mib(n):
    return 'n/a' if n is None else f'{n / 2**20:.1f} MiB'


def load_data(dataset, root=None, synthetic=False):
    if synthetic:
        return synthetic_pubmed(), 'synthetic PubMed-sized graph'
    ds = load_planetoid(dataset, root)
    return ds[0], ds.name


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--dataset', default='Cora',
                   type=lambda s: {'cora': 'Cora', 'citeseer': 'CiteSeer',
                                   'pubmed': 'PubMed'}.get(s.lower(), s),
                   choices=['Cora', 'CiteSeer', 'PubMed'])
    p.add_argument('--layer', default='fast', choices=['fast', 'pyg', 'both'])
    p.add_argument('--model', default='gat', choices=sorted(MODELS),
                   help='layer family: GATConv, GATv2Conv or TransformerConv '
                        '(and its drop-in)')
    p.add_argument('--epochs', type=int, default=200)
    p.add_argument('--runs', type=int, default=1)
    p.add_argument('--device', default='auto', help="'auto', 'cpu', 'cuda'")
    p.add_argument('--root', default=None,
                   help='Planetoid root holding <Name>/raw/ind.<name>.* '
                   '(default: $PYG_FASTATTN_DATA, ./data/Planetoid, then '
                   '../shared/data/Planetoid)')
    p.add_argument('--seed', type=int, default=0)
    p.add_argument('--log-every', type=int, default=20,
                   help='progress line every N epochs (0: none)')
    p.add_argument('--threads', type=int, default=None,
                   help='torch.set_num_threads (CPU)')
    p.add_argument('--synthetic', action='store_true',
                   help='use a PubMed-sized random graph instead of files '
                   '(benchmarking only)')
    p.add_argument('--cuda-graph', action='store_true',
                   help='capture the whole training step in a CUDA graph '
                   '(fast layer, CUDA only; not with --compile or --amp fp16)')
    p.add_argument('--amp', default='none', choices=list(AMP_DTYPES),
                   help='run forward and loss under torch.autocast in this '
                   'dtype (fp16 adds a GradScaler)')
    p.add_argument('--compile', default='none', choices=list(COMPILE_MODES),
                   help='torch.compile(model, mode=...) ("default": inductor '
                   'default mode; reduce-overhead adds CUDA graphs on CUDA)')
    p.add_argument('--compile-rng', default='inductor',
                   choices=['inductor', 'eager'],
                   help="with --compile: dropout from inductor's random "
                   "streams, or eager's (fallback_random: the same masks as "
                   "an eager run of the same seed)")
    p.add_argument('--no-memory', action='store_true',
                   help='skip the CPU memory measurement')
    args = p.parse_args(argv)
    try:
        _check_options(args.amp, args.compile, args.cuda_graph)
    except ValueError as e:
        p.error(str(e))

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device('cuda' if args.device == 'auto'
                          and torch.cuda.is_available() else
                          'cpu' if args.device == 'auto' else args.device)
    try:
        data, name = load_data(args.dataset, args.root, args.synthetic)
    except DatasetNotFoundError as e:
        print(f'error: {e}', file=sys.stderr)
        return 2
    print(f'{name}: {data.num_nodes} nodes, {data.num_edges} edges, '
          f'{data.num_features} features; device {device}'
          f'{"" if device.type != "cpu" else f", {torch.get_num_threads()} threads"}'
          f'; pyg_fastattn backend: '
          f'{"native" if pyg_fastattn.backend_info()["native_cpu"] else "reference"}')
    amp = args.amp if args.amp == 'none' else \
        f'{args.amp} (autocast {AMP_DTYPES[args.amp]}' + \
        (', GradScaler)' if args.amp == 'fp16' else ')')
    print(f'settings: model {args.model}, layer {args.layer}, amp {amp}, '
          f'compile {args.compile}'
          f'{f" (rng {args.compile_rng})" if args.compile != "none" else ""}, '
          f'cuda-graph {"on" if args.cuda_graph else "off"}, epochs '
          f'{args.epochs}, runs {args.runs}')

    layers = ['fast', 'pyg'] if args.layer == 'both' else [args.layer]
    results = {k: [] for k in layers}
    for i in range(args.runs):
        for layer in layers:
            r = train(data, layer, epochs=args.epochs, device=device,
                      seed=args.seed + i, log_every=args.log_every,
                      cuda_graph=args.cuda_graph,
                      measure_memory=not args.no_memory, amp=args.amp,
                      compile=args.compile, family=args.model,
                      compile_rng=args.compile_rng)
            results[layer].append(r)
            print(f'[{layer}] run {i + 1}: test accuracy {r["test_acc"]:.4f}'
                  f' (best val {r["best_val_acc"]:.4f} at epoch '
                  f'{r["best_epoch"]}), median epoch '
                  f'{r["median_epoch_ms"]:.2f} ms, warm-up {r["warmup_s"]:.2f}'
                  f' s (first {r["warmup_epochs"]} epochs), '
                  f'peak memory {_mib(r["peak_memory"])}')

    rows = []
    for layer in layers:
        rs = results[layer]
        accs = [r['test_acc'] for r in rs]
        std = statistics.stdev(accs) if len(accs) > 1 else 0.0
        ms = statistics.median(
            t for r in rs for t in r['epoch_times'][r['warmup_epochs']:]
            or r['epoch_times']) * 1e3
        mem = [r['peak_memory'] for r in rs if r['peak_memory'] is not None]
        warm = statistics.mean(r['warmup_s'] for r in rs)
        rows.append((layer, f'{statistics.mean(accs):.4f} ± {std:.4f}',
                     f'{ms:.2f}', _mib(max(mem) if mem else None), ms,
                     max(mem) if mem else None, f'{warm:.2f}'))
    if len(rows) > 1:
        print()
        print(f'{"layer":6s} {"test acc (mean ± std)":>22s} '
              f'{"median epoch ms":>16s} {"peak memory":>12s} '
              f'{"warm-up s":>10s}')
        for r in rows:
            print(f'{r[0]:6s} {r[1]:>22s} {r[2]:>16s} {r[3]:>12s} '
                  f'{r[6]:>10s}')
        f, g = rows[0], rows[1]
        line = f'fast vs pyg: {g[4] / f[4]:.2f}x faster per epoch'
        if f[5] and g[5]:
            line += f', {g[5] / f[5]:.2f}x less peak memory'
        print(line)
        method = results[layers[0]][0]['memory_method']
        if method:
            print(f'(memory: {method})')
    else:
        r = rows[0]
        print(f'{r[0]}: test accuracy {r[1]}, median epoch {r[2]} ms, '
              f'warm-up {r[6]} s (mean per run)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
