// Torch binding of the BGMV decode kernels (lora_bgmv.cu) as the ops flexserve::lora_bgmv_shrink and
// flexserve::lora_bgmv_expand. Both write into tensors the caller gives (no allocation, no host
// sync: capturable by CUDA graphs) on the current stream. Bad shapes, dtypes or devices raise
// ValueError (TORCH_CHECK_VALUE) naming what was wrong.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <atomic>
#include <limits>

namespace flexserve {

cudaError_t bgmv_shrink_launch(int dtype, const void* x, const void* lora_a, const int32_t* token_slots,
                               float* s, int num_tokens, int in_size, int max_rank, int num_slots,
                               int64_t stride_xt, int64_t stride_as, int64_t stride_ar, int64_t stride_st,
                               int num_sms, bool cluster_launch, cudaStream_t stream);
cudaError_t bgmv_expand_launch(int dtype, const float* s, const void* lora_b, const int32_t* token_slots,
                               const float* scaling, void* y, int num_tokens, int out_size, int max_rank,
                               int num_slots, int64_t stride_st, int64_t stride_bs, int64_t stride_bn,
                               int64_t stride_yt, int num_sms, cudaStream_t stream);

namespace {

// The largest rank the expand takes (12288, what staging a row of s in 48 KiB of shared memory
// allowed in an earlier version of the kernels; kept so the op accepts the same inputs).
constexpr int64_t kMaxRank = 48 * 1024 / sizeof(float);

int dtype_code(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    default:
      TORCH_CHECK_VALUE(false, "lora_bgmv: ", name, " must be float32, float16 or bfloat16, got ",
                        t.scalar_type());
  }
  return -1;
}

// An attribute of a device, read once per (attribute, device): the launchers size their grids from
// the multiprocessor count and split the shrink only where the device launches clusters.
int device_attribute(cudaDeviceAttr attr, std::atomic<int> (&cache)[256], int device, const char* what) {
  const int index = device & 255;
  int value = cache[index].load(std::memory_order_relaxed);
  if (value == 0) {
    const cudaError_t err = cudaDeviceGetAttribute(&value, attr, device);
    TORCH_CHECK(err == cudaSuccess, "lora_bgmv: reading ", what, " failed: ", cudaGetErrorString(err));
    value += 1;  // stored plus one: 0 means not read yet
    cache[index].store(value, std::memory_order_relaxed);
  }
  return value - 1;
}

int num_sms(int device) {
  static std::atomic<int> cache[256];
  return device_attribute(cudaDevAttrMultiProcessorCount, cache, device, "the multiprocessor count");
}

bool cluster_launch(int device) {
  static std::atomic<int> cache[256];
  return device_attribute(cudaDevAttrClusterLaunch, cache, device, "cluster launch support") != 0;
}

void check_cuda(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  TORCH_CHECK_VALUE(t.is_cuda(), "lora_bgmv: ", name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK_VALUE(t.device() == ref.device(), "lora_bgmv: ", name, " is on ", t.device(),
                    " but the activations are on ", ref.device());
}

void check_inner_contiguous(const at::Tensor& t, const char* name) {
  // A size-1 last dimension may carry any stride: the kernels never step along it.
  TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, "lora_bgmv: ", name,
                    " must be contiguous in its last dimension, got strides ", t.strides());
}

void check_token_slots(const at::Tensor& token_slots, int64_t num_tokens, const at::Tensor& ref) {
  check_cuda(token_slots, ref, "token_slots");
  TORCH_CHECK_VALUE(token_slots.dim() == 1 && token_slots.size(0) == num_tokens,
                    "lora_bgmv: token_slots must be [", num_tokens, "], got ", token_slots.sizes());
  TORCH_CHECK_VALUE(token_slots.scalar_type() == at::kInt, "lora_bgmv: token_slots must be int32, got ",
                    token_slots.scalar_type());
  TORCH_CHECK_VALUE(num_tokens <= 1 || token_slots.stride(0) == 1, "lora_bgmv: token_slots must be contiguous");
}

void check_int_range(int64_t value, const char* name) {
  TORCH_CHECK_VALUE(value <= std::numeric_limits<int>::max(), "lora_bgmv: ", name, " ", value,
                    " is too large for the kernels");
}

// s[t] = x[t] @ lora_a[token_slots[t]].T in float32; rows whose slot is -1 are written as zeros.
void lora_bgmv_shrink(const at::Tensor& x, const at::Tensor& lora_a, const at::Tensor& token_slots,
                      at::Tensor& s) {
  TORCH_CHECK_VALUE(x.dim() == 2 && lora_a.dim() == 3 && s.dim() == 2,
                    "lora_bgmv_shrink wants x [T, in], lora_a [num_slots, max_rank, in] and s [T, max_rank], "
                    "got x ", x.sizes(), ", lora_a ", lora_a.sizes(), " and s ", s.sizes());
  const int64_t num_tokens = x.size(0), in_size = x.size(1);
  const int64_t num_slots = lora_a.size(0), max_rank = lora_a.size(1);
  TORCH_CHECK_VALUE(lora_a.size(2) == in_size, "lora_bgmv_shrink: lora_a ", lora_a.sizes(),
                    " does not take x's hidden size ", in_size);
  TORCH_CHECK_VALUE(num_slots > 0 && max_rank > 0, "lora_bgmv_shrink: lora_a ", lora_a.sizes(),
                    " has no slot or no rank");
  TORCH_CHECK_VALUE(s.size(0) == num_tokens && s.size(1) == max_rank, "lora_bgmv_shrink: s must be [",
                    num_tokens, ", ", max_rank, "], got ", s.sizes());
  TORCH_CHECK_VALUE(lora_a.scalar_type() == x.scalar_type(), "lora_bgmv_shrink: x and lora_a must share a dtype, got ",
                    x.scalar_type(), " and ", lora_a.scalar_type());
  TORCH_CHECK_VALUE(s.scalar_type() == at::kFloat, "lora_bgmv_shrink: s must be float32, got ", s.scalar_type());
  const int dtype = dtype_code(x, "x");
  check_cuda(x, x, "x");
  check_cuda(lora_a, x, "lora_a");
  check_cuda(s, x, "s");
  check_token_slots(token_slots, num_tokens, x);
  check_inner_contiguous(x, "x");
  check_inner_contiguous(lora_a, "lora_a");
  check_inner_contiguous(s, "s");
  check_int_range(num_tokens, "the token count");
  check_int_range(in_size, "the input size");
  check_int_range(num_slots, "the slot count");

  const c10::cuda::CUDAGuard guard(x.device());
  const cudaError_t err = bgmv_shrink_launch(
      dtype, x.data_ptr(), lora_a.data_ptr(), token_slots.data_ptr<int32_t>(), s.data_ptr<float>(),
      static_cast<int>(num_tokens), static_cast<int>(in_size), static_cast<int>(max_rank),
      static_cast<int>(num_slots), x.stride(0), lora_a.stride(0), lora_a.stride(1), s.stride(0),
      num_sms(x.get_device()), cluster_launch(x.get_device()), c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "lora_bgmv_shrink launch failed: ", cudaGetErrorString(err));
}

// y[t] += scaling[slot] * s[t] @ lora_b[slot].T for slot = token_slots[t] >= 0, in place.
void lora_bgmv_expand(const at::Tensor& s, const at::Tensor& lora_b, const at::Tensor& token_slots,
                      const at::Tensor& scaling, at::Tensor& y) {
  TORCH_CHECK_VALUE(s.dim() == 2 && lora_b.dim() == 3 && y.dim() == 2 && scaling.dim() == 1,
                    "lora_bgmv_expand wants s [T, max_rank], lora_b [num_slots, out, max_rank], y [T, out] "
                    "and scaling [num_slots], got s ", s.sizes(), ", lora_b ", lora_b.sizes(), ", y ", y.sizes(),
                    " and scaling ", scaling.sizes());
  const int64_t num_tokens = y.size(0), out_size = y.size(1);
  const int64_t num_slots = lora_b.size(0), max_rank = lora_b.size(2);
  TORCH_CHECK_VALUE(num_slots > 0 && max_rank > 0, "lora_bgmv_expand: lora_b ", lora_b.sizes(),
                    " has no slot or no rank");
  TORCH_CHECK_VALUE(max_rank <= kMaxRank, "lora_bgmv_expand: max_rank ", max_rank, " exceeds ", kMaxRank);
  TORCH_CHECK_VALUE(lora_b.size(1) == out_size, "lora_bgmv_expand: y ", y.sizes(),
                    " does not match lora_b's output size ", lora_b.size(1));
  TORCH_CHECK_VALUE(s.size(0) == num_tokens && s.size(1) == max_rank, "lora_bgmv_expand: s must be [",
                    num_tokens, ", ", max_rank, "], got ", s.sizes());
  TORCH_CHECK_VALUE(scaling.size(0) == num_slots, "lora_bgmv_expand: scaling has ", scaling.size(0),
                    " entries for ", num_slots, " slots");
  TORCH_CHECK_VALUE(lora_b.scalar_type() == y.scalar_type(), "lora_bgmv_expand: y and lora_b must share a dtype, got ",
                    y.scalar_type(), " and ", lora_b.scalar_type());
  TORCH_CHECK_VALUE(s.scalar_type() == at::kFloat, "lora_bgmv_expand: s must be float32, got ", s.scalar_type());
  TORCH_CHECK_VALUE(scaling.scalar_type() == at::kFloat, "lora_bgmv_expand: scaling must be float32, got ",
                    scaling.scalar_type());
  const int dtype = dtype_code(y, "y");
  check_cuda(y, y, "y");
  check_cuda(s, y, "s");
  check_cuda(lora_b, y, "lora_b");
  check_cuda(scaling, y, "scaling");
  check_token_slots(token_slots, num_tokens, y);
  check_inner_contiguous(s, "s");
  check_inner_contiguous(lora_b, "lora_b");
  check_inner_contiguous(y, "y");
  check_inner_contiguous(scaling, "scaling");
  check_int_range(num_tokens, "the token count");
  check_int_range(out_size, "the output size");
  check_int_range(num_slots, "the slot count");

  const c10::cuda::CUDAGuard guard(y.device());
  const cudaError_t err = bgmv_expand_launch(
      dtype, s.data_ptr<float>(), lora_b.data_ptr(), token_slots.data_ptr<int32_t>(), scaling.data_ptr<float>(),
      y.data_ptr(), static_cast<int>(num_tokens), static_cast<int>(out_size), static_cast<int>(max_rank),
      static_cast<int>(num_slots), s.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
      num_sms(y.get_device()), c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "lora_bgmv_expand launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace flexserve

TORCH_LIBRARY(flexserve, m) {
  m.def("lora_bgmv_shrink(Tensor x, Tensor lora_a, Tensor token_slots, Tensor(a!) s) -> ()");
  m.def("lora_bgmv_expand(Tensor s, Tensor lora_b, Tensor token_slots, Tensor scaling, Tensor(a!) y) -> ()");
}

TORCH_LIBRARY_IMPL(flexserve, CUDA, m) {
  m.impl("lora_bgmv_shrink", &flexserve::lora_bgmv_shrink);
  m.impl("lora_bgmv_expand", &flexserve::lora_bgmv_expand);
}
