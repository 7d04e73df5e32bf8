"""``swap_gat``: replace PyG ``GATConv`` layers of a model by ``FastGATConv``."""
import warnings
from collections import OrderedDict

import torch
from torch_geometric.nn.conv import GATConv

from .gat_conv import FastGATConv

__all__ = ['swap_gat', 'to_fast']


def _why_not(conv: GATConv):
    """Why ``conv`` cannot use the fused kernel (None if it can)."""
    if type(conv) is not GATConv:
        return (f'{type(conv).__name__} subclasses GATConv and may change its '
                f'behaviour')
    if conv.aggr not in ('add', 'sum'):
        return f"aggr={conv.aggr!r} (the fused kernel sums)"
    if conv.flow != 'source_to_target':
        return f"flow={conv.flow!r}"
    if getattr(conv, '_explain', None):
        return 'explain mode is on'
    return None


def to_fast(conv: GATConv) -> FastGATConv:
    """An equivalent :class:`FastGATConv` sharing ``conv``'s parameters,
    buffers, submodules, hooks and training mode (no copies: an optimizer
    built on the old layer keeps training the new one)."""
    new = FastGATConv.__new__(FastGATConv)
    state = {}
    for k, v in conv.__dict__.items():
        # Own containers (parameters, modules, hooks), shared contents.
        state[k] = type(v)(v) if isinstance(v, (dict, OrderedDict)) else v
    new.__dict__.update(state)
    return new


def swap_gat(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every ``GATConv`` (exactly that class) in ``model``, in place,
    by an equivalent :class:`FastGATConv` holding the same parameters (the
    same tensors: device, dtype, ``requires_grad`` and training mode are kept,
    and existing optimizers stay valid). Returns ``model``; if ``model`` is
    itself a ``GATConv``, returns the new layer.

    Layers that cannot be converted (subclasses of GATConv it does not
    know, ``aggr`` other than 'add', reverse flow, explain mode) are left
    alone with a warning saying why. Lazily initialized layers
    (``in_channels=-1``) are converted too: they share the lazy submodules,
    which initialize on the first forward as before.
    """
    if isinstance(model, GATConv) and not isinstance(model, FastGATConv):
        why = _why_not(model)
        if why is None:
            return to_fast(model)
        warnings.warn(f'swap_gat: left the model as is: {why}', stacklevel=2)
        return model

    done = {}  # id(old) -> new, so shared layers stay shared
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent._modules.items()):
            if (child is None or not isinstance(child, GATConv)
                    or isinstance(child, FastGATConv)):
                continue
            if id(child) in done:
                parent._modules[name] = done[id(child)]
                continue
            full = f'{parent_name}.{name}' if parent_name else name
            why = _why_not(child)
            if why is not None:
                warnings.warn(f'swap_gat: left {full} ({type(child).__name__})'
                              f' as is: {why}', stacklevel=2)
                done[id(child)] = child
                continue
            done[id(child)] = parent._modules[name] = to_fast(child)
    return model
