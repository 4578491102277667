// BGMV for multi-LoRA decode (Punica's idea): one token per row, each row with its own adapter slot.
//
//   shrink: s[t, r]  = sum_k x[t, k] * A[slot(t), r, k]                      (float32 out)
//   expand: y[t, n] += scaling[slot(t)] * sum_r s[t, r] * B[slot(t), n, r]   (in place)
//
// slot(t) = token_slots[t]; -1 (or a slot past num_slots) means no adapter: the shrink writes a
// zero row, the expand leaves y's row alone. Accumulation is float32; y is rounded once.
//
// Shrink: split-K over thread block clusters. A decode step has few tokens and a narrow output
// (the rank), so a grid of (token, rank tile) blocks leaves most SMs idle; here `in` is also cut
// into num_splits contiguous chunks (about kSplitChunk elements each, at most kMaxSplits), one
// block per (token, chunk, rank tile), and the chunks of one (token, rank tile) form a cluster.
// Each block sums its chunk for every rank of its tile (16-byte loads, warp shuffles, shared
// memory); the cluster's first block adds the chunks' sums in chunk order through distributed
// shared memory and writes s. So s is final when the shrink returns: no workspace, no atomics,
// and a token's s does not depend on the batch (the split follows in_size alone; the rank tile,
// picked from the batch to fill the GPU, changes no rank's order of summation). Where the device
// does not launch clusters (before sm_90) the shrink keeps `in` whole (num_splits = 1).
//
// Expand: G lanes share one output n (G = the number of 16-byte chunks in B's row, rounded up to
// a power of 2, at most 32), so a warp's 16-byte loads of B cover adjacent rows: one contiguous
// span when B's rows are packed. Each thread works on kWideOutputs outputs of its token (or one,
// for the few tokens of small decode steps) with all their loads issued before the sums; the G
// lanes' partial sums meet by shuffles and one lane writes y[t, n].
//
// Both kernels issue all the loads of a step before its first multiply, as read in the SASS
// (CUDA 13, sm_90): no load sits behind a branch (ptxas issued such loads only after the
// multiplies before them), and __launch_bounds__(kThreads, 1) leaves ptxas the registers (with the
// default bounds it interleaved loads with the multiplies waiting on them). At most 168 registers,
// no spills.
//
// This file holds no torch headers (so nvcc compile-checks it anywhere); lora_bgmv.cpp is the
// torch binding and calls the launchers at the bottom. Both launchers only enqueue work on the
// given stream: no host sync and no allocation, so CUDA graphs can capture them (cluster launches
// included).

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

namespace flexserve {
namespace {

constexpr int kThreads = 128;  // one warp group (4 warps) per block
constexpr int kWarps = kThreads / 32;
constexpr int kMaxSplits = 8;         // the portable cluster size: every sm_90+ part launches it
constexpr int kSplitChunk = 1024;     // elements of `in` per shrink block, about
constexpr int kWideOutputs = 4;       // outputs per thread in the expand's wide tiles

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// VEC elements of T as loaded: one 16-byte load (kept as its raw 16 bytes until an element is
// read) when VEC * sizeof(T) == 16, else element by element. Kernels load every pack they need
// before reading any (reading waits for the load), so a thread's loads are in flight together.
template <typename T, int VEC, bool kWide = VEC * sizeof(T) == 16>
struct Pack {
  T v[VEC];
  __device__ __forceinline__ float get(int i) const { return to_float(v[i]); }
};

template <typename T, int VEC>
struct Pack<T, VEC, true> {
  uint4 raw;
  __device__ __forceinline__ float get(int i) const { return to_float(reinterpret_cast<const T*>(&raw)[i]); }
};

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* __restrict__ p) {
  Pack<T, VEC> out;
  if constexpr (VEC * sizeof(T) == 16) {
    out.raw = __ldg(reinterpret_cast<const uint4*>(p));
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) out.v[i] = p[i];
  }
  return out;
}

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> zero_pack() {
  Pack<T, VEC> out;
  if constexpr (VEC * sizeof(T) == 16) {
    out.raw = make_uint4(0, 0, 0, 0);  // +0.0 in every element, whatever T
  } else {
#pragma unroll
    for (int i = 0; i < VEC; ++i) out.v[i] = from_float<T>(0.0f);
  }
  return out;
}

// The first `count` (<= VEC) elements of p, element by element, zeros after them (a row's last,
// partial chunk; s, whose rows need not be 16-byte aligned).
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC, false> load_part(const T* __restrict__ p, int count) {
  Pack<T, VEC, false> out;
#pragma unroll
  for (int i = 0; i < VEC; ++i) out.v[i] = i < count ? p[i] : from_float<T>(0.0f);
  return out;
}

// acc + sum_i a[i] * b[i] in float32, i in order.
template <typename PA, typename PB, int VEC>
__device__ __forceinline__ float dot_pack(const PA& a, const PB& b, float acc) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc = fmaf(a.get(i), b.get(i), acc);
  return acc;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Grid (token x chunk, rank tile); blockIdx.x = token * num_splits + chunk, and with num_splits > 1
// the launch groups the num_splits blocks of a token into one cluster (cluster rank = chunk).
// Chunk c covers the VEC-wide vectors [c * vecs_per_split, (c + 1) * vecs_per_split) of `in`; the
// last chunk also takes the elements past the last full vector. The block's 128 threads take the
// chunk's vectors in turn (16-byte loads, coalesced across the warp); each thread loads x's vector
// once and keeps RANK_TILE float32 sums, one per row of A in the tile.
template <typename T, int VEC, int RANK_TILE>
__global__ void __launch_bounds__(kThreads, 1) bgmv_shrink_kernel(
    const T* __restrict__ x, const T* __restrict__ lora_a, const int32_t* __restrict__ token_slots,
    float* __restrict__ s, int in_size, int max_rank, int num_slots, int num_splits, int vecs_per_split,
    int64_t stride_xt, int64_t stride_as, int64_t stride_ar, int64_t stride_st) {
  static_assert(RANK_TILE <= kThreads, "one thread per rank of the tile writes s");
  const int chunk = static_cast<int>(blockIdx.x % num_splits);
  const int64_t token = blockIdx.x / num_splits;
  const int rank0 = blockIdx.y * RANK_TILE;
  const int ranks = min(RANK_TILE, max_rank - rank0);  // the last tile may be partial
  const int slot = token_slots[token];
  float* s_out = s + token * stride_st + rank0;
  if (slot < 0 || slot >= num_slots) {
    // Zero rows keep s fully defined for whoever reads it (the fine-tuning capture, a test). The
    // whole cluster shares the token, so every block of it returns here, before any cluster sync.
    if (chunk == 0 && static_cast<int>(threadIdx.x) < ranks) s_out[threadIdx.x] = 0.0f;
    return;
  }
  const T* x_row = x + token * stride_xt;
  const T* a_tile = lora_a + static_cast<int64_t>(slot) * stride_as + static_cast<int64_t>(rank0) * stride_ar;

  float acc[RANK_TILE];
#pragma unroll
  for (int r = 0; r < RANK_TILE; ++r) acc[r] = 0.0f;

  const int num_vecs = in_size / VEC;
  const int v_begin = chunk * vecs_per_split;
  const int v_end =
      static_cast<int>(min(static_cast<int64_t>(num_vecs), static_cast<int64_t>(v_begin) + vecs_per_split));
  // No load depends on a branch (the compiler would issue it only after the multiplies before it):
  // rows past the last rank of a partial tile read that rank's row again (their sums are never
  // written), and unrolled steps past the chunk's end read its last vector, zeroed after the load.
  // So x's packs and the tile's packs of A for kUnroll vectors are in flight together.
  constexpr int kUnroll = RANK_TILE >= 16 ? 1 : (RANK_TILE >= 4 ? 2 : 4);  // 17, 10 or 8 loads
  const T* a_row[RANK_TILE];
#pragma unroll
  for (int r = 0; r < RANK_TILE; ++r) a_row[r] = a_tile + static_cast<int64_t>(min(r, ranks - 1)) * stride_ar;
  for (int v0 = v_begin + static_cast<int>(threadIdx.x); v0 < v_end; v0 += kThreads * kUnroll) {
    Pack<T, VEC> xv[kUnroll];
    Pack<T, VEC> av[kUnroll][RANK_TILE];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t k = static_cast<int64_t>(min(v0 + u * kThreads, v_end - 1)) * VEC;
      xv[u] = load_pack<T, VEC>(x_row + k);
#pragma unroll
      for (int r = 0; r < RANK_TILE; ++r) av[u][r] = load_pack<T, VEC>(a_row[r] + k);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (u > 0) {  // a step past the chunk's end adds 0 * 0
        const bool inside = v0 + u * kThreads < v_end;
        xv[u] = inside ? xv[u] : zero_pack<T, VEC>();
#pragma unroll
        for (int r = 0; r < RANK_TILE; ++r) av[u][r] = inside ? av[u][r] : zero_pack<T, VEC>();
      }
#pragma unroll
      for (int r = 0; r < RANK_TILE; ++r)
        acc[r] = dot_pack<Pack<T, VEC>, Pack<T, VEC>, VEC>(xv[u], av[u][r], acc[r]);
    }
  }
  // Tail of `in` past the last full vector (only when in_size % VEC != 0), in the last chunk.
  if (chunk == num_splits - 1) {
    for (int k = num_vecs * VEC + static_cast<int>(threadIdx.x); k < in_size; k += kThreads) {
      const float xk = to_float(x_row[k]);
#pragma unroll
      for (int r = 0; r < RANK_TILE; ++r) {
        if (r < ranks) acc[r] = fmaf(xk, to_float(a_tile[r * stride_ar + k]), acc[r]);
      }
    }
  }

  __shared__ float warp_part[kWarps][RANK_TILE];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < RANK_TILE; ++r) {
    if (r < ranks) {  // uniform over the block
      const float sum = warp_sum(acc[r]);
      if (lane == 0) warp_part[warp][r] = sum;
    }
  }
  __syncthreads();
  const int r = threadIdx.x;
  float total = 0.0f;
  if (r < ranks) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += warp_part[w][r];
  }
  if (num_splits == 1) {
    if (r < ranks) s_out[r] = total;
    return;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // The chunks' sums, added in chunk order by the cluster's first block (deterministic).
  __shared__ float block_part[RANK_TILE];
  cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  if (r < ranks) block_part[r] = total;
  cluster.sync();  // every block's block_part is written and visible to the cluster
  if (chunk == 0 && r < ranks) {
    float sum = 0.0f;
    for (int c = 0; c < num_splits; ++c) sum += *cluster.map_shared_rank(&block_part[r], c);
    s_out[r] = sum;
  }
  cluster.sync();  // no block leaves (freeing its shared memory) before the first has read it
#else
  __trap();  // the launcher splits only where the device launches clusters (sm_90 and later)
#endif
}

// Grid (token, output tile; tiles past gridDim.y loop). G = group_lanes lanes (a power of 2, at
// most 32) share an output n: lane j of the group reads the VEC-wide chunks j, j + G, ... of B's
// row n (16 bytes each; s's matching elements one by one, its rows need not be aligned), and the
// group's sums meet by shuffles. A tile holds OUTPUTS passes of kThreads / G adjacent outputs; a
// thread loads B for all its passes before it adds. Outputs past out_size read row out_size - 1
// (and are never written), so no load waits on a branch. Every lane reads y[t, n] (one transaction
// for the group) before the loads of B; the group's first lane writes it, rounded once.
template <typename T, int VEC, int OUTPUTS>
__global__ void __launch_bounds__(kThreads, 1) bgmv_expand_kernel(
    const float* __restrict__ s, const T* __restrict__ lora_b, const int32_t* __restrict__ token_slots,
    const float* __restrict__ scaling, T* __restrict__ y, int out_size, int max_rank, int num_slots,
    int group_lanes, int64_t stride_st, int64_t stride_bs, int64_t stride_bn, int64_t stride_yt) {
  const int64_t token = blockIdx.x;
  const int slot = token_slots[token];
  if (slot < 0 || slot >= num_slots) return;
  const float* s_row = s + token * stride_st;
  const T* b_slot = lora_b + static_cast<int64_t>(slot) * stride_bs;
  T* y_row = y + token * stride_yt;
  const float scale = scaling[slot];

  const int lane_in_group = threadIdx.x & (group_lanes - 1);
  const int outputs_per_pass = kThreads / group_lanes;
  const int64_t outputs_per_tile = static_cast<int64_t>(outputs_per_pass) * OUTPUTS;
  const int64_t num_tiles = (out_size + outputs_per_tile - 1) / outputs_per_tile;
  const int num_chunks = (max_rank + VEC - 1) / VEC;

  for (int64_t tile = blockIdx.y; tile < num_tiles; tile += gridDim.y) {
    const int64_t n0 = tile * outputs_per_tile + threadIdx.x / group_lanes;
    const T* b_row[OUTPUTS];
    float y_old[OUTPUTS];
    float acc[OUTPUTS];
#pragma unroll
    for (int p = 0; p < OUTPUTS; ++p) {
      const int64_t n = min(n0 + p * outputs_per_pass, static_cast<int64_t>(out_size) - 1);
      b_row[p] = b_slot + n * stride_bn;
      y_old[p] = to_float(y_row[n]);
      acc[p] = 0.0f;
    }
    for (int c = lane_in_group; c < num_chunks; c += group_lanes) {
      const int r0 = c * VEC;
      const int count = min(VEC, max_rank - r0);
      if (count == VEC) {
        Pack<float, VEC, false> sv;
#pragma unroll
        for (int i = 0; i < VEC; ++i) sv.v[i] = s_row[r0 + i];
        Pack<T, VEC> bv[OUTPUTS];
#pragma unroll
        for (int p = 0; p < OUTPUTS; ++p) bv[p] = load_pack<T, VEC>(b_row[p] + r0);
#pragma unroll
        for (int p = 0; p < OUTPUTS; ++p)
          acc[p] = dot_pack<Pack<float, VEC, false>, Pack<T, VEC>, VEC>(sv, bv[p], acc[p]);
      } else {  // the partial last chunk of a rank that is not a multiple of VEC
        const Pack<float, VEC, false> sv = load_part<float, VEC>(s_row + r0, count);
#pragma unroll
        for (int p = 0; p < OUTPUTS; ++p)
          acc[p] = dot_pack<Pack<float, VEC, false>, Pack<T, VEC, false>, VEC>(
              sv, load_part<T, VEC>(b_row[p] + r0, count), acc[p]);
      }
    }
#pragma unroll
    for (int p = 0; p < OUTPUTS; ++p) {
      for (int offset = group_lanes >> 1; offset > 0; offset >>= 1)
        acc[p] += __shfl_xor_sync(0xffffffffu, acc[p], offset);
      const int64_t n = n0 + p * outputs_per_pass;
      if (lane_in_group == 0 && n < out_size) y_row[n] = from_float<T>(y_old[p] + scale * acc[p]);
    }
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

template <typename T, int VEC, int RANK_TILE>
cudaError_t launch_shrink_tile(const T* x, const T* lora_a, const int32_t* token_slots, float* s, int num_tokens,
                               int in_size, int max_rank, int num_slots, int num_splits, int vecs_per_split,
                               int64_t stride_xt, int64_t stride_as, int64_t stride_ar, int64_t stride_st,
                               cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(num_tokens) * num_splits, ceil_div(max_rank, RANK_TILE));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute cluster[1];
  cluster[0].id = cudaLaunchAttributeClusterDimension;
  cluster[0].val.clusterDim.x = num_splits;
  cluster[0].val.clusterDim.y = 1;
  cluster[0].val.clusterDim.z = 1;
  config.attrs = cluster;
  config.numAttrs = num_splits > 1 ? 1 : 0;
  return cudaLaunchKernelEx(&config, bgmv_shrink_kernel<T, VEC, RANK_TILE>, x, lora_a, token_slots, s, in_size,
                            max_rank, num_slots, num_splits, vecs_per_split, stride_xt, stride_as, stride_ar,
                            stride_st);
}

template <typename T>
cudaError_t launch_shrink(const void* x, const void* lora_a, const int32_t* token_slots, float* s,
                          int num_tokens, int in_size, int max_rank, int num_slots, int64_t stride_xt,
                          int64_t stride_as, int64_t stride_ar, int64_t stride_st, int num_sms,
                          bool cluster_launch, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const T* xp = static_cast<const T*>(x);
  const T* ap = static_cast<const T*>(lora_a);
  // 16-byte loads need 16-byte aligned rows: base pointers and every row stride in whole vectors.
  const bool vectorized = aligned16(xp) && aligned16(ap) && stride_xt % kVec == 0 &&
                          stride_as % kVec == 0 && stride_ar % kVec == 0;
  const int vec = vectorized ? kVec : 1;
  const int num_vecs = in_size / vec;
  // Chunks of about kSplitChunk elements, from in_size alone (so a token's sums do not depend on the
  // batch); no empty chunk. The grid's x dimension (tokens x chunks) must fit in an int.
  int num_splits = 1;
  if (cluster_launch && num_tokens <= INT_MAX / kMaxSplits) {
    num_splits = (in_size + kSplitChunk / 2) / kSplitChunk;
    num_splits = num_splits < 1 ? 1 : (num_splits > kMaxSplits ? kMaxSplits : num_splits);
  }
  int vecs_per_split = num_vecs > 0 ? ceil_div(num_vecs, num_splits) : 1;
  num_splits = num_vecs > 0 ? ceil_div(num_vecs, vecs_per_split) : 1;
  // Rank tile: the widest of 16, 4, 1 that gives the grid about 1.5 blocks per SM (narrower tiles
  // read x once more per tile, from L2); no wider than the rank needs.
  const int64_t target = static_cast<int64_t>(num_sms) * 3 / 2;
  const auto blocks = [&](int tile) {
    return static_cast<int64_t>(num_tokens) * num_splits * ceil_div(max_rank, tile);
  };
  int rank_tile = max_rank <= 1 ? 1 : (max_rank <= 4 ? 4 : 16);
  if (rank_tile == 16 && blocks(16) < target) rank_tile = 4;
  if (rank_tile == 4 && blocks(4) < target) rank_tile = 1;
  if (ceil_div(max_rank, rank_tile) > 65535) rank_tile = 16;  // grid.y's limit
#define FLEXSERVE_SHRINK(VEC, TILE)                                                                        \
  return launch_shrink_tile<T, VEC, TILE>(xp, ap, token_slots, s, num_tokens, in_size, max_rank, num_slots, \
                                          num_splits, vecs_per_split, stride_xt, stride_as, stride_ar,     \
                                          stride_st, stream)
  if (vectorized) {
    if (rank_tile == 16) FLEXSERVE_SHRINK(kVec, 16);
    if (rank_tile == 4) FLEXSERVE_SHRINK(kVec, 4);
    FLEXSERVE_SHRINK(kVec, 1);
  }
  if (rank_tile == 16) FLEXSERVE_SHRINK(1, 16);
  if (rank_tile == 4) FLEXSERVE_SHRINK(1, 4);
  FLEXSERVE_SHRINK(1, 1);
#undef FLEXSERVE_SHRINK
}

template <typename T, int VEC, int OUTPUTS>
cudaError_t launch_expand_tile(const float* s, const T* lora_b, const int32_t* token_slots, const float* scaling,
                               T* y, int num_tokens, int out_size, int max_rank, int num_slots, int group_lanes,
                               int64_t stride_st, int64_t stride_bs, int64_t stride_bn, int64_t stride_yt,
                               cudaStream_t stream) {
  const int num_tiles = ceil_div(out_size, static_cast<int64_t>(kThreads / group_lanes) * OUTPUTS);
  const dim3 grid(num_tokens, num_tiles < 65535 ? num_tiles : 65535);
  bgmv_expand_kernel<T, VEC, OUTPUTS><<<grid, kThreads, 0, stream>>>(
      s, lora_b, token_slots, scaling, y, out_size, max_rank, num_slots, group_lanes, stride_st, stride_bs,
      stride_bn, stride_yt);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_expand(const float* s, const void* lora_b, const int32_t* token_slots,
                          const float* scaling, void* y, int num_tokens, int out_size, int max_rank,
                          int num_slots, int64_t stride_st, int64_t stride_bs, int64_t stride_bn,
                          int64_t stride_yt, int num_sms, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const T* bp = static_cast<const T*>(lora_b);
  T* yp = static_cast<T*>(y);
  // Only B's rows take 16-byte loads: its base and row strides in whole vectors.
  const bool vectorized = aligned16(bp) && stride_bs % kVec == 0 && stride_bn % kVec == 0;
  const int num_chunks = ceil_div(max_rank, vectorized ? kVec : 1);
  int group_lanes = 1;
  while (group_lanes < num_chunks && group_lanes < 32) group_lanes *= 2;
  // kWideOutputs outputs per thread (a quarter of the blocks, 4 loads of B in flight per chunk)
  // while that still gives about 2 blocks per SM; 1 below that (decode steps of a few tokens).
  const int64_t wide_blocks = static_cast<int64_t>(num_tokens) *
                              ceil_div(out_size, static_cast<int64_t>(kThreads / group_lanes) * kWideOutputs);
  const bool wide = wide_blocks >= 2 * static_cast<int64_t>(num_sms);
#define FLEXSERVE_EXPAND(VEC, OUTPUTS)                                                                         \
  return launch_expand_tile<T, VEC, OUTPUTS>(s, bp, token_slots, scaling, yp, num_tokens, out_size, max_rank, \
                                             num_slots, group_lanes, stride_st, stride_bs, stride_bn,       \
                                             stride_yt, stream)
  if (vectorized) {
    if (wide) FLEXSERVE_EXPAND(kVec, kWideOutputs);
    FLEXSERVE_EXPAND(kVec, 1);
  }
  if (wide) FLEXSERVE_EXPAND(1, kWideOutputs);
  FLEXSERVE_EXPAND(1, 1);
#undef FLEXSERVE_EXPAND
}

}  // namespace

// dtype: 0 float32, 1 float16, 2 bfloat16 (lora_bgmv.cpp maps torch's dtypes). num_sms: the
// device's multiprocessors; cluster_launch: whether it launches thread block clusters
// (cudaDevAttrClusterLaunch; without them the shrink does not split `in`).
cudaError_t bgmv_shrink_launch(int dtype, const void* x, const void* lora_a, const int32_t* token_slots,
                               float* s, int num_tokens, int in_size, int max_rank, int num_slots,
                               int64_t stride_xt, int64_t stride_as, int64_t stride_ar, int64_t stride_st,
                               int num_sms, bool cluster_launch, cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  switch (dtype) {
    case 0: return launch_shrink<float>(x, lora_a, token_slots, s, num_tokens, in_size, max_rank, num_slots,
                                        stride_xt, stride_as, stride_ar, stride_st, num_sms, cluster_launch,
                                        stream);
    case 1: return launch_shrink<__half>(x, lora_a, token_slots, s, num_tokens, in_size, max_rank, num_slots,
                                         stride_xt, stride_as, stride_ar, stride_st, num_sms, cluster_launch,
                                         stream);
    case 2: return launch_shrink<__nv_bfloat16>(x, lora_a, token_slots, s, num_tokens, in_size, max_rank,
                                                num_slots, stride_xt, stride_as, stride_ar, stride_st, num_sms,
                                                cluster_launch, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t bgmv_expand_launch(int dtype, const float* s, const void* lora_b, const int32_t* token_slots,
                               const float* scaling, void* y, int num_tokens, int out_size, int max_rank,
                               int num_slots, int64_t stride_st, int64_t stride_bs, int64_t stride_bn,
                               int64_t stride_yt, int num_sms, cudaStream_t stream) {
  if (num_tokens == 0 || out_size == 0) return cudaSuccess;
  switch (dtype) {
    case 0: return launch_expand<float>(s, lora_b, token_slots, scaling, y, num_tokens, out_size, max_rank,
                                        num_slots, stride_st, stride_bs, stride_bn, stride_yt, num_sms, stream);
    case 1: return launch_expand<__half>(s, lora_b, token_slots, scaling, y, num_tokens, out_size, max_rank,
                                         num_slots, stride_st, stride_bs, stride_bn, stride_yt, num_sms, stream);
    case 2: return launch_expand<__nv_bfloat16>(s, lora_b, token_slots, scaling, y, num_tokens, out_size,
                                                max_rank, num_slots, stride_st, stride_bs, stride_bn, stride_yt,
                                                num_sms, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace flexserve
