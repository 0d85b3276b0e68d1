// Step kernels for x86 CPUs with AVX2 and FMA, called from jitted JAX code through XLA's FFI
// (pantheon/ops/native/__init__.py builds and registers them):
//
// * rows_matmul: y[m, n] = sum_k x[m, k] * w[n, k]. XLA:CPU hands an [8, K] x [K, N] product to a
//   general GEMM that packs the weight panel on every call and reaches ~36 GFLOP/s here, so 8
//   decode rows cost twice one row although both stream the same weights. Here each group of 6
//   weight rows is loaded once and multiplied into every activation row in 4 x 3 tiles (60-70
//   GFLOP/s a core from 8 rows up, prefill chunks included).
// * rows_matmul_q: the same product reading the weights as the GGUF file stores them, every format
//   but F32: the 32-weight blocks Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and IQ4_NL, the 256-weight K-quants
//   Q2_K .. Q6_K and IQ4_XS, and F16 / BF16 arrays. 2-7x fewer bytes to stream than f32, while every
//   weight is widened to the exact f32 value gguf's dequantizer gives (see Format<T>), so results
//   are identical to rows_matmul's over the dequantized matrix. Up to 8 rows (decode) widen each
//   block in registers, a 32-weight sub-block at a time, and use it at once; more rows expand a few
//   weight rows at a time into L1 and run rows_matmul's tiles over them.
// * the same product in its int8 form (the `dot` attribute, 1): each activation row quantized to
//   8 bits once per call and integer dot products with the weight blocks, as llama.cpp computes
//   them: ~3x less work per weight than widening to f32, at the price of the activation's rounding.
// * decode_attention: one query token per row against its own slot of the KV cache (f32, f16 or
//   bf16, widened as it is read), in place up to the row's position. The XLA form gathers a bucketed
//   span of every row's slot into a new array first and masks the unused tail; this reads only the
//   filled positions and copies nothing.
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

// ---- GGUF formats -------------------------------------------------------------------------------
//
// Format<T> for each ggml type id T the stored-weight product reads: kWeights and kBytes of one
// block, and Expand(blk, use), which calls use(p, v) for p = 0, 1, ..., kWeights / 8 - 1 in order,
// v being weights 8p .. 8p + 7 of the block as f32. Every value is the f32 number gguf's numpy
// dequantizer (gguf/quants.py) gives, computed with its operations in its order; where one fma
// stands for numpy's product and sum, the product is exact in f32 (its operands' significands
// together have at most 24 bits), so the fma rounds once where numpy rounds once. A product over
// these weights therefore equals the f32 kernel's over `gguf.quants.dequantize`d weights bit for
// bit. Every fma is written out: the build passes -ffp-contract=off, so the compiler fuses nothing.
// The 256-weight formats are expanded one 32-weight sub-block at a time, each with its own scale,
// so no more than a handful of vectors is ever live: the decode path stays in registers.
//
// The nibble formats share one layout: byte i of a run of 16 (or 32) bytes holds weight i in its
// low nibble and weight i + 16 (or i + 32) in its high one, so widening 8 bytes to 32-bit lanes
// gives 8 consecutive weights masked and the 8 at +16 (+32) shifted.

constexpr int32_t kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11,
                  kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23, kBF16 = 30;

inline float HalfAt(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// Bytes p[0..7] as eight 32-bit lanes.
inline __m256i Widen8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 ToFloat(__m256i v) { return _mm256_cvtepi32_ps(v); }

template <int32_t T>
struct Format;

// Q4_0 (f16 d, 16 nibble bytes: (q - 8) * d), Q4_1 (f16 d, f16 m: q * d + m), Q5_0 (f16 d, u32 of
// fifth bits, nibbles: (q - 16) * d), Q5_1 (f16 d, f16 m, u32, nibbles: q * d + m): 32 weights.
template <int32_t T>
struct Legacy32 {
  static constexpr bool kMin = T == kQ4_1 || T == kQ5_1;
  static constexpr bool kFifth = T == kQ5_0 || T == kQ5_1;
  static constexpr int kWeights = 32, kBytes = 18 + (kMin ? 2 : 0) + (kFifth ? 4 : 0);

  template <class Use>
  static inline void Expand(const uint8_t* blk, Use&& use) {
    const __m256 d = _mm256_set1_ps(HalfAt(blk));
    const __m256 m = _mm256_set1_ps(kMin ? HalfAt(blk + 2) : 0.0f);
    const uint8_t* qs = blk + 2 + (kMin ? 2 : 0) + (kFifth ? 4 : 0);
    const __m256i low = _mm256_set1_epi32(0x0F);
    const __m256i r0 = Widen8(qs), r1 = Widen8(qs + 8);
    __m256i q[4] = {_mm256_and_si256(r0, low), _mm256_and_si256(r1, low), _mm256_srli_epi32(r0, 4),
                    _mm256_srli_epi32(r1, 4)};
    if constexpr (kFifth) {  // bit i of qh is bit 4 of weight i
      uint32_t qh;
      std::memcpy(&qh, blk + 2 + (kMin ? 2 : 0), 4);
      const __m256i bits = _mm256_set1_epi32(static_cast<int>(qh));
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i one = _mm256_set1_epi32(1);
      for (int p = 0; p < 4; ++p) {
        const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(bits, _mm256_add_epi32(lane, _mm256_set1_epi32(8 * p))), one);
        q[p] = _mm256_or_si256(q[p], _mm256_slli_epi32(bit, 4));
      }
    }
    const __m256i offset = _mm256_set1_epi32(T == kQ4_0 ? 8 : T == kQ5_0 ? 16 : 0);
    for (int p = 0; p < 4; ++p) {
      const __m256 v = ToFloat(_mm256_sub_epi32(q[p], offset));
      // d * q is exact in f32, so fma rounds once, as numpy's (d * q) + m does
      use(p, kMin ? _mm256_fmadd_ps(d, v, m) : _mm256_mul_ps(d, v));
    }
  }
};
template <> struct Format<kQ4_0> : Legacy32<kQ4_0> {};
template <> struct Format<kQ4_1> : Legacy32<kQ4_1> {};
template <> struct Format<kQ5_0> : Legacy32<kQ5_0> {};
template <> struct Format<kQ5_1> : Legacy32<kQ5_1> {};

// Q8_0: f16 d, 32 int8 q: q * d.
template <>
struct Format<kQ8_0> {
  static constexpr int kWeights = 32, kBytes = 34;
  template <class Use>
  static inline void Expand(const uint8_t* blk, Use&& use) {
    const __m256 d = _mm256_set1_ps(HalfAt(blk));
    for (int p = 0; p < 4; ++p) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * p));
      use(p, _mm256_mul_ps(ToFloat(_mm256_cvtepi8_epi32(q8)), d));
    }
  }
};

// The non-linear 4-bit grid of IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl).
inline __m128i Iq4Grid() {
  return _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
}

// 32 weights d * grid[q] from 16 nibble bytes, vectors base .. base + 3: one byte shuffle looks
// up 16 weights at once.
template <class Use>
inline void Iq4Run(const uint8_t* qs, __m256 d, int base, Use& use) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_shuffle_epi8(Iq4Grid(), _mm_and_si128(raw, low));
  const __m128i hi = _mm_shuffle_epi8(Iq4Grid(), _mm_and_si128(_mm_srli_epi16(raw, 4), low));
  use(base, _mm256_mul_ps(d, ToFloat(_mm256_cvtepi8_epi32(lo))));
  use(base + 1, _mm256_mul_ps(d, ToFloat(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)))));
  use(base + 2, _mm256_mul_ps(d, ToFloat(_mm256_cvtepi8_epi32(hi))));
  use(base + 3, _mm256_mul_ps(d, ToFloat(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))));
}

// IQ4_NL: f16 d, 16 nibble bytes: d * grid[q].
template <>
struct Format<kIQ4_NL> {
  static constexpr int kWeights = 32, kBytes = 18;
  template <class Use>
  static inline void Expand(const uint8_t* blk, Use&& use) {
    Iq4Run(blk + 2, _mm256_set1_ps(HalfAt(blk)), 0, use);
  }
};

// IQ4_XS: f16 d, u16 of 2-bit scale highs, 4 bytes of 4-bit scale lows, 8 x 16 nibble bytes.
// Sub-block j: (d * (scale_j - 32)) * grid[q].
template <>
struct Format<kIQ4_XS> {
  static constexpr int kWeights = 256, kBytes = 136;
  template <class Use>
  static inline void Expand(const uint8_t* blk, Use&& use) {
    const float d = HalfAt(blk);
    uint16_t high;
    std::memcpy(&high, blk + 2, 2);
    const uint8_t* low = blk + 4;
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const int scale = ((low[j / 2] >> (4 * (j % 2))) & 0x0F) | (((high >> (2 * j)) & 3) << 4);
      Iq4Run(blk + 8 + 16 * j, _mm256_set1_ps(d * static_cast<float>(scale - 32)), 4 * j, use);
    }
  }
};

// Q2_K: 16 bytes of scales (low nibble: scale, high nibble: min, one per 16 weights), 64 bytes of
// 2-bit q, f16 d, f16 dmin. Weight 128g + 32s + i is bits 2s, 2s+1 of byte 32g + i; its value is
// (d * scale) * q - dmin * min. d * scale has at most 15 significant bits and q 2: exact, one fma.
template <>
struct Format<kQ2_K> {
  static constexpr int kWeights = 256, kBytes = 84;
  template <class Use>
  static inline void Expand(const uint8_t* blk, Use&& use) {
    const uint8_t* qs = blk + 16;
    const float d = HalfAt(blk + 80), dmin = HalfAt(blk + 82);
    const __m256i three = _mm256_set1_epi32(3);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      for (int half = 0; half < 2; ++half) {
        const uint8_t sc = blk[2 * j + half];
        const __m256 dl = _mm256_set1_ps(d * static_cast<float>(sc & 0x0F));
        const __m256 ml = _mm256_set1_ps(-(dmin * static_cast<float>(sc >> 4)));
        for (int p = 2 * half; p < 2 * half + 2; ++p) {
          const __m256i q = _mm256_and_si256(_mm256_srli_epi32(Widen8(qs + 32 * (j / 4) + 8 * p), 2 * (j % 4)), three);
          use(4 * j + p, _mm256_fmadd_ps(dl, ToFloat(q), ml));
        }
      }
    }
  }
};

// Q3_K: 32 bytes of high-bit masks, 64 bytes of 2-bit low q, 12 bytes of 6-bit scales (one per 16
// weights), f16 d. Weight 32j + i: low bits as in Q2_K, high bit = bit j of mask byte i, and
// q = low - 4 when that bit is clear; its value is (d * (scale - 32)) * q.
template <>
struct Format<kQ3_K> {
  static constexpr int kWeights = 256, kBytes = 110;
  template <class Use>
  static inline void Expand(const uint8_t* blk, Use&& use) {
    const uint8_t* hmask = blk;
    const uint8_t* qs = blk + 32;
    const uint8_t* sc = blk + 96;
    const float d = HalfAt(blk + 108);
    const __m256i three = _mm256_set1_epi32(3), one = _mm256_set1_epi32(1), four = _mm256_set1_epi32(4);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      for (int half = 0; half < 2; ++half) {
        const int s = 2 * j + half;
        const int scale = ((s < 8 ? sc[s] : sc[s - 8] >> 4) & 0x0F) | (((sc[8 + s % 4] >> (2 * (s / 4))) & 3) << 4);
        const __m256 dl = _mm256_set1_ps(d * static_cast<float>(scale - 32));
        for (int p = 2 * half; p < 2 * half + 2; ++p) {
          const __m256i raw = Widen8(qs + 32 * (j / 4) + 8 * p);
          const __m256i low = _mm256_and_si256(_mm256_srli_epi32(raw, 2 * (j % 4)), three);
          const __m256i high = _mm256_and_si256(_mm256_srli_epi32(Widen8(hmask + 8 * p), j), one);
          const __m256i q = _mm256_sub_epi32(_mm256_or_si256(low, _mm256_slli_epi32(high, 2)), four);
          use(4 * j + p, _mm256_mul_ps(dl, ToFloat(q)));
        }
      }
    }
  }
};

// The eight 6-bit scales and mins of a Q4_K / Q5_K super-block (12 packed bytes), times d and dmin.
// Each product has at most 17 significant bits, and times a 5-bit q still fits f32: exact.
inline void ScalesAndMins(const uint8_t* s, float d, float dmin, float scale[8], float min[8]) {
  for (int j = 0; j < 4; ++j) {
    scale[j] = d * static_cast<float>(s[j] & 63);
    min[j] = dmin * static_cast<float>(s[j + 4] & 63);
    scale[j + 4] = d * static_cast<float>((s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30));
    min[j + 4] = dmin * static_cast<float>((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
  }
}

// Q4_K: f16 d, f16 dmin, 12 scale bytes, 4 x 32 nibble bytes (sub-blocks 2g, 2g + 1 are the low and
// high nibbles of run g). Sub-block j: (d * scale_j) * q - dmin * min_j.
// Q5_K: the same with 32 bytes of fifth bits before the nibbles (bit j of byte i: weight 32j + i).
template <int32_t T>
struct KQuant45 {
  static constexpr bool kFifth = T == kQ5_K;
  static constexpr int kWeights = 256, kBytes = kFifth ? 176 : 144;
  template <class Use>
  static inline void Expand(const uint8_t* blk, Use&& use) {
    float scale[8], min[8];
    ScalesAndMins(blk + 4, HalfAt(blk), HalfAt(blk + 2), scale, min);
    const uint8_t* qh = blk + 16;
    const uint8_t* qs = blk + (kFifth ? 48 : 16);
    const __m256i low = _mm256_set1_epi32(0x0F), one = _mm256_set1_epi32(1);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256 d = _mm256_set1_ps(scale[j]), m = _mm256_set1_ps(-min[j]);
      for (int p = 0; p < 4; ++p) {
        const __m256i raw = Widen8(qs + 32 * (j / 2) + 8 * p);
        __m256i q = j % 2 ? _mm256_srli_epi32(raw, 4) : _mm256_and_si256(raw, low);
        if constexpr (kFifth)
          q = _mm256_or_si256(q, _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(Widen8(qh + 8 * p), j), one), 4));
        use(4 * j + p, _mm256_fmadd_ps(d, ToFloat(q), m));
      }
    }
  }
};
template <> struct Format<kQ4_K> : KQuant45<kQ4_K> {};
template <> struct Format<kQ5_K> : KQuant45<kQ5_K> {};

// Four vectors of 8 from 32 signed bytes q (weights 0-7, 8-15, 16-23, 24-31), each times its
// 16-weight scale: vectors base, base + 1 take d0, base + 2, base + 3 take d1.
template <class Use>
inline void SignedBytes32(__m256i q, __m256 d0, __m256 d1, int base, Use& use) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  use(base, _mm256_mul_ps(d0, ToFloat(_mm256_cvtepi8_epi32(lo))));
  use(base + 1, _mm256_mul_ps(d0, ToFloat(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)))));
  use(base + 2, _mm256_mul_ps(d1, ToFloat(_mm256_cvtepi8_epi32(hi))));
  use(base + 3, _mm256_mul_ps(d1, ToFloat(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)))));
}

// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per 16 weights),
// f16 d. Weight 128g + 32r + i: low nibble (r / 2) of byte 64g + 32(r % 2) + i, high bits 2r, 2r+1
// of byte 32g + i; value (d * scale) * (q - 32). A sub-block's 32 q are formed as bytes in one
// register, then widened: half the integer work of forming them 8 lanes at a time (8 rows: 25-33
// against 21-28 GFLOP/s a core, measured).
template <>
struct Format<kQ6_K> {
  static constexpr int kWeights = 256, kBytes = 210;
  template <class Use>
  static inline void Expand(const uint8_t* blk, Use&& use) {
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    const float d = HalfAt(blk + 208);
    const __m256i nibble = _mm256_set1_epi8(0x0F), high_bits = _mm256_set1_epi8(0x30), offset = _mm256_set1_epi8(32);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const int g = j / 4, r = j % 4;
      __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * g + 32 * (r % 2)));
      if (r / 2) lo = _mm256_srli_epi16(lo, 4);
      __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * g));
      hi = r < 2 ? _mm256_slli_epi16(hi, 4 - 2 * r) : r == 2 ? hi : _mm256_srli_epi16(hi, 2);  // bits 2r, 2r+1 to 4, 5
      const __m256i q = _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(lo, nibble), _mm256_and_si256(hi, high_bits)),
                                        offset);
      const __m256 d0 = _mm256_set1_ps(d * static_cast<float>(sc[2 * j]));
      const __m256 d1 = _mm256_set1_ps(d * static_cast<float>(sc[2 * j + 1]));
      SignedBytes32(q, d0, d1, 4 * j, use);
    }
  }
};

// F16 and BF16 weights [N, K], taken 8 at a time: F16C's exact widening, and bf16's 16-bit shift
// (numpy's (int16 << 16) viewed as f32: the same bits).
template <>
struct Format<kF16> {
  static constexpr int kWeights = 8, kBytes = 16;
  template <class Use>
  static inline void Expand(const uint8_t* blk, Use&& use) {
    use(0, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk))));
  }
};
template <>
struct Format<kBF16> {
  static constexpr int kWeights = 8, kBytes = 16;
  template <class Use>
  static inline void Expand(const uint8_t* blk, Use&& use) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
    use(0, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
  }
};

// One weight row of K values from its blocks.
template <class F>
void DequantRowOf(const uint8_t* row, int64_t K, float* out) {
  for (int64_t b = 0; b < K / F::kWeights; ++b, out += F::kWeights)
    F::Expand(row + b * F::kBytes, [out](int p, __m256 v) { _mm256_storeu_ps(out + 8 * p, v); });
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

// y[i, j] = x[i] . w[j] for MB <= 8 rows of x and `count` weight rows in format F, each block
// expanded in registers and used at once by every row: a decode step's few rows would spend as
// long storing and reloading an expanded scratch row as multiplying it (1.15-1.45x faster at 4-8
// rows on one core). K is walked in parts (whole blocks) that keep x in L1; each lane's partial sum
// is carried from part to part, so every output is still one k-ordered chain: the same bits as Tile.
template <class F, int MB>
void ExpandedRows(const float* x, const uint8_t* w, float* y, int64_t K, int64_t ldy, int64_t count) {
  constexpr int64_t bw = F::kWeights, bb = F::kBytes;
  const int64_t row_bytes = K / bw * bb;
  const int64_t parts = (MB * K * int64_t{sizeof(float)} + kRowsL1Bytes - 1) / kRowsL1Bytes;
  const int64_t kc = (K / bw + parts - 1) / parts * bw;
  // x interleaved by 8 lanes, xi[k / 8][i] = x[i, k .. k + 8]: every row's operand for weights k
  // is then at a fixed offset from one pointer. Read from MB row pointers, the fully unrolled
  // 256-weight blocks made GCC keep one address per (row, vector) and reload it from the stack
  // before every fma (8 rows: half the speed of the 32-weight formats).
  std::vector<__m256> interleaved(MB > 1 ? MB * K / 8 : 0);
  const float* xs = x;
  if constexpr (MB > 1) {
    for (int64_t k = 0; k < K; k += 8)
      for (int i = 0; i < MB; ++i) interleaved[k / 8 * MB + i] = _mm256_loadu_ps(x + i * K + k);
    xs = reinterpret_cast<const float*>(interleaved.data());
  }
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
        const uint8_t* blk = w + (j0 + j) * row_bytes + k0 / bw * bb;
        for (int64_t k = k0; k < k1; k += bw, blk += bb) {
          const float* xk = xs + k * MB;
          F::Expand(blk, [&acc, xk](int p, __m256 v) {
            for (int i = 0; i < MB; ++i) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xk + (p * MB + i) * 8), v, acc[i]);
          });
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

template <class F>
void ExpandedRowsOf(const float* x, const uint8_t* w, float* y, int64_t M, int64_t K, int64_t ldy, int64_t count) {
  switch (M) {
    case 1: return ExpandedRows<F, 1>(x, w, y, K, ldy, count);
    case 2: return ExpandedRows<F, 2>(x, w, y, K, ldy, count);
    case 3: return ExpandedRows<F, 3>(x, w, y, K, ldy, count);
    case 4: return ExpandedRows<F, 4>(x, w, y, K, ldy, count);
    case 5: return ExpandedRows<F, 5>(x, w, y, K, ldy, count);
    case 6: return ExpandedRows<F, 6>(x, w, y, K, ldy, count);
    case 7: return ExpandedRows<F, 7>(x, w, y, K, ldy, count);
    case 8: return ExpandedRows<F, 8>(x, w, y, K, ldy, count);
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

// The output columns [n0, n1) of x [M, K] f32 times w [N, K / F::kWeights blocks] in format F,
// rows [skip0, skip1) left out. Up to 8 live rows (decode) take each block straight from
// registers; more rows (prefill) amortise an expanded scratch: 6 weight rows at a time are
// expanded into L1, then multiplied into every row of x in 4 x 3 tiles.
template <class F>
void QuantColumns(const float* xp, const uint8_t* wp, float* yp, int64_t M, int64_t K, int64_t N, int64_t n0,
                  int64_t n1, int64_t skip0, int64_t skip1) {
  const int64_t row_bytes = K / F::kWeights * F::kBytes;
  if (M - (skip1 - skip0) <= kExpandedMaxRows) {  // a decode step: no scratch rows at all
    LiveRows(xp, yp + n0, M, K, N, n1 - n0, skip0, skip1, [&](const float* xr, float* yr, int64_t rows) {
      ExpandedRowsOf<F>(xr, wp + n0 * row_bytes, yr, rows, K, N, n1 - n0);
    });
    return;
  }
  // 64-byte aligned: a 32-byte load that straddles two cache lines costs two, and the tiles load
  // every scratch row once per 4 activation rows (the unaligned buffer ran 1.7x slower)
  std::vector<float> buffer(kGroupRows * K + 16);
  float* scratch = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t{63});
  for (int64_t n = n0; n < n1; n += kGroupRows) {
    const int64_t count = n + kGroupRows <= n1 ? kGroupRows : n1 - n;
    for (int64_t j = 0; j < count; ++j) DequantRowOf<F>(wp + (n + j) * row_bytes, K, scratch + j * K);
    LiveRows(xp, yp + n, M, K, N, count, skip0, skip1, [&](const float* xr, float* yr, int64_t rows) {
      Rows(xr, scratch, yr, rows, K, N, count);
    });
  }
}

using ColumnsFn = decltype(&QuantColumns<Format<kQ4_0>>);

// The product for ggml type `qtype`, the dtype its weights are stored in, its block geometry.
struct StoredFormat {
  ColumnsFn columns = nullptr;
  ffi::DataType dtype = ffi::DataType::U8;
  int64_t weights = 0, bytes = 0;
};

template <int32_t T>
StoredFormat Stored(ffi::DataType dtype = ffi::DataType::U8) {
  return {QuantColumns<Format<T>>, dtype, Format<T>::kWeights, Format<T>::kBytes};
}

StoredFormat StoredFormatOf(int32_t qtype) {
  switch (qtype) {
    case kF16: return Stored<kF16>(ffi::DataType::F16);
    case kBF16: return Stored<kBF16>(ffi::DataType::BF16);
    case kQ4_0: return Stored<kQ4_0>();
    case kQ4_1: return Stored<kQ4_1>();
    case kQ5_0: return Stored<kQ5_0>();
    case kQ5_1: return Stored<kQ5_1>();
    case kQ8_0: return Stored<kQ8_0>();
    case kQ2_K: return Stored<kQ2_K>();
    case kQ3_K: return Stored<kQ3_K>();
    case kQ4_K: return Stored<kQ4_K>();
    case kQ5_K: return Stored<kQ5_K>();
    case kQ6_K: return Stored<kQ6_K>();
    case kIQ4_NL: return Stored<kIQ4_NL>();
    case kIQ4_XS: return Stored<kIQ4_XS>();
    default: return {};
  }
}

// ---- the int8 form (dot = "int8") ---------------------------------------------------------------
//
// The exact form above spends several instructions on every weight (widen, convert, scale, fma),
// so one decode row is compute-bound at about a third of the memory bandwidth. The int8 form does
// what llama.cpp's CPU backend does: each activation row is quantized to 8 bits once per call, in
// blocks the size of the weight format's block (32 for Q4_0 .. Q8_0 and IQ4_NL; 256 for the
// K-quants and IQ4_XS), the block's step d = amax / 127 made up to 8x finer for its sub-blocks of
// smaller values (powers of two: QuantizeRow), q = rint(x / step) (rint: nearest, ties to even; all
// zero when amax = 0). A weight block then meets its activation block in integer arithmetic:
// vpmaddubsw multiplies unsigned weight bytes by signed activation bytes into int16 pairs (never
// saturating: every format's unsigned weights are below 64, and signed ones go through the sign
// trick, |w| <= 128 times sign-adjusted q), vpmaddwd sums them (times a sub-block scale where the
// format has one) into 8 int32 lanes. Lane l holds the products of weights 4l .. 4l + 3 of each
// 32-weight run. Integer sums are exact, so their order is free.
//
// The float part is fixed and the same for every row: per block, acc[l] = acc[l] + f32(lane l) *
// (d_w * d_x) (d_x: the row block's unit, amax / 127 / 8), a multiply and an add (no fma, so numpy can replay it bit for bit: see
// tests/test_native_int8.py); formats with a minimum keep a second accumulator, its own lanes (the
// K-quants: lane l = m_l * (bsum_2l + bsum_2l+1), times dmin * d_x) or one float (Q4_1 / Q5_1:
// + f32(sum q) * (m * d_x)), in block order. The output is HorizontalSum(acc) then -
// HorizontalSum(mins) (K-quants) or + the float (Q4_1, Q5_1). Nothing reads another row and the
// block loop of each output is the same whatever rows share the call or how the columns are split,
// so a row's result is the same bits alone or batched, at any thread count.
//
// Numerically this is not the f32 product: the activation's rounding to 8 bits adds a relative
// error of at most half a step (1/254 of the block's largest value, or 2-8x less in a sub-block of
// smaller values) per product. Hence a static choice of the caller
// (the `dot` attribute); the exact form stays the oracle's. F16 and BF16 keep the exact form.

inline __m256i Load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// One activation row quantized: q[K]; d[K / B] (the block's unit: its step is d * 2^sh, below); for
// B = 32 the f32 sum of each block's q * 2^sh and `sc`, each block's 8 int32-lane shifts as bytes
// (lanes 0-3 hold weights 0-15, lanes 4-7 weights 16-31); for B = 256 the int16 sum of each 16 q * 2^sh (the
// minimums' and the offset formats' correction terms) and `sh`, each 32-run's shift.
struct Q8Row {
  const int8_t* q;
  const float* d;
  const float* s;
  const int16_t* bs;
  const uint8_t* sc;
  const int32_t* sh;
};

// MB quantized rows taken together. Their q are interleaved by 32-value runs (run r of row i at
// q + (r * MB + i) * 32): every row's operand for a run is then at a fixed offset from one pointer,
// and rows K apart (K a multiple of 4096 in most models) do not all map to the same L1 sets.
template <int MB>
struct Q8Group {
  const int8_t* q;
  const float* d[MB];
  const float* s[MB];
  const int16_t* bs[MB];
  const uint8_t* sc[MB];
  const int32_t* sh[MB];
  inline __m256i Run(int64_t r, int i) const { return Load32(q + (r * MB + i) * 32); }
};

// Quantizes x[K] in blocks of B (32 or 256) into q, d, and s, sc (B = 32) or bs, sh (B = 256).
// Sub-blocks of S (16 for B = 32, 32 for B = 256) take a power-of-two finer step than the block's
// where their own largest value allows it: with amax the block's and m the sub-block's largest |x|,
// e = the largest of 0 .. 3 with m * 2^e <= amax, q = rint(x * ((127 / amax) * 2^e)), so |q| <= 127
// and the sub-block's step is (amax / 127) / 2^e. In units of u = (amax / 127) / 8 (stored as d) a q
// weighs 2^(3 - e) = 2^sh: the integer sums stay exact (each run's int32 lanes are shifted left by sh
// before they meet any float) and the float part is the same as with one step per
// block. Why: one step per 256 values lets a block's one large activation (ffn_down's inputs have
// them) round all the others to a few levels; per-sub-block steps halve the int8 form's logit error
// on the catalog models (measured: gemma3 0.32 -> 0.17, SmolLM2 0.40 -> 0.30 mean top-20 distance to
// the exact form over every prompt position), at one variable shift per run and row.
template <int B>
void QuantizeRow(const float* x, int64_t K, int8_t* q, float* d, float* s, int16_t* bs, uint8_t* sc, int32_t* sh) {
  constexpr int S = B == 32 ? 16 : 32, NS = B / S;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t b = 0; b < K / B; ++b) {
    const float* xb = x + b * B;
    float sub[NS];
    float amax = 0.0f;
    for (int g = 0; g < NS; ++g) {
      __m256 mx = _mm256_setzero_ps();
      for (int k = 0; k < S; k += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xb + g * S + k), abs_mask));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      sub[g] = _mm_cvtss_f32(m4);
      amax = sub[g] > amax ? sub[g] : amax;
    }
    d[b] = (amax / 127.0f) * 0.125f;
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int shift[NS];
    __m256 mul[NS];
    for (int g = 0; g < NS; ++g) {
      int e = 0;
      while (e < 3 && sub[g] * static_cast<float>(2 << e) <= amax) ++e;
      shift[g] = 3 - e;
      mul[g] = _mm256_set1_ps(id * static_cast<float>(1 << e));
    }
    int8_t* qb = q + b * B;
    for (int k = 0; k < B; k += 32) {
      __m256i v[4];
      for (int t = 0; t < 4; ++t) v[t] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + k + 8 * t), mul[(k + 8 * t) / S]));
      // packs work within 128-bit lanes: dwords come out as 0 4 1 5 2 6 3 7 of the wanted order
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + k), _mm256_permutevar8x32_epi32(p, order));
    }
    if constexpr (B == 32) {
      int sum = 0;
      for (int k = 0; k < 32; ++k) sum += qb[k] * (1 << shift[k / 16]);
      s[b] = static_cast<float>(sum);
      for (int l = 0; l < 8; ++l) sc[8 * b + l] = static_cast<uint8_t>(shift[l / 4]);
    } else {
      for (int g = 0; g < B / 16; ++g) {
        int sum = 0;
        for (int k = 0; k < 16; ++k) sum += qb[16 * g + k];
        bs[b * (B / 16) + g] = static_cast<int16_t>(sum * (1 << shift[g / 2]));
      }
      for (int g = 0; g < NS; ++g) sh[b * NS + g] = shift[g];
    }
  }
}

inline __m128i Load16(const void* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
// 16 nibble bytes as 32 bytes: the low nibbles (weights 0-15), then the high ones (16-31).
inline __m256i Nibbles(const uint8_t* p) {
  const __m128i raw = Load16(p);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}
// Unsigned weight bytes u times signed activation bytes x: int32 lane l = sum of products 4l .. 4l + 3,
// each int16 pair times its scale (`scale`: 16 int16; ones where the block has one scale).
inline __m256i DotU(__m256i u, __m256i x, __m256i scale) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), scale);
}
// 32 bytes whose byte i is 0x10 where bit i of `bits` is set (Q5's fifth bits).
inline __m256i FifthBits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i mask = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask), _mm256_set1_epi8(0x10));
}
inline __m256i Iq4Grid256() { return _mm256_broadcastsi128_si256(Iq4Grid()); }
// A 16-lane int16 scale vector: lanes 0-7 (the run's first 16 weights) a, lanes 8-15 b.
inline __m256i Scale16(int a, int b) { return _mm256_set_m128i(_mm_set1_epi16(b), _mm_set1_epi16(a)); }

template <int32_t T>
struct Int8;

// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL against 32-blocks. Signed weights (q - 8, q - 16, int8, the
// IQ4 grid) use the sign trick; Q4_1 / Q5_1 multiply their unsigned q and add m * d_x * sum(q_x).
template <int32_t T>
struct Int8Legacy {
  static constexpr bool kMin = T == kQ4_1 || T == kQ5_1;
  static constexpr bool kFifth = T == kQ5_0 || T == kQ5_1;
  static constexpr int kWeights = 32;
  static constexpr int kBytes = T == kQ8_0 ? 34 : T == kIQ4_NL ? 18 : 18 + (kMin ? 2 : 0) + (kFifth ? 4 : 0);

  template <int MB>
  static inline void Block(const uint8_t* blk, int64_t b, const Q8Group<MB>& x, __m256* acc, __m256*, float* mins) {
    const float dw = HalfAt(blk);
    __m256i w;
    if constexpr (T == kQ8_0) {
      w = Load32(blk + 2);
    } else if constexpr (T == kIQ4_NL) {
      w = _mm256_shuffle_epi8(Iq4Grid256(), Nibbles(blk + 2));
    } else {
      w = Nibbles(blk + 2 + (kMin ? 2 : 0) + (kFifth ? 4 : 0));
      if constexpr (kFifth) {
        uint32_t qh;
        std::memcpy(&qh, blk + 2 + (kMin ? 2 : 0), 4);
        w = _mm256_or_si256(w, FifthBits(qh));
      }
      if constexpr (!kMin) w = _mm256_sub_epi8(w, _mm256_set1_epi8(T == kQ4_0 ? 8 : 16));
    }
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i u = kMin ? w : _mm256_abs_epi8(w);
    for (int i = 0; i < MB; ++i) {
      const __m256i xq = x.Run(b, i);
      // each half's sums in the row's units: times 2^sh of its 16 weights (QuantizeRow)
      const __m256i sh = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x.sc[i] + 8 * b)));
      const __m256i lanes = _mm256_sllv_epi32(DotU(u, kMin ? xq : _mm256_sign_epi8(xq, w), ones), sh);
      const float dx = x.d[i][b];
      acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(dw * dx)));
      if constexpr (kMin) mins[i] = mins[i] + x.s[i][b] * (HalfAt(blk + 2) * dx);
    }
  }
  static inline float Finish(__m256 acc, __m256, float mins) {
    return kMin ? HorizontalSum(acc) + mins : HorizontalSum(acc);
  }
};
template <> struct Int8<kQ4_0> : Int8Legacy<kQ4_0> {};
template <> struct Int8<kQ4_1> : Int8Legacy<kQ4_1> {};
template <> struct Int8<kQ5_0> : Int8Legacy<kQ5_0> {};
template <> struct Int8<kQ5_1> : Int8Legacy<kQ5_1> {};
template <> struct Int8<kQ8_0> : Int8Legacy<kQ8_0> {};
template <> struct Int8<kIQ4_NL> : Int8Legacy<kIQ4_NL> {};

// The 256-weight formats against 256-blocks: sub-block scales multiply the int16 pairs (vpmaddwd),
// so a super-block's whole sum stays integer; one float step per super-block and row.
// `Run(j)`: the unsigned (or, kSigned, signed) bytes of weights 32j .. 32j + 31; `Scale(j)`: their
// 16-lane scale; `Offset`: the q offset of formats stored unsigned (Q3_K 4, Q6_K 32), subtracted as
// offset * sum_k scale_k * bsum_k (per-16 scales as 16 int16 in `Scales16`).
template <class Blk, int MB>
inline void SuperBlock(const Blk& blk, int64_t b, const Q8Group<MB>& x, __m256* acc, __m256* mins) {
  __m256i isum[MB];
  for (int i = 0; i < MB; ++i) isum[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int j = 0; j < 8; j += 2) {
    const __m256i w0 = blk.Run(j), scale0 = blk.Scale(j);
    const __m256i w1 = blk.Run(j + 1), scale1 = blk.Scale(j + 1);
    const __m256i u0 = Blk::kSigned ? _mm256_abs_epi8(w0) : w0;
    const __m256i u1 = Blk::kSigned ? _mm256_abs_epi8(w1) : w1;
    for (int i = 0; i < MB; ++i) {
      const __m256i x0 = x.Run(8 * b + j, i), x1 = x.Run(8 * b + j + 1, i);
      // each run's sums in the row's units: times 2^sh of its sub-block (QuantizeRow)
      const __m256i p0 = _mm256_sllv_epi32(DotU(u0, Blk::kSigned ? _mm256_sign_epi8(x0, w0) : x0, scale0),
                                           _mm256_set1_epi32(x.sh[i][8 * b + j]));
      const __m256i p1 = _mm256_sllv_epi32(DotU(u1, Blk::kSigned ? _mm256_sign_epi8(x1, w1) : x1, scale1),
                                           _mm256_set1_epi32(x.sh[i][8 * b + j + 1]));
      isum[i] = _mm256_add_epi32(isum[i], _mm256_add_epi32(p0, p1));
      // one chain per row, kept as written: GCC otherwise reassociates the 8 sub-blocks' integer sums
      // into trees whose partial sums spill (8 rows: 20-25% slower, measured)
      asm("" : "+x"(isum[i]));
    }
  }
  for (int i = 0; i < MB; ++i) {
    const __m256i bsums = Load32(x.bs[i] + 16 * b);
    if constexpr (Blk::kOffsetShift > 0)
      isum[i] = _mm256_sub_epi32(isum[i], _mm256_slli_epi32(_mm256_madd_epi16(bsums, blk.scales16), Blk::kOffsetShift));
    const float dx = x.d[i][b];
    acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(_mm256_cvtepi32_ps(isum[i]), _mm256_set1_ps(blk.d * dx)));
    if constexpr (Blk::kMin) {
      const __m256i m = _mm256_madd_epi16(bsums, blk.mins16);
      mins[i] = _mm256_add_ps(mins[i], _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(blk.dmin * dx)));
    }
  }
}

template <int32_t T, class Blk>
struct Int8Super {
  static constexpr int kWeights = 256, kBytes = Format<T>::kBytes;
  template <int MB>
  static inline void Block(const uint8_t* p, int64_t b, const Q8Group<MB>& x, __m256* acc, __m256* mins, float*) {
    SuperBlock<Blk, MB>(Blk(p), b, x, acc, mins);
  }
  static inline float Finish(__m256 acc, __m256 mins, float) {
    return Blk::kMin ? HorizontalSum(acc) - HorizontalSum(mins) : HorizontalSum(acc);
  }
};

// Q4_K / Q5_K: 6-bit scales and mins of the eight 32-weight sub-blocks, from the 12 packed bytes.
template <bool kFifth>
struct K45Blk {
  static constexpr bool kSigned = false, kMin = true;
  static constexpr int kOffsetShift = 0;
  const uint8_t* qh;
  const uint8_t* qs;
  float d, dmin;
  uint8_t scale[8], min[8];
  __m256i scales16, mins16;  // mins16: m_j for the two 16-sums of sub-block j
  explicit K45Blk(const uint8_t* p) : qh(p + 16), qs(p + (kFifth ? 48 : 16)), d(HalfAt(p)), dmin(HalfAt(p + 2)) {
    const uint8_t* s = p + 4;
    for (int j = 0; j < 4; ++j) {
      scale[j] = s[j] & 63;
      min[j] = s[j + 4] & 63;
      scale[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30);
      min[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
    const __m128i m = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(min)));
    mins16 = _mm256_set_m128i(_mm_unpackhi_epi16(m, m), _mm_unpacklo_epi16(m, m));
  }
  inline __m256i Run(int j) const {
    const __m256i raw = Load32(qs + 32 * (j / 2));
    __m256i u = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(raw, 4) : raw, _mm256_set1_epi8(0x0F));
    if constexpr (kFifth) {
      const __m256i h = _mm256_and_si256(_mm256_srli_epi16(Load32(qh), j), _mm256_set1_epi8(1));
      u = _mm256_or_si256(u, _mm256_slli_epi16(h, 4));
    }
    return u;
  }
  inline __m256i Scale(int j) const { return _mm256_set1_epi16(scale[j]); }
};
template <> struct Int8<kQ4_K> : Int8Super<kQ4_K, K45Blk<false>> {};
template <> struct Int8<kQ5_K> : Int8Super<kQ5_K, K45Blk<true>> {};

// Q6_K: unsigned q (0..63) with the offset 32 taken out through the 16-sums; int8 scales per 16.
struct Q6Blk {
  static constexpr bool kSigned = false, kMin = false;
  static constexpr int kOffsetShift = 5;
  const uint8_t* ql;
  const uint8_t* qh;
  const int8_t* sc;
  float d, dmin = 0.0f;
  __m256i scales16, mins16;
  explicit Q6Blk(const uint8_t* p)
      : ql(p), qh(p + 128), sc(reinterpret_cast<const int8_t*>(p + 192)), d(HalfAt(p + 208)) {
    scales16 = _mm256_cvtepi8_epi16(Load16(sc));
  }
  inline __m256i Run(int j) const {
    const int g = j / 4, r = j % 4;
    __m256i lo = Load32(ql + 64 * g + 32 * (r % 2));
    if (r / 2) lo = _mm256_srli_epi16(lo, 4);
    __m256i hi = Load32(qh + 32 * g);
    hi = r < 2 ? _mm256_slli_epi16(hi, 4 - 2 * r) : r == 2 ? hi : _mm256_srli_epi16(hi, 2);
    return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi8(0x0F)), _mm256_and_si256(hi, _mm256_set1_epi8(0x30)));
  }
  inline __m256i Scale(int j) const { return Scale16(sc[2 * j], sc[2 * j + 1]); }
};
template <> struct Int8<kQ6_K> : Int8Super<kQ6_K, Q6Blk> {};

// Q2_K: 2-bit q, scale (low nibble) and min (high nibble) per 16 weights.
struct Q2Blk {
  static constexpr bool kSigned = false, kMin = true;
  static constexpr int kOffsetShift = 0;
  const uint8_t* sc;
  const uint8_t* qs;
  float d, dmin;
  __m256i scales16, mins16;
  explicit Q2Blk(const uint8_t* p) : sc(p), qs(p + 16), d(HalfAt(p + 80)), dmin(HalfAt(p + 82)) {
    mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(Load16(p), 4), _mm_set1_epi8(0x0F)));
  }
  inline __m256i Run(int j) const {
    return _mm256_and_si256(_mm256_srli_epi16(Load32(qs + 32 * (j / 4)), 2 * (j % 4)), _mm256_set1_epi8(3));
  }
  inline __m256i Scale(int j) const { return Scale16(sc[2 * j] & 0x0F, sc[2 * j + 1] & 0x0F); }
};
template <> struct Int8<kQ2_K> : Int8Super<kQ2_K, Q2Blk> {};

// Q3_K: unsigned q (0..7: low bits | high bit << 2) with the offset 4 taken out through the 16-sums;
// 6-bit scales - 32 per 16 weights.
struct Q3Blk {
  static constexpr bool kSigned = false, kMin = false;
  static constexpr int kOffsetShift = 2;
  const uint8_t* hmask;
  const uint8_t* qs;
  float d, dmin = 0.0f;
  int16_t scale[16];
  __m256i scales16, mins16;
  explicit Q3Blk(const uint8_t* p) : hmask(p), qs(p + 32), d(HalfAt(p + 108)) {
    const uint8_t* sc = p + 96;
    for (int s = 0; s < 16; ++s)
      scale[s] = static_cast<int16_t>((((s < 8 ? sc[s] : sc[s - 8] >> 4) & 0x0F) |
                                       (((sc[8 + s % 4] >> (2 * (s / 4))) & 3) << 4)) - 32);
    scales16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale));
  }
  inline __m256i Run(int j) const {
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(Load32(qs + 32 * (j / 4)), 2 * (j % 4)), _mm256_set1_epi8(3));
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(Load32(hmask), j), _mm256_set1_epi8(1));
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 2));
  }
  inline __m256i Scale(int j) const { return Scale16(scale[2 * j], scale[2 * j + 1]); }
};
template <> struct Int8<kQ3_K> : Int8Super<kQ3_K, Q3Blk> {};

// IQ4_XS: the IQ4 grid (signed: the sign trick), 6-bit scales - 32 per 32 weights.
struct Iq4XsBlk {
  static constexpr bool kSigned = true, kMin = false;
  static constexpr int kOffsetShift = 0;
  const uint8_t* p;
  float d, dmin = 0.0f;
  __m256i scales16, mins16;
  explicit Iq4XsBlk(const uint8_t* blk) : p(blk), d(HalfAt(blk)) {}
  inline __m256i Run(int j) const { return _mm256_shuffle_epi8(Iq4Grid256(), Nibbles(p + 8 + 16 * j)); }
  inline __m256i Scale(int j) const {
    uint16_t high;
    std::memcpy(&high, p + 2, 2);
    const int scale = ((p[4 + j / 2] >> (4 * (j % 2))) & 0x0F) | (((high >> (2 * j)) & 3) << 4);
    return _mm256_set1_epi16(static_cast<int16_t>(scale - 32));
  }
};
template <> struct Int8<kIQ4_XS> : Int8Super<kIQ4_XS, Iq4XsBlk> {};

// y[i][j] for the MB quantized rows of x and `count` weight rows of w (row_bytes apart), in format F.
template <class F, int MB>
void Int8Rows(const Q8Group<MB>& x, const uint8_t* w, int64_t row_bytes, int64_t blocks, float* const* y,
              int64_t count) {
  for (int64_t j = 0; j < count; ++j) {
    __m256 acc[MB], mins[MB];
    float fmins[MB];
    for (int i = 0; i < MB; ++i) {
      acc[i] = mins[i] = _mm256_setzero_ps();
      fmins[i] = 0.0f;
    }
    const uint8_t* blk = w + j * row_bytes;
    for (int64_t b = 0; b < blocks; ++b, blk += F::kBytes) F::template Block<MB>(blk, b, x, acc, mins, fmins);
    for (int i = 0; i < MB; ++i) y[i][j] = F::Finish(acc[i], mins[i], fmins[i]);
  }
}

constexpr int64_t kInt8GroupRows = 8;  // rows taken together over one weight row (registers)
constexpr int64_t kInt8TileColumns = 16;  // past 8 rows: weight rows read once from memory, then from cache

// The group of MB live rows live[0 .. MB) (their q interleaved at `q`) against `count` weight rows.
template <class F, int MB>
void Int8Group(const Q8Row* rows, const int64_t* live, const int8_t* q, const uint8_t* w, int64_t row_bytes,
               int64_t blocks, float* y, int64_t N, int64_t count) {
  Q8Group<MB> x;
  float* out[MB];
  x.q = q;
  for (int i = 0; i < MB; ++i) {
    const Q8Row& r = rows[live[i]];
    x.d[i] = r.d;
    x.s[i] = r.s;
    x.bs[i] = r.bs;
    x.sc[i] = r.sc;
    x.sh[i] = r.sh;
    out[i] = y + live[i] * N;
  }
  Int8Rows<F, MB>(x, w, row_bytes, blocks, out, count);
}

// Columns [n0, n1) of the live rows (`live`: their indices, L of them; their q interleaved by groups
// of 8 in `q`: group g at q + g * K) against w [N, row bytes] in F.
template <class F>
void Int8Columns(const Q8Row* rows, const int64_t* live, int64_t L, const int8_t* q, const uint8_t* w, float* y,
                 int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t blocks = K / F::kWeights, row_bytes = blocks * F::kBytes;
  const int64_t tile = L <= kInt8GroupRows ? n1 - n0 : kInt8TileColumns;
  for (int64_t t = n0; t < n1; t += tile) {
    const int64_t count = t + tile <= n1 ? tile : n1 - t;
    for (int64_t g = 0; g < L; g += kInt8GroupRows) {
      const int64_t mb = L - g < kInt8GroupRows ? L - g : kInt8GroupRows;
      const uint8_t* wt = w + t * row_bytes;
      float* yt = y + t;
      const int8_t* qg = q + g * K;
      switch (mb) {
        case 1: Int8Group<F, 1>(rows, live + g, qg, wt, row_bytes, blocks, yt, N, count); break;
        case 2: Int8Group<F, 2>(rows, live + g, qg, wt, row_bytes, blocks, yt, N, count); break;
        case 3: Int8Group<F, 3>(rows, live + g, qg, wt, row_bytes, blocks, yt, N, count); break;
        case 4: Int8Group<F, 4>(rows, live + g, qg, wt, row_bytes, blocks, yt, N, count); break;
        case 5: Int8Group<F, 5>(rows, live + g, qg, wt, row_bytes, blocks, yt, N, count); break;
        case 6: Int8Group<F, 6>(rows, live + g, qg, wt, row_bytes, blocks, yt, N, count); break;
        case 7: Int8Group<F, 7>(rows, live + g, qg, wt, row_bytes, blocks, yt, N, count); break;
        default: Int8Group<F, 8>(rows, live + g, qg, wt, row_bytes, blocks, yt, N, count); break;
      }
    }
  }
}

using Int8ColumnsFn = decltype(&Int8Columns<Int8<kQ4_0>>);

struct Int8Format {
  Int8ColumnsFn columns = nullptr;
  int64_t block = 0;  // the activation's block: the weight format's
};

template <int32_t T>
Int8Format Int8Of() {
  static_assert(Int8<T>::kBytes == Format<T>::kBytes && Int8<T>::kWeights == Format<T>::kWeights);
  return {Int8Columns<Int8<T>>, Int8<T>::kWeights};
}

// The int8 form of ggml type `qtype`, or none (F16, BF16: the exact form serves them).
Int8Format Int8FormatOf(int32_t qtype) {
  switch (qtype) {
    case kQ4_0: return Int8Of<kQ4_0>();
    case kQ4_1: return Int8Of<kQ4_1>();
    case kQ5_0: return Int8Of<kQ5_0>();
    case kQ5_1: return Int8Of<kQ5_1>();
    case kQ8_0: return Int8Of<kQ8_0>();
    case kQ2_K: return Int8Of<kQ2_K>();
    case kQ3_K: return Int8Of<kQ3_K>();
    case kQ4_K: return Int8Of<kQ4_K>();
    case kQ5_K: return Int8Of<kQ5_K>();
    case kQ6_K: return Int8Of<kQ6_K>();
    case kIQ4_NL: return Int8Of<kIQ4_NL>();
    case kIQ4_XS: return Int8Of<kIQ4_XS>();
    default: return {};
  }
}

// The int8 product of x [M, K] and the matrix at wp: each live row quantized once, then the column
// chunks on the pool. Skipped rows are zeros.
void Int8Product(ffi::ThreadPool& pool, const Int8Format& f, ffi::Buffer<ffi::S32>& skip, const float* x,
                 const uint8_t* wp, float* y, int64_t M, int64_t N, int64_t K) {
  int64_t skip0, skip1;
  SkipRange(skip, M, &skip0, &skip1);
  std::vector<int64_t> live;
  for (int64_t m = 0; m < M; ++m) {
    if (m >= skip0 && m < skip1) {
      std::memset(y + m * N, 0, N * sizeof(float));
    } else {
      live.push_back(m);
    }
  }
  const int64_t B = f.block, L = static_cast<int64_t>(live.size());
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * K / B), s(B == 32 ? M * K / B : 0);
  std::vector<int16_t> bs(B == 256 ? M * K / 16 + 16 : 0);  // + 16: the last 16-sums load is 32 bytes
  std::vector<uint8_t> sc(B == 32 ? M * K / 4 : 0);  // 8 lane shifts per 32-block
  std::vector<int32_t> sh(B == 256 ? M * K / 32 : 0);
  std::vector<Q8Row> rows(M);
  for (int64_t m : live) {
    int8_t* qm = q.data() + m * K;
    float* dm = d.data() + m * (K / B);
    float* sm = B == 32 ? s.data() + m * (K / B) : nullptr;
    int16_t* bm = B == 256 ? bs.data() + m * (K / 16) : nullptr;
    uint8_t* cm = B == 32 ? sc.data() + m * (K / 4) : nullptr;
    int32_t* hm = B == 256 ? sh.data() + m * (K / 32) : nullptr;
    if (B == 32) {
      QuantizeRow<32>(x + m * K, K, qm, dm, sm, bm, cm, hm);
    } else {
      QuantizeRow<256>(x + m * K, K, qm, dm, sm, bm, cm, hm);
    }
    rows[m] = {qm, dm, sm, bm, cm, hm};
  }
  if (L == 0) return;
  // each group of 8 live rows (the last may have fewer) interleaved by 32-value runs (Q8Group)
  std::vector<int8_t> grouped(L * K);
  for (int64_t g = 0; g < L; g += kInt8GroupRows) {
    const int64_t mb = L - g < kInt8GroupRows ? L - g : kInt8GroupRows;
    for (int64_t i = 0; i < mb; ++i)
      for (int64_t r = 0; r < K / 32; ++r)
        std::memcpy(grouped.data() + g * K + (r * mb + i) * 32, q.data() + live[g + i] * K + r * 32, 32);
  }
  const Q8Row* rp = rows.data();
  const int64_t* lp = live.data();
  const int8_t* gp = grouped.data();
  const Int8ColumnsFn columns = f.columns;
  const int64_t chunk = ChunkOf(pool, N);
  ParallelFor(pool, (N + chunk - 1) / chunk, (L + kWeightWork) * N * K, [=](int64_t c) {
    const int64_t n0 = c * chunk;
    columns(rp, lp, L, gp, wp, y, K, N, n0, n0 + chunk < N ? n0 + chunk : N);
  });
}

// x [..., K] f32 times w in ggml type qtype: uint8 blocks [N, K / weights * bytes], or for F16 and
// BF16 the [N, K] array itself (its 8-weight "blocks" are 16 bytes of it).
// w is one matrix [N, cols], or a stack of them [E, N, cols] of which `index` picks one (an MoE
// layer's experts): reading the chosen matrix in place spares XLA the copy a slice of the stack costs
// (as many bytes again as the product streams).
// mapped = 1: w is a whole mapped file as uint8 rows of kFileUnit bytes [units, kFileUnit], and
// index is [u, e]: the matrices of a stack start u * kFileUnit bytes into it (one layer's tensor, in
// place in the file: a stack over layers then needs no copy of the layers into one buffer) and the
// product is with matrix e of them (an expert; 0 for a layer's one matrix); N is y's width.
// dot: 0 the exact form (every weight widened to gguf's f32 value), 1 the int8 form where the format
// has one (see "the int8 form"; F16 and BF16 take the exact form either way).
constexpr int64_t kFileUnit = 32;  // GGUF aligns every tensor to 32 bytes (general.alignment's default)
ffi::Error RowsMatmulQuantImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                               ffi::Buffer<ffi::S32> skip, ffi::Buffer<ffi::S32> index,
                               ffi::ResultBuffer<ffi::F32> y, int32_t qtype, int32_t dot, int32_t mapped) {
  const StoredFormat f = StoredFormatOf(qtype);  // the format and the form are chosen once per call
  if (!f.columns) return ffi::Error::InvalidArgument("rows_matmul_q: unsupported format");
  if (w.element_type() != f.dtype) return ffi::Error::InvalidArgument("rows_matmul_q: w has the wrong dtype");
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto yd = y->dimensions();
  if (xd.size() < 1 || yd.size() != 2) return ffi::Error::InvalidArgument("rows_matmul_q: x or y has no rows");
  const int64_t K = xd[xd.size() - 1];
  const int64_t cols = f.dtype == ffi::DataType::U8 ? K / f.weights * f.bytes : K;
  const int64_t elem = f.dtype == ffi::DataType::U8 ? 1 : 2;
  if (K % f.weights != 0) return ffi::Error::InvalidArgument("rows_matmul_q: K does not match the format");
  const uint8_t* wp = nullptr;
  int64_t N = 0;
  if (mapped) {  // [u, e] into a mapped file: bounds checked, never clamped into another tensor
    N = yd[1];
    if (f.dtype != ffi::DataType::U8 || wd.size() != 2 || wd[1] != kFileUnit || index.element_count() != 2)
      return ffi::Error::InvalidArgument("rows_matmul_q: a mapped w is uint8 [units, 32] with index [u, e]");
    const int64_t u = index.typed_data()[0], e = index.typed_data()[1];
    const int64_t start = u * kFileUnit + e * N * cols;
    if (u < 0 || e < 0 || start + N * cols > wd[0] * kFileUnit)
      return ffi::Error::InvalidArgument("rows_matmul_q: the matrix lies outside the mapped file");
    wp = static_cast<const uint8_t*>(w.untyped_data()) + start;
  } else {
    if (wd.size() != 2 && wd.size() != 3)
      return ffi::Error::InvalidArgument("rows_matmul_q: w must be [N, cols] or [E, N, cols]");
    const int64_t E = wd.size() == 3 ? wd[0] : 1;
    N = wd[wd.size() - 2];
    if (wd[wd.size() - 1] != cols || yd[1] != N) return ffi::Error::InvalidArgument("rows_matmul_q: K does not match w");
    int64_t e = index.element_count() ? index.typed_data()[0] : 0;
    e = e < 0 ? 0 : e >= E ? E - 1 : e;  // as XLA clamps a dynamic index
    wp = static_cast<const uint8_t*>(w.untyped_data()) + e * N * cols * elem;
  }
  const int64_t M = K ? x.element_count() / K : 0;
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  if (dot == 1) {
    const Int8Format fast = Int8FormatOf(qtype);
    if (fast.columns) {
      Int8Product(pool, fast, skip, xp, wp, yp, M, N, K);
      return ffi::Error::Success();
    }
  }
  const ColumnsFn columns = f.columns;
  OverColumns(pool, skip, xp, yp, M, N, K,
              [=](const float* xc, float* yc, int64_t m, int64_t n0, int64_t n1, int64_t skip0, int64_t skip1) {
                columns(xc, wp, yc, m, K, N, n0, n1, skip0, skip1);
              });
  return ffi::Error::Success();
}

// ---- decode_attention ---------------------------------------------------------------------------

// Eight cached values as f32, for the three cache dtypes: f32 as is, f16 through F16C (exact), bf16
// by the 16-bit shift (exact). The dots and sums are the f32 ones either way.
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
struct Half {
  uint16_t bits;
};
struct Brain {
  uint16_t bits;
};
inline __m256 Load8(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 Load8(const Brain* p) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

// Dot products of one query [D] with keys [n, D], 4 keys at a time for independent FMA chains.
template <typename T>
void Scores(const float* q, const T* keys, int64_t n, int64_t D, float scale, float* s) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const T* k0 = keys + j * D;
    for (int64_t d = 0; d < D; d += 8) {
      __m256 qd = _mm256_loadu_ps(q + d);
      a0 = _mm256_fmadd_ps(qd, Load8(k0 + d), a0);
      a1 = _mm256_fmadd_ps(qd, Load8(k0 + D + d), a1);
      a2 = _mm256_fmadd_ps(qd, Load8(k0 + 2 * D + d), a2);
      a3 = _mm256_fmadd_ps(qd, Load8(k0 + 3 * D + d), a3);
    }
    s[j] = HorizontalSum(a0) * scale;
    s[j + 1] = HorizontalSum(a1) * scale;
    s[j + 2] = HorizontalSum(a2) * scale;
    s[j + 3] = HorizontalSum(a3) * scale;
  }
  for (; j < n; ++j) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), Load8(keys + j * D + d), a);
    s[j] = HorizontalSum(a) * scale;
  }
}

// out[D] = sum_j p[j] * values[j] / total, D a multiple of 8 and at most 256.
template <typename T>
void Mix(const float* p, const T* values, int64_t n, int64_t D, float total, float* out) {
  __m256 acc[32];
  const int64_t lanes = D / 8;
  for (int64_t i = 0; i < lanes; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m256 pj = _mm256_set1_ps(p[j]);
    const T* vj = values + j * D;
    for (int64_t i = 0; i < lanes; ++i) acc[i] = _mm256_fmadd_ps(pj, Load8(vj + 8 * i), acc[i]);
  }
  __m256 inv = _mm256_set1_ps(1.0f / total);
  for (int64_t i = 0; i < lanes; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], inv));
}

// Row b's query heads h*G .. h*G+G-1 attend to positions 0..pos[b] of slot slots[b], kv head h.
template <typename T>
void Attend(ffi::ThreadPool& pool, const float* qp, const T* kp, const T* vp, int64_t li, const int32_t* sp,
            const int32_t* pp, float* op, int64_t B, int64_t N, int64_t D, int64_t S, int64_t KH, int64_t C,
            float scale) {
  const int64_t G = N / KH;
  int64_t work = 0;  // multiply-adds: every row's filled positions, keys and values, all heads
  for (int64_t b = 0; b < B; ++b) work += (int64_t(pp[b]) + 1) * 2 * N * D * kWeightWork;  // each value read once
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
}

// q [B, N, D] f32; k, v caches [L, S, KH, C, D], both f32, f16 or bf16; layer []; slots, pos [B];
// out [B, N, D] f32.
ffi::Error DecodeAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                               ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> slots, ffi::Buffer<ffi::S32> pos,
                               ffi::ResultBuffer<ffi::F32> out, float scale) {
  auto qd = q.dimensions();
  auto cd = k.dimensions();
  auto vd = v.dimensions();
  if (qd.size() != 3 || cd.size() != 5 || vd.size() != 5)
    return ffi::Error::InvalidArgument("decode_attention: bad ranks");
  for (int i = 0; i < 5; ++i)
    if (cd[i] != vd[i]) return ffi::Error::InvalidArgument("decode_attention: k and v caches differ in shape");
  const ffi::DataType dtype = k.element_type();
  if (v.element_type() != dtype) return ffi::Error::InvalidArgument("decode_attention: k and v caches differ in dtype");
  const int64_t B = qd[0], N = qd[1], D = qd[2];
  const int64_t L = cd[0], S = cd[1], KH = cd[2], C = cd[3];
  if (cd[4] != D || D % 8 != 0 || D > 256 || KH == 0 || N % KH != 0)
    return ffi::Error::InvalidArgument("decode_attention: bad head shapes");
  const int64_t li = layer.typed_data()[0];
  if (li < 0 || li >= L) return ffi::Error::InvalidArgument("decode_attention: layer out of range");
  const float* qp = q.typed_data();
  const int32_t* sp = slots.typed_data();
  const int32_t* pp = pos.typed_data();
  float* op = out->typed_data();
  const auto attend = [&](auto tag) {
    using T = decltype(tag);
    Attend(pool, qp, static_cast<const T*>(k.untyped_data()), static_cast<const T*>(v.untyped_data()), li, sp, pp, op,
           B, N, D, S, KH, C, scale);
  };
  switch (dtype) {
    case ffi::DataType::F32: attend(float{}); break;
    case ffi::DataType::F16: attend(Half{}); break;
    case ffi::DataType::BF16: attend(Brain{}); break;
    default: return ffi::Error::InvalidArgument("decode_attention: caches must be f32, f16 or bf16");
  }
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
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("qtype")
                                  .Attr<int32_t>("dot")
                                  .Attr<int32_t>("mapped"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PantheonDecodeAttention, DecodeAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
