// Step kernels for x86 CPUs with AVX2 and FMA, called from jitted JAX code through XLA's FFI
// (pantheon/native.py builds and registers them):
//
// * rows_matmul: y[m, n] = sum_k x[m, k] * w[n, k]. XLA:CPU hands an [8, K] x [K, N] product to a
//   general GEMM that packs the weight panel on every call and reaches ~36 GFLOP/s here, so 8
//   decode rows cost twice one row although both stream the same weights. Here each group of 6
//   weight rows is loaded once and multiplied into every activation row in 4 x 3 tiles (60-70
//   GFLOP/s a core from 8 rows up, prefill chunks included).
// * rows_matmul_q: the same product reading the weights in their GGUF block format (Q4_0, Q4_1,
//   Q5_0, Q5_1, Q8_0): 4-7x fewer bytes to stream than f32, while every weight is the exact f32
//   value the f32 path multiplies by, so results are identical. Up to 8 rows (decode) widen each
//   block in registers and use it at once; more rows expand a few weight rows at a time into L1.
// * decode_attention: one query token per row against its own slot of the KV cache, read in place
//   up to the row's position. The XLA form gathers a bucketed span of every row's slot into a new
//   array first and masks the unused tail; this reads only the filled positions and copies nothing.
//
// All compute every output element in an order that does not depend on the other rows of the call
// (fixed 8-lane accumulation, then one fixed horizontal sum), so a row's result is the same alone
// or batched: the batch-invariance the scheduler's "alone == batched" guarantee rests on.
//
// Work is split into tasks that the calling thread and XLA's intra-op pool claim from one atomic
// counter. The caller works too and only waits for tasks already claimed, so a call completes even
// when the pool has no free thread.

#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Below this much work (in multiply-adds) a call runs on the caller alone: handing tasks to the
// pool costs more than it saves, and a core stays free for the web workers (tiny models, short
// contexts). A matmul counts 4 multiply-adds more per weight than it has rows: streaming or
// expanding a weight costs about that much (0.11 ns a weight against 0.03 ns a multiply-add).
constexpr int64_t kParallelMinWork = int64_t{1} << 20;
constexpr int64_t kWeightWork = 4;

// Runs task(i) for i in [0, n) on the caller and up to pool.num_threads() - 1 pool threads.
struct Tasks {
  std::function<void(int64_t)> task;
  int64_t n = 0;
  std::atomic<int64_t> next{0};  // the next unclaimed task
  std::atomic<int64_t> done{0};  // tasks finished; the caller returns when it reaches n

  void Work() {
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      task(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

void ParallelFor(ffi::ThreadPool& pool, int64_t n, int64_t work, std::function<void(int64_t)> task) {
  if (work < kParallelMinWork) {
    for (int64_t i = 0; i < n; ++i) task(i);
    return;
  }
  auto tasks = std::make_shared<Tasks>();  // kept alive by whichever of caller and helpers ends last
  tasks->task = std::move(task);
  tasks->n = n;
  int64_t threads = pool.num_threads();
  for (int64_t t = 1; t < threads && t < n; ++t) pool.Schedule([tasks] { tasks->Work(); });
  tasks->Work();
  while (tasks->done.load(std::memory_order_acquire) < n) _mm_pause();
}

// ---- rows_matmul --------------------------------------------------------------------------------

// y[i, j] = x[i] . w[j] for rows i < MB of x and `count` weight rows w[j] (NB at a time: MB * NB
// accumulators); x rows are K apart, y rows ldy apart.
template <int MB, int NB>
void Tile(const float* x, const float* w, float* y, int64_t K, int64_t ldy, int64_t count) {
  int64_t n = 0;
  for (; n + NB <= count; n += NB) {
    __m256 acc[MB][NB];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      __m256 wv[NB];
      for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_ps(w + (n + j) * K + k);
      for (int i = 0; i < MB; ++i) {
        __m256 xv = _mm256_loadu_ps(x + i * K + k);
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < NB; ++j) y[i * ldy + n + j] = HorizontalSum(acc[i][j]);
  }
  if constexpr (NB > 1) {
    if (n < count) Tile<MB, NB - 1>(x, w + n * K, y + n, K, ldy, count - n);
  }
}

// Weight rows taken together by Rows: each group is read from memory once and then from L1 for
// every block of 4 activation rows.
constexpr int64_t kGroupRows = 6;

// All M rows of x against `count` weight rows. A 4 x 3 tile (12 accumulators, 7 loads per 12 FMAs)
// keeps the FMA units busier than 8 x 1 (9 loads per 8 FMAs): 83 vs 61 GFLOP/s on one core with
// 64-byte-aligned operands in L1. Fewer than 4 rows left take wider tiles.
void Rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t ldy, int64_t count) {
  for (int64_t n = 0; n < count; n += kGroupRows) {
    const int64_t c = count - n < kGroupRows ? count - n : kGroupRows;
    const float* wn = w + n * K;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) Tile<4, 3>(x + m * K, wn, y + m * ldy + n, K, ldy, c);
    const float* xr = x + m * K;
    float* yr = y + m * ldy + n;
    switch (M - m) {
      case 3: Tile<3, 4>(xr, wn, yr, K, ldy, c); break;
      case 2: Tile<2, 4>(xr, wn, yr, K, ldy, c); break;
      case 1: Tile<1, 4>(xr, wn, yr, K, ldy, c); break;
      default: break;
    }
  }
}

// rows(x', y', m) for the rows of x outside [skip0, skip1) (the two runs before and after it), and
// zeros for the `count` outputs of each skipped row. A prefill chunk is padded to its length
// bucket: its padding rows need no products.
template <typename RowsFn>
void LiveRows(const float* x, float* y, int64_t M, int64_t K, int64_t ldy, int64_t count, int64_t skip0,
              int64_t skip1, RowsFn rows) {
  rows(x, y, skip0);
  for (int64_t m = skip0; m < skip1; ++m) std::memset(y + m * ldy, 0, count * sizeof(float));
  rows(x + skip1 * K, y + skip1 * ldy, M - skip1);
}

// The rows [skip0, skip1) a call may leave out, clamped to [0, M] (an empty range when none).
void SkipRange(ffi::Buffer<ffi::S32>& skip, int64_t M, int64_t* skip0, int64_t* skip1) {
  const int32_t* s = skip.typed_data();
  int64_t a = skip.element_count() == 2 ? s[0] : M, b = skip.element_count() == 2 ? s[1] : M;
  a = a < 0 ? 0 : a > M ? M : a;
  b = b < a ? a : b > M ? M : b;
  *skip0 = a;
  *skip1 = b;
}

// GGUF block formats the quantized product reads (ggml type ids), 32 weights a block.
constexpr int32_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8;

constexpr int64_t BlockBytes(int32_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;  // f16 d, 16 bytes of nibbles: (q - 8) * d
    case kQ4_1: return 20;  // f16 d, f16 m, 16 bytes of nibbles: q * d + m
    case kQ5_0: return 22;  // f16 d, u32 fifth bits, 16 bytes of nibbles: (q - 16) * d
    case kQ5_1: return 24;  // f16 d, f16 m, u32 fifth bits, 16 bytes of nibbles: q * d + m
    case kQ8_0: return 34;  // f16 d, 32 int8: q * d
    default: return 0;
  }
}

inline float HalfAt(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The 32 weights of one block as four vectors of 8, in order. Every value is the same f32 number
// gguf's numpy dequantizer gives (each product is exact in f32 and each value is rounded once), so
// a product over these weights equals the f32 kernel's over `gguf.quants.dequantize`d weights bit
// for bit. One instance per format, so the per-block format tests fold away.
//
// Byte i of the 16 nibble bytes holds weight i (low nibble) and weight i + 16 (high nibble), so
// widening bytes 0-7 and 8-15 to 32-bit lanes gives weights 0-15 masked and 16-31 shifted.
template <int32_t qtype>
inline void ExpandBlock(const uint8_t* blk, __m256 out[4]) {
  constexpr bool has_min = qtype == kQ4_1 || qtype == kQ5_1;
  constexpr bool fifth_bit = qtype == kQ5_0 || qtype == kQ5_1;
  const __m256 d = _mm256_set1_ps(HalfAt(blk));
  if constexpr (qtype == kQ8_0) {
    for (int p = 0; p < 4; ++p) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * p));
      out[p] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), d);
    }
    return;
  }
  const __m256 m = _mm256_set1_ps(has_min ? HalfAt(blk + 2) : 0.0f);
  const uint8_t* qs = blk + 2 + (has_min ? 2 : 0) + (fifth_bit ? 4 : 0);
  const __m256i low = _mm256_set1_epi32(0x0F);
  const __m256i r0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
  const __m256i r1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));
  __m256i q[4] = {_mm256_and_si256(r0, low), _mm256_and_si256(r1, low), _mm256_srli_epi32(r0, 4),
                  _mm256_srli_epi32(r1, 4)};
  if constexpr (fifth_bit) {  // bit i of qh is bit 4 of weight i
    uint32_t qh;
    std::memcpy(&qh, blk + 2 + (has_min ? 2 : 0), 4);
    const __m256i bits = _mm256_set1_epi32(static_cast<int>(qh));
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i one = _mm256_set1_epi32(1);
    for (int p = 0; p < 4; ++p) {
      const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(bits, _mm256_add_epi32(lane, _mm256_set1_epi32(8 * p))), one);
      q[p] = _mm256_or_si256(q[p], _mm256_slli_epi32(bit, 4));
    }
  }
  const __m256i offset = _mm256_set1_epi32(qtype == kQ4_0 ? 8 : qtype == kQ5_0 ? 16 : 0);
  for (int p = 0; p < 4; ++p) {
    const __m256 v = _mm256_cvtepi32_ps(_mm256_sub_epi32(q[p], offset));
    // d * q is exact in f32, so fma rounds once, as numpy's (d * q) + m does
    out[p] = has_min ? _mm256_fmadd_ps(d, v, m) : _mm256_mul_ps(d, v);
  }
}

// One weight row of K values from its blocks.
template <int32_t qtype>
void DequantRowOf(const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / 32; ++b, out += 32) {
    __m256 v[4];
    ExpandBlock<qtype>(row + b * BlockBytes(qtype), v);
    for (int p = 0; p < 4; ++p) _mm256_storeu_ps(out + 8 * p, v[p]);
  }
}

// Bytes of activation rows a pass over K keeps in L1 beside the weights streaming through. Eight
// rows of w_down (K = 1536) are 48 KB: read whole, every row is fetched from L2 for every block and
// the product runs at ~48 GFLOP/s against ~70 when K is cut into L1-sized parts.
constexpr int64_t kRowsL1Bytes = 20 * 1024;
// Columns whose partial sums are carried from one part of K to the next (16 KB at 8 rows).
constexpr int64_t kCarryColumns = 64;
// While the first part of K reads column j, the whole row of column j + kPrefetchAhead is fetched
// into L2: later parts then find it there, and DRAM sees whole rows in order, not three
// interleaved strides (which the hardware prefetcher follows poorly: ~50 GFLOP/s instead of ~70).
constexpr int64_t kPrefetchAhead = 2;

// y[i, j] = x[i] . w[j] for MB <= 8 rows of x and `count` weight rows in block format, each block
// expanded in registers and used at once by every row: a decode step's few rows would spend as
// long storing and reloading an expanded scratch row as multiplying it (1.15-1.45x faster at 4-8
// rows on one core). K is walked in parts that keep x in L1; each lane's partial sum is carried
// from part to part, so every output is still one k-ordered chain: the same bits as Tile.
template <int32_t qtype, int MB>
void ExpandedRows(const float* x, const uint8_t* w, float* y, int64_t K, int64_t ldy, int64_t count) {
  constexpr int64_t bb = BlockBytes(qtype);
  const int64_t row_bytes = K / 32 * bb;
  const int64_t parts = (MB * K * int64_t{sizeof(float)} + kRowsL1Bytes - 1) / kRowsL1Bytes;
  const int64_t kc = (K / 32 + parts - 1) / parts * 32;
  __m256 carry[kCarryColumns][MB];
  for (int64_t j0 = 0; j0 < count; j0 += kCarryColumns) {
    const int64_t jn = count - j0 < kCarryColumns ? count - j0 : kCarryColumns;
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
      const int64_t k1 = k0 + kc < K ? k0 + kc : K;
      for (int64_t j = 0; j < jn; ++j) {
        if (k0 == 0 && k1 < K && j0 + j + kPrefetchAhead < count) {
          const char* ahead = reinterpret_cast<const char*>(w + (j0 + j + kPrefetchAhead) * row_bytes);
          for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T1);
        }
        __m256 acc[MB];
        for (int i = 0; i < MB; ++i) acc[i] = k0 == 0 ? _mm256_setzero_ps() : carry[j][i];
        const uint8_t* blk = w + (j0 + j) * row_bytes + k0 / 32 * bb;
        for (int64_t k = k0; k < k1; k += 32, blk += bb) {
          __m256 wv[4];
          ExpandBlock<qtype>(blk, wv);
          for (int p = 0; p < 4; ++p)
            for (int i = 0; i < MB; ++i) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * K + k + 8 * p), wv[p], acc[i]);
        }
        if (k1 < K) {
          for (int i = 0; i < MB; ++i) carry[j][i] = acc[i];
        } else {
          for (int i = 0; i < MB; ++i) y[i * ldy + j0 + j] = HorizontalSum(acc[i]);
        }
      }
    }
  }
}

constexpr int64_t kExpandedMaxRows = 8;

template <int32_t qtype>
void ExpandedRowsOf(const float* x, const uint8_t* w, float* y, int64_t M, int64_t K, int64_t ldy, int64_t count) {
  switch (M) {
    case 1: return ExpandedRows<qtype, 1>(x, w, y, K, ldy, count);
    case 2: return ExpandedRows<qtype, 2>(x, w, y, K, ldy, count);
    case 3: return ExpandedRows<qtype, 3>(x, w, y, K, ldy, count);
    case 4: return ExpandedRows<qtype, 4>(x, w, y, K, ldy, count);
    case 5: return ExpandedRows<qtype, 5>(x, w, y, K, ldy, count);
    case 6: return ExpandedRows<qtype, 6>(x, w, y, K, ldy, count);
    case 7: return ExpandedRows<qtype, 7>(x, w, y, K, ldy, count);
    case 8: return ExpandedRows<qtype, 8>(x, w, y, K, ldy, count);
    default: return;
  }
}

// Column chunks for the pool: four a thread (balance when a core is busy), whole weight-row groups.
int64_t ChunkOf(ffi::ThreadPool& pool, int64_t N) {
  int64_t threads = pool.num_threads() < 1 ? 1 : pool.num_threads();
  int64_t chunk = (N + threads * 4 - 1) / (threads * 4);
  return chunk < 1 ? kGroupRows : (chunk + kGroupRows - 1) / kGroupRows * kGroupRows;
}

// Runs part(x', y', m, n0, n1, skip0, skip1) for the column chunks [n0, n1) of an [M, K] x [K, N]
// product on the pool, the rows [skip0, skip1) of x left out of the work (and of the products, by
// `part`); x', y' and m are x, y and M, or the compacted copies below and their row count.
//
// A skipped range with live rows on both sides (a prefill chunk's padding, then the decode rows of
// a mixed step) would cut the rows into two runs, each with its own remainder tile: 21 + 7 rows take
// 5 + 1 four-row tiles and a 1-row and a 3-row remainder, which run at a third to half the speed.
// Past the register path's 8 rows the live rows are copied into one block first (x and y rows are
// K and N floats: a fraction of a percent of the product), so they take 7 full tiles.
template <typename Part>
void OverColumns(ffi::ThreadPool& pool, ffi::Buffer<ffi::S32>& skip, const float* x, float* y, int64_t M, int64_t N,
                 int64_t K, Part part) {
  int64_t skip0, skip1;
  SkipRange(skip, M, &skip0, &skip1);
  const int64_t live = M - (skip1 - skip0);
  const bool compact = skip0 > 0 && skip1 < M && live > kExpandedMaxRows;
  std::vector<float> xs(compact ? live * K : 0), ys(compact ? live * N : 0);
  if (compact) {
    std::memcpy(xs.data(), x, skip0 * K * sizeof(float));
    std::memcpy(xs.data() + skip0 * K, x + skip1 * K, (M - skip1) * K * sizeof(float));
  }
  const float* xp = compact ? xs.data() : x;
  float* yp = compact ? ys.data() : y;
  const int64_t rows = compact ? live : M, s0 = compact ? live : skip0, s1 = compact ? live : skip1;
  const int64_t chunk = ChunkOf(pool, N);
  ParallelFor(pool, (N + chunk - 1) / chunk, (live + kWeightWork) * N * K, [=](int64_t c) {
    const int64_t n0 = c * chunk;
    part(xp, yp, rows, n0, n0 + chunk < N ? n0 + chunk : N, s0, s1);
  });
  if (compact) {
    std::memcpy(y, ys.data(), skip0 * N * sizeof(float));
    std::memset(y + skip0 * N, 0, (skip1 - skip0) * N * sizeof(float));
    std::memcpy(y + skip1 * N, ys.data() + skip0 * N, (M - skip1) * N * sizeof(float));
  }
}

ffi::Error RowsMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                          ffi::Buffer<ffi::S32> skip, ffi::ResultBuffer<ffi::F32> y) {
  auto wd = w.dimensions();
  if (wd.size() != 2) return ffi::Error::InvalidArgument("rows_matmul: w must be [N, K]");
  const int64_t N = wd[0], K = wd[1];
  if (K % 8 != 0) return ffi::Error::InvalidArgument("rows_matmul: K must be a multiple of 8");
  const int64_t M = K ? x.element_count() / K : 0;
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  OverColumns(pool, skip, xp, yp, M, N, K,
              [=](const float* xc, float* yc, int64_t m, int64_t n0, int64_t n1, int64_t skip0, int64_t skip1) {
                LiveRows(xc, yc + n0, m, K, N, n1 - n0, skip0, skip1, [&](const float* xr, float* yr, int64_t rows) {
                  Rows(xr, wp + n0 * K, yr, rows, K, N, n1 - n0);
                });
              });
  return ffi::Error::Success();
}

// The output columns [n0, n1) of x [M, K] f32 times w [N, K/32 blocks] in block format qtype,
// rows [skip0, skip1) left out. Up to 8 live rows (decode) take each block straight from
// registers; more rows (prefill) amortise an expanded scratch: 6 weight rows at a time are
// expanded into L1, then multiplied into every row of x in 4 x 3 tiles.
template <int32_t qtype>
void QuantColumns(const float* xp, const uint8_t* wp, float* yp, int64_t M, int64_t K, int64_t N, int64_t n0,
                  int64_t n1, int64_t skip0, int64_t skip1) {
  const int64_t row_bytes = K / 32 * BlockBytes(qtype);
  if (M - (skip1 - skip0) <= kExpandedMaxRows) {  // a decode step: no scratch rows at all
    LiveRows(xp, yp + n0, M, K, N, n1 - n0, skip0, skip1, [&](const float* xr, float* yr, int64_t rows) {
      ExpandedRowsOf<qtype>(xr, wp + n0 * row_bytes, yr, rows, K, N, n1 - n0);
    });
    return;
  }
  // 64-byte aligned: a 32-byte load that straddles two cache lines costs two, and the tiles load
  // every scratch row once per 4 activation rows (the unaligned buffer ran 1.7x slower)
  std::vector<float> buffer(kGroupRows * K + 16);
  float* scratch = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
  for (int64_t n = n0; n < n1; n += kGroupRows) {
    const int64_t count = n + kGroupRows <= n1 ? kGroupRows : n1 - n;
    for (int64_t j = 0; j < count; ++j) DequantRowOf<qtype>(wp + (n + j) * row_bytes, K, scratch + j * K);
    LiveRows(xp, yp + n, M, K, N, count, skip0, skip1, [&](const float* xr, float* yr, int64_t rows) {
      Rows(xr, scratch, yr, rows, K, N, count);
    });
  }
}

ffi::Error RowsMatmulQuantImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                               ffi::Buffer<ffi::S32> skip, ffi::ResultBuffer<ffi::F32> y, int32_t qtype) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  decltype(&QuantColumns<kQ4_0>) columns = nullptr;  // the format is chosen once per call
  switch (qtype) {
    case kQ4_0: columns = QuantColumns<kQ4_0>; break;
    case kQ4_1: columns = QuantColumns<kQ4_1>; break;
    case kQ5_0: columns = QuantColumns<kQ5_0>; break;
    case kQ5_1: columns = QuantColumns<kQ5_1>; break;
    case kQ8_0: columns = QuantColumns<kQ8_0>; break;
    default: return ffi::Error::InvalidArgument("rows_matmul_q: unsupported block format");
  }
  const int64_t bb = BlockBytes(qtype);
  if (wd.size() != 2 || xd.size() < 1) return ffi::Error::InvalidArgument("rows_matmul_q: w must be [N, bytes]");
  const int64_t N = wd[0], K = xd[xd.size() - 1];
  if (K % 32 != 0 || wd[1] != K / 32 * bb) return ffi::Error::InvalidArgument("rows_matmul_q: K does not match w");
  const int64_t M = K ? x.element_count() / K : 0;
  const float* xp = x.typed_data();
  const uint8_t* wp = w.typed_data();
  float* yp = y->typed_data();
  OverColumns(pool, skip, xp, yp, M, N, K,
              [=](const float* xc, float* yc, int64_t m, int64_t n0, int64_t n1, int64_t skip0, int64_t skip1) {
                columns(xc, wp, yc, m, K, N, n0, n1, skip0, skip1);
              });
  return ffi::Error::Success();
}

// ---- decode_attention ---------------------------------------------------------------------------

// Dot products of one query [D] with keys [n, D], 4 keys at a time for independent FMA chains.
void Scores(const float* q, const float* keys, int64_t n, int64_t D, float scale, float* s) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const float* k0 = keys + j * D;
    for (int64_t d = 0; d < D; d += 8) {
      __m256 qd = _mm256_loadu_ps(q + d);
      a0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + d), a0);
      a1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + D + d), a1);
      a2 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + 2 * D + d), a2);
      a3 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + 3 * D + d), a3);
    }
    s[j] = HorizontalSum(a0) * scale;
    s[j + 1] = HorizontalSum(a1) * scale;
    s[j + 2] = HorizontalSum(a2) * scale;
    s[j + 3] = HorizontalSum(a3) * scale;
  }
  for (; j < n; ++j) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(keys + j * D + d), a);
    s[j] = HorizontalSum(a) * scale;
  }
}

// out[D] = sum_j p[j] * values[j] / total, D a multiple of 8 and at most 256.
void Mix(const float* p, const float* values, int64_t n, int64_t D, float total, float* out) {
  __m256 acc[32];
  const int64_t lanes = D / 8;
  for (int64_t i = 0; i < lanes; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m256 pj = _mm256_set1_ps(p[j]);
    const float* vj = values + j * D;
    for (int64_t i = 0; i < lanes; ++i) acc[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * i), acc[i]);
  }
  __m256 inv = _mm256_set1_ps(1.0f / total);
  for (int64_t i = 0; i < lanes; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], inv));
}

// q [B, N, D]; k, v caches [L, S, KH, C, D]; layer []; slots, pos [B]; out [B, N, D].
// Row b's query heads h*G .. h*G+G-1 attend to positions 0..pos[b] of slot slots[b], kv head h.
ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                               ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slots,
                               ffi::Buffer<ffi::S32> pos, ffi::ResultBuffer<ffi::F32> out, float scale) {
  auto qd = q.dimensions();
  auto cd = k.dimensions();
  if (qd.size() != 3 || cd.size() != 5) return ffi::Error::InvalidArgument("decode_attention: bad ranks");
  const int64_t B = qd[0], N = qd[1], D = qd[2];
  const int64_t L = cd[0], S = cd[1], KH = cd[2], C = cd[3];
  if (cd[4] != D || D % 8 != 0 || D > 256 || KH == 0 || N % KH != 0)
    return ffi::Error::InvalidArgument("decode_attention: bad head shapes");
  const int64_t G = N / KH;
  const int64_t li = layer.typed_data()[0];
  if (li < 0 || li >= L) return ffi::Error::InvalidArgument("decode_attention: layer out of range");
  const float* qp = q.typed_data();
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  const int32_t* sp = slots.typed_data();
  const int32_t* pp = pos.typed_data();
  float* op = out->typed_data();
  int64_t work = 0;  // multiply-adds: every row's filled positions, keys and values, all heads
  for (int64_t b = 0; b < B; ++b) work += (int64_t(pp[b]) + 1) * 2 * N * D * kWeightWork;  // each cached value read once
  ParallelFor(pool, B * KH, work, [=](int64_t task) {
    const int64_t b = task / KH, h = task % KH;
    int64_t slot = sp[b], n = int64_t(pp[b]) + 1;
    if (slot < 0) slot = 0;
    if (slot >= S) slot = S - 1;
    if (n < 1) n = 1;
    if (n > C) n = C;
    const int64_t base = (((li * S + slot) * KH + h) * C) * D;
    std::vector<float> s(n);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t head = h * G + g;
      Scores(qp + (b * N + head) * D, kp + base, n, D, scale, s.data());
      float top = s[0];
      for (int64_t j = 1; j < n; ++j) top = s[j] > top ? s[j] : top;
      float total = 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        s[j] = std::exp(s[j] - top);
        total += s[j];
      }
      Mix(s.data(), vp + base, n, D, total, op + (b * N + head) * D);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PantheonRowsMatmul, RowsMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(PantheonRowsMatmulQuant, RowsMatmulQuantImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("qtype"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PantheonDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
