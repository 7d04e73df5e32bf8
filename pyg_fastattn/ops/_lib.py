"""The ``pyg_fastattn`` operator library: one place that defines each op and
registers it with PyTorch the documented way.

Each op module (``attention.py``, ``gat.py``, ...) calls :func:`define` with
its schema and :func:`register` with its fake (meta) implementation, its
autograd formula and whether it takes an autocast rule. The kernels come from
the C++/CUDA extension (``TORCH_LIBRARY_IMPL`` in ``csrc/``); where it is
unavailable for a device, :func:`install_backends` registers the pure-PyTorch
reference (:mod:`pyg_fastattn.reference`, same names and arguments) as that
device's kernel of the same op. :func:`use_reference` swaps the reference in
for a while (tests compare both).

Every op has batching rules (:func:`_register_vmap`) for ``torch.func.vmap``
and ``autograd.grad(is_grads_batched=True)``.

Autocast: under ``torch.autocast`` every floating-point tensor argument is
cast to the autocast dtype (float16/bfloat16); kernels read that dtype and
accumulate in float32.
"""
import contextlib
import warnings
from typing import Callable, Dict, List, Optional

import torch
from torch import Tensor

NAMESPACE = 'pyg_fastattn'
_lib = torch.library.Library(NAMESPACE, 'DEF')
_names: List[str] = []


def define(schema: str) -> None:
    """Define ``pyg_fastattn::<schema>`` (once per process)."""
    _lib.define(schema)
    _names.append(schema.split('(', 1)[0].strip())


_overloads: Dict[str, torch._ops.OpOverload] = {}


def op(name: str):
    """``torch.ops.pyg_fastattn.<name>.default`` (looked up once; a plain
    dict, which torch.compile traces without a warning)."""
    o = _overloads.get(name)
    if o is None:
        o = _overloads[name] = getattr(getattr(torch.ops, NAMESPACE),
                                       name).default
    return o


def _cast_args(args, dtype, device_type: str):
    def cast(a):
        if (isinstance(a, Tensor) and a.is_floating_point()
                and a.device.type == device_type and a.dtype != torch.float64):
            return a.to(dtype)
        return a

    return [cast(a) for a in args]


_autocast_impls: Dict[str, List[tuple]] = {}


def _register_autocast(name: str) -> None:
    """Cast floating-point arguments to the current autocast dtype, then run
    the op with autocast off (as ``torch.library.register_autocast`` does,
    but with the dtype read at call time). This Python rule serves the
    Python dispatcher (tracing) always, and eager calls only without the
    extension: its C++ kernel (``csrc/ops/autocast.h``) does the same
    through autocast's cast cache, at a fraction of the host time."""
    overload = op(name)
    impls = _autocast_impls[name] = []
    for device_type in ('cpu', 'cuda'):
        key_name = 'Autocast' + torch._C._dispatch_key_for_device(device_type)
        key = getattr(torch._C.DispatchKey, key_name)
        keyset = torch._C.DispatchKeySet(key)

        def impl(*args, _dev=device_type, _keyset=keyset):
            dtype = torch.get_autocast_dtype(_dev)
            with torch._C._ExcludeDispatchKeyGuard(_keyset):
                return overload(*_cast_args(args, dtype, _dev))

        overload.py_impl(key)(impl)  # for the Python dispatcher (tracing)
        impls.append((key_name, impl))


def _install_python_autocast(name: str) -> None:
    for key_name, impl in _autocast_impls[name]:
        _lib.impl(name, lambda _ks, *args, _f=impl: _f(*args), key_name,
                  with_keyset=True)


def keep_graph() -> bool:
    """Whether the running backward keeps the graph (retain_graph or
    create_graph; True where torch cannot tell)."""
    f = getattr(torch._C._autograd, '_get_current_graph_task_keep_graph',
                None)
    return True if f is None else bool(f())


def _saved_tensor_hooks() -> bool:
    """Whether saved-tensor hooks are active (activation checkpointing,
    ``save_on_cpu``)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks
    try:
        return top(False) is not None
    except TypeError:  # torch without the ignore_is_tracing argument
        return top() is not None


def keep_output(ctx, out: Tensor) -> Optional[Tensor]:
    """Keep the attention ops' ``out``, which their backward reads and the
    layers often return as it is, on ``ctx`` instead of saving it: out of
    autograd's version check, so that an in-place op on the layer's output
    (``relu_``, ``+=``), which PyG's layers allow, makes :func:`kept_output`
    recompute it rather than the backward raise. (A torch.compile trace
    sees the in-place op above functionalization, so traced tensors take
    the same route.) Under saved-tensor hooks, which must see every saved
    activation, ``out`` is saved as usual. Returns what
    ``save_for_backward`` takes in its place."""
    if _saved_tensor_hooks():
        return out
    ctx.kept_out, ctx.kept_version = out.detach(), out._version
    ctx.kept_traced = type(out) is not Tensor
    return None


def kept_output(ctx, saved: Optional[Tensor],
                recompute: Callable[[], Tensor]) -> Tensor:
    """In the backward: ``out`` as the forward made it (``saved``:
    :func:`keep_output`'s result as saved), recomputed by ``recompute()``
    (the forward op again) when it changed in place since; a tensor traced
    here but not in the forward (compiled autograd's proxy, whose version
    says nothing) too."""
    if saved is not None:
        return saved
    out = ctx.kept_out
    if out is None:
        raise RuntimeError('the attention output was already released: call '
                           'backward with retain_graph=True to backward twice')
    proxy = type(out) is not Tensor and not ctx.kept_traced
    if proxy or out._version != ctx.kept_version:
        with torch.no_grad():
            out = recompute()
    if not proxy and not keep_graph():
        ctx.kept_out = None  # as autograd releases saved tensors
    return out


class _NoSecondDerivative(torch.autograd.Function):
    """The gradients of a backward as they are under ``create_graph``: the
    same tensors, with a ``grad_fn`` that raises. Its graph inputs are the
    incoming gradients and the forward's saved tensors, so that
    differentiating the gradients meets it on the way to the forward's
    inputs (``NoSecondDerivative`` in ``csrc/ops/autograd.h``)."""

    @staticmethod
    def forward(ctx, name, n, *tensors):
        ctx.name = name
        return tensors[:n]

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f'pyg_fastattn: {ctx.name} has no second derivative: '
            'differentiating its gradient (create_graph=True: double '
            'backward, gradient penalties) is not supported. Use the PyG '
            'layer for higher-order gradients.')


def once_differentiable(name: str, backward: Callable, ctx, *grads):
    """``backward(ctx, *grads)`` as the C++ autograd kernels run it
    (``once_differentiable`` in ``csrc/ops/autograd.h``): without grad mode,
    then under ``create_graph`` its gradients through
    :class:`_NoSecondDerivative`, so that a double backward raises a clear
    error rather than giving a wrong number."""
    with torch.no_grad():
        out = backward(ctx, *grads)
    if not torch.is_grad_enabled():
        return out
    outs = out if isinstance(out, tuple) else (out, )
    defined = [t for t in outs if isinstance(t, Tensor)]
    if not defined:
        return out
    inputs = [t for t in (*grads, *ctx.saved_tensors)
              if isinstance(t, Tensor) and t.requires_grad]
    wrapped = iter(_NoSecondDerivative.apply(name, len(defined), *defined,
                                             *inputs))
    res = tuple(next(wrapped) if isinstance(t, Tensor) else t for t in outs)
    return res if isinstance(out, tuple) else res[0]


def _register_autograd(name: str, backward: Callable,
                       setup_context: Callable) -> None:
    """The Autograd kernel that ``torch.library.register_autograd`` makes,
    less its per-call ``fill_defaults`` over the schema (host time on every
    call; these schemas have no defaults to fill): below
    autograd the op redispatches; with grad, through an autograd.Function
    whose forward calls ``setup_context(ctx, inputs, output)`` and whose
    backward is ``backward(ctx, *grads)``."""
    overload = op(name)
    after_autograd = torch._C._after_autograd_keyset

    def forward(ctx, *args):
        keyset = args[-1]
        # below view tracking too, as C++ autograd kernels call their ops: an
        # output that a kernel made as a view of its own buffer stays a plain
        # tensor, which in-place ops on the layer output may modify
        with torch._C._AutoDispatchBelowADInplaceOrView():
            out = overload.redispatch(keyset & after_autograd, *args[:-1])
        setup_context(ctx, args[:-1], out)
        return out

    def backward_(ctx, *grads):
        grads_in = once_differentiable(name, backward, ctx, *grads)
        return (*grads_in, None) if isinstance(grads_in, tuple) else (
            grads_in, None)

    fn = type(f'{name}_autograd', (torch.autograd.Function, ), {
        'forward': staticmethod(forward),
        'backward': staticmethod(backward_)})

    def kernel(keyset, *args):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return fn.apply(*args, keyset)
        with torch._C._AutoDispatchBelowAutograd():
            return overload.redispatch(keyset & after_autograd, *args)

    _lib.impl(name, kernel, 'Autograd', with_keyset=True)


def _per_sample(name: str, overload, written, args, batched):
    """``overload`` once per sample, outputs stacked at dim 0 (None where
    undefined): ``args[i]`` with ``batched[i]`` has the batch at dim 0 and
    is passed sliced, the others as they are. Arguments the op writes are
    written through to their batched tensors."""
    for i in written:
        if not batched[i]:
            raise RuntimeError(
                f'vmap: pyg_fastattn::{name} writes its argument '
                f'{overload._schema.arguments[i].name!r}, which is not '
                'batched while other arguments are')
    size = next(a.size(0) for a, b in zip(args, batched) if b)
    if size == 0:
        raise RuntimeError(f'vmap: pyg_fastattn::{name} does not support a '
                           'batch of size 0')
    outs = []
    for k in range(size):
        sample = [a.select(0, k) if b else a for a, b in zip(args, batched)]
        for i in written:  # (a kernel may assume them contiguous)
            sample[i] = sample[i].contiguous()
        outs.append(overload(*sample))
        for i in written:
            args[i].select(0, k).copy_(sample[i])
    if isinstance(outs[0], Tensor):
        return torch.stack(outs)
    return type(outs[0])(None if ts[0] is None else torch.stack(ts)
                         for ts in zip(*outs))


def _legacy_level(t: Tensor) -> Optional[int]:
    """The level of a tensor batched by one legacy vmap (None if by several).
    Read from the tensor: a CUDA backward runs on autograd's device thread,
    where the vmap nesting (thread-local) is 0. Removing another level
    leaves the tensor batched."""
    for level in range(1, 65):
        if not torch._C._functorch.is_legacy_batchedtensor(
                torch._remove_batch_dim(t, level, 0, 0)):
            return level
    return None


def _register_vmap(name: str) -> None:
    """Batching rules of ``name``: the op once per sample
    (:func:`_per_sample`). For ``torch.func.vmap`` (FuncTorchBatched) and
    for the legacy vmap (Batched) of ``autograd.grad(is_grads_batched=True)``
    and ``jacobian(vectorize=True)``, which reaches the backward ops. (The
    per-sample fallbacks of both take no ``Tensor[]`` returns and no ops that
    write several arguments.) Calls without batched tensors never reach
    them."""
    overload = op(name)
    written = [i for i, a in enumerate(overload._schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write]

    def functorch_rule(info, in_dims, *args):
        batched = [isinstance(d, int) for d in in_dims]
        args = [a.movedim(d, 0) if b else a
                for a, d, b in zip(args, in_dims, batched)]
        out = _per_sample(name, overload, written, args, batched)
        if isinstance(out, Tensor):
            return out, 0
        return out, type(out)(None if t is None else 0 for t in out)

    torch.library.register_vmap(f'{NAMESPACE}::{name}', functorch_rule,
                                lib=_lib)

    def legacy_kernel(*args):
        batched = [isinstance(a, Tensor)
                   and torch._C._functorch.is_legacy_batchedtensor(a)
                   for a in args]
        levels = {_legacy_level(a) for a, b in zip(args, batched) if b}
        if len(levels) != 1 or None in levels:
            raise RuntimeError(f'pyg_fastattn::{name}: nested vmap '
                               '(is_grads_batched) is not supported')
        level = levels.pop()
        args = [torch._remove_batch_dim(a, level, 0, 0) if b else a
                for a, b in zip(args, batched)]
        out = _per_sample(name, overload, written, args, batched)
        if isinstance(out, Tensor):
            return torch._add_batch_dim(out, 0, level)
        return type(out)(None if t is None else torch._add_batch_dim(
            t, 0, level) for t in out)

    _lib.impl(name, legacy_kernel, 'Batched')


# Autograd formulas that the extension also implements in C++: registered
# from Python only when it is not loaded.
_python_autograd_fallback: Dict[str, tuple] = {}


def register(name: str, *, fake: Callable, backward: Optional[Callable] = None,
             setup_context: Optional[Callable] = None, autocast: bool = False,
             native_autograd: bool = False) -> None:
    """Fake impl, batching rule (:func:`_register_vmap`), autograd formula
    and autocast rule of ``name``.
    ``native_autograd``: csrc/ registers the Autograd kernel; ``backward``
    is then only the formula of builds without the extension."""
    torch.library.register_fake(f'{NAMESPACE}::{name}', fake, lib=_lib)
    _register_vmap(name)
    if backward is not None and native_autograd:
        _python_autograd_fallback[name] = (backward, setup_context)
    elif backward is not None:
        _register_autograd(name, backward, setup_context)
    if autocast:
        _register_autocast(name)


def _reference_kernels() -> Dict[str, Callable]:
    from .. import reference
    return {n: getattr(reference, n) for n in _names}


_installed = False
_reference_keys = set()  # devices whose kernels are the reference already


def install_backends() -> None:
    """Build/load the native kernels and give every device without them the
    reference kernels. Runs once, at import of :mod:`pyg_fastattn.ops`."""
    global _installed
    if _installed:
        return
    from .. import _build
    st = _build.load()
    missing = [] if st.native else ['CPU']
    if not st.cuda:
        missing.append('CUDA')
    _reference_keys.update(missing)
    for key in missing:
        for name, fn in _reference_kernels().items():
            _lib.impl(name, fn, key)
    if not st.native:
        for name, (backward, setup_context) in _python_autograd_fallback.items():
            _register_autograd(name, backward, setup_context)
        for name in _autocast_impls:
            _install_python_autocast(name)
    _installed = True


@contextlib.contextmanager
def use_reference():
    """Run every op on the reference kernels (CPU and CUDA) inside the
    block; the native kernels come back after it."""
    lib = torch.library.Library(NAMESPACE, 'IMPL')
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='.*[Oo]verrid')
        for name, fn in _reference_kernels().items():
            for key in ('CPU', 'CUDA'):
                if key not in _reference_keys:  # (torch 2.11 raises there)
                    lib.impl(name, fn, key)
    try:
        yield
    finally:
        lib._destroy()
