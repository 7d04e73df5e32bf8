// transformer_attention_backward on CUDA, source pass (gatv2_cols.cuh;
// launched by transformer_backward.cu): grad_key and grad_value over the
// transpose.
#include "gatv2_cols.cuh"

namespace pyg_fastattn {
namespace cuda {
namespace gatv2 {
PFA_GATV2_COLS_ALL(true)
}  // namespace gatv2
}  // namespace cuda
}  // namespace pyg_fastattn
