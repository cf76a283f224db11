// Moving KV chunks between vLLM's paged cache and contiguous chunk pages, one launch per batch.
//
// The cache is one tensor per layer, blocks contiguous along dim 0 (vLLM's GPU flash layout
// [num_blocks, 2, block_size, kv_heads, head_size]); a block is an opaque run of `block_bytes`.
// A chunk page holds, for every layer in order, the chunk's blocks in order:
//     page = layer_0[b_0] | layer_0[b_1] | ... | layer_1[b_0] | ...
// Pages may live in GPU memory or in pinned host memory: with unified addressing a pinned host
// pointer is valid on the device, so the same kernel gathers GPU -> host over PCIe with no
// staging buffer and no second copy.
//
// One CUDA block copies one (chunk, layer, block) unit (or, capped at max_ctas, walks several) with
// 16-byte loads and stores when every
// address and the block size allow it (the caller checks alignment and picks the width).
// Validation (dtypes, devices, shapes, block ids in range) happens in Python before the launch,
// where it can name the bad argument; the checks here guard the raw-pointer contract.

#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

namespace {

struct Plan {
  const uint64_t* layer_ptrs;  // [num_layers] base address of each layer's cache
  const uint64_t* page_ptrs;   // [num_chunks] base address of each chunk's page
  const int64_t* block_ids;    // [num_chunks * blocks_per_chunk] cache block of each chunk block
  const int64_t* first_block;  // [num_chunks] blocks before this one are skipped (scatter only)
  int64_t num_layers;
  int64_t blocks_per_chunk;
  int64_t block_bytes;
};

template <typename Vec, bool kToPages>
__device__ void copy_unit(const Plan& plan, int64_t unit) {
  const int64_t per_chunk = plan.num_layers * plan.blocks_per_chunk;
  const int64_t chunk = unit / per_chunk;
  const int64_t layer = (unit % per_chunk) / plan.blocks_per_chunk;
  const int64_t block = unit % plan.blocks_per_chunk;
  if (!kToPages && block < plan.first_block[chunk]) return;  // the engine computed it already

  const int64_t cache_block = plan.block_ids[chunk * plan.blocks_per_chunk + block];
  char* cache = reinterpret_cast<char*>(plan.layer_ptrs[layer]) + cache_block * plan.block_bytes;
  char* page = reinterpret_cast<char*>(plan.page_ptrs[chunk]) +
               (layer * plan.blocks_per_chunk + block) * plan.block_bytes;
  const Vec* src = reinterpret_cast<const Vec*>(kToPages ? cache : page);
  Vec* dst = reinterpret_cast<Vec*>(kToPages ? page : cache);
  const int64_t n = plan.block_bytes / static_cast<int64_t>(sizeof(Vec));
  // Four loads in flight per thread before the stores: reads over PCIe (pages in host memory)
  // are latency-bound, and more outstanding requests is what fills the link.
  int64_t i = threadIdx.x;
  const int64_t stride = blockDim.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    Vec a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a;
    dst[i + stride] = b;
    dst[i + 2 * stride] = c;
    dst[i + 3 * stride] = d;
  }
  for (; i < n; i += stride) dst[i] = src[i];
}

// One (chunk, layer, block) unit per CTA; with fewer CTAs than units each CTA walks the units
// grid-stride. A copy beside a forward pass runs on a few CTAs: one CTA per unit would take
// every SM, and a gather into host memory keeps them waiting on PCIe while the GEMMs queue.
template <typename Vec, bool kToPages>
__global__ void copy_blocks(Plan plan, int64_t units) {
  for (int64_t unit = blockIdx.x; unit < units; unit += gridDim.x) copy_unit<Vec, kToPages>(plan, unit);
}

template <bool kToPages>
void launch(const Plan& plan, int64_t num_chunks, int64_t vec_bytes, int64_t max_ctas, cudaStream_t stream) {
  const int64_t units = num_chunks * plan.num_layers * plan.blocks_per_chunk;
  if (units == 0) return;
  TORCH_CHECK(units < (int64_t{1} << 31), "too many (chunk, layer, block) units in one launch: ", units);
  const int64_t vecs = plan.block_bytes / vec_bytes;
  const int threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, (vecs + 31) / 32 * 32)));
  const dim3 grid(static_cast<unsigned>(max_ctas > 0 ? std::min(units, max_ctas) : units));
  switch (vec_bytes) {
    case 16: copy_blocks<uint4, kToPages><<<grid, threads, 0, stream>>>(plan, units); break;
    case 8: copy_blocks<uint2, kToPages><<<grid, threads, 0, stream>>>(plan, units); break;
    case 4: copy_blocks<uint32_t, kToPages><<<grid, threads, 0, stream>>>(plan, units); break;
    case 2: copy_blocks<uint16_t, kToPages><<<grid, threads, 0, stream>>>(plan, units); break;
    case 1: copy_blocks<uint8_t, kToPages><<<grid, threads, 0, stream>>>(plan, units); break;
    default: TORCH_CHECK(false, "vector width must be 1, 2, 4, 8 or 16 bytes, got ", vec_bytes);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void check_table(const torch::Tensor& t, const char* name, torch::ScalarType dtype, int64_t numel,
                 const torch::Device& device) {
  TORCH_CHECK(t.device() == device, name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous() && t.numel() == numel, name, " must be contiguous with ", numel,
              " elements, got ", t.numel());
}

// meta: int64 on the cache's device, [num_chunks * blocks_per_chunk block ids | num_chunks
// page addresses | num_chunks first blocks]; layer_ptrs: int64 [num_layers] on the same device.
void run(torch::Tensor layer_ptrs, torch::Tensor meta, int64_t num_chunks, int64_t blocks_per_chunk,
         int64_t block_bytes, int64_t vec_bytes, bool to_pages, int64_t max_ctas) {
  const torch::Device device = layer_ptrs.device();
  TORCH_CHECK(device.is_cuda(), "layer_ptrs must be on a CUDA device, got ", device);
  TORCH_CHECK(num_chunks >= 0 && blocks_per_chunk > 0 && block_bytes > 0, "bad sizes: ", num_chunks, " chunks, ",
              blocks_per_chunk, " blocks per chunk, ", block_bytes, " bytes per block");
  TORCH_CHECK(max_ctas >= 0, "max_ctas must be 0 (one CTA per block) or positive, got ", max_ctas);
  TORCH_CHECK(block_bytes % vec_bytes == 0, "block_bytes ", block_bytes, " is not a multiple of ", vec_bytes);
  check_table(layer_ptrs, "layer_ptrs", torch::kInt64, layer_ptrs.numel(), device);
  check_table(meta, "meta", torch::kInt64, num_chunks * (blocks_per_chunk + 2), device);
  const c10::cuda::CUDAGuard guard(device);
  const int64_t* m = meta.data_ptr<int64_t>();
  Plan plan{reinterpret_cast<const uint64_t*>(layer_ptrs.data_ptr<int64_t>()),
            reinterpret_cast<const uint64_t*>(m + num_chunks * blocks_per_chunk), m,
            m + num_chunks * (blocks_per_chunk + 1), layer_ptrs.numel(), blocks_per_chunk, block_bytes};
  cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index());
  if (to_pages) {
    launch<true>(plan, num_chunks, vec_bytes, max_ctas, stream);
  } else {
    launch<false>(plan, num_chunks, vec_bytes, max_ctas, stream);
  }
}

}  // namespace

namespace lmcache_p2p {
// page_checksum.cu: the device checksum of a batch of pages (lmcache_p2p.device_checksum).
void page_checksums(torch::Tensor page_ptrs, int64_t page_bytes, int64_t vec_bytes, int64_t ctas_per_page,
                    torch::Tensor out);
}  // namespace lmcache_p2p

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lmcache-p2p: gather/scatter KV chunks between a paged cache and chunk pages";
  m.def("copy_blocks", &run, "Gather (to_pages=True) or scatter a batch of chunks across all layers in one launch",
        py::arg("layer_ptrs"), py::arg("meta"), py::arg("num_chunks"), py::arg("blocks_per_chunk"),
        py::arg("block_bytes"), py::arg("vec_bytes"), py::arg("to_pages"), py::arg("max_ctas") = 0);
  m.def("page_checksums", &lmcache_p2p::page_checksums,
        "Device checksums (version 1) of a batch of equal-sized pages, written into out",
        py::arg("page_ptrs"), py::arg("page_bytes"), py::arg("vec_bytes"), py::arg("ctas_per_page"), py::arg("out"));
}
