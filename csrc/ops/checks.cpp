// Metadata checks shared by all ops (declared in common.h).
#include "../common.h"

namespace pyg_fastattn {

void check_rowptr(const at::Tensor& rowptr, const char* name) {
  PFA_CHECK(rowptr.dim() == 1, "`", name, "` must be 1-D, got shape ",
            rowptr.sizes());
  PFA_CHECK(rowptr.scalar_type() == at::kInt || rowptr.scalar_type() == at::kLong,
            "`", name, "` must be int32 or int64, got ", rowptr.scalar_type());
  PFA_CHECK(rowptr.numel() >= 1, "`", name,
            "` must hold at least one entry (N + 1 for N rows)");
}

void check_index(const at::Tensor& index, const at::Tensor& rowptr,
                 const char* name) {
  PFA_CHECK(index.dim() == 1, "`", name, "` must be 1-D, got shape ",
            index.sizes());
  PFA_CHECK(index.scalar_type() == rowptr.scalar_type(), "`", name,
            "` must have the same dtype as `rowptr` (", rowptr.scalar_type(),
            "), got ", index.scalar_type());
  check_same_device(rowptr, index, "rowptr", name);
}

void check_float(const at::Tensor& t, const char* name, int64_t dim) {
  PFA_CHECK(at::isFloatingType(t.scalar_type()), "`", name,
            "` must be a floating-point tensor, got ", t.scalar_type());
  PFA_CHECK(t.dim() == dim, "`", name, "` must be ", dim, "-D, got shape ",
            t.sizes());
}

void check_same_device(const at::Tensor& ref, const at::Tensor& t,
                       const char* ref_name, const char* name) {
  PFA_CHECK(ref.device() == t.device(), "`", name, "` is on ", t.device(),
            " but `", ref_name, "` is on ", ref.device(),
            "; all tensors must be on the same device");
}

void check_same_dtype(const at::Tensor& ref, const at::Tensor& t,
                      const char* ref_name, const char* name) {
  PFA_CHECK(ref.scalar_type() == t.scalar_type(), "`", name, "` has dtype ",
            t.scalar_type(), " but `", ref_name, "` has ", ref.scalar_type());
}

void check_size(const at::Tensor& t, int64_t dim, int64_t size,
                const char* name, const char* what) {
  PFA_CHECK(t.size(dim) == size, "`", name, "`.size(", dim, ") must be ", size,
            " (", what, "), got ", t.size(dim));
}

}  // namespace pyg_fastattn
