// The autocast kernel of the ops that take one: under torch.autocast every
// floating-point tensor argument on the autocast device (float64 excepted)
// is cast to the autocast dtype, read at call time, through autocast's own
// cache (a parameter is cast once per autocast region, as for aten ops);
// then the op runs with autocast off. Kernels accumulate in float32.
#pragma once

#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace pyg_fastattn {

// kKeep >= 0: argument kKeep stays float32 where argument kIf is a tensor
// (x beside its weight in gat_attention and linear: the op casts x itself,
// so that neither the cast nor the gradient's cast back outlives the op;
// see mixed_x).
template <c10::DeviceType device, int kKeep = -1, int kIf = -1>
void autocast_boxed(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(device);
  const size_t n = op.schema().arguments().size();
  const size_t base = stack->size() - n;
  for (size_t i = base; i < stack->size(); ++i) {
    c10::IValue& v = (*stack)[i];
    if (!v.isTensor()) continue;
    if (kKeep >= 0 && i == base + kKeep && (*stack)[base + kIf].isTensor() &&
        v.toTensor().scalar_type() == at::kFloat)
      continue;
    v = at::autocast::cached_cast(dtype, v.toTensor(), device);
  }
  c10::impl::ExcludeDispatchKeyGuard no_autocast(
      at::autocast::get_autocast_dispatch_key_from_device_type(device));
  op.callBoxed(stack);
}

// The op's side of kKeep: x in float32 beside a float16/bfloat16 weight.
// The op casts x itself where it reads it, and x's gradient comes back in
// float32.
inline bool mixed_x(const at::Tensor& x, const at::Tensor& weight) {
  return x.scalar_type() == at::kFloat &&
         (weight.scalar_type() == at::kHalf ||
          weight.scalar_type() == at::kBFloat16);
}

// x in weight's dtype.
inline at::Tensor x_as_weight(const at::Tensor& x, const at::Tensor& weight) {
  return x.scalar_type() == weight.scalar_type()
             ? x
             : x.to(weight.scalar_type());
}

// x's gradient g @ weight in x's dtype (float32 beside a 16-bit weight: on
// CUDA the GEMM writes float32 itself, through aten::mm.dtype where this
// torch has it).
inline at::Tensor grad_x(const at::Tensor& g, const at::Tensor& weight,
                         at::ScalarType dtype) {
  if (dtype == weight.scalar_type()) return g.mm(weight);
  if (g.is_cuda()) {
    static const auto mm_dtype =
        c10::Dispatcher::singleton().findOp({"aten::mm", "dtype"});
    if (mm_dtype.has_value())
      return mm_dtype
          ->typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                             at::ScalarType)>()
          .call(g, weight, dtype);
  }
  return g.mm(weight).to(dtype);
}

}  // namespace pyg_fastattn

// Registers the autocast kernel of op `name` for CPU and CUDA (KEEP, IF:
// autocast_boxed's kKeep, kIf).
#define PFA_REGISTER_AUTOCAST_KEEP(name, KEEP, IF)                           \
  TORCH_LIBRARY_IMPL(pyg_fastattn, AutocastCPU, m) {                         \
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<                  \
                     &pyg_fastattn::autocast_boxed<c10::DeviceType::CPU,     \
                                                   KEEP, IF>>());            \
  }                                                                          \
  TORCH_LIBRARY_IMPL(pyg_fastattn, AutocastCUDA, m) {                        \
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<                  \
                     &pyg_fastattn::autocast_boxed<c10::DeviceType::CUDA,    \
                                                   KEEP, IF>>());            \
  }
#define PFA_REGISTER_AUTOCAST(name) PFA_REGISTER_AUTOCAST_KEEP(name, -1, -1)
