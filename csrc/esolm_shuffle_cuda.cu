// megatron_dllm._esolm_shuffle_cuda: the Eso-LM diffusion shuffle on CUDA tensors, the same
// permutation as the torch reference (megatron_dllm/families/shuffle.py), bit for bit:
//
//   sort_idx = argsort(is_mask + 0.9 * u, stable=True)   (key computed in u's dtype)
//
// * shuffle_kernel: one block per row (L <= 4096). The row's (key, index) pairs are loaded into
//   shared memory, padded to the next power of two with (3, i >= L), and bitonic-sorted by the
//   lexicographic order (key, index). Every index is distinct, so the order is total and equals the
//   stable argsort's (ties of the rounded key broken by the lower index). The key is formed with
//   explicitly rounded intrinsics (__dmul_rn/__dadd_rn, __fmul_rn/__fadd_rn): no FMA contraction,
//   exactly the two roundings of torch's `mask.to(dtype) + 0.9 * u`. The block then writes
//   sort_idx and gathers up to kMaxSources int64 tensors (z_t, x0, positions) from global memory.
// * unpermute_kernel: out[b, sort_idx[b, i]] = x[b, i] for rows of elem_bytes bytes, copied in
//   the widest word (16/8/4/2/1 bytes) that divides the element size.
//
// Built by setup.py only where nvcc and a CUDA build of torch exist; the Python wrapper dispatches
// here for CUDA tensors, and otherwise to the C++ CPU extension or the torch reference.

#include <torch/extension.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int kMaxLen = 4096;
constexpr int kMaxSources = 8;
constexpr int kThreads = 512;

struct Sources {
  const int64_t *src[kMaxSources];
  int64_t *dst[kMaxSources];
  int count;
};

template <typename T>
__device__ __forceinline__ T make_key(uint8_t m, T u);

template <>
__device__ __forceinline__ double make_key<double>(uint8_t m, double u) {
  return __dadd_rn(m ? 1.0 : 0.0, __dmul_rn(0.9, u));
}

template <>
__device__ __forceinline__ float make_key<float>(uint8_t m, float u) {
  return __fadd_rn(m ? 1.0f : 0.0f, __fmul_rn(0.9f, u));
}

template <typename T>
__device__ __forceinline__ bool less(T ka, int ia, T kb, int ib) {
  return ka < kb || (ka == kb && ia < ib);
}

template <typename T>
__global__ void shuffle_kernel(const uint8_t *__restrict__ mask, const T *__restrict__ u, int64_t L,
                               int n /* power of two >= L */, int64_t *__restrict__ sort_idx,
                               Sources sources) {
  extern __shared__ unsigned char smem[];
  T *keys = reinterpret_cast<T *>(smem);
  int *idx = reinterpret_cast<int *>(keys + n);
  const int64_t row = blockIdx.x;
  const uint8_t *m = mask + row * L;
  const T *ur = u + row * L;

  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    if (i < L) {
      keys[i] = make_key<T>(m[i], ur[i]);
      idx[i] = i;
    } else {
      keys[i] = static_cast<T>(3);  // above every real key (< 1.9)
      idx[i] = i;  // >= L: after every real entry
    }
  }
  __syncthreads();

  // Bitonic sort, ascending in (key, index).
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int j = i ^ stride;
        if (j > i) {
          const bool ascending = (i & size) == 0;
          const T ki = keys[i], kj = keys[j];
          const int ii = idx[i], ij = idx[j];
          const bool swap = ascending ? less(kj, ij, ki, ii) : less(ki, ii, kj, ij);
          if (swap) {
            keys[i] = kj, keys[j] = ki;
            idx[i] = ij, idx[j] = ii;
          }
        }
      }
      __syncthreads();
    }
  }

  int64_t *out_idx = sort_idx + row * L;
  for (int i = threadIdx.x; i < L; i += blockDim.x) out_idx[i] = idx[i];
  for (int s = 0; s < sources.count; ++s) {
    const int64_t *src = sources.src[s] + row * L;
    int64_t *dst = sources.dst[s] + row * L;
    for (int i = threadIdx.x; i < L; i += blockDim.x) dst[i] = src[idx[i]];
  }
}

template <typename W>
__global__ void unpermute_kernel(const W *__restrict__ x, const int64_t *__restrict__ sort_idx,
                                 W *__restrict__ out, int64_t L, int64_t words) {
  const int64_t row = blockIdx.y;
  for (int64_t i = blockIdx.x; i < L; i += gridDim.x) {
    const int64_t j = sort_idx[row * L + i];
    const W *s = x + (row * L + i) * words;
    W *d = out + (row * L + j) * words;
    for (int64_t w = threadIdx.x; w < words; w += blockDim.x) d[w] = s[w];
  }
}

int next_pow2(int64_t L) {
  int n = 1;
  while (n < L) n <<= 1;
  return n;
}

std::vector<torch::Tensor> shuffle(torch::Tensor mask, torch::Tensor u, std::vector<torch::Tensor> sources) {
  TORCH_CHECK(mask.is_cuda() && u.is_cuda(), "esolm_shuffle_cuda: CUDA tensors expected");
  TORCH_CHECK(mask.dim() == 2 && u.sizes() == mask.sizes(), "esolm_shuffle_cuda: mask and keys must be [B, L]");
  TORCH_CHECK(mask.scalar_type() == torch::kUInt8, "esolm_shuffle_cuda: mask must be uint8");
  TORCH_CHECK(u.scalar_type() == torch::kFloat64 || u.scalar_type() == torch::kFloat32,
              "esolm_shuffle_cuda: keys must be float32 or float64");
  TORCH_CHECK((int)sources.size() <= kMaxSources, "esolm_shuffle_cuda: at most 8 gathered tensors");
  const int64_t B = mask.size(0), L = mask.size(1);
  TORCH_CHECK(L <= kMaxLen, "esolm_shuffle_cuda: L <= 4096");
  const c10::cuda::CUDAGuard guard(mask.device());
  mask = mask.contiguous();
  u = u.contiguous();
  auto sort_idx = torch::empty({B, L}, mask.options().dtype(torch::kInt64));
  std::vector<torch::Tensor> result{sort_idx};
  Sources srcs{};
  srcs.count = static_cast<int>(sources.size());
  for (size_t s = 0; s < sources.size(); ++s) {
    auto src = sources[s].contiguous();
    TORCH_CHECK(src.scalar_type() == torch::kInt64 && src.sizes() == mask.sizes() && src.is_cuda(),
                "esolm_shuffle_cuda: gathered tensors must be int64 [B, L] on the GPU");
    sources[s] = src;
    auto dst = torch::empty_like(src);
    srcs.src[s] = src.data_ptr<int64_t>();
    srcs.dst[s] = dst.data_ptr<int64_t>();
    result.push_back(dst);
  }
  if (B == 0 || L == 0) return result;
  const int n = next_pow2(L);
  const int threads = std::min(kThreads, std::max(32, n / 2));
  auto stream = c10::cuda::getCurrentCUDAStream();
  if (u.scalar_type() == torch::kFloat64) {
    const size_t shm = n * (sizeof(double) + sizeof(int));
    shuffle_kernel<double><<<B, threads, shm, stream>>>(mask.data_ptr<uint8_t>(), u.data_ptr<double>(), L, n,
                                                        sort_idx.data_ptr<int64_t>(), srcs);
  } else {
    const size_t shm = n * (sizeof(float) + sizeof(int));
    shuffle_kernel<float><<<B, threads, shm, stream>>>(mask.data_ptr<uint8_t>(), u.data_ptr<float>(), L, n,
                                                       sort_idx.data_ptr<int64_t>(), srcs);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return result;
}

torch::Tensor unpermute(torch::Tensor x, torch::Tensor sort_idx) {
  TORCH_CHECK(x.is_cuda() && sort_idx.is_cuda(), "esolm_unpermute_cuda: CUDA tensors expected");
  TORCH_CHECK(sort_idx.dim() == 2 && x.dim() >= 2 && x.size(0) == sort_idx.size(0) && x.size(1) == sort_idx.size(1),
              "esolm_unpermute_cuda: x must be [B, L, ...] like sort_idx [B, L]");
  const c10::cuda::CUDAGuard guard(x.device());
  x = x.contiguous();
  sort_idx = sort_idx.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(x);
  const int64_t B = sort_idx.size(0), L = sort_idx.size(1);
  if (x.numel() == 0) return out;
  const int64_t elem_bytes = x.numel() / (B * L) * x.element_size();
  auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(L, 65535)), static_cast<unsigned>(B));
  auto launch = [&](auto word) {
    using W = decltype(word);
    const int64_t words = elem_bytes / sizeof(W);
    const int threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, words)));
    unpermute_kernel<W><<<grid, threads, 0, stream>>>(
        reinterpret_cast<const W *>(x.data_ptr()), sort_idx.data_ptr<int64_t>(),
        reinterpret_cast<W *>(out.data_ptr()), L, words);
  };
  if (elem_bytes % 16 == 0) launch(int4{});
  else if (elem_bytes % 8 == 0) launch(int64_t{});
  else if (elem_bytes % 4 == 0) launch(int32_t{});
  else if (elem_bytes % 2 == 0) launch(int16_t{});
  else launch(uint8_t{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Eso-LM diffusion shuffle (clean-first argsort + gathers) and its inverse, on CUDA";
  m.def("shuffle", &shuffle, "(sort_idx, *gathered) for CUDA mask [B, L] uint8, keys [B, L], int64 sources");
  m.def("unpermute", &unpermute, "out[b, sort_idx[b, i]] = x[b, i]");
}
