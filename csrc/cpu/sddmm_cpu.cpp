// sddmm_dot (CPU): per-edge, per-head dot products of node features.
#include "utils.h"

namespace pyg_fastattn {
namespace {

// Edges are split over threads (at::parallel_for); each edge's H dot products
// are contiguous length-C loops.
at::Tensor sddmm_dot_cpu(const at::Tensor& a_, const at::Tensor& b_,
                         const at::Tensor& a_idx_, const at::Tensor& b_idx_) {
  check_sddmm_dot(a_, b_, a_idx_, b_idx_);
  const at::Tensor a = a_.contiguous(), b = b_.contiguous(),
                   a_idx = a_idx_.contiguous(), b_idx = b_idx_.contiguous();
  const int64_t E = a_idx.numel(), Na = a.size(0), Nb = b.size(0),
                H = a.size(1), C = a.size(2);
  at::Tensor out = at::empty({E, H}, a.options());
  PFA_DISPATCH_INDEX(a_idx.scalar_type(), "sddmm_dot_cpu", [&] {
    PFA_DISPATCH_FLOATS(a.scalar_type(), "sddmm_dot_cpu", [&] {
      const index_t* ai = a_idx.const_data_ptr<index_t>();
      const index_t* bi = b_idx.const_data_ptr<index_t>();
      const scalar_t* pa = a.const_data_ptr<scalar_t>();
      const scalar_t* pb = b.const_data_ptr<scalar_t>();
      scalar_t* o = out.data_ptr<scalar_t>();
      const int64_t grain =
          std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, H * C));
      at::parallel_for(0, E, grain, [&](int64_t e0, int64_t e1) {
        for (int64_t e = e0; e < e1; ++e) {
          const int64_t i = ai[e], j = bi[e];
          const bool ok = i >= 0 && i < Na && j >= 0 && j < Nb;
          for (int64_t h = 0; h < H; ++h)
            o[e * H + h] = ok ? scalar_t(cpu::dot(pa + (i * H + h) * C,
                                                  pb + (j * H + h) * C, C))
                              : scalar_t(0);
        }
      });
    });
  });
  return out;
}

}  // namespace
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, CPU, m) {
  m.impl("sddmm_dot", &pyg_fastattn::sddmm_dot_cpu);
}
