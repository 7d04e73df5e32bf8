// sddmm_dot: per-edge dot products of node features.
#include "../common.h"
#include "autocast.h"

namespace pyg_fastattn {

// a [Na, H, C], b [Nb, H, C] (same dtype); a_idx, b_idx [E] int32/int64.
void check_sddmm_dot(const at::Tensor& a, const at::Tensor& b,
                     const at::Tensor& a_idx, const at::Tensor& b_idx) {
  check_float(a, "a", 3);
  check_float(b, "b", 3);
  check_same_dtype(a, b, "a", "b");
  check_same_device(a, b, "a", "b");
  PFA_CHECK(a.size(1) == b.size(1) && a.size(2) == b.size(2),
            "`a` and `b` must agree in heads and channels, got ", a.sizes(),
            " and ", b.sizes());
  PFA_CHECK(a_idx.dim() == 1, "`a_idx` must be 1-D, got shape ", a_idx.sizes());
  PFA_CHECK(a_idx.scalar_type() == at::kInt || a_idx.scalar_type() == at::kLong,
            "`a_idx` must be int32 or int64, got ", a_idx.scalar_type());
  check_index(b_idx, a_idx, "b_idx");
  check_same_device(a, a_idx, "a", "a_idx");
  PFA_CHECK(a_idx.numel() == b_idx.numel(), "`a_idx` and `b_idx` must have the "
            "same length, got ", a_idx.numel(), " and ", b_idx.numel());
}

}  // namespace pyg_fastattn

PFA_REGISTER_AUTOCAST("sddmm_dot")
PFA_REGISTER_AUTOCAST("sddmm_csr")
