// megatron_dllm._index_builders: dataset index builders, output-identical to megatron-core's
// helpers_cpp (megatron/core/datasets/helpers.cpp, megatron-core 0.16.1), so that the caches
// either one writes are interchangeable.
//
//  * build_sample_idx_int32/int64: the GPTDataset sample index, [num_samples + 1, 2] rows of
//    (position in the document index, token offset in that document). Megatron walks the
//    document stream sample by sample in one thread. Here the same answer is computed in
//    closed form: row k (k >= 1) starts at global token k * seq_length of the epoch-concatenated
//    document stream, and is stored against the document j whose token range (C_j, C_{j+1}]
//    contains the sample end k * seq_length + add_extra (C = prefix sums of the document
//    lengths in document-index order), with offset k * seq_length - C_j. Past the end of the
//    stream (only with drop_last_partial_sequence = false) the row is (D - 1, L_{D-1} - extra),
//    as in megatron. The document stream is cut into contiguous chunks, one per thread: pass 1
//    gathers the lengths and sums each chunk, an exclusive scan over the chunk sums gives each
//    chunk's C, and pass 2 lets each thread emit the rows whose sample end falls in its chunk.
//    Both passes run per block of 2^24 documents, bounding the lengths buffer at 64 MiB.
//  * build_blending_indices: megatron's greedy max-error blend, bit-identical. The rule is a
//    deterministic function of (step, per-dataset counts), so the sample range is cut into
//    chunks run speculatively in parallel from an estimated state (the greedy run for a warm-up
//    stretch from the rounded ideal counts); a sequential pass then re-runs each chunk from its
//    true starting state until its state coincides with the speculative one (after which the
//    outputs are equal by determinism) or the chunk ends. The result never depends on the guess.
//  * build_exhaustive_blending_indices: a straight port (megatron's serial algorithm).
//
// Threads are std::thread (no OpenMP runtime is loaded next to torch's), the GIL is released.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <memory>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace {

// num_threads > 0 is taken as given (tests force several threads on small inputs); 0 means all
// cores, but no more threads than min_work_per_thread units of work each can keep busy.
int resolve_threads(int requested, int64_t work, int64_t min_work_per_thread) {
  if (requested > 0) return requested;
  int hw = static_cast<int>(std::thread::hardware_concurrency());
  if (hw <= 0) hw = 1;
  int64_t by_work = std::max<int64_t>(1, work / std::max<int64_t>(1, min_work_per_thread));
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(hw, by_work)));
}

template <typename F>
void parallel_for(int num_threads, F &&fn) {
  if (num_threads <= 1) {
    fn(0);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(num_threads - 1);
  for (int t = 1; t < num_threads; ++t) pool.emplace_back(fn, t);
  fn(0);
  for (auto &th : pool) th.join();
}

// ------------------------------------------------------------------------------------------
// Sample index
// ------------------------------------------------------------------------------------------

int64_t sample_count(int32_t seq_length, int32_t num_epochs, int64_t tokens_per_epoch,
                     bool drop_last_partial_sequence, int add_extra) {
  // Megatron's expression, including the float (32-bit) rounding of its ceil branch.
  if (drop_last_partial_sequence) {
    return (num_epochs * tokens_per_epoch - add_extra) / seq_length;
  }
  return static_cast<int64_t>(std::ceil(float(num_epochs * tokens_per_epoch - add_extra) / seq_length));
}

template <typename T>
py::array_t<T> build_sample_idx(const py::array_t<int32_t, py::array::c_style | py::array::forcecast> &sizes_,
                                const py::array_t<int32_t, py::array::c_style | py::array::forcecast> &document_idx_,
                                const int32_t seq_length, const int32_t num_epochs,
                                const int64_t tokens_per_epoch,
                                const bool drop_last_partial_sequence = true,
                                const int add_extra_token_to_sequence = 1,
                                const int num_threads = 0, const int64_t block_docs = int64_t(1) << 24) {
  if (sizes_.ndim() != 1 || document_idx_.ndim() != 1)
    throw std::invalid_argument("build_sample_idx: sizes and document_idx must be 1-D");
  if (seq_length <= 1 || num_epochs <= 0 || tokens_per_epoch <= 1)
    throw std::invalid_argument("build_sample_idx: needs seq_length > 1, num_epochs > 0, tokens_per_epoch > 1");
  const int64_t D = document_idx_.shape(0);
  if (D == 0) throw std::invalid_argument("build_sample_idx: empty document index");
  const int64_t num_sizes = sizes_.shape(0);
  const int32_t *sizes = sizes_.data();
  const int32_t *doc_idx = document_idx_.data();
  const int64_t extra = add_extra_token_to_sequence;
  const int64_t seq = seq_length;
  const int64_t N = sample_count(seq_length, num_epochs, tokens_per_epoch, drop_last_partial_sequence,
                                 add_extra_token_to_sequence);
  if (N < 0) throw std::invalid_argument("build_sample_idx: negative sample count");

  T *out = new T[2 * (N + 1)];
  py::capsule free_when_done(out, [](void *p) { delete[] reinterpret_cast<T *>(p); });
  bool bad_doc = false;
  {
    py::gil_scoped_release release;
    const int P0 = resolve_threads(num_threads, D + N, 1 << 18);
    // Documents are processed in blocks of block_docs, so the gathered-lengths buffer stays
    // bounded (64 MiB by default) however long the document index is.
    const int64_t block = std::max<int64_t>(1, std::min<int64_t>(D, block_docs));
    std::unique_ptr<int32_t[]> lengths(new int32_t[block]);
    std::vector<int64_t> chunk_begin(P0 + 1), chunk_base(P0 + 1, 0);
    std::vector<char> bad(P0, 0);
    out[0] = 0;
    out[1] = 0;
    int64_t C_block = 0;  // tokens before this block
    for (int64_t B0 = 0; B0 < D && !bad_doc; B0 += block) {
      const int64_t B1 = std::min<int64_t>(D, B0 + block);
      const bool last_block = B1 == D;
      // Every chunk holds at least one document.
      const int P = static_cast<int>(std::min<int64_t>(B1 - B0, P0));
      for (int t = 0; t <= P; ++t) chunk_begin[t] = B0 + (B1 - B0) * t / P;
      chunk_base[0] = C_block;
      // Pass 1: gather sizes[doc_idx[j]] (latency-bound on a shuffled index: prefetch ahead)
      // into the block buffer, and sum each chunk.
      parallel_for(P, [&](int t) {
        int64_t sum = 0;
        const int64_t end_j = chunk_begin[t + 1];
        for (int64_t j = chunk_begin[t]; j < end_j; ++j) {
          if (j + 32 < end_j) {
            const int64_t ahead = doc_idx[j + 32];
            if (ahead >= 0 && ahead < num_sizes) __builtin_prefetch(sizes + ahead);
          }
          const int64_t d = doc_idx[j];
          if (d < 0 || d >= num_sizes) { bad[t] = 1; break; }
          sum += (lengths[j - B0] = sizes[d]);
        }
        chunk_base[t + 1] = sum;
      });
      for (int t = 0; t < P; ++t) bad_doc |= bad[t];
      if (bad_doc) break;
      for (int t = 0; t < P; ++t) chunk_base[t + 1] += chunk_base[t];  // exclusive scan
      // Pass 2: each chunk [a, b) emits the rows k whose sample end k * seq + extra lies in
      // (C_a, C_b]; rows whose end lies past the stream go to the very last chunk.
      parallel_for(P, [&](int t) {
        const int64_t a = chunk_begin[t], b = chunk_begin[t + 1];
        int64_t C = chunk_base[t];  // C_j for the current j
        // first k >= 1 with k * seq + extra > C
        int64_t k = C - extra < 0 ? 1 : std::max<int64_t>(1, (C - extra) / seq + 1);
        int64_t j = a;
        int64_t L = lengths[j - B0];
        for (; k <= N; ++k) {
          const int64_t end = k * seq + extra;
          while (C + L < end) {
            C += L;
            if (++j == b) break;
            L = lengths[j - B0];
          }
          if (j == b) break;
          out[2 * k] = static_cast<T>(j);
          out[2 * k + 1] = static_cast<T>(k * seq - C);
        }
        if (last_block && t == P - 1) {
          const T last_off = static_cast<T>(sizes[doc_idx[D - 1]] - extra);
          for (; k <= N; ++k) {
            out[2 * k] = static_cast<T>(D - 1);
            out[2 * k + 1] = last_off;
          }
        }
      });
      C_block = chunk_base[P];
    }
  }
  if (bad_doc) throw std::out_of_range("build_sample_idx: document index entry out of range of sizes");
  return py::array_t<T>(std::vector<int64_t>{N + 1, 2}, {2 * int64_t(sizeof(T)), int64_t(sizeof(T))}, out,
                        free_when_done);
}

// ------------------------------------------------------------------------------------------
// Blending indices
// ------------------------------------------------------------------------------------------

// The greedy rule of helpers.cpp for one step; ties go to the lowest dataset index.
inline int64_t greedy_choice(const double *w, const int64_t *counts, int32_t n, int64_t step) {
  const double s = std::max(static_cast<double>(step), 1.0);
  int64_t best = 0;
  double best_err = w[0] * s - static_cast<double>(counts[0]);
  for (int32_t i = 1; i < n; ++i) {
    const double err = w[i] * s - static_cast<double>(counts[i]);
    if (err > best_err) {
      best_err = err;
      best = i;
    }
  }
  return best;
}

void run_greedy(const double *w, int64_t *counts, int32_t n, int64_t begin, int64_t end, int16_t *di,
                int64_t *dsi) {
  for (int64_t s = begin; s < end; ++s) {
    const int64_t c = greedy_choice(w, counts, n, s);
    di[s] = static_cast<int16_t>(c);
    dsi[s] = counts[c];
    counts[c] += 1;
  }
}

// A plausible greedy state at `step`: run the greedy for `warmup` steps from the largest-remainder
// rounding of w * (step - warmup). Only a guess; verification makes the output exact regardless.
void guess_state(const double *w, int32_t n, int64_t step, int64_t warmup, int64_t *counts) {
  const int64_t s0 = std::max<int64_t>(0, step - warmup);
  double total_w = 0;
  for (int32_t i = 0; i < n; ++i) total_w += w[i];
  std::vector<std::pair<double, int32_t>> rem(n);
  int64_t assigned = 0;
  for (int32_t i = 0; i < n; ++i) {
    const double ideal = w[i] / total_w * static_cast<double>(s0);
    counts[i] = static_cast<int64_t>(std::floor(ideal));
    assigned += counts[i];
    rem[i] = {ideal - std::floor(ideal), i};
  }
  std::sort(rem.begin(), rem.end(), [](const auto &x, const auto &y) {
    return x.first != y.first ? x.first > y.first : x.second < y.second;
  });
  for (int64_t r = 0; assigned < s0 && r < n; ++r, ++assigned) counts[rem[r].second] += 1;
  for (int64_t s = s0; s < step; ++s) counts[greedy_choice(w, counts, n, s)] += 1;
}

// Steps re-run sequentially by the last build_blending_indices call (0: every guess was right).
int64_t g_last_repair_steps = 0;

void build_blending_indices(py::array_t<int16_t> &dataset_index, py::array_t<int64_t> &dataset_sample_index,
                            const py::array_t<double, py::array::c_style | py::array::forcecast> &weights_,
                            const int32_t num_datasets, const int64_t size, const bool verbose,
                            const int num_threads = 0, const int64_t warmup = 4096) {
  if (num_datasets <= 0 || weights_.ndim() != 1 || weights_.shape(0) < num_datasets)
    throw std::invalid_argument("build_blending_indices: need num_datasets >= 1 weights");
  if (dataset_index.ndim() != 1 || dataset_sample_index.ndim() != 1 || dataset_index.shape(0) < size ||
      dataset_sample_index.shape(0) < size)
    throw std::invalid_argument("build_blending_indices: output arrays shorter than size");
  if (!(dataset_index.flags() & py::array::c_style) || !(dataset_sample_index.flags() & py::array::c_style))
    throw std::invalid_argument("build_blending_indices: output arrays must be contiguous");
  if (verbose) std::cout << "> building indices for blended datasets ..." << std::endl;
  const int32_t n = num_datasets;
  std::vector<double> w(weights_.data(), weights_.data() + n);
  int16_t *di = dataset_index.mutable_data();
  int64_t *dsi = dataset_sample_index.mutable_data();
  std::vector<int64_t> final_counts(n, 0);
  {
    py::gil_scoped_release release;
    const int P = static_cast<int>(
        std::max<int64_t>(1, std::min<int64_t>(size, resolve_threads(num_threads, size, int64_t(1) << 20))));
    std::vector<int64_t> bounds(P + 1);
    for (int t = 0; t <= P; ++t) bounds[t] = size * t / P;
    // start_state[t]: the state chunk t started from; end_state[t]: its state after its chunk.
    std::vector<std::vector<int64_t>> start_state(P, std::vector<int64_t>(n, 0)), end_state(P);
    parallel_for(P, [&](int t) {
      if (t > 0) guess_state(w.data(), n, bounds[t], warmup, start_state[t].data());
      std::vector<int64_t> counts = start_state[t];
      run_greedy(w.data(), counts.data(), n, bounds[t], bounds[t + 1], di, dsi);
      end_state[t] = std::move(counts);
    });
    // Verify and repair in order. Chunk 0 started from the true (zero) state.
    std::vector<int64_t> truth = end_state[0];
    int64_t repaired = 0;
    for (int t = 1; t < P; ++t) {
      std::vector<int64_t> &spec = start_state[t];  // speculative state, advanced alongside
      int64_t differing = 0;
      for (int32_t i = 0; i < n; ++i) differing += truth[i] != spec[i];
      int64_t s = bounds[t];
      for (; s < bounds[t + 1] && differing > 0; ++s) {
        const int64_t b = di[s];  // the speculative choice at s, from the speculative state
        const int64_t a = greedy_choice(w.data(), truth.data(), n, s);
        di[s] = static_cast<int16_t>(a);
        dsi[s] = truth[a];
        if (a != b) {
          const bool a_was = truth[a] != spec[a], b_was = truth[b] != spec[b];
          truth[a] += 1;
          spec[b] += 1;
          differing += (truth[a] != spec[a]) - a_was + (truth[b] != spec[b]) - b_was;
        } else {
          truth[a] += 1;
          spec[b] += 1;
        }
      }
      repaired += s - bounds[t];
      if (differing == 0) truth = end_state[t];  // the rest of the chunk was already right
    }
    final_counts = truth;
    g_last_repair_steps = repaired;
  }
  if (verbose) {
    std::cout << " > sample ratios:" << std::endl;
    for (int32_t i = 0; i < n; ++i)
      std::cout << "   dataset " << i << ", input: " << w[i]
                << ", achieved: " << static_cast<double>(final_counts[i]) / static_cast<double>(size) << std::endl;
  }
}

void build_exhaustive_blending_indices(py::array_t<int16_t> &dataset_index,
                                       py::array_t<int64_t> &dataset_sample_index,
                                       const py::array_t<int64_t, py::array::c_style | py::array::forcecast> &sizes_,
                                       const int32_t num_datasets) {
  if (num_datasets <= 0 || sizes_.ndim() != 1 || sizes_.shape(0) < num_datasets)
    throw std::invalid_argument("build_exhaustive_blending_indices: need num_datasets sizes");
  const int64_t *sizes = sizes_.data();
  int64_t total = 0;
  for (int32_t i = 0; i < num_datasets; ++i) {
    if (sizes[i] <= 0) throw std::invalid_argument("build_exhaustive_blending_indices: sizes must be positive");
    total += sizes[i];
  }
  if (dataset_index.shape(0) < total || dataset_sample_index.shape(0) < total)
    throw std::invalid_argument("build_exhaustive_blending_indices: output arrays shorter than sum(sizes)");
  int16_t *di = dataset_index.mutable_data();
  int64_t *dsi = dataset_sample_index.mutable_data();
  py::gil_scoped_release release;
  std::vector<int64_t> counts(num_datasets, 0);
  std::vector<double> w(num_datasets);
  std::set<int32_t> unspent;
  for (int32_t i = 0; i < num_datasets; ++i) {
    w[i] = sizes[i] / static_cast<double>(total);
    unspent.insert(i);
  }
  int64_t s = 0;
  while (!unspent.empty()) {
    const double sd = std::max(static_cast<double>(s), 1.0);
    int64_t best = -1;
    double best_err = std::numeric_limits<double>::lowest();
    for (int32_t i : unspent) {
      const double err = w[i] * sd - static_cast<double>(counts[i]);
      if (err > best_err) {
        best = i;
        best_err = err;
      }
    }
    di[s] = static_cast<int16_t>(best);
    dsi[s] = counts[best];
    counts[best] += 1;
    if (sizes[best] - static_cast<double>(counts[best]) == 0) unspent.erase(static_cast<int32_t>(best));
    ++s;
  }
}

}  // namespace

PYBIND11_MODULE(_index_builders, m) {
  m.doc() = "Dataset index builders, output-identical to megatron-core's helpers_cpp";
  m.def("build_sample_idx_int32", &build_sample_idx<int32_t>, py::arg("sizes"), py::arg("document_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"),
        py::arg("drop_last_partial_sequence") = true, py::arg("add_extra_token_to_sequence") = 1,
        py::arg("num_threads") = 0, py::arg("block_docs") = int64_t(1) << 24);
  m.def("build_sample_idx_int64", &build_sample_idx<int64_t>, py::arg("sizes"), py::arg("document_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"),
        py::arg("drop_last_partial_sequence") = true, py::arg("add_extra_token_to_sequence") = 1,
        py::arg("num_threads") = 0, py::arg("block_docs") = int64_t(1) << 24);
  m.def("build_blending_indices", &build_blending_indices, py::arg("dataset_index"),
        py::arg("dataset_sample_index"), py::arg("weights"), py::arg("num_datasets"), py::arg("size"),
        py::arg("verbose") = false, py::arg("num_threads") = 0, py::arg("warmup") = 4096);
  m.def("build_exhaustive_blending_indices", &build_exhaustive_blending_indices, py::arg("dataset_index"),
        py::arg("dataset_sample_index"), py::arg("sizes"), py::arg("num_datasets"));
  m.def("last_blend_repair_steps", []() { return g_last_repair_steps; },
        "Blending steps the last build_blending_indices call re-ran after a wrong speculative start");
  m.def("default_num_threads", []() { return resolve_threads(0, int64_t(1) << 40, 1); });
}
