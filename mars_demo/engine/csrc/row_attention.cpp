// Row-exact attention for short passes on the CPU (mars_demo/engine/rowattn.py).
//
// Every query row attends alone: its output depends only on its query and on the sequence of keys
// and values it may see, never on the other rows of the call, their number or the keys it may not
// see. A row computed in a one-token pass and the same row in a wider pass (MARS, exact mode) or a
// batch therefore agree bit for bit. Within a row the order of every sum is fixed by the row's own
// visible keys: scores are dot products over the head dimension (8-lane partial sums, then a fixed
// tree; eight keys' trees at once), the softmax sums in 8 lanes by position, and the values
// accumulate key by key.
//
// Built at run time by native.py (g++ -O3 -march=native -fopenmp, no fast-math) and called through
// ctypes by rowattn.py. Threads: torch's own OpenMP team.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f load8(const float* p) {
  v8f v;
  memcpy(&v, p, sizeof(v));
  return v;
}

static inline void store8(float* p, v8f v) { memcpy(p, &v, sizeof(v)); }

static inline float hsum8(v8f v) {
  // a fixed pairwise order, neighbours first: the one sums8 takes
  float a = (v[0] + v[1]) + (v[2] + v[3]);
  float b = (v[4] + v[5]) + (v[6] + v[7]);
  return a + b;
}

// hsum8 of eight vectors at once: their sums as one vector, each summed in hsum8's order
static inline v8f sums8(v8f a0, v8f a1, v8f a2, v8f a3, v8f a4, v8f a5, v8f a6, v8f a7) {
#if defined(__AVX__)
  // neighbours (hadd), then pairs of those (hadd), then the two 128-bit halves
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_permute2f128_ps(u0, u1, 0x20) + _mm256_permute2f128_ps(u0, u1, 0x31);
#else
  return v8f{hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3), hsum8(a4), hsum8(a5), hsum8(a6), hsum8(a7)};
#endif
}

// Element-by-element work (the values' accumulators, decoder.cpp's SiLU), where a vector's width
// changes no bits: 16 floats where the CPU has AVX-512 (half the instructions), else 8.
#if defined(__AVX512F__)
#define VALUE_LANES 16
#else
#define VALUE_LANES 8
#endif
typedef float vv __attribute__((vector_size(VALUE_LANES * sizeof(float))));
typedef int32_t vvi __attribute__((vector_size(VALUE_LANES * sizeof(int32_t))));

static inline v8f splat(float a) { return v8f{a, a, a, a, a, a, a, a}; }

// exp(x) for x <= 0 (scores minus their maximum), Cephes' expf polynomial, a vector at a time: F is
// a float vector and I the int32 vector of its width. Lane by lane, so the width changes no bits.
template <typename F, typename I>
__attribute__((always_inline)) static inline F exp_lanes(F x) {
  const F lo = F{} + -87.33654f;
  x = x < lo ? lo : x;
  F n = x * 1.44269504088896341f + 0.5f;
  I ni = __builtin_convertvector(n, I);  // truncation toward zero
  F nf = __builtin_convertvector(ni, F);
  ni = nf > n ? ni - 1 : ni;  // floor
  nf = __builtin_convertvector(ni, F);
  x = x - nf * 0.693359375f;
  x = x - nf * -2.12194440e-4f;
  F z = x * x;
  F p = F{} + 1.9875691500e-4f;
  p = p * x + 1.3981999507e-3f;
  p = p * x + 8.3334519073e-3f;
  p = p * x + 4.1665795894e-2f;
  p = p * x + 1.6666665459e-1f;
  p = p * x + 5.0000001201e-1f;
  p = p * z + x + 1.0f;
  I bits = (ni + 127) << 23;
  F scale;
  memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

__attribute__((always_inline)) static inline v8f exp8(v8f x) { return exp_lanes<v8f, v8i>(x); }

struct Call {
  const float* q; int64_t qb, qh, qr;   // query (batch, heads, rows, dim): strides in floats, dim contiguous
  const float* k; int64_t kb, kh, ks;   // keys (batch, kv heads, keys, dim)
  const float* v; int64_t vb, vh, vs;   // values, as keys
  float* out;                           // (batch, rows, heads, dim), contiguous
  int64_t batch, heads, kv_heads, rows, keys, dim;
  const int64_t* ranges;                // [start, end) pairs of visible keys, by row; null: causal
  const int64_t* offsets;               // row (b * rows + i) owns ranges offsets[r] .. offsets[r + 1] - 1
  float scale;
};

// The dot product of q and k over dim (a multiple of 8 when D8 > 0): 8-lane partial sums, then a fixed tree.
template <int D8>
static inline float dot(const float* q, const float* k, int64_t d) {
  v8f acc = splat(0.0f);
  const int64_t n8 = D8 > 0 ? D8 * 8 : d - d % 8;
  for (int64_t t = 0; t < n8; t += 8) acc += load8(q + t) * load8(k + t);
  float s = hsum8(acc);
  if (D8 == 0)
    for (int64_t t = n8; t < d; t++) s += q[t] * k[t];
  return s;
}

// One row, heads h0 .. h1 - 1: q row (b, i) over its visible keys. D8: dim / 8 when the dim is 64 or
// 128 (the accumulators stay in registers), 0 for any dim. A model always takes the same branch.
template <int D8>
static void attend_row(const Call* c, int64_t b, int64_t i, int64_t h0, int64_t h1, float* scores) {
  const int64_t d = c->dim, group = c->heads / c->kv_heads;
  int64_t causal_range[2];
  const int64_t* ranges;
  int64_t n_ranges;
  if (c->ranges) {
    const int64_t r = b * c->rows + i;
    ranges = c->ranges + 2 * c->offsets[r];
    n_ranges = c->offsets[r + 1] - c->offsets[r];
  } else {
    causal_range[0] = 0;
    causal_range[1] = c->keys - c->rows + i + 1;
    ranges = causal_range;
    n_ranges = 1;
  }
  const int64_t d8 = D8 > 0 ? D8 * 8 : d - d % 8;
  for (int64_t h = h0; h < h1; h++) {
    const float* q = c->q + b * c->qb + h * c->qh + i * c->qr;
    const int64_t kvh = h / group;
    const float* kbase = c->k + b * c->kb + kvh * c->kh;
    const float* vbase = c->v + b * c->vb + kvh * c->vh;
    float* out = c->out + ((b * c->rows + i) * c->heads + h) * d;
    // scores, in the order of the visible keys; eight keys at a time for independent chains
    int64_t m = 0;
    for (int64_t g = 0; g < n_ranges; g++) {
      int64_t j = ranges[2 * g];
      const int64_t end = ranges[2 * g + 1];
      for (; j + 8 <= end; j += 8) {
        const float* kj = kbase + j * c->ks;
        const int64_t ks = c->ks;
        v8f a0 = splat(0.0f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t t = 0; t < d8; t += 8) {
          const v8f qt = load8(q + t);
          a0 += qt * load8(kj + t);
          a1 += qt * load8(kj + ks + t);
          a2 += qt * load8(kj + 2 * ks + t);
          a3 += qt * load8(kj + 3 * ks + t);
          a4 += qt * load8(kj + 4 * ks + t);
          a5 += qt * load8(kj + 5 * ks + t);
          a6 += qt * load8(kj + 6 * ks + t);
          a7 += qt * load8(kj + 7 * ks + t);
        }
        v8f block = sums8(a0, a1, a2, a3, a4, a5, a6, a7);
        if (D8 == 0) {
          for (int u = 0; u < 8; u++) {
            float tail = block[u];
            for (int64_t t = d8; t < d; t++) tail += q[t] * kj[u * ks + t];
            block[u] = tail;
          }
        }
        store8(scores + m, block * c->scale);
        m += 8;
      }
      for (; j < end; j++) scores[m++] = dot<D8>(q, kbase + j * c->ks, d) * c->scale;
    }
    if (m == 0) {  // nothing visible (a padding row): zeros
      memset(out, 0, d * sizeof(float));
      continue;
    }
    // the largest score: eight running maxima, then theirs (a maximum is exact in any order)
    v8f tops = splat(scores[0]);
    int64_t j = 0;
    for (; j + 8 <= m; j += 8) {
      const v8f sj = load8(scores + j);
      tops = sj > tops ? sj : tops;
    }
    float top = tops[0];
    for (int u = 1; u < 8; u++) top = tops[u] > top ? tops[u] : top;
    for (; j < m; j++) top = scores[j] > top ? scores[j] : top;
    // exponentials and their sum, in 8 lanes by position
    for (int64_t j = m; j < m + 8; j++) scores[j] = -INFINITY;  // the tail's unused lanes: exp gives 0
    v8f lanes = splat(0.0f);
    for (int64_t j = 0; j < m; j += 8) {
      v8f e = exp8(load8(scores + j) - top);
      store8(scores + j, e);
      lanes += e;
    }
    const float inv = 1.0f / hsum8(lanes);
    // values, key by key
    if (D8 > 0) {
      constexpr int N = D8 * 8 / VALUE_LANES;
      vv acc[N > 0 ? N : 1];
      for (int u = 0; u < N; u++) acc[u] = vv{} + 0.0f;
      int64_t at = 0;
      for (int64_t g = 0; g < n_ranges; g++) {
        for (int64_t j = ranges[2 * g]; j < ranges[2 * g + 1]; j++, at++) {
          const float* vj = vbase + j * c->vs;
          const vv p = vv{} + scores[at];
          for (int u = 0; u < N; u++) {
            vv value;
            memcpy(&value, vj + VALUE_LANES * u, sizeof(value));
            acc[u] += p * value;
          }
        }
      }
      for (int u = 0; u < N; u++) {
        const vv o = acc[u] * inv;
        memcpy(out + VALUE_LANES * u, &o, sizeof(o));
      }
    } else {
      for (int64_t t = 0; t < d; t++) out[t] = 0.0f;
      int64_t at = 0;
      for (int64_t g = 0; g < n_ranges; g++) {
        for (int64_t j = ranges[2 * g]; j < ranges[2 * g + 1]; j++, at++) {
          const float* vj = vbase + j * c->vs;
          const float p = scores[at];
          for (int64_t t = 0; t < d; t++) out[t] += p * vj[t];
        }
      }
      for (int64_t t = 0; t < d; t++) out[t] *= inv;
    }
  }
}

// Units (b * rows + i) * heads + h, first .. last - 1: each one computed whole by one thread, so how
// the units are split over threads changes no bits.
static int run_units(const Call* c, int64_t first, int64_t last) {
  float* scores = (float*)malloc((c->keys + 16) * sizeof(float));
  if (!scores) return 1;
  while (first < last) {
    const int64_t r = first / c->heads, h0 = first % c->heads;
    const int64_t h1 = h0 + (last - first) < c->heads ? h0 + (last - first) : c->heads;
    if (c->dim == 64)
      attend_row<8>(c, r / c->rows, r % c->rows, h0, h1, scores);
    else if (c->dim == 128)
      attend_row<16>(c, r / c->rows, r % c->rows, h0, h1, scores);
    else
      attend_row<0>(c, r / c->rows, r % c->rows, h0, h1, scores);
    first += h1 - h0;
  }
  free(scores);
  return 0;
}

// All units of c, split evenly by count over up to `threads` of torch's OpenMP threads.
static int attend_all(const Call* c, int64_t threads) {
  const int64_t total = c->batch * c->rows * c->heads;
  if (threads > total) threads = total;
  int failed = 0;
#if defined(_OPENMP)
  if (threads > 1) {
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
      const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
      failed |= run_units(c, total * t / n, total * (t + 1) / n);
    }
    return failed;
  }
#endif
  return run_units(c, 0, total);
}

extern "C" int row_attention(
    const float* q, int64_t qb, int64_t qh, int64_t qr, const float* k, int64_t kb, int64_t kh, int64_t ks,
    const float* v, int64_t vb, int64_t vh, int64_t vs, float* out, int64_t batch, int64_t heads,
    int64_t kv_heads, int64_t rows, int64_t keys, int64_t dim, const int64_t* ranges, const int64_t* offsets,
    float scale, int64_t threads) {
  Call c = {q, qb, qh, qr, k, kb, kh, ks, v, vb, vh, vs, out, batch, heads, kv_heads, rows, keys, dim,
            ranges, offsets, scale};
  return attend_all(&c, threads);
}
