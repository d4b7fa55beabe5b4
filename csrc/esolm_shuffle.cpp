// megatron_dllm._esolm_shuffle: the Eso-LM diffusion shuffle on CPU, bit-identical to the torch
// reference in megatron_dllm/families/shuffle.py:
//
//   sort_idx = argsort(is_mask + 0.9 * u, stable=True)   (key computed in u's dtype)
//
// * shuffle: per row, a stable counting partition of the positions into clean / masked (the key
//   ranges [0, 0.9) and [1, 1.9) never overlap, so the partition is the first sort key), then each
//   group is sorted by (key, index) -- the index breaks ties exactly as a stable argsort does --
//   and the caller's int64 tensors (z_t, x0, position ids) are gathered with the permutation in
//   the same pass. O(L log L) per row at worst.
// * unpermute: the inverse scatter out[b, sort_idx[b, i]] = x[b, i] over rows of any element size
//   (raw bytes, so logits of any dtype go through unchanged).
//
// The key is computed exactly as torch does it (k = T(m) + T(0.9) * u, two roundings, no FMA:
// setup.py compiles with -ffp-contract=off), so ties that appear only after rounding (1 + 0.9u
// drops low bits of u) are ties here too. Rows run in parallel on std::threads; the GIL is
// released. Buffers come from torch via .numpy() (zero copy); torch is not needed to build.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace {

int resolve_threads(int requested, int64_t rows, int64_t work) {
  if (requested > 0) return static_cast<int>(std::min<int64_t>(requested, std::max<int64_t>(rows, 1)));
  int hw = static_cast<int>(std::thread::hardware_concurrency());
  if (hw <= 0) hw = 1;
  const int64_t by_work = std::max<int64_t>(1, work / (1 << 15));  // >= 32k tokens per thread
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>({(int64_t)hw, by_work, rows})));
}

template <typename F>
void parallel_rows(int64_t rows, int num_threads, F &&fn) {
  if (num_threads <= 1) {
    for (int64_t r = 0; r < rows; ++r) fn(r);
    return;
  }
  auto worker = [&](int t) {
    for (int64_t r = t; r < rows; r += num_threads) fn(r);
  };
  std::vector<std::thread> pool;
  pool.reserve(num_threads - 1);
  for (int t = 1; t < num_threads; ++t) pool.emplace_back(worker, t);
  worker(0);
  for (auto &th : pool) th.join();
}

template <typename T>
struct Entry {
  T key;
  int64_t index;
  bool operator<(const Entry &o) const { return key < o.key || (key == o.key && index < o.index); }
};

template <typename T>
void shuffle_impl(const uint8_t *mask, const T *u, int64_t B, int64_t L,
                  const std::vector<const int64_t *> &srcs, int64_t *sort_idx,
                  const std::vector<int64_t *> &outs, int threads) {
  const T scale = static_cast<T>(0.9);
  parallel_rows(B, resolve_threads(threads, B, B * L), [&](int64_t r) {
    const uint8_t *m = mask + r * L;
    const T *ur = u + r * L;
    std::vector<Entry<T>> entries(static_cast<size_t>(L));
    int64_t num_clean = 0;
    for (int64_t i = 0; i < L; ++i) num_clean += m[i] == 0;
    // Counting partition: clean positions fill [0, num_clean), masked [num_clean, L), each in
    // index order (stable).
    int64_t c = 0, k = num_clean;
    for (int64_t i = 0; i < L; ++i) {
      const T key = static_cast<T>(m[i] != 0) + scale * ur[i];  // mul, then add (no FMA)
      entries[m[i] ? k++ : c++] = Entry<T>{key, i};
    }
    std::sort(entries.begin(), entries.begin() + num_clean);
    std::sort(entries.begin() + num_clean, entries.end());
    int64_t *idx = sort_idx + r * L;
    for (int64_t i = 0; i < L; ++i) idx[i] = entries[i].index;
    for (size_t s = 0; s < srcs.size(); ++s) {
      const int64_t *src = srcs[s] + r * L;
      int64_t *dst = outs[s] + r * L;
      for (int64_t i = 0; i < L; ++i) dst[i] = src[idx[i]];
    }
  });
}

using I64 = py::array_t<int64_t, py::array::c_style>;
using U8 = py::array_t<uint8_t, py::array::c_style>;

void check_2d(const py::array &a, int64_t B, int64_t L, const char *what) {
  if (a.ndim() != 2 || a.shape(0) != B || a.shape(1) != L)
    throw std::invalid_argument(std::string("esolm_shuffle: ") + what + " must be [B, L] like the mask");
}

void shuffle(U8 mask, py::array u, std::vector<I64> srcs, I64 sort_idx, std::vector<I64> outs,
             int threads) {
  if (mask.ndim() != 2) throw std::invalid_argument("esolm_shuffle: mask must be [B, L]");
  const int64_t B = mask.shape(0), L = mask.shape(1);
  check_2d(u, B, L, "keys");
  check_2d(sort_idx, B, L, "sort_idx");
  if (srcs.size() != outs.size()) throw std::invalid_argument("esolm_shuffle: one output per source");
  std::vector<const int64_t *> src_ptrs;
  std::vector<int64_t *> out_ptrs;
  for (size_t s = 0; s < srcs.size(); ++s) {
    check_2d(srcs[s], B, L, "source");
    check_2d(outs[s], B, L, "output");
    src_ptrs.push_back(srcs[s].data());
    out_ptrs.push_back(outs[s].mutable_data());
  }
  const uint8_t *m = mask.data();
  int64_t *idx = sort_idx.mutable_data();
  if (!(u.flags() & py::array::c_style)) throw std::invalid_argument("esolm_shuffle: keys must be contiguous");
  if (py::isinstance<py::array_t<double>>(u)) {
    const double *up = static_cast<const double *>(u.data());
    py::gil_scoped_release nogil;
    shuffle_impl<double>(m, up, B, L, src_ptrs, idx, out_ptrs, threads);
  } else if (py::isinstance<py::array_t<float>>(u)) {
    const float *up = static_cast<const float *>(u.data());
    py::gil_scoped_release nogil;
    shuffle_impl<float>(m, up, B, L, src_ptrs, idx, out_ptrs, threads);
  } else {
    throw std::invalid_argument("esolm_shuffle: keys must be float32 or float64");
  }
}

void unpermute(U8 x, I64 sort_idx, U8 out, int64_t elem_bytes, int threads) {
  if (sort_idx.ndim() != 2) throw std::invalid_argument("esolm_unpermute: sort_idx must be [B, L]");
  const int64_t B = sort_idx.shape(0), L = sort_idx.shape(1);
  if (x.size() != B * L * elem_bytes || out.size() != x.size())
    throw std::invalid_argument("esolm_unpermute: x and out must hold B * L elements of elem_bytes");
  const uint8_t *src = x.data();
  uint8_t *dst = out.mutable_data();
  const int64_t *idx = sort_idx.data();
  for (int64_t i = 0; i < B * L; ++i)
    if (idx[i] < 0 || idx[i] >= L) throw std::out_of_range("esolm_unpermute: sort_idx out of range");
  py::gil_scoped_release nogil;
  parallel_rows(B, resolve_threads(threads, B, B * L * std::max<int64_t>(1, elem_bytes / 8)), [&](int64_t r) {
    const int64_t *ir = idx + r * L;
    const uint8_t *s = src + r * L * elem_bytes;
    uint8_t *d = dst + r * L * elem_bytes;
    for (int64_t i = 0; i < L; ++i) {
      const int64_t j = ir[i];
      std::memcpy(d + j * elem_bytes, s + i * elem_bytes, static_cast<size_t>(elem_bytes));
    }
  });
}

}  // namespace

PYBIND11_MODULE(_esolm_shuffle, m) {
  m.doc() = "Eso-LM diffusion shuffle (clean-first argsort + gathers) and its inverse, on CPU";
  m.def("shuffle", &shuffle, py::arg("mask"), py::arg("keys"), py::arg("sources"), py::arg("sort_idx"),
        py::arg("outputs"), py::arg("threads") = 0,
        "sort_idx[b] = argsort(mask[b] + 0.9 * keys[b], stable) and outputs[s][b] = sources[s][b][sort_idx[b]]");
  m.def("unpermute", &unpermute, py::arg("x"), py::arg("sort_idx"), py::arg("out"), py::arg("elem_bytes"),
        py::arg("threads") = 0, "out[b, sort_idx[b, i]] = x[b, i] over raw elements of elem_bytes");
}
