// gatv2_attention_backward on CUDA, source pass (gatv2_cols.cuh; launched
// by gatv2_backward.cu): grad_x_l over the transpose.
#include "gatv2_cols.cuh"

namespace pyg_fastattn {
namespace cuda {
namespace gatv2 {
PFA_GATV2_COLS_ALL(false)
}  // namespace gatv2
}  // namespace cuda
}  // namespace pyg_fastattn
