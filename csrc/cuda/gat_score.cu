// GAT's per-node score terms on CUDA, for small graphs: one launch for what
// the generic path does with a block-diagonal GEMM and its helpers (a cat, a
// zero fill, a diagonal copy, two contiguous slices). Used by
// gat_attention (csrc/ops/gat_attention.cpp) below kGatScoreKernelElems.
//   forward:  a_k[n, h] = <h[n, h], att_k[h]>  for k = src, dst
//   backward: g_h[n, h, :] += g_src[n, h] att_src[h] + g_dst[n, h] att_dst[h]
//             g_att_k[h, c] = sum_n h[n, h, c] g_k[n, h]  (fixed order)
#include "utils.cuh"

namespace pyg_fastattn {
namespace cuda {
namespace {

// One thread per (n, h) pair (grid-stride): the two dot products over C.
template <typename scalar_t>
__global__ void __launch_bounds__(kBlock)
    gat_score_kernel(const scalar_t* __restrict__ h,
                     const scalar_t* __restrict__ att_src,
                     const scalar_t* __restrict__ att_dst, int64_t NH, int H,
                     int C, scalar_t* __restrict__ a_src,
                     scalar_t* __restrict__ a_dst) {
  using A = acc_t<scalar_t>;
  for (int64_t p = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       p < NH; p += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int hh = static_cast<int>(p % H);
    const scalar_t* x = h + p * C;
    const scalar_t* ws = att_src + static_cast<int64_t>(hh) * C;
    const scalar_t* wd = att_dst + static_cast<int64_t>(hh) * C;
    A s = A(0), d = A(0);
    for (int c = 0; c < C; ++c) {
      const A v = to_acc(x[c]);
      s += v * to_acc(ws[c]);
      d += v * to_acc(wd[c]);
    }
    a_src[p] = from_acc<scalar_t>(s);
    a_dst[p] = from_acc<scalar_t>(d);
  }
}

// Block b takes rows [b * R, (b + 1) * R), thread t the columns j = t,
// t + blockDim, ... of the flattened [N, H * C] rows: updates g_h in place
// and writes its column partials part[b, k, j] (rows in order).
template <typename scalar_t>
__global__ void __launch_bounds__(kBlock)
    gat_score_bwd_kernel(const scalar_t* __restrict__ h,
                         scalar_t* __restrict__ g_h,
                         const scalar_t* __restrict__ g_src,
                         const scalar_t* __restrict__ g_dst,
                         const scalar_t* __restrict__ att_src,
                         const scalar_t* __restrict__ att_dst, int64_t N,
                         int64_t R, int H, int C,
                         acc_t<scalar_t>* __restrict__ part) {
  using A = acc_t<scalar_t>;
  const int64_t HC = static_cast<int64_t>(H) * C;
  const int64_t r0 = blockIdx.x * R;
  const int64_t r1 = r0 + R < N ? r0 + R : N;
  for (int64_t j = threadIdx.x; j < HC; j += blockDim.x) {
    const int64_t hh = j / C;
    const A ws = to_acc(att_src[j]), wd = to_acc(att_dst[j]);
    A ps = A(0), pd = A(0);
    for (int64_t n = r0; n < r1; ++n) {
      const A gs = to_acc(g_src[n * H + hh]), gd = to_acc(g_dst[n * H + hh]);
      const A x = to_acc(h[n * HC + j]);
      g_h[n * HC + j] =
          from_acc<scalar_t>(to_acc(g_h[n * HC + j]) + gs * ws + gd * wd);
      ps += x * gs;
      pd += x * gd;
    }
    part[(blockIdx.x * 2) * HC + j] = ps;
    part[(blockIdx.x * 2 + 1) * HC + j] = pd;
  }
}

// One thread per (k, j) (grid-stride): the sum of the blocks' partials in
// block order.
template <typename scalar_t>
__global__ void __launch_bounds__(kBlock)
    gat_score_sum_kernel(const acc_t<scalar_t>* __restrict__ part, int nb,
                         int64_t HC, scalar_t* __restrict__ g_att_src,
                         scalar_t* __restrict__ g_att_dst) {
  using A = acc_t<scalar_t>;
  for (int64_t q = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       q < 2 * HC; q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t k = q / HC, j = q % HC;
    A s = A(0);
    for (int b = 0; b < nb; ++b) s += part[(b * 2 + k) * HC + j];
    (k == 0 ? g_att_src : g_att_dst)[j] = from_acc<scalar_t>(s);
  }
}

int64_t blocks_of(int64_t n) {
  return std::max<int64_t>(1, std::min<int64_t>(ceil_div(n, kBlock),
                                                int64_t(num_sms()) * 8));
}

}  // namespace

// h contiguous with N rows of H * C, att_src / att_dst [1, H, C] of h's
// dtype: (a_src, a_dst) [N, H].
std::tuple<at::Tensor, at::Tensor> gat_score_cuda(const at::Tensor& h,
                                                  const at::Tensor& att_src,
                                                  const at::Tensor& att_dst) {
  const c10::cuda::CUDAGuard guard(h.device());
  const int64_t N = h.size(0);
  const int H = static_cast<int>(att_src.size(1));
  const int C = static_cast<int>(att_src.size(2));
  at::Tensor a_src = at::empty({N, H}, h.options());
  at::Tensor a_dst = at::empty({N, H}, h.options());
  const at::Tensor ws = att_src.contiguous(), wd = att_dst.contiguous();
  const int64_t NH = N * H;
  if (NH == 0) return {a_src, a_dst};
  const auto stream = at::cuda::getCurrentCUDAStream();
  PFA_DISPATCH_FLOATS(h.scalar_type(), "gat_score_cuda", [&] {
    gat_score_kernel<scalar_t><<<blocks_of(NH), kBlock, 0, stream>>>(
        h.const_data_ptr<scalar_t>(), ws.const_data_ptr<scalar_t>(),
        wd.const_data_ptr<scalar_t>(), NH, H, C, a_src.data_ptr<scalar_t>(),
        a_dst.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {a_src, a_dst};
}

// Updates g_h (contiguous, h's shape) in place; returns (g_att_src,
// g_att_dst) [1, H, C]. g_src / g_dst [N, H].
std::tuple<at::Tensor, at::Tensor> gat_score_backward_cuda(
    const at::Tensor& h, at::Tensor& g_h, const at::Tensor& g_src,
    const at::Tensor& g_dst, const at::Tensor& att_src,
    const at::Tensor& att_dst) {
  const c10::cuda::CUDAGuard guard(h.device());
  const int64_t N = h.size(0);
  const int H = static_cast<int>(att_src.size(1));
  const int C = static_cast<int>(att_src.size(2));
  const int64_t HC = static_cast<int64_t>(H) * C;
  at::Tensor ga_src = at::empty({1, H, C}, h.options());
  at::Tensor ga_dst = at::empty({1, H, C}, h.options());
  if (HC == 0) return {ga_src, ga_dst};
  const at::Tensor ws = att_src.contiguous(), wd = att_dst.contiguous();
  const at::Tensor gs = g_src.contiguous(), gd = g_dst.contiguous();
  // rows per block: enough blocks to fill the GPU, at least kGatScoreRows
  const int64_t nb = std::max<int64_t>(
      1, std::min<int64_t>(ceil_div(N, kGatScoreRows), num_sms() * 4));
  const int64_t R = std::max<int64_t>(1, ceil_div(N, nb));
  const int64_t blocks = std::max<int64_t>(1, ceil_div(N, R));
  const int threads = static_cast<int>(
      std::min<int64_t>(kBlock, ceil_div(HC, kWarp) * kWarp));
  const auto stream = at::cuda::getCurrentCUDAStream();
  PFA_DISPATCH_FLOATS(h.scalar_type(), "gat_score_backward_cuda", [&] {
    using A = acc_t<scalar_t>;
    at::Tensor part = at::empty(
        {blocks * 2 * HC},
        h.options().dtype(c10::CppTypeToScalarType<A>::value));
    gat_score_bwd_kernel<scalar_t><<<blocks, threads, 0, stream>>>(
        h.const_data_ptr<scalar_t>(), g_h.data_ptr<scalar_t>(),
        gs.const_data_ptr<scalar_t>(), gd.const_data_ptr<scalar_t>(),
        ws.const_data_ptr<scalar_t>(), wd.const_data_ptr<scalar_t>(), N, R, H,
        C, part.data_ptr<A>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    gat_score_sum_kernel<scalar_t><<<blocks_of(2 * HC), kBlock, 0, stream>>>(
        part.const_data_ptr<A>(), static_cast<int>(blocks), HC,
        ga_src.data_ptr<scalar_t>(), ga_dst.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {ga_src, ga_dst};
}

}  // namespace cuda
}  // namespace pyg_fastattn
