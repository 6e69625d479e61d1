// A graph's linear on the tile-order copy of its bf16 weight (packed_weights.py), found in C++.
//
// A graph passes the plain weight; the op finds the weight's packed copy by its address and calls the tile
// kernel it was packed for. Doing that lookup in a Python kernel (packed_weights' linear_prepacked) cost
// ~2.5 us a call more than calling the tile kernel itself (4.4 vs 1.9 us on a tiny shape; 2 cores, AMD EPYC
// Zen 5, 2026-12-04): 121 calls, ~0.3 ms, of every decode_b16 and prefill step of the bundled model.
// A weight without a registered copy, of another shape, or rows beyond what its kernel serves takes at::linear.
#include "op_table.h"
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/linear.h>

#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using TileKernel = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t);

struct TileCopy {
  std::vector<int64_t> shape;  // the plain weight's [N, K]
  at::Tensor tiles;
  c10::TypedOperatorHandle<TileKernel> kernel;
  int64_t rows;  // the most input rows the kernel serves
};

std::unordered_map<const void*, TileCopy>& copies() {
  static std::unordered_map<const void*, TileCopy> m;
  return m;
}

std::shared_mutex& copies_lock() {
  static std::shared_mutex mu;
  return mu;
}

}  // namespace

void vn_ops::register_tile_copy(const at::Tensor& w, const at::Tensor& tiles, const std::string& kernel, int64_t rows) {
  TORCH_CHECK(w.dim() == 2, "register_tile_copy: the weight must be 2-D");
  auto handle =
      c10::Dispatcher::singleton().findSchemaOrThrow(("vllm_neuron::" + kernel).c_str(), "").typed<TileKernel>();
  std::unique_lock<std::shared_mutex> g(copies_lock());
  copies().insert_or_assign(w.data_ptr(), TileCopy{w.sizes().vec(), tiles, handle, rows});
}

void vn_ops::forget_tile_copy(int64_t address) {
  std::unique_lock<std::shared_mutex> g(copies_lock());
  copies().erase(reinterpret_cast<const void*>(address));
}

at::Tensor vn_ops::linear_tiles(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  std::shared_lock<std::shared_mutex> g(copies_lock());
  const auto it = copies().find(w.data_ptr());
  if (it != copies().end() && it->second.shape == w.sizes() && x.dim() == 2 && x.size(0) <= it->second.rows &&
      (!bias.has_value() || bias->scalar_type() == at::kBFloat16)) {
    const at::Tensor tiles = it->second.tiles;
    const auto kernel = it->second.kernel;
    const int64_t n = it->second.shape[0];
    g.unlock();
    return kernel.call(x, tiles, bias, n);
  }
  g.unlock();
  return at::linear(x, w, bias);
}
