// Probe kernels of benchmarks/gather_ceiling.py: how fast can random 512-byte
// rows be gathered on this GPU? One warp per CSR row; a row of h is 32 float4
// (4 heads x 32 floats). Each kernel says how it splits the work.
#include <cstdint>
#include <cuda_runtime.h>

#define FULL 0xffffffffu

__device__ __forceinline__ float4 ld4(const float4* p) { return __ldg(p); }
__device__ __forceinline__ void add4(float4& a, const float4& b, float w) {
  a.x += w * b.x; a.y += w * b.y; a.z += w * b.z; a.w += w * b.w;
}

// EB rows in flight per lane; IDX=1: lane l loads col[c0 + l] once per
// chunk of 32 and the batch takes its indices by shuffles.
template <int EB, int IDX, int MINB>
__global__ void __launch_bounds__(256, MINB)
reg_gather(const int* __restrict__ rowptr, const int* __restrict__ col,
           const float4* __restrict__ h, float4* __restrict__ out, int N) {
  const int row = (blockIdx.x * 256 + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const int s = rowptr[row], e = rowptr[row + 1];
  float4 acc = make_float4(0, 0, 0, 0);
  if (IDX) {
    for (int c0 = s; c0 < e; c0 += 32) {
      const int my = c0 + lane < e ? col[c0 + lane] : 0;
      const int n = min(32, e - c0);
      for (int b0 = 0; b0 < n; b0 += EB) {
        float4 r[EB];
#pragma unroll
        for (int b = 0; b < EB; ++b) {
          const int j = __shfl_sync(FULL, my, (b0 + b) & 31);
          r[b] = b0 + b < n ? ld4(h + (int64_t)j * 32 + lane) : make_float4(0, 0, 0, 0);
        }
#pragma unroll
        for (int b = 0; b < EB; ++b) add4(acc, r[b], 1.f);
      }
    }
  } else {
    for (int k = s; k < e; k += EB) {
      float4 r[EB];
#pragma unroll
      for (int b = 0; b < EB; ++b)
        r[b] = k + b < e ? ld4(h + (int64_t)col[k + b] * 32 + lane) : make_float4(0, 0, 0, 0);
#pragma unroll
      for (int b = 0; b < EB; ++b) add4(acc, r[b], 1.f);
    }
  }
  out[(int64_t)row * 32 + lane] = acc;
}

// The forward's shape: pass 1 gathers a_src[j] (4 heads, 16 bytes) per edge
// and takes each head's max and sum of exp; pass 2 gathers the rows with
// their softmax weights (a_src re-read, from L1/L2).
template <int EB, int MINB>
__global__ void __launch_bounds__(256, MINB)
two_pass(const int* __restrict__ rowptr, const int* __restrict__ col,
         const float4* __restrict__ a_src, const float4* __restrict__ h,
         float4* __restrict__ out, int N) {
  const int row = (blockIdx.x * 256 + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (row >= N) return;
  const int s = rowptr[row], e = rowptr[row + 1];
  float m[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY}, z[4] = {0, 0, 0, 0};
  for (int k = s + lane; k < e; k += 32) {
    const float4 a = ld4(a_src + col[k]);
    const float v[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float t = v[q] > 0 ? v[q] : 0.2f * v[q];
      const float nm = fmaxf(m[q], t);
      z[q] = z[q] * __expf(m[q] - nm) + __expf(t - nm);
      m[q] = nm;
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float om = __shfl_xor_sync(FULL, m[q], off), oz = __shfl_xor_sync(FULL, z[q], off);
      const float nm = fmaxf(m[q], om);
      z[q] = (nm == -INFINITY) ? 0.f : z[q] * __expf(m[q] - nm) + oz * __expf(om - nm);
      m[q] = nm;
    }
  const int hd = lane >> 3;
  const float mh = hd == 0 ? m[0] : hd == 1 ? m[1] : hd == 2 ? m[2] : m[3];
  const float zh = hd == 0 ? z[0] : hd == 1 ? z[1] : hd == 2 ? z[2] : z[3];
  const float inv = 1.f / zh;
  const float* as = reinterpret_cast<const float*>(a_src);
  float4 acc = make_float4(0, 0, 0, 0);
  for (int k = s; k < e; k += EB) {
    float4 r[EB];
    float w[EB];
#pragma unroll
    for (int b = 0; b < EB; ++b) {
      const bool ok = k + b < e;
      const int j = ok ? col[k + b] : 0;
      r[b] = ok ? ld4(h + (int64_t)j * 32 + lane) : make_float4(0, 0, 0, 0);
      const float t = ok ? __ldg(as + (int64_t)j * 4 + hd) : 0.f;
      w[b] = ok ? __expf((t > 0 ? t : 0.2f * t) - mh) * inv : 0.f;
    }
#pragma unroll
    for (int b = 0; b < EB; ++b) add4(acc, r[b], w[b]);
  }
  out[(int64_t)row * 32 + lane] = acc;
}


// Closer to the package's fwd_row: pass 1 splits (edge, head) pairs over the
// lanes (lane = hs*8 + cl takes edges cl + 8k for head hs, 4-byte loads, U in
// flight); pass 2 as two_pass but the weight's a_src load comes after the
// row loads (as gather_accumulate's fn.weight). SYNC: the block syncs once
// before the rows (run_rows' s_long).
template <int EB, int MINB, int SYNC, int WLATE>
__global__ void __launch_bounds__(256, MINB)
real_like(const int* __restrict__ rowptr, const int* __restrict__ col,
          const float* __restrict__ a_src, const float4* __restrict__ h,
          float4* __restrict__ out, int N) {
  __shared__ int s_long[8];
  const int row = (blockIdx.x * 256 + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  int s = 0, e = 0;
  if (row < N) { s = rowptr[row]; e = rowptr[row + 1]; }
  if (SYNC) {
    if (lane == 0) s_long[threadIdx.x >> 5] = e - s > 256 ? row : -1;
    __syncthreads();
    if (s_long[(threadIdx.x >> 5) ^ 1] == 12345678) return;
  }
  if (row >= N) return;
  const int hs = lane >> 3, cl = lane & 7;
  float m = -INFINITY, z = 0.f;
  for (int64_t e0 = s + cl; e0 < e; e0 += 8 * 4) {
    float x[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t k = e0 + u * 8;
      const bool ok = k < e;
      const int64_t j = ok ? (int64_t)col[k] : 0;
      const float t = ok ? a_src[j * 4 + hs] : 0.f;
      x[u] = ok ? (t > 0 ? t : 0.2f * t) : -INFINITY;
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float nm = fmaxf(m, x[u]);
      z = nm == -INFINITY ? 0.f : z * __expf(m - nm) + __expf(x[u] - nm);
      m = nm;
    }
  }
#pragma unroll
  for (int off = 1; off < 8; off <<= 1) {
    const float om = __shfl_xor_sync(FULL, m, off), oz = __shfl_xor_sync(FULL, z, off);
    const float nm = fmaxf(m, om);
    z = (nm == -INFINITY) ? 0.f : z * __expf(m - nm) + oz * __expf(om - nm);
    m = nm;
  }
  const float inv = 1.f / z;
  float4 acc = make_float4(0, 0, 0, 0);
  for (int64_t k = s; k < e; k += EB) {
    float4 r[EB];
    int64_t j[EB];
    float w[EB];
#pragma unroll
    for (int b = 0; b < EB; ++b) {
      const bool ok = k + b < e;
      j[b] = ok ? (int64_t)col[k + b] : 0;
      r[b] = ok ? h[j[b] * 32 + lane] : make_float4(0, 0, 0, 0);
      if (!WLATE) {
        const float t = ok ? a_src[j[b] * 4 + hs] : 0.f;
        w[b] = ok ? __expf((t > 0 ? t : 0.2f * t) - m) * inv : 0.f;
      }
    }
#pragma unroll
    for (int b = 0; b < EB; ++b) {
      if (WLATE) {
        const bool ok = k + b < e;
        const float t = ok ? a_src[j[b] * 4 + hs] : 0.f;
        w[b] = ok ? __expf((t > 0 ? t : 0.2f * t) - m) * inv : 0.f;
      }
      add4(acc, r[b], w[b]);
    }
  }
  out[(int64_t)row * 32 + lane] = acc;
}

// Hopper bulk copies: each warp gathers up to SLOTS rows of its CSR row at
// once into its own shared-memory slots (one cp.async.bulk of 512 bytes per
// edge, issued by lane b for slot b), completion on one mbarrier per warp.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <int SLOTS, int WARPS>
__global__ void __launch_bounds__(WARPS * 32)
bulk_gather(const int* __restrict__ rowptr, const int* __restrict__ col,
            const float4* __restrict__ h, float4* __restrict__ out, int N) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t bar[WARPS];
  const int wib = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = blockIdx.x * WARPS + wib;
  float4* slots = reinterpret_cast<float4*>(smem) + (size_t)wib * SLOTS * 32;
  if (lane == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bar[wib])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  if (row >= N) return;
  const int s = rowptr[row], e = rowptr[row + 1];
  float4 acc = make_float4(0, 0, 0, 0);
  uint32_t phase = 0;
  for (int c0 = s; c0 < e; c0 += SLOTS) {
    const int n = min(SLOTS, e - c0);
    if (lane == 0)
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&bar[wib])),
                   "r"(n * 512) : "memory");
    __syncwarp();
    for (int b = lane; b < n; b += 32) {
      const int j = col[c0 + b];
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 512, [%2];" ::"r"(
              smem_addr(slots + b * 32)),
          "l"(h + (int64_t)j * 32), "r"(smem_addr(&bar[wib]))
          : "memory");
    }
    uint32_t done = 0;
    while (!done)
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(smem_addr(&bar[wib])), "r"(phase)
          : "memory");
    phase ^= 1;
    for (int b = 0; b < n; ++b) add4(acc, slots[b * 32 + lane], 1.f);
    __syncwarp();
  }
  out[(int64_t)row * 32 + lane] = acc;
}

// Launchers (stream 0 = torch's current stream is set by the caller).
extern "C" {
#define REG(EB, IDX, MINB)                                                                      \
  void reg_##EB##_##IDX##_##MINB(const int* rp, const int* c, const float* h, float* o, int N, \
                                 cudaStream_t st) {                                            \
    reg_gather<EB, IDX, MINB><<<(N + 7) / 8, 256, 0, st>>>(rp, c, (const float4*)h, (float4*)o, N); \
  }
REG(4, 0, 1) REG(4, 1, 1) REG(8, 0, 1) REG(8, 1, 1) REG(16, 1, 1) REG(8, 1, 4) REG(16, 1, 4) REG(4, 1, 8)
#define TWO(EB, MINB)                                                                           \
  void two_##EB##_##MINB(const int* rp, const int* c, const float* a, const float* h, float* o, \
                         int N, cudaStream_t st) {                                              \
    two_pass<EB, MINB><<<(N + 7) / 8, 256, 0, st>>>(rp, c, (const float4*)a, (const float4*)h, \
                                                     (float4*)o, N);                            \
  }
TWO(4, 1) TWO(8, 1) TWO(8, 4)
#define BULK(SLOTS, WARPS)                                                                      \
  void bulk_##SLOTS##_##WARPS(const int* rp, const int* c, const float* h, float* o, int N,     \
                              cudaStream_t st) {                                                \
    const int sm = SLOTS * WARPS * 512;                                                         \
    cudaFuncSetAttribute(bulk_gather<SLOTS, WARPS>, cudaFuncAttributeMaxDynamicSharedMemorySize, sm); \
    bulk_gather<SLOTS, WARPS><<<(N + WARPS - 1) / WARPS, WARPS * 32, sm, st>>>(                 \
        rp, c, (const float4*)h, (float4*)o, N);                                                \
  }
BULK(32, 4) BULK(24, 4) BULK(16, 8) BULK(8, 8) BULK(32, 2)
#define REAL(EB, MINB, SYNC, WLATE)                                                             \
  void real_##EB##_##MINB##_##SYNC##_##WLATE(const int* rp, const int* c, const float* a,       \
                                             const float* h, float* o, int N, cudaStream_t st) {\
    real_like<EB, MINB, SYNC, WLATE><<<(N + 7) / 8, 256, 0, st>>>(rp, c, a, (const float4*)h,  \
                                                                  (float4*)o, N);               \
  }
REAL(4, 1, 0, 0) REAL(4, 1, 0, 1) REAL(4, 1, 1, 1) REAL(4, 4, 1, 1) REAL(8, 4, 1, 1) REAL(4, 6, 0, 0) REAL(4, 6, 1, 1)
}
