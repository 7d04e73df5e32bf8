// attention / attention_backward on CUDA: what the forward
// (attention.cu) and the backward (attention_backward.cu) share.
#pragma once

#include "aggregate.cuh"

namespace pyg_fastattn {
namespace cuda {
namespace {

// What the backward needs of destination row i, head h, in one load:
// a_dst[i, h] (0 without a_dst), lse[i, h] and delta = <grad_out[i, h],
// out[i, h] - bias[h]>.
template <typename A>
struct alignas(4 * sizeof(A)) RowInfo {
  A adst, lse, delta, pad;
};

// RowInfo without a_dst (softmax_aggregate's backward): half the bytes that
// every CSC entry gathers.
template <typename A>
struct alignas(2 * sizeof(A)) RowInfoLD {
  A lse, delta;
};

template <typename A>
__device__ __forceinline__ A row_adst(const RowInfo<A>& r) { return r.adst; }
template <typename A>
__device__ __forceinline__ A row_adst(const RowInfoLD<A>&) { return A(0); }
template <typename A>
__device__ __forceinline__ void row_none(RowInfo<A>& r) {
  r.adst = A(0);
  r.lse = neg_inf<A>();  // alpha 0
  r.delta = A(0);
}
template <typename A>
__device__ __forceinline__ void row_none(RowInfoLD<A>& r) {
  r.lse = neg_inf<A>();
  r.delta = A(0);
}

template <typename scalar_t, typename index_t>
struct AttnArgs {
  const index_t* rowptr;
  const index_t* col;
  const scalar_t* a_src;   // [Ns, H] or nullptr
  const scalar_t* a_dst;   // [N, H] or nullptr
  const scalar_t* a_edge;  // [E, H] or nullptr
  const scalar_t* mask;    // [E, H] or nullptr
  const scalar_t* values;  // [Ns, H, C]
  const scalar_t* bias;    // [H, C] or nullptr: in out (forward's store)
  // forward outputs
  scalar_t* out;               // [N, H, C]
  acc_t<scalar_t>* lse_out;    // [N, H]
  // backward inputs / outputs
  const index_t* colptr;       // [Ns + 1] transpose
  const index_t* row_t;        // [E] CSR row of each CSC entry
  const index_t* perm;         // [E] CSR position of each CSC entry
  const acc_t<scalar_t>* lse;    // [N, H]
  RowInfo<acc_t<scalar_t>>* rinfo;  // [N, H] per-row terms of the backward
  const scalar_t* grad_out;    // [N, H, C]
  scalar_t* gvalues;           // [Ns, H, C]
  scalar_t* gz;                // [E, H], CSC order (CSR with gz_csr)
  bool gz_csr;
  scalar_t* gsrc;              // [Ns, H]
  int64_t N, E, Ns;
  int64_t coop;  // rows / columns over this many edges are block-shared
  acc_t<scalar_t> slope;
  // split path (utils.cuh): long rows / columns and their partials
  SplitArgs sp;
  acc_t<scalar_t>* part_acc;  // [2 * nwin, D] (backward: [2 * nwin, D + H])
  acc_t<scalar_t>* part_ms;   // [2 * nwin, H, 2] forward (max, sum)
};

// Inputs shared by the forward and backward launches (outputs set by each).
template <typename scalar_t, typename index_t>
AttnArgs<scalar_t, index_t> attn_args(const at::Tensor& rowptr,
                                      const at::Tensor& col,
                                      const at::Tensor& a_src,
                                      const at::Tensor& a_dst,
                                      const at::Tensor& a_edge,
                                      const at::Tensor& mask,
                                      const at::Tensor& values,
                                      const at::Tensor& bias, double slope) {
  AttnArgs<scalar_t, index_t> a{};
  a.rowptr = rowptr.data_ptr<index_t>();
  a.col = col.data_ptr<index_t>();
  a.a_src = opt_ptr<scalar_t>(a_src);
  a.a_dst = opt_ptr<scalar_t>(a_dst);
  a.a_edge = opt_ptr<scalar_t>(a_edge);
  a.mask = opt_ptr<scalar_t>(mask);
  a.values = values.data_ptr<scalar_t>();
  a.bias = opt_ptr<scalar_t>(bias);
  a.N = rowptr.numel() - 1;
  a.E = col.numel();
  a.Ns = values.size(0);
  a.slope = static_cast<acc_t<scalar_t>>(slope);
  return a;
}

}  // namespace
}  // namespace cuda
}  // namespace pyg_fastattn
