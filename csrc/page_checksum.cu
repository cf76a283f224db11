// The device checksum of chunk pages (lmcache_p2p.device_checksum, version 1), one launch for
// a batch of pages.
//
// A page is read as 32-bit words x_i and summed as sum_i (x_i * w_i mod 2^32, signed) with odd
// weights w_i drawn from the word index by a fixed integer mix: the same number the torch code
// in device_checksum.py computes, which stays the definition (and the path on CPUs). The torch
// version walks a page in slices, a handful of launches and a weight table read each; this one
// computes the weights in registers and reads each page once, so a 10,000-token document
// (1.3 GB) is checked in about the time HBM takes to read it.
//
// Sums are kept in 64-bit unsigned arithmetic: it wraps mod 2^64 (defined, where signed overflow
// is not), and the caller keeps the result mod 2^64 as well, so the order of the additions
// (threads, CTAs, atomics) cannot change the number.

#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

namespace lmcache_p2p {
namespace {

constexpr int kThreads = 256;

// Word `index`'s term: the weight from the integer mix (device_checksum._mixed_odd_weights),
// times the word mod 2^32, as a signed 32-bit value widened to 64 bits.
__device__ __forceinline__ uint64_t term(uint32_t word, uint64_t index) {
  uint64_t h = index * 2654435761ull;  // index < 2^31: under 2^63, as exact as the torch code's int64
  h ^= h >> 15;
  h = (h * 2246822519ull) & 0xFFFFFFFFull;  // only the low 32 bits matter: wrapping is fine
  const uint32_t weight = static_cast<uint32_t>(h) | 1u;
  const int32_t product = static_cast<int32_t>(word * weight);
  return static_cast<uint64_t>(static_cast<int64_t>(product));
}

// Grid: ctas_per_page CTAs for each page, each walking its share of the page grid-stride.
// kVec: 4 for 16-byte loads (page address and size multiples of 16), 1 for single words.
template <int kVec>
__global__ void checksum_pages(const uint64_t* page_ptrs, int64_t words, int64_t ctas_per_page,
                               unsigned long long* out) {
  const int64_t page = blockIdx.x / ctas_per_page;
  const int64_t part = blockIdx.x % ctas_per_page;
  const uint32_t* base = reinterpret_cast<const uint32_t*>(page_ptrs[page]);
  const int64_t loads = words / kVec;
  uint64_t sum = 0;
  for (int64_t i = part * kThreads + threadIdx.x; i < loads; i += ctas_per_page * kThreads) {
    const uint64_t first = static_cast<uint64_t>(i) * kVec;
    if constexpr (kVec == 4) {
      const uint4 v = reinterpret_cast<const uint4*>(base)[i];
      sum += term(v.x, first) + term(v.y, first + 1) + term(v.z, first + 2) + term(v.w, first + 3);
    } else {
      sum += term(base[i], first);
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  __shared__ uint64_t warp_sums[kThreads / 32];
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = sum;
  __syncthreads();
  if (warp != 0) return;
  sum = lane < kThreads / 32 ? warp_sums[lane] : 0;
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
  if (lane == 0) atomicAdd(out + page, static_cast<unsigned long long>(sum));
}

}  // namespace

// page_ptrs: int64 [num_pages] page addresses on the device; out: int64 [num_pages] on the same
// device, overwritten with the checksums (as int64 bit patterns). Runs on the current stream.
void page_checksums(torch::Tensor page_ptrs, int64_t page_bytes, int64_t vec_bytes, int64_t ctas_per_page,
                    torch::Tensor out) {
  const torch::Device device = page_ptrs.device();
  TORCH_CHECK(device.is_cuda(), "page_ptrs must be on a CUDA device, got ", device);
  TORCH_CHECK(page_ptrs.scalar_type() == torch::kInt64 && page_ptrs.is_contiguous(),
              "page_ptrs must be contiguous int64");
  TORCH_CHECK(out.device() == device && out.scalar_type() == torch::kInt64 && out.is_contiguous() &&
                  out.numel() == page_ptrs.numel(),
              "out must be contiguous int64 with one element per page on ", device);
  TORCH_CHECK(vec_bytes == 16 || vec_bytes == 4, "vec_bytes must be 16 or 4, got ", vec_bytes);
  TORCH_CHECK(page_bytes > 0 && page_bytes % vec_bytes == 0, "page_bytes ", page_bytes,
              " is not a positive multiple of ", vec_bytes);
  // Word indices under 2^31 keep the torch code's int64 products exact, so both mix alike.
  TORCH_CHECK(page_bytes / 4 < (int64_t{1} << 31), "page of ", page_bytes, " bytes: over 2^31 words");
  TORCH_CHECK(ctas_per_page > 0, "ctas_per_page must be positive, got ", ctas_per_page);
  const int64_t pages = page_ptrs.numel();
  TORCH_CHECK(pages * ctas_per_page < (int64_t{1} << 31), "too many CTAs: ", pages, " x ", ctas_per_page);
  const c10::cuda::CUDAGuard guard(device);
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index());
  out.zero_();
  if (pages == 0) return;
  const auto* ptrs = reinterpret_cast<const uint64_t*>(page_ptrs.data_ptr<int64_t>());
  auto* sums = reinterpret_cast<unsigned long long*>(out.data_ptr<int64_t>());
  const dim3 grid(static_cast<unsigned>(pages * ctas_per_page));
  if (vec_bytes == 16) {
    checksum_pages<4><<<grid, kThreads, 0, stream>>>(ptrs, page_bytes / 4, ctas_per_page, sums);
  } else {
    checksum_pages<1><<<grid, kThreads, 0, stream>>>(ptrs, page_bytes / 4, ctas_per_page, sums);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace lmcache_p2p
