// BGMV for multi-LoRA decode (Punica's idea): one token per row, each row with its own adapter slot.
//
//   shrink: s[t, r]  = sum_k x[t, k] * A[slot(t), r, k]                      (float32 out)
//   expand: y[t, n] += scaling[slot(t)] * sum_r s[t, r] * B[slot(t), n, r]   (in place)
//
// slot(t) = token_slots[t]; -1 (or a slot past num_slots) means no adapter: the shrink writes a
// zero row, the expand leaves y's row alone. Accumulation is float32; y is rounded once.
//
// This file holds no torch headers (so nvcc compile-checks it anywhere); lora_bgmv.cpp is the
// torch binding and calls the launchers at the bottom. Both launchers only enqueue work on the
// given stream: no host sync and no allocation, so CUDA graphs can capture them.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace flexserve {
namespace {

constexpr int kThreads = 128;  // one warp group (4 warps) per block
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// VEC elements of T from p (16 bytes when VEC * sizeof(T) == 16, else element by element), as floats.
template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float (&out)[VEC]) {
  if constexpr (VEC * sizeof(T) == 16) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
    const T* elems = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = to_float(elems[i]);
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = to_float(p[i]);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Grid (token, rank tile). The block's 128 threads split `in` into VEC-wide chunks (16-byte loads,
// coalesced across the warp); each thread keeps RANK_TILE float32 partial sums, reduced over the
// warp with shuffles and over the 4 warps through shared memory. x's chunk is loaded once and used
// for all RANK_TILE rows of A.
template <typename T, int VEC, int RANK_TILE>
__global__ void __launch_bounds__(kThreads) bgmv_shrink_kernel(
    const T* __restrict__ x, const T* __restrict__ lora_a, const int32_t* __restrict__ token_slots,
    float* __restrict__ s, int in_size, int max_rank, int num_slots, int64_t stride_xt,
    int64_t stride_as, int64_t stride_ar, int64_t stride_st) {
  const int64_t token = blockIdx.x;
  const int rank0 = blockIdx.y * RANK_TILE;
  const int slot = token_slots[token];
  float* s_row = s + token * stride_st;
  if (slot < 0 || slot >= num_slots) {
    // Zero rows keep s fully defined for whoever reads it (the fine-tuning capture, a test).
    for (int r = threadIdx.x; r < RANK_TILE && rank0 + r < max_rank; r += kThreads) s_row[rank0 + r] = 0.0f;
    return;
  }
  const T* x_row = x + token * stride_xt;
  const T* a_tile = lora_a + static_cast<int64_t>(slot) * stride_as + static_cast<int64_t>(rank0) * stride_ar;

  float acc[RANK_TILE];
#pragma unroll
  for (int r = 0; r < RANK_TILE; ++r) acc[r] = 0.0f;

  const int num_vecs = in_size / VEC;
  // Two iterations unrolled: twice the independent 16-byte loads in flight per thread.
#pragma unroll 2
  for (int v = threadIdx.x; v < num_vecs; v += kThreads) {
    float xv[VEC];
    load_vec<T, VEC>(x_row + static_cast<int64_t>(v) * VEC, xv);
#pragma unroll
    for (int r = 0; r < RANK_TILE; ++r) {
      if (rank0 + r < max_rank) {
        float av[VEC];
        load_vec<T, VEC>(a_tile + r * stride_ar + static_cast<int64_t>(v) * VEC, av);
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[r] = fmaf(xv[i], av[i], acc[r]);
      }
    }
  }
  // Tail of `in` past the last full vector (only when in_size % VEC != 0).
  for (int k = num_vecs * VEC + threadIdx.x; k < in_size; k += kThreads) {
    const float xk = to_float(x_row[k]);
#pragma unroll
    for (int r = 0; r < RANK_TILE; ++r) {
      if (rank0 + r < max_rank) acc[r] = fmaf(xk, to_float(a_tile[r * stride_ar + k]), acc[r]);
    }
  }

  __shared__ float partial[kWarps][RANK_TILE];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < RANK_TILE; ++r) {
    const float sum = warp_sum(acc[r]);
    if (lane == 0) partial[warp][r] = sum;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < RANK_TILE && rank0 + r < max_rank; r += kThreads) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += partial[w][r];
    s_row[rank0 + r] = sum;
  }
}

// Grid (token, output tile of 128). s's row is staged in shared memory (max_rank floats, dynamic);
// each thread owns one output n and reads B[slot, n, :] (a contiguous max_rank row) in 16-byte
// chunks; the warp's 32 rows are adjacent in memory, so its loads cover one contiguous span.
template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads) bgmv_expand_kernel(
    const float* __restrict__ s, const T* __restrict__ lora_b, const int32_t* __restrict__ token_slots,
    const float* __restrict__ scaling, T* __restrict__ y, int out_size, int max_rank, int num_slots,
    int64_t stride_st, int64_t stride_bs, int64_t stride_bn, int64_t stride_yt) {
  extern __shared__ float s_shared[];
  const int64_t token = blockIdx.x;
  const int slot = token_slots[token];
  if (slot < 0 || slot >= num_slots) return;
  const float* s_row = s + token * stride_st;
  for (int r = threadIdx.x; r < max_rank; r += kThreads) s_shared[r] = s_row[r];
  __syncthreads();

  const int n = blockIdx.y * kThreads + threadIdx.x;
  if (n >= out_size) return;
  const T* b_row = lora_b + static_cast<int64_t>(slot) * stride_bs + static_cast<int64_t>(n) * stride_bn;
  float acc = 0.0f;
  const int num_vecs = max_rank / VEC;
  for (int v = 0; v < num_vecs; ++v) {
    float bv[VEC];
    load_vec<T, VEC>(b_row + v * VEC, bv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc = fmaf(s_shared[v * VEC + i], bv[i], acc);
  }
  for (int r = num_vecs * VEC; r < max_rank; ++r) acc = fmaf(s_shared[r], to_float(b_row[r]), acc);
  T* out = y + token * stride_yt + n;
  *out = from_float<T>(to_float(*out) + scaling[slot] * acc);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
cudaError_t launch_shrink(const void* x, const void* lora_a, const int32_t* token_slots, float* s,
                          int num_tokens, int in_size, int max_rank, int num_slots, int64_t stride_xt,
                          int64_t stride_as, int64_t stride_ar, int64_t stride_st, int num_sms,
                          cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const T* xp = static_cast<const T*>(x);
  const T* ap = static_cast<const T*>(lora_a);
  // 16-byte loads need 16-byte aligned rows: base pointers and every row stride in whole vectors.
  const bool vectorized = aligned16(xp) && aligned16(ap) && stride_xt % kVec == 0 &&
                          stride_as % kVec == 0 && stride_ar % kVec == 0;
  // Wide rank tiles read x once for 16 rows of A; at small batches narrow ones give the GPU more
  // blocks (a decode step of one token and rank 16 would otherwise run on a single SM).
  const bool wide = static_cast<int64_t>(num_tokens) * ((max_rank + 15) / 16) >= 2 * num_sms;
  const int rank_tile = wide ? 16 : 4;
  const dim3 grid(num_tokens, (max_rank + rank_tile - 1) / rank_tile);
#define FLEXSERVE_SHRINK(VEC, TILE)                                                                  \
  bgmv_shrink_kernel<T, VEC, TILE><<<grid, kThreads, 0, stream>>>(xp, ap, token_slots, s, in_size,   \
                                                                   max_rank, num_slots, stride_xt,   \
                                                                   stride_as, stride_ar, stride_st)
  if (vectorized && wide) FLEXSERVE_SHRINK(kVec, 16);
  else if (vectorized) FLEXSERVE_SHRINK(kVec, 4);
  else if (wide) FLEXSERVE_SHRINK(1, 16);
  else FLEXSERVE_SHRINK(1, 4);
#undef FLEXSERVE_SHRINK
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_expand(const float* s, const void* lora_b, const int32_t* token_slots,
                          const float* scaling, void* y, int num_tokens, int out_size, int max_rank,
                          int num_slots, int64_t stride_st, int64_t stride_bs, int64_t stride_bn,
                          int64_t stride_yt, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const T* bp = static_cast<const T*>(lora_b);
  T* yp = static_cast<T*>(y);
  const bool vectorized = aligned16(bp) && stride_bs % kVec == 0 && stride_bn % kVec == 0;
  const dim3 grid(num_tokens, (out_size + kThreads - 1) / kThreads);
  const size_t shared_bytes = static_cast<size_t>(max_rank) * sizeof(float);
  if (vectorized) {
    bgmv_expand_kernel<T, kVec><<<grid, kThreads, shared_bytes, stream>>>(
        s, bp, token_slots, scaling, yp, out_size, max_rank, num_slots, stride_st, stride_bs, stride_bn, stride_yt);
  } else {
    bgmv_expand_kernel<T, 1><<<grid, kThreads, shared_bytes, stream>>>(
        s, bp, token_slots, scaling, yp, out_size, max_rank, num_slots, stride_st, stride_bs, stride_bn, stride_yt);
  }
  return cudaGetLastError();
}

}  // namespace

// dtype: 0 float32, 1 float16, 2 bfloat16 (lora_bgmv.cpp maps torch's dtypes).
cudaError_t bgmv_shrink_launch(int dtype, const void* x, const void* lora_a, const int32_t* token_slots,
                               float* s, int num_tokens, int in_size, int max_rank, int num_slots,
                               int64_t stride_xt, int64_t stride_as, int64_t stride_ar, int64_t stride_st,
                               int num_sms, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  switch (dtype) {
    case 0: return launch_shrink<float>(x, lora_a, token_slots, s, num_tokens, in_size, max_rank, num_slots,
                                        stride_xt, stride_as, stride_ar, stride_st, num_sms, stream);
    case 1: return launch_shrink<__half>(x, lora_a, token_slots, s, num_tokens, in_size, max_rank, num_slots,
                                         stride_xt, stride_as, stride_ar, stride_st, num_sms, stream);
    case 2: return launch_shrink<__nv_bfloat16>(x, lora_a, token_slots, s, num_tokens, in_size, max_rank,
                                                num_slots, stride_xt, stride_as, stride_ar, stride_st, num_sms,
                                                stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t bgmv_expand_launch(int dtype, const float* s, const void* lora_b, const int32_t* token_slots,
                               const float* scaling, void* y, int num_tokens, int out_size, int max_rank,
                               int num_slots, int64_t stride_st, int64_t stride_bs, int64_t stride_bn,
                               int64_t stride_yt, cudaStream_t stream) {
  if (num_tokens == 0 || out_size == 0) return cudaSuccess;
  switch (dtype) {
    case 0: return launch_expand<float>(s, lora_b, token_slots, scaling, y, num_tokens, out_size, max_rank,
                                        num_slots, stride_st, stride_bs, stride_bn, stride_yt, stream);
    case 1: return launch_expand<__half>(s, lora_b, token_slots, scaling, y, num_tokens, out_size, max_rank,
                                         num_slots, stride_st, stride_bs, stride_bn, stride_yt, stream);
    case 2: return launch_expand<__nv_bfloat16>(s, lora_b, token_slots, scaling, y, num_tokens, out_size,
                                                max_rank, num_slots, stride_st, stride_bs, stride_bn, stride_yt,
                                                stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace flexserve
