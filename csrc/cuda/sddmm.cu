// sddmm_dot on CUDA: out[e, h] = <a[a_idx[e], h, :], b[b_idx[e], h, :]>.
#include "aggregate.cuh"

namespace pyg_fastattn {
namespace cuda {
namespace {

template <typename scalar_t, typename index_t>
struct SddmmArgs {
  const scalar_t* a;   // [Na, H, C]
  const scalar_t* b;   // [Nb, H, C]
  const index_t* ai;   // [E]
  const index_t* bi;   // [E]
  scalar_t* out;       // [E, H]
  int64_t E, Na, Nb;
};

// Work item = block of ES*EB consecutive edges of head tile blockIdx.y; the
// warps of grid row y take the edge blocks grid-stride. Lane layout as
// TileLayout: lane (es, hs, cl) takes edges es + ES*b (b < EB) of the block
// and, of each, head h0 + hs and units cl + LH*kc (16-byte loads of a and b;
// 2*EB loads in flight), then
// the partial dot products are summed over the head's LH lanes with xor
// shuffles and lane cl == 0 writes out[e, h]. Out-of-range indices give 0.
template <typename scalar_t, typename index_t, int V>
__global__ void __launch_bounds__(kBlock)
    sddmm_kernel(SddmmArgs<scalar_t, index_t> a, TileLayout L,
                 int64_t n_eblk) {
  using A = acc_t<scalar_t>;
  constexpr int EB = kSddmmBatch;
  const int lane = lane_id();
  const int LH = 1 << L.lh_log;
  const int HS = 1 << L.hs_log;
  const int ES = kWarp >> (L.lh_log + L.hs_log);
  const int cl = lane & (LH - 1);
  const int hs = (lane >> L.lh_log) & (HS - 1);
  const int es = lane >> (L.lh_log + L.hs_log);
  const int H = L.H;
  const int64_t D = static_cast<int64_t>(H) * L.C;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const int h0 = static_cast<int>(blockIdx.y) * L.HT;
  for (int64_t eblk = global_warp(); eblk < n_eblk; eblk += nwarps) {
    const int hend = min(H, h0 + L.HT);
    const int h = h0 + hs;
    const bool hok = h < hend;
    int64_t e[EB], ia[EB], ib[EB];
    bool ok[EB];
#pragma unroll
    for (int q = 0; q < EB; ++q) {
      e[q] = eblk * (static_cast<int64_t>(ES) * EB) +
             static_cast<int64_t>(q) * ES + es;
      ok[q] = e[q] < a.E;
      ia[q] = ok[q] ? static_cast<int64_t>(a.ai[e[q]]) : 0;
      ib[q] = ok[q] ? static_cast<int64_t>(a.bi[e[q]]) : 0;
      ok[q] = ok[q] && ia[q] >= 0 && ia[q] < a.Na && ib[q] >= 0 && ib[q] < a.Nb;
    }
    A dot[EB];
#pragma unroll
    for (int q = 0; q < EB; ++q) dot[q] = A(0);
    for (int kc = 0; kc < L.KC; ++kc) {
      const int c = cl + LH * kc;
      const bool cok = c < L.CU;
      Vec<scalar_t, V> ra[EB], rb[EB];
#pragma unroll
      for (int q = 0; q < EB; ++q) {
        const bool go = ok[q] && hok && cok;
        const int64_t off =
            static_cast<int64_t>(h) * L.C + static_cast<int64_t>(c) * V;
        ra[q] = go ? load_vec<scalar_t, V>(a.a + ia[q] * D + off)
                   : zero_vec<scalar_t, V>();
        rb[q] = go ? load_vec<scalar_t, V>(a.b + ib[q] * D + off)
                   : zero_vec<scalar_t, V>();
      }
#pragma unroll
      for (int q = 0; q < EB; ++q)
#pragma unroll
        for (int v = 0; v < V; ++v)
          dot[q] += vec_get(ra[q], v) * vec_get(rb[q], v);
    }
#pragma unroll
    for (int q = 0; q < EB; ++q) dot[q] = xor_sum(dot[q], 1, LH);
    if (cl == 0) {
#pragma unroll
      for (int q = 0; q < EB; ++q)
        if (e[q] < a.E && hok)
          a.out[e[q] * H + h] = from_acc<scalar_t>(dot[q]);
    }
  }
}

at::Tensor sddmm_dot_cuda(const at::Tensor& a_in, const at::Tensor& b_in,
                          const at::Tensor& a_idx_in,
                          const at::Tensor& b_idx_in) {
  check_sddmm_dot(a_in, b_in, a_idx_in, b_idx_in);
  c10::cuda::CUDAGuard guard(a_in.device());
  const at::Tensor A_ = a_in.contiguous();
  const at::Tensor B_ = b_in.contiguous();
  const at::Tensor ai = a_idx_in.contiguous();
  const at::Tensor bi = b_idx_in.contiguous();
  const int64_t E = ai.numel();
  const int64_t H = A_.size(1), C = A_.size(2);
  at::Tensor out = at::empty({E, H}, A_.options());
  if (out.numel() == 0) return out;
  PFA_DISPATCH_FLOATS(A_.scalar_type(), "sddmm_dot_cuda", [&] {
    PFA_DISPATCH_INDEX(ai.scalar_type(), "sddmm_dot_cuda", [&] {
      SddmmArgs<scalar_t, index_t> args;
      args.a = A_.data_ptr<scalar_t>();
      args.b = B_.data_ptr<scalar_t>();
      args.ai = ai.data_ptr<index_t>();
      args.bi = bi.data_ptr<index_t>();
      args.out = out.data_ptr<scalar_t>();
      args.E = E;
      args.Na = A_.size(0);
      args.Nb = B_.size(0);
      constexpr int VW = vec_width<scalar_t>();
      const bool vec = C % VW == 0 && aligned16(args.a) && aligned16(args.b);
      const TileLayout L = make_layout(H, C, vec ? VW : 1, false);
      const int ES = kWarp >> (L.lh_log + L.hs_log);
      const int64_t n_eblk =
          ceil_div(E, static_cast<int64_t>(ES) * kSddmmBatch);
      PFA_CHECK(L.n_tiles <= 65535, "too many head tiles");
      auto stream = at::cuda::getCurrentCUDAStream();
      dispatch_v<scalar_t>(vec, [&](auto v) {
        auto kernel = sddmm_kernel<scalar_t, index_t, decltype(v)::value>;
        // As many blocks as fit on the device at once (grid-stride loop).
        static const int occ = blocks_per_sm(kernel);
        const int64_t bx = std::max<int64_t>(
            1, std::min<int64_t>(ceil_div(n_eblk, kWarpsPerBlock),
                                 ceil_div(static_cast<int64_t>(occ) * num_sms(),
                                          L.n_tiles)));
        const dim3 grid(static_cast<unsigned>(bx),
                        static_cast<unsigned>(L.n_tiles));
        kernel<<<grid, kBlock, 0, stream>>>(args, L, n_eblk);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  return out;
}

}  // namespace
}  // namespace cuda
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, CUDA, m) {
  m.impl("sddmm_dot", &pyg_fastattn::cuda::sddmm_dot_cuda);
}
