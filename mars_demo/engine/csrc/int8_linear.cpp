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

struct Linear {
  const uint8_t* codes;  // (rows, in)
  const float* row_max;  // (rows)
  int64_t rows, in, out;
  const int8_t* weight;  // (out, in)
  const int32_t* weight_sums;  // (out): 128 * sum of the channel's weights
  const float* scale;  // (out): input step * weight scale
  const float* bias;  // (out) or null
  float* y;  // (rows, out)
  int64_t block;  // columns per unit of work handed out
};

inline int32_t dot_tail(const uint8_t* a, const int8_t* w, int64_t from, int64_t to) {
  int32_t s = 0;
  for (int64_t k = from; k < to; k++) s += (int32_t)a[k] * (int32_t)w[k];
  return s;
}

#if defined(__AVX2__)
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 8
#endif
inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// sums[r][c] = codes of rows r0, r0 + 1 (R of them) . weights of columns c0 .. c0 + 3
template <int R>
inline void tile(const Linear& L, int64_t r0, int64_t c0, int32_t sums[2][4]) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R][4];
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 4; c++) acc[r][c] = _mm256_setzero_si256();
  const int64_t in = L.in, body = in & ~(int64_t)31;
  const int8_t* w = L.weight + c0 * in;
  const uint8_t* a = L.codes + r0 * in;
  const int8_t* ahead = w + PREFETCH_BLOCKS * 4 * in;  // the weights of a later block of columns
  const int8_t* end = L.weight + L.out * in;
  for (int64_t k = 0; k < body; k += 32) {
    if (ahead + 4 * k + 128 <= end) {  // 4 columns' 32 bytes a step: the later block's 128 bytes
      _mm_prefetch((const char*)(ahead + 4 * k), _MM_HINT_T0);
      _mm_prefetch((const char*)(ahead + 4 * k + 64), _MM_HINT_T0);
    }
    __m256i wv[4];
    for (int c = 0; c < 4; c++) wv[c] = _mm256_loadu_si256((const __m256i*)(w + c * in + k));
    for (int r = 0; r < R; r++) {
      __m256i av = _mm256_loadu_si256((const __m256i*)(a + r * in + k));
      for (int c = 0; c < 4; c++)
        acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(_mm256_maddubs_epi16(av, wv[c]), ones));
    }
  }
  for (int r = 0; r < R; r++)
    for (int c = 0; c < 4; c++) sums[r][c] = hsum(acc[r][c]) + dot_tail(a + r * in, w + c * in, body, in);
}

inline int32_t column(const Linear& L, int64_t r, int64_t c) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc = _mm256_setzero_si256();
  const int64_t in = L.in, body = in & ~(int64_t)31;
  const int8_t* w = L.weight + c * in;
  const uint8_t* a = L.codes + r * in;
  for (int64_t k = 0; k < body; k += 32)
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(
        _mm256_loadu_si256((const __m256i*)(a + k)), _mm256_loadu_si256((const __m256i*)(w + k))), ones));
  return hsum(acc) + dot_tail(a, w, body, in);
}
#else
inline int32_t column(const Linear& L, int64_t r, int64_t c) {
  return dot_tail(L.codes + r * L.in, L.weight + c * L.in, 0, L.in);
}
#endif

inline void finish(const Linear& L, int64_t r, int64_t c, int32_t sum) {
  float v = (float)(sum - L.weight_sums[c]) * L.scale[c];
  v = v * L.row_max[r];
  if (L.bias) v = v + L.bias[c];
  L.y[r * L.out + c] = v;
}

void columns(const Linear& L, int64_t c_from, int64_t c_to) {
  int64_t c = c_from;
#if defined(__AVX2__)
  int32_t sums[2][4];
  for (; c + 4 <= c_to; c += 4) {
    int64_t r = 0;
    for (; r + 2 <= L.rows; r += 2) {
      tile<2>(L, r, c, sums);
      for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) finish(L, r + i, c + j, sums[i][j]);
    }
    if (r < L.rows) {
      tile<1>(L, r, c, sums);
      for (int j = 0; j < 4; j++) finish(L, r, c + j, sums[0][j]);
    }
  }
#endif
  for (; c < c_to; c++)
    for (int64_t r = 0; r < L.rows; r++) finish(L, r, c, column(L, r, c));
}

void share_of_columns(const Linear& L, int64_t share, int64_t shares) {
  // whole blocks of columns, split evenly by count: which thread computes a column changes no bits
  const int64_t blocks = (L.out + L.block - 1) / L.block;
  const int64_t from = blocks * share / shares * L.block, to = blocks * (share + 1) / shares * L.block;
  columns(L, from, to < L.out ? to : L.out);
}

// Each row divided by its largest magnitude and coded as uint8 around 128 (fbgemm's arithmetic).
void code_rows(const float* x, int64_t rows, int64_t in, int64_t x_stride, float inverse, uint8_t* codes,
               float* row_max) {
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * x_stride;
    float m = 0.0f;
    for (int64_t k = 0; k < in; k++) {
      float a = fabsf(xr[k]);
      m = a > m ? a : m;
    }
    m = m < 1e-30f ? 1e-30f : m;
    row_max[r] = m;
    uint8_t* cr = codes + r * in;
    for (int64_t k = 0; k < in; k++) {
      float q = nearbyintf((xr[k] / m) * inverse) + 128.0f;
      q = q < 0.0f ? 0.0f : (q > 255.0f ? 255.0f : q);
      cr[k] = (uint8_t)q;
    }
  }
}

// L's sums and float ends, its column blocks split over up to `threads` of torch's OpenMP threads.
void run_linear(const Linear& L, int64_t threads) {
  const int64_t blocks = (L.out + L.block - 1) / L.block;
  if (threads > blocks) threads = blocks;
#if defined(_OPENMP)
  if (threads > 1) {
    // torch's own OpenMP threads (native.py links the runtime torch has loaded): no second pool
    // competes with them for the cores
#pragma omp parallel num_threads(threads)
    share_of_columns(L, omp_get_thread_num(), omp_get_num_threads());
    return;
  }
#endif
  columns(L, 0, L.out);
}

}  // namespace

extern "C" {

// y (rows, out) = the row-exact int8 linear of x (rows, in; rows `x_stride` floats apart).
// inverse: 1 / the input step (float), as fbgemm quantizes with. Returns 0, or 1 when out of memory.
int int8_linear(const float* x, int64_t rows, int64_t in, int64_t x_stride, const int8_t* weight,
                const int32_t* weight_sums, const float* scale, const float* bias, int64_t out, float* y,
                float inverse, int64_t threads) {
  uint8_t* codes = (uint8_t*)malloc((size_t)(rows * in + 1));
  float* row_max = (float*)malloc(sizeof(float) * (size_t)(rows + 1));
  if (!codes || !row_max) {
    free(codes);
    free(row_max);
    return 1;
  }
  code_rows(x, rows, in, x_stride, inverse, codes, row_max);
  Linear L{codes, row_max, rows, in, out, weight, weight_sums, scale, bias, y, 16};
  run_linear(L, threads);
  free(codes);
  free(row_max);
  return 0;
}
}
