"""``swap``: replace PyG attention layers of a model by their fused drop-ins
(``GATConv``, ``GATv2Conv`` when :mod:`pyg_fastattn` has it, and
``TransformerConv``)."""
import warnings
from collections import OrderedDict
from typing import Dict, Optional, Type

import torch
from torch_geometric.nn.conv import GATConv, GATv2Conv, TransformerConv

from .gat_conv import FastGATConv
from .transformer_conv import FastTransformerConv

__all__ = ['swap', 'swap_gat', 'to_fast']


def _drop_ins() -> Dict[type, type]:
    """PyG class -> drop-in class, for the drop-ins this install has."""
    table = {GATConv: FastGATConv, TransformerConv: FastTransformerConv}
    try:
        from .gatv2_conv import FastGATv2Conv
    except ImportError:
        pass
    else:
        table[GATv2Conv] = FastGATv2Conv
    return table


def _pyg_class(conv, table) -> Optional[type]:
    """The PyG class ``conv`` is an instance of (a key of ``table``), if
    any, and it is not already a drop-in."""
    if isinstance(conv, tuple(table.values())):
        return None
    for cls in table:
        if isinstance(conv, cls):
            return cls
    return None


def _why_not(conv, cls: type):
    """Why ``conv`` cannot use the fused kernels (None if it can)."""
    if type(conv) is not cls:
        return (f'{type(conv).__name__} subclasses {cls.__name__} and may '
                f'change its behaviour')
    if conv.aggr not in ('add', 'sum'):
        return f"aggr={conv.aggr!r} (the fused kernel sums)"
    if conv.flow != 'source_to_target':
        return f"flow={conv.flow!r}"
    if getattr(conv, '_explain', None):
        return 'explain mode is on'
    return None


def to_fast(conv: torch.nn.Module, new_cls: Optional[Type] = None):
    """An equivalent drop-in (``new_cls``, by default the one for ``conv``'s
    class) sharing ``conv``'s parameters, buffers, submodules, hooks and
    training mode (no copies: an optimizer built on the old layer keeps
    training the new one)."""
    if new_cls is None:
        table = _drop_ins()
        new_cls = table[_pyg_class(conv, table) or type(conv)]
    new = new_cls.__new__(new_cls)
    state = {}
    for k, v in conv.__dict__.items():
        # Own containers (parameters, modules, hooks), shared contents.
        state[k] = type(v)(v) if isinstance(v, (dict, OrderedDict)) else v
    new.__dict__.update(state)
    return new


def _swap(model: torch.nn.Module, table: Dict[type, type], who: str):
    cls = _pyg_class(model, table)
    if cls is not None:
        why = _why_not(model, cls)
        if why is None:
            return to_fast(model, table[cls])
        warnings.warn(f'{who}: left the model as is: {why}', stacklevel=3)
        return model

    done = {}  # id(old) -> new, so shared layers stay shared
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            cls = _pyg_class(child, table)
            if cls is None:
                continue
            if id(child) in done:
                parent._modules[name] = done[id(child)]
                continue
            full = f'{parent_name}.{name}' if parent_name else name
            why = _why_not(child, cls)
            if why is not None:
                warnings.warn(f'{who}: left {full} ({type(child).__name__})'
                              f' as is: {why}', stacklevel=3)
                done[id(child)] = child
                continue
            done[id(child)] = parent._modules[name] = to_fast(child,
                                                              table[cls])
    return model


def swap(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every ``GATConv``, ``GATv2Conv`` and ``TransformerConv``
    (exactly those classes) in ``model``, in place, by its drop-in
    (:class:`FastGATConv`, ``FastGATv2Conv`` when this install has it,
    :class:`FastTransformerConv`) holding the same parameters (the same
    tensors: device, dtype, ``requires_grad`` and training mode are kept,
    the ``state_dict`` is unchanged and existing optimizers stay valid).
    Returns ``model``; if ``model`` is itself such a layer, returns the new
    layer.

    Layers that cannot be converted (subclasses it does not know, ``aggr``
    other than 'add', reverse flow, explain mode) are left alone with a
    warning saying why. Lazily initialized layers (``in_channels=-1``) are
    converted too: they share the lazy submodules, which initialize on the
    first forward as before.
    """
    return _swap(model, _drop_ins(), 'swap')


def swap_gat(model: torch.nn.Module) -> torch.nn.Module:
    """Alias of :func:`swap` (it converts GATv2Conv and TransformerConv
    layers too)."""
    return _swap(model, _drop_ins(), 'swap_gat')
