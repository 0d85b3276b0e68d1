// Two decode-step kernels for x86 CPUs with AVX2 and FMA, called from jitted JAX code through XLA's
// FFI (pantheon/native.py builds and registers them):
//
// * rows_matmul: y[m, n] = sum_k x[m, k] * w[n, k] for a few rows. XLA:CPU hands an [8, K] x [K, N]
//   product to a general GEMM that packs the weight panel on every call and reaches ~36 GFLOP/s
//   here, so 8 decode rows cost twice one row although both stream the same weights. Here each
//   weight row is loaded once and multiplied into up to 8 activation rows held in L1.
// * decode_attention: one query token per row against its own slot of the KV cache, read in place
//   up to the row's position. The XLA form gathers a bucketed span of every row's slot into a new
//   array first and masks the unused tail; this reads only the filled positions and copies nothing.
//
// Both compute every output element in an order that does not depend on the other rows of the call
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

void ParallelFor(ffi::ThreadPool& pool, int64_t n, std::function<void(int64_t)> task) {
  auto tasks = std::make_shared<Tasks>();  // kept alive by whichever of caller and helpers ends last
  tasks->task = std::move(task);
  tasks->n = n;
  int64_t threads = pool.num_threads();
  for (int64_t t = 1; t < threads && t < n; ++t) pool.Schedule([tasks] { tasks->Work(); });
  tasks->Work();
  while (tasks->done.load(std::memory_order_acquire) < n) _mm_pause();
}

// ---- rows_matmul --------------------------------------------------------------------------------

// Rows [0, MB) of x times weight rows [n0, n1), NB weight rows at a time (MB * NB accumulators).
template <int MB, int NB>
void Tile(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
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
      for (int j = 0; j < NB; ++j) y[i * N + n + j] = HorizontalSum(acc[i][j]);
  }
  if (n < n1) Tile<MB, 1>(x, w, y, K, N, n, n1);
}

// All M rows against weight rows [n0, n1): blocks of 8 rows, then the remainder.
void Rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) Tile<8, 1>(x + m * K, w, y + m * N, K, N, n0, n1);
  const float* xr = x + m * K;
  float* yr = y + m * N;
  switch (M - m) {
    case 7: Tile<7, 1>(xr, w, yr, K, N, n0, n1); break;
    case 6: Tile<6, 2>(xr, w, yr, K, N, n0, n1); break;
    case 5: Tile<5, 2>(xr, w, yr, K, N, n0, n1); break;
    case 4: Tile<4, 2>(xr, w, yr, K, N, n0, n1); break;
    case 3: Tile<3, 3>(xr, w, yr, K, N, n0, n1); break;
    case 2: Tile<2, 4>(xr, w, yr, K, N, n0, n1); break;
    case 1: Tile<1, 4>(xr, w, yr, K, N, n0, n1); break;
    default: break;
  }
}

ffi::Error RowsMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                          ffi::ResultBuffer<ffi::F32> y) {
  auto wd = w.dimensions();
  if (wd.size() != 2) return ffi::Error::InvalidArgument("rows_matmul: w must be [N, K]");
  const int64_t N = wd[0], K = wd[1];
  if (K % 8 != 0) return ffi::Error::InvalidArgument("rows_matmul: K must be a multiple of 8");
  const int64_t M = K ? x.element_count() / K : 0;
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  // Four chunks of output columns a thread (balance when a core is busy), multiples of 4 rows of w.
  int64_t threads = pool.num_threads() < 1 ? 1 : pool.num_threads();
  int64_t chunk = (N + threads * 4 - 1) / (threads * 4);
  chunk = chunk < 4 ? 4 : (chunk + 3) / 4 * 4;
  ParallelFor(pool, (N + chunk - 1) / chunk, [=](int64_t c) {
    int64_t n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
    Rows(xp, wp, yp, M, K, N, n0, n1);
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
  ParallelFor(pool, B * KH, [=](int64_t task) {
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
                                  .Ret<ffi::Buffer<ffi::F32>>());

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
