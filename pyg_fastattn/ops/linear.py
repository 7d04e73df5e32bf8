"""``linear`` (``x @ weight.t() + bias``, what the layers' ``Linear``
computes) and ``column_sum``: on CUDA the bias gradient is a column sum that
reads ``grad_out`` at near copy rate (``torch.sum(0)`` over [N, K] does not).
Kernels: ``csrc/ops/linear.cpp`` or :func:`pyg_fastattn.reference.linear`."""
from typing import Optional

from torch import Tensor

from . import _lib

# x [R, F], weight [K, F], bias [K] or None -> [R, K].
_lib.define('linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor')
# Gradients of (x, weight, bias), each empty where output_mask is false.
_lib.define('linear_backward(Tensor grad_out, Tensor x, Tensor weight, '
            'bool[3] output_mask) -> Tensor[]')
# src [R, K] -> [K], the sum over rows (fixed order: deterministic).
_lib.define('column_sum(Tensor src) -> Tensor')


def _fake(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=weight.dtype)


def _fake_backward(grad_out, x, weight, output_mask):
    likes = (((x.shape[0], x.shape[1]), x.dtype), (tuple(weight.shape),
             weight.dtype), ((weight.shape[0], ), weight.dtype))
    return [x.new_empty(s, dtype=dt) if want else x.new_empty((0, ))
            for (s, dt), want in zip(likes, output_mask)]


def _fake_column_sum(src):
    return src.new_empty((src.shape[1], ))


def _setup_context(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, grad_out):
    if grad_out is None:
        return None, None, None
    x, weight = ctx.saved_tensors
    need = ctx.needs_input_grad
    mask = [need[0], need[1], ctx.has_bias and need[2]]
    g = _lib.op('linear_backward')(grad_out.contiguous(), x, weight, mask)
    return tuple(t if want else None for t, want in zip(g, mask))


_lib.register('linear', fake=_fake, backward=_backward,
              setup_context=_setup_context, autocast=True,
              native_autograd=True)
_lib.register('linear_backward', fake=_fake_backward)


def _setup_column_sum(ctx, inputs, output):
    ctx.rows = inputs[0].shape[0]


def _backward_column_sum(ctx, grad_out):
    return grad_out.unsqueeze(0).expand(ctx.rows, -1)


_lib.register('column_sum', fake=_fake_column_sum,
              backward=_backward_column_sum, setup_context=_setup_column_sum)


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    r"""``x @ weight.t() + bias`` as one op, differentiable in all three.

    Args:
        x: [R, F]; weight: [K, F]; bias: [K] or None (one dtype and device,
            except that x may be float32 beside a float16/bfloat16 weight:
            the op casts it where it reads it, and x's gradient comes back
            in float32. Under ``torch.autocast`` weight and bias take its
            dtype and a float32 x stays so).

    Returns:
        [R, K] in weight's dtype. The bias gradient is :func:`column_sum` of
        the output's gradient.
    """
    return _lib.op('linear')(x, weight, bias)


def column_sum(src: Tensor) -> Tensor:
    r"""``src.sum(0)`` of a 2-D ``src`` [R, K] -> [K]: on CUDA with many rows
    a matrix-vector product against ones (several times faster than
    ``sum(0)`` on [10^5-10^6, 128]), else ``sum(0)``. Deterministic."""
    return _lib.op('column_sum')(src)
