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
// (gat_attention's x beside its weight: the op casts x itself, so that
// neither the cast nor the gradient's cast back outlives the op).
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
