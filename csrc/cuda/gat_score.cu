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

// One thread per (n, h) pair (grid-stride): the two dot products over C in
// order (heads whose C does not divide 32).
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

// Heads whose C divides 32: one warp per row n (grid-stride),
// lane l the columns j = j0 + l (j0 = 0, 32, ...; coalesced), then each
// aligned group of C lanes (one head) sums by a fixed xor tree.
template <typename scalar_t>
__global__ void __launch_bounds__(kBlock)
    gat_score_warp_kernel(const scalar_t* __restrict__ h,
                          const scalar_t* __restrict__ att_src,
                          const scalar_t* __restrict__ att_dst, int64_t N,
                          int H, int C, scalar_t* __restrict__ a_src,
                          scalar_t* __restrict__ a_dst) {
  using A = acc_t<scalar_t>;
  const int lane = threadIdx.x % kWarp;
  const int HC = H * C;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t n = (blockIdx.x * static_cast<int64_t>(blockDim.x) +
                    threadIdx.x) / kWarp;
       n < N; n += warps) {
    const scalar_t* x = h + n * HC;
    for (int j0 = 0; j0 < HC; j0 += kWarp) {
      const int j = j0 + lane;
      A s = A(0), d = A(0);
      if (j < HC) {
        const A v = to_acc(x[j]);
        s = v * to_acc(att_src[j]);
        d = v * to_acc(att_dst[j]);
      }
      for (int o = C / 2; o > 0; o /= 2) {
        s += __shfl_xor_sync(kFullMask, s, o);
        d += __shfl_xor_sync(kFullMask, d, o);
      }
      if (j < HC && lane % C == 0) {
        a_src[n * H + j / C] = from_acc<scalar_t>(s);
        a_dst[n * H + j / C] = from_acc<scalar_t>(d);
      }
    }
  }
}

// Block b takes rows [b * R, (b + 1) * R) of the flattened [N, H * C] g_h
// and h; thread (x, y) the columns j = j0 + x (j0 = 0, blockDim.x, ...) of
// the rows r0 + y, r0 + y + blockDim.y, ... (four of them loaded before
// any is used): updates g_h in place and writes its column partials
// part[b, k, j], each y's sum taken in order, then the y's in order.
template <typename scalar_t>
__global__ void __launch_bounds__(kGatScoreBwdThreads, kGatScoreBwdBlocksPerSm)
    gat_score_bwd_kernel(const scalar_t* __restrict__ h,
                         scalar_t* __restrict__ g_h,
                         const scalar_t* __restrict__ g_src,
                         const scalar_t* __restrict__ g_dst,
                         const scalar_t* __restrict__ att_src,
                         const scalar_t* __restrict__ att_dst, int64_t N,
                         int64_t R, int H, int C,
                         acc_t<scalar_t>* __restrict__ part) {
  using A = acc_t<scalar_t>;
  __shared__ A red[2][kGatScoreBwdThreads];
  const int64_t HC = static_cast<int64_t>(H) * C;
  const int64_t r0 = blockIdx.x * R;
  const int64_t r1 = r0 + R < N ? r0 + R : N;
  const int tx = threadIdx.x, ty = threadIdx.y, t = ty * blockDim.x + tx;
  for (int64_t j0 = 0; j0 < HC; j0 += blockDim.x) {
    const int64_t j = j0 + tx;
    A ps = A(0), pd = A(0);
    if (j < HC) {
      const int64_t hh = j / C;
      const A ws = to_acc(att_src[j]), wd = to_acc(att_dst[j]);
      const int64_t step = blockDim.y;
      for (int64_t n = r0 + ty; n < r1; n += 4 * step) {
        A gs[4], gd[4], x[4], g[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {  // every load of the batch first
          const int64_t m = n + u * step;
          if (m < r1) {
            gs[u] = to_acc(g_src[m * H + hh]);
            gd[u] = to_acc(g_dst[m * H + hh]);
            x[u] = to_acc(h[m * HC + j]);
            g[u] = to_acc(g_h[m * HC + j]);
          }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int64_t m = n + u * step;
          if (m < r1) {
            g_h[m * HC + j] = from_acc<scalar_t>(g[u] + gs[u] * ws + gd[u] * wd);
            ps += x[u] * gs[u];
            pd += x[u] * gd[u];
          }
        }
      }
    }
    red[0][t] = ps;
    red[1][t] = pd;
    __syncthreads();
    if (ty == 0 && j < HC) {
      for (int y = 1; y < static_cast<int>(blockDim.y); ++y) {
        ps += red[0][y * blockDim.x + tx];
        pd += red[1][y * blockDim.x + tx];
      }
      part[(blockIdx.x * 2) * HC + j] = ps;
      part[(blockIdx.x * 2 + 1) * HC + j] = pd;
    }
    __syncthreads();
  }
}

// One warp per (k, j) (grid-stride over warps): lane l sums the partials of
// blocks l, l + 32, ... in order, then a fixed shuffle tree (deterministic).
template <typename scalar_t>
__global__ void __launch_bounds__(kBlock)
    gat_score_sum_kernel(const acc_t<scalar_t>* __restrict__ part, int nb,
                         int64_t HC, scalar_t* __restrict__ g_att_src,
                         scalar_t* __restrict__ g_att_dst) {
  using A = acc_t<scalar_t>;
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t q = (blockIdx.x * static_cast<int64_t>(blockDim.x) +
                    threadIdx.x) / kWarp;
       q < 2 * HC; q += warps) {
    const int64_t k = q / HC, j = q % HC;
    A s = A(0);
    for (int b = lane; b < nb; b += kWarp) s += part[(b * 2 + k) * HC + j];
    for (int o = kWarp / 2; o > 0; o /= 2) s += __shfl_down_sync(kFullMask, s, o);
    if (lane == 0) (k == 0 ? g_att_src : g_att_dst)[j] = from_acc<scalar_t>(s);
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
    if (C <= kWarp && kWarp % C == 0)
      gat_score_warp_kernel<scalar_t><<<blocks_of(N * kWarp), kBlock, 0, stream>>>(
          h.const_data_ptr<scalar_t>(), ws.const_data_ptr<scalar_t>(),
          wd.const_data_ptr<scalar_t>(), N, H, C, a_src.data_ptr<scalar_t>(),
          a_dst.data_ptr<scalar_t>());
    else
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
  // columns: up to kGatScoreBwdColumns threads, whole warps; rows: the rest
  // of kGatScoreBwdThreads; rows per block: enough blocks to fill the GPU,
  // at least kGatScoreRows
  const int tx = static_cast<int>(
      std::min<int64_t>(kGatScoreBwdColumns, ceil_div(HC, kWarp) * kWarp));
  const int ty = std::max(1, kGatScoreBwdThreads / tx);
  const int64_t nb = std::max<int64_t>(
      1, std::min<int64_t>(ceil_div(N, kGatScoreRows),
                           int64_t(num_sms()) * kGatScoreBwdBlocksPerSm));
  const int64_t R = std::max<int64_t>(1, ceil_div(N, nb));
  const int64_t blocks = std::max<int64_t>(1, ceil_div(N, R));
  const auto stream = at::cuda::getCurrentCUDAStream();
  PFA_DISPATCH_FLOATS(h.scalar_type(), "gat_score_backward_cuda", [&] {
    using A = acc_t<scalar_t>;
    at::Tensor part = at::empty(
        {blocks * 2 * HC},
        h.options().dtype(c10::CppTypeToScalarType<A>::value));
    gat_score_bwd_kernel<scalar_t><<<blocks, dim3(tx, ty), 0, stream>>>(
        h.const_data_ptr<scalar_t>(), g_h.data_ptr<scalar_t>(),
        gs.const_data_ptr<scalar_t>(), gd.const_data_ptr<scalar_t>(),
        ws.const_data_ptr<scalar_t>(), wd.const_data_ptr<scalar_t>(), N, R, H,
        C, part.data_ptr<A>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    gat_score_sum_kernel<scalar_t>
        <<<blocks_of(2 * HC * kWarp), kBlock, 0, stream>>>(
        part.const_data_ptr<A>(), static_cast<int>(blocks), HC,
        ga_src.data_ptr<scalar_t>(), ga_dst.data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {ga_src, ga_dst};
}

}  // namespace cuda
}  // namespace pyg_fastattn
