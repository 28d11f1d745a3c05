// Row-exact int8 x int8 linear on the CPU: int8dyn's linear (mars_demo/engine/int8gemm.py).
//
// y = x W^T + b with one activation scale per row and one weight scale per output channel, the
// arithmetic of kernels.RowInt8Linear's fbgemm call bit for bit: each row is divided by its
// largest magnitude, coded as uint8 around 128 (code = nearbyint(x / max * inverse) + 128, clamped
// to 0..255), multiplied by the 7-bit weights with exact int32 sums, and the sum s becomes
// (float(s) * scale[j]) * max (+ b[j]), where scale[j] is the input step times the channel's
// weight scale. Integer sums are exact in any order, so a row's output never depends on the other
// rows of the call or on how the columns are split over threads.
//
// What it saves over fbgemm at a few rows is not arithmetic: fbgemm's call packs its input for
// every GEMM, and the row scaling around it is five more torch ops. Here one call does it all.
//
// The weights are packed once (int8gemm.pack): blocks of 8 output columns, each block's bytes in
// steps of 4 inputs, [block][in / 4][8 columns][4 inputs], columns padded to 16 and inputs to 4
// with zeros. One 32-byte load is then 8 columns x 4 inputs, multiplied by a row's 4 codes
// broadcast to every lane (vpmaddubsw, then vpmaddwd by ones): the 8 lanes of the accumulator are
// 8 columns' sums, with no horizontal sum at the end, and a tile of 16 columns streams two
// contiguous blocks while up to 4 rows reuse every load.
//
// Built at run time by native.py (g++ -O3 -march=native -fopenmp -ffp-contract=off, no fast-math) and
// called through ctypes.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t COLS = 8;    // columns in a packed block
constexpr int64_t DEPTH = 4;   // inputs a block holds together for each column
constexpr int64_t TILE = 16;   // columns a tile computes (two blocks): the unit of work handed out

inline int64_t padded(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

struct Linear {
  const uint8_t* codes;  // (rows, depth): each row's codes, then zeros up to depth
  const float* row_max;  // (rows)
  int64_t rows, in, out;
  const int8_t* packed;  // (padded(out, TILE) / COLS, depth / DEPTH, COLS, DEPTH): see the top
  const int32_t* weight_sums;  // (out): 128 * sum of the channel's weights
  const float* scale;  // (out): input step * weight scale
  const float* bias;  // (out) or null
  float* y;  // (rows, out)
  int64_t depth() const { return padded(in, DEPTH); }
};

inline void finish(const Linear& L, int64_t r, int64_t c, int32_t sum) {
  float v = (float)(sum - L.weight_sums[c]) * L.scale[c];
  v = v * L.row_max[r];
  if (L.bias) v = v + L.bias[c];
  L.y[r * L.out + c] = v;
}

#if defined(__AVX2__)
#ifndef PREFETCH_TILES
#define PREFETCH_TILES 1
#endif
// Row r0 + r's accumulators, each 8 columns' sums (a tile's two blocks)
struct Pair {
  __m256i first, second;
};

// rows r0 .. r0 + R - 1 times the 16 columns of tile t. The accumulators are named variables, not
// an array: g++ keeps an array of them in memory, and every step then waits for its own store.
template <int R>
inline void tile(const Linear& L, int64_t r0, int64_t t) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i zero = _mm256_setzero_si256();
  Pair p0{zero, zero}, p1{zero, zero}, p2{zero, zero}, p3{zero, zero};
  const int64_t depth = L.depth(), steps = depth / DEPTH;
  const int8_t* w0 = L.packed + t * TILE * depth;
  const int8_t* w1 = w0 + COLS * depth;
  const int8_t* ahead = w0 + PREFETCH_TILES * TILE * depth;  // the same bytes of a later tile
  const bool fetch = ahead + TILE * depth <= L.packed + padded(L.out, TILE) * depth;
  const uint8_t* a = L.codes + r0 * depth;
  for (int64_t s = 0; s < steps; s++) {
    if (fetch && (s & 1) == 0) {  // one 64-byte line of each block every two steps
      _mm_prefetch((const char*)(ahead + s * 32), _MM_HINT_T0);
      _mm_prefetch((const char*)(ahead + COLS * depth + s * 32), _MM_HINT_T0);
    }
    const __m256i b0 = _mm256_loadu_si256((const __m256i*)(w0 + s * 32));
    const __m256i b1 = _mm256_loadu_si256((const __m256i*)(w1 + s * 32));
    auto step = [&](int r, Pair& p) {
      int32_t four;  // the row's 4 codes of this step, in every lane
      memcpy(&four, a + r * depth + s * DEPTH, sizeof(four));
      const __m256i av = _mm256_set1_epi32(four);
      p.first = _mm256_add_epi32(p.first, _mm256_madd_epi16(_mm256_maddubs_epi16(av, b0), ones));
      p.second = _mm256_add_epi32(p.second, _mm256_madd_epi16(_mm256_maddubs_epi16(av, b1), ones));
    };
    step(0, p0);
    if constexpr (R > 1) step(1, p1);
    if constexpr (R > 2) step(2, p2);
    if constexpr (R > 3) step(3, p3);
  }
  const int64_t c0 = t * TILE, n = L.out - c0 < TILE ? L.out - c0 : TILE;
  auto store = [&](int r, const Pair& p) {
    int32_t sums[TILE];
    _mm256_storeu_si256((__m256i*)sums, p.first);
    _mm256_storeu_si256((__m256i*)(sums + COLS), p.second);
    for (int64_t j = 0; j < n; j++) finish(L, r0 + r, c0 + j, sums[j]);
  };
  store(0, p0);
  if constexpr (R > 1) store(1, p1);
  if constexpr (R > 2) store(2, p2);
  if constexpr (R > 3) store(3, p3);
}
#endif

// tiles t_from .. t_to - 1, every row
void tiles(const Linear& L, int64_t t_from, int64_t t_to) {
#if defined(__AVX2__)
  for (int64_t t = t_from; t < t_to; t++) {
    int64_t r = 0;
    for (; r + 4 <= L.rows; r += 4) tile<4>(L, r, t);
    switch (L.rows - r) {
      case 3: tile<3>(L, r, t); break;
      case 2: tile<2>(L, r, t); break;
      case 1: tile<1>(L, r, t); break;
    }
  }
#else
  const int64_t depth = L.depth();
  for (int64_t c = t_from * TILE; c < t_to * TILE && c < L.out; c++) {
    const int8_t* w = L.packed + (c / COLS) * COLS * depth + (c % COLS) * DEPTH;
    for (int64_t r = 0; r < L.rows; r++) {
      const uint8_t* a = L.codes + r * depth;
      int32_t s = 0;
      for (int64_t k = 0; k < L.in; k++) s += (int32_t)a[k] * (int32_t)w[(k / DEPTH) * COLS * DEPTH + k % DEPTH];
      finish(L, r, c, s);
    }
  }
#endif
}

// Each row divided by its largest magnitude and coded as uint8 around 128 (fbgemm's arithmetic),
// then zeros up to the packed depth.
void code_rows(const float* x, int64_t rows, int64_t in, int64_t x_stride, float inverse, uint8_t* codes,
               float* row_max) {
  const int64_t depth = padded(in, DEPTH);
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * x_stride;
    float m = 0.0f;
    for (int64_t k = 0; k < in; k++) {
      float a = fabsf(xr[k]);
      m = a > m ? a : m;
    }
    m = m < 1e-30f ? 1e-30f : m;
    row_max[r] = m;
    uint8_t* cr = codes + r * depth;
    for (int64_t k = 0; k < in; k++) {
      float q = nearbyintf((xr[k] / m) * inverse) + 128.0f;
      q = q < 0.0f ? 0.0f : (q > 255.0f ? 255.0f : q);
      cr[k] = (uint8_t)q;
    }
    for (int64_t k = in; k < depth; k++) cr[k] = 0;
  }
}

// L's sums and float ends, its tiles split evenly over up to `threads` of torch's OpenMP threads:
// which thread computes a column changes no bits.
void run_linear(const Linear& L, int64_t threads) {
  const int64_t n_tiles = padded(L.out, TILE) / TILE;
  if (threads > n_tiles) threads = n_tiles;
#if defined(_OPENMP)
  if (threads > 1) {
    // torch's own OpenMP threads (native.py links the runtime torch has loaded): no second pool
    // competes with them for the cores
#pragma omp parallel num_threads(threads)
    {
      const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
      tiles(L, n_tiles * t / n, n_tiles * (t + 1) / n);
    }
    return;
  }
#endif
  tiles(L, 0, n_tiles);
}

}  // namespace

extern "C" {

// y (rows, out) = the row-exact int8 linear of x (rows, in; rows `x_stride` floats apart) and the
// packed weights. inverse: 1 / the input step (float), as fbgemm quantizes with. Returns 0, or 1
// when out of memory.
int int8_linear(const float* x, int64_t rows, int64_t in, int64_t x_stride, const int8_t* packed,
                const int32_t* weight_sums, const float* scale, const float* bias, int64_t out, float* y,
                float inverse, int64_t threads) {
  uint8_t* codes = (uint8_t*)malloc((size_t)(rows * padded(in, DEPTH) + 1));
  float* row_max = (float*)malloc(sizeof(float) * (size_t)(rows + 1));
  if (!codes || !row_max) {
    free(codes);
    free(row_max);
    return 1;
  }
  code_rows(x, rows, in, x_stride, inverse, codes, row_max);
  Linear L{codes, row_max, rows, in, out, packed, weight_sums, scale, bias, y};
  run_linear(L, threads);
  free(codes);
  free(row_max);
  return 0;
}
}
