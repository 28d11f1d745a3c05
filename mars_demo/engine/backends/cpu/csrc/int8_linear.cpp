// Row-exact int8 x int8 linear on the CPU: int8dyn's linear (mars_demo/engine/backends/cpu/int8gemm.py).
//
// y = x W^T + b with one activation scale per row and one weight scale per output channel, the
// arithmetic of quant.RowInt8Linear's fbgemm call bit for bit: each row is divided by its
// largest magnitude, coded as uint8 around 128 (code = nearbyint(x / max * inverse) + 128, clamped
// to 0..255), multiplied by the 7-bit weights with exact int32 sums, and the sum s becomes
// (float(s) * scale[j]) * max (+ b[j]), where scale[j] is the input step times the channel's
// weight scale. Integer sums are exact in any order, so a row's output never depends on the other
// rows of the call or on how the columns are split over threads.
//
// What it saves over fbgemm at a few rows is not arithmetic: fbgemm's call packs its input for
// every GEMM, and the row scaling around it is five more torch ops. Here one call does it all.
//
// The weights are packed once (int8gemm.pack): blocks of 16 output columns, each block's bytes in
// steps of 4 inputs, [block][in / 4][16 columns][4 inputs], columns padded to 16 and inputs to 4
// with zeros. One step of a block is 64 contiguous bytes, 16 columns x 4 inputs, multiplied by a
// row's 4 codes broadcast to every lane: each 32-bit lane of the accumulator is one column's sum,
// with no horizontal sum at the end, and up to TILE_ROWS rows reuse every load of the block.
//
// How a step multiplies depends on the CPU (all exact int32 sums, so every build gives the same
// bits): AVX-512 takes the 64 bytes in one register, AVX2 in two halves; with int8 dot products
// (AVX-512 VNNI, AVX-VNNI) one vpdpbusd does the work of vpmaddubsw + vpmaddwd + vpaddd. With
// AVX-512's 32 vector registers a tile takes 16 rows, so a pass of up to 16 tokens reads each
// weight once; AVX2's 16 registers hold 4 rows. Without AVX2 a scalar loop reads the same layout.
// Short tiles (int8_tiling) take AVX-512 rows 8 at a time instead, the last tile up to 12: a
// block's bytes are read again from L1 for each tile, but on some CPUs (the broadcasts' loads, the
// accumulators' chains) the shorter tile's steps run enough faster to pay. int8gemm.tiling times
// both on the CPU at hand and sets the faster. On a CPU with AMX a wide enough call multiplies on the tile unit
// instead (amx_tiles, below).
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
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512BW__)
#define AMX_TILES 1  // this build can multiply on AMX tiles (amx_tiles)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t DEPTH = 4;   // inputs a block holds together for each column
constexpr int64_t TILE = 16;   // columns in a packed block: the unit of work handed out
constexpr int64_t STEP = TILE * DEPTH;  // bytes of one step of a block

inline int64_t padded(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

struct Linear {
  const uint8_t* codes;  // (rows, depth): each row's codes, then zeros up to depth
  const float* row_max;  // (rows)
  int64_t rows, in, out;
  const int8_t* packed;  // (padded(out, TILE) / TILE, depth / DEPTH, TILE, DEPTH): see the top
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

// Where a tile asks for the same bytes of the tile PREFETCH_TILES on, by its rows (int8_prefetch): [0] for a tile
// of one row, [1] for a tile of a few (fewer than MANY_ROWS), [2] for more. 0: not at all (the CPU's own
// prefetchers), 1: into L1, 2: into L2. The bytes come whichever: int8gemm.prefetching times the three for tiles
// of a few rows and of many on the CPU at hand.
constexpr int MANY_ROWS = 5;
int64_t prefetch_into[3] = {1, 1, 1};

#if defined(__AVX2__)
#ifndef PREFETCH_TILES
#define PREFETCH_TILES 1
#endif
#if defined(__AVX512BW__)
constexpr int TILE_ROWS = 16;
using Block = __m512i;  // one step of a block: 16 columns x 4 inputs
using Sums = __m512i;   // a row's 16 column sums
inline Block load_block(const int8_t* w) { return _mm512_loadu_si512((const void*)w); }
inline Sums no_sums() { return _mm512_setzero_si512(); }
// sums + each column's dot product of the row's 4 codes (u8, in every lane) and its 4 weights (s8)
inline Sums dot(Sums sums, int32_t four, Block w) {
  const __m512i codes = _mm512_set1_epi32(four);
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(sums, codes, w);
#else  // u8 x s8 pairs summed in int16 (7-bit weights: never saturates), then pairs of those in int32
  return _mm512_add_epi32(sums, _mm512_madd_epi16(_mm512_maddubs_epi16(codes, w), _mm512_set1_epi16(1)));
#endif
}
inline void store_sums(int32_t* out, Sums sums) { _mm512_storeu_si512((void*)out, sums); }
// finish() of 16 columns c0 .. c0 + 15 of row r at once: the same operations, lane by lane
inline void finish_all(const Linear& L, int64_t r, int64_t c0, Sums sums) {
  const __m512i centred = _mm512_sub_epi32(sums, _mm512_loadu_si512((const void*)(L.weight_sums + c0)));
  __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(centred), _mm512_loadu_ps(L.scale + c0));
  v = _mm512_mul_ps(v, _mm512_set1_ps(L.row_max[r]));
  if (L.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(L.bias + c0));
  _mm512_storeu_ps(L.y + r * L.out + c0, v);
}
#else
constexpr int TILE_ROWS = 4;
struct Block {  // columns 0-7 and 8-15
  __m256i low, high;
};
using Sums = Block;
inline Block load_block(const int8_t* w) {
  return {_mm256_loadu_si256((const __m256i*)w), _mm256_loadu_si256((const __m256i*)(w + 32))};
}
inline Sums no_sums() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline __m256i dot8(__m256i sums, __m256i codes, __m256i w) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(sums, codes, w);
#else
  return _mm256_add_epi32(sums, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, w), _mm256_set1_epi16(1)));
#endif
}
inline Sums dot(Sums sums, int32_t four, Block w) {
  const __m256i codes = _mm256_set1_epi32(four);
  return {dot8(sums.low, codes, w.low), dot8(sums.high, codes, w.high)};
}
inline void store_sums(int32_t* out, Sums sums) {
  _mm256_storeu_si256((__m256i*)out, sums.low);
  _mm256_storeu_si256((__m256i*)(out + 8), sums.high);
}
inline void finish_half(const Linear& L, int64_t r, int64_t c0, __m256i sums) {
  const __m256i centred = _mm256_sub_epi32(sums, _mm256_loadu_si256((const __m256i*)(L.weight_sums + c0)));
  __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(centred), _mm256_loadu_ps(L.scale + c0));
  v = _mm256_mul_ps(v, _mm256_set1_ps(L.row_max[r]));
  if (L.bias) v = _mm256_add_ps(v, _mm256_loadu_ps(L.bias + c0));
  _mm256_storeu_ps(L.y + r * L.out + c0, v);
}
// finish() of 16 columns c0 .. c0 + 15 of row r at once: the same operations, lane by lane
inline void finish_all(const Linear& L, int64_t r, int64_t c0, Sums sums) {
  finish_half(L, r, c0, sums.low);
  finish_half(L, r, c0 + 8, sums.high);
}
#endif

// Each of a tile's rows, by its number k: its sums are named variables s0, s1, ..., not an array (g++
// keeps an array of them in memory, and every step then waits for its own store).
#define EACH_ROW(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11) F(12) F(13) F(14) F(15)
static_assert(TILE_ROWS <= 16, "EACH_ROW names 16 rows");

// rows r0 .. r0 + R - 1 times the 16 columns of tile t
template <int R>
inline void tile(const Linear& L, int64_t r0, int64_t t) {
#define DECLARE(k) Sums s##k = no_sums();
  EACH_ROW(DECLARE)
#undef DECLARE
  const int64_t depth = L.depth(), steps = depth / DEPTH;
  const int8_t* w = L.packed + t * TILE * depth;
  const int8_t* ahead = w + PREFETCH_TILES * TILE * depth;  // the same bytes of a later tile
  const int64_t into = prefetch_into[R == 1 ? 0 : R < MANY_ROWS ? 1 : 2];
  const bool fetch = into && ahead + TILE * depth <= L.packed + padded(L.out, TILE) * depth;
  const uint8_t* a = L.codes + r0 * depth;
  for (int64_t s = 0; s < steps; s++) {
    if (fetch) {  // a step is one 64-byte line
      if (into == 1)
        _mm_prefetch((const char*)(ahead + s * STEP), _MM_HINT_T0);
      else
        _mm_prefetch((const char*)(ahead + s * STEP), _MM_HINT_T1);
    }
    const Block b = load_block(w + s * STEP);
    auto step = [&](int r, Sums& sums) {
      int32_t four;  // the row's 4 codes of this step
      memcpy(&four, a + r * depth + s * DEPTH, sizeof(four));
      sums = dot(sums, four, b);
    };
#define STEP(k) \
  if constexpr (R > k) step(k, s##k);
    EACH_ROW(STEP)
#undef STEP
  }
  const int64_t c0 = t * TILE, n = L.out - c0 < TILE ? L.out - c0 : TILE;
  auto store = [&](int r, const Sums& sums) {
    if (n == TILE) return finish_all(L, r0 + r, c0, sums);
    int32_t out[TILE];  // the last tile's columns past L.out are padding
    store_sums(out, sums);
    for (int64_t j = 0; j < n; j++) finish(L, r0 + r, c0 + j, out[j]);
  };
#define STORE(k) \
  if constexpr (R > k) store(k, s##k);
  EACH_ROW(STORE)
#undef STORE
}

#if defined(__AVX512BW__)
constexpr int SHORT_ROWS = 8, SHORT_MOST = 12;
#else  // AVX2's 4-row tiles either way
constexpr int SHORT_ROWS = TILE_ROWS, SHORT_MOST = TILE_ROWS;
#endif

// rows r .. L.rows - 1 (at most R) of tile t, in one tile of their number
template <int R>
inline void rest(const Linear& L, int64_t r, int64_t t) {
  if constexpr (R > 0) {
    if (L.rows - r == R)
      tile<R>(L, r, t);
    else
      rest<R - 1>(L, r, t);
  }
}
#endif

int64_t short_tiles = 0;  // int8_tiling

#if defined(AMX_TILES)
// AMX: the CPU's tile unit multiplies a tile of up to 16 rows x 64 codes by 16 rows of 64 weight bytes, the same
// u8 x s8 sums as vpdpbusd, in one instruction (tdpbusd). A packed block's 16 steps (64 inputs) are exactly its
// B tile: 16 rows of 64 bytes, 16 columns x 4 inputs each, 64 bytes apart. A call multiplies rows 32 at a time
// (two A tiles of up to 16 rows) by blocks two at a time (two B tiles), into four C tiles of sums that finish()
// ends as the vector tiles' sums are. The same exact sums, so the same bits.
//
// Linux hands a process the tiles' state only on request (int8_amx asks); calls of at least amx_from rows use the
// tiles, where int8gemm.amx timed them faster than the vector tiles on the CPU at hand (0: never).
constexpr int64_t AMX_DEPTH = 64;  // inputs a tile step takes: depth must be a multiple of it
int64_t amx_from = 0;

struct TileConfig {  // the layout ldtilecfg reads (palette 1)
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tiles 0, 1: sums of rows r0 .. r0 + n0 - 1 (block t, t + 1); 2, 3: the next n1 rows; 4, 5: their codes; 6, 7: weights
inline void amx_configure(int64_t n0, int64_t n1) {
  TileConfig c;
  memset(&c, 0, sizeof(c));
  c.palette = 1;
  const int64_t rows[8] = {n0, n0, n1, n1, n0, n1, AMX_DEPTH / DEPTH, AMX_DEPTH / DEPTH};
  for (int k = 0; k < 8; k++)
    if (rows[k]) {
      c.rows[k] = (uint8_t)rows[k];
      c.colsb[k] = 64;
    }
  _tile_loadconfig(&c);
}

// the sums of one C tile (n rows of 16 columns, 64 bytes apart) finished into row r0's .. and block t's columns
inline void amx_finish(const Linear& L, const int32_t (*sums)[TILE], int64_t r0, int64_t n, int64_t t) {
  const int64_t c0 = t * TILE, cols = L.out - c0 < TILE ? L.out - c0 : TILE;
  for (int64_t r = 0; r < n; r++) {
    if (cols == TILE) {
      finish_all(L, r0 + r, c0, _mm512_loadu_si512((const void*)sums[r]));
    } else {
      for (int64_t j = 0; j < cols; j++) finish(L, r0 + r, c0 + j, sums[r][j]);
    }
  }
}

void amx_tiles(const Linear& L, int64_t t_from, int64_t t_to) {
  const int64_t depth = L.depth();
  alignas(64) int32_t sums[4][16][TILE];
  for (int64_t r0 = 0; r0 < L.rows; r0 += 32) {
    const int64_t n0 = L.rows - r0 < 16 ? L.rows - r0 : 16;
    const int64_t n1 = L.rows - r0 - n0 < 16 ? L.rows - r0 - n0 : 16;
    amx_configure(n0, n1);
    const uint8_t* a0 = L.codes + r0 * depth;
    const uint8_t* a1 = a0 + 16 * depth;
    for (int64_t t = t_from; t < t_to; t += 2) {
      const bool two = t + 1 < t_to;
      const int8_t* w0 = L.packed + t * TILE * depth;
      const int8_t* w1 = w0 + TILE * depth;
      _tile_zero(0);
      if (two) _tile_zero(1);
      if (n1) {
        _tile_zero(2);
        if (two) _tile_zero(3);
      }
      for (int64_t k = 0; k < depth; k += AMX_DEPTH) {
        const int64_t at = k / DEPTH * STEP;  // block bytes before this step
        // the next step's weights asked into L1 (tile loads that miss it wait; asking for the next pair's, or into
        // L2, ran slower in turns)
        if (k + AMX_DEPTH < depth)
          for (int64_t line = 0; line < AMX_DEPTH / DEPTH; line++) {
            _mm_prefetch((const char*)(w0 + at + AMX_DEPTH / DEPTH * STEP + line * 64), _MM_HINT_T0);
            if (two) _mm_prefetch((const char*)(w1 + at + AMX_DEPTH / DEPTH * STEP + line * 64), _MM_HINT_T0);
          }
        _tile_loadd(4, a0 + k, depth);
        _tile_loadd(6, w0 + at, STEP);
        _tile_dpbusd(0, 4, 6);
        if (n1) {
          _tile_loadd(5, a1 + k, depth);
          _tile_dpbusd(2, 5, 6);
        }
        if (two) {
          _tile_loadd(7, w1 + at, STEP);
          _tile_dpbusd(1, 4, 7);
          if (n1) _tile_dpbusd(3, 5, 7);
        }
      }
      _tile_stored(0, sums[0], 64);
      if (two) _tile_stored(1, sums[1], 64);
      if (n1) {
        _tile_stored(2, sums[2], 64);
        if (two) _tile_stored(3, sums[3], 64);
      }
      amx_finish(L, sums[0], r0, n0, t);
      if (two) amx_finish(L, sums[1], r0, n0, t + 1);
      if (n1) {
        amx_finish(L, sums[2], r0 + 16, n1, t);
        if (two) amx_finish(L, sums[3], r0 + 16, n1, t + 1);
      }
    }
  }
  _tile_release();
}

// Asks Linux for the tiles' state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): 1 granted, else 0.
int64_t amx_permitted() {
  static const int64_t granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}
#endif

// tiles t_from .. t_to - 1, every row
void tiles(const Linear& L, int64_t t_from, int64_t t_to) {
#if defined(AMX_TILES)
  if (amx_from && L.rows >= amx_from && L.depth() % AMX_DEPTH == 0) return amx_tiles(L, t_from, t_to);
#endif
#if defined(__AVX2__)
  for (int64_t t = t_from; t < t_to; t++) {
    int64_t r = 0;
    if (short_tiles) {
      for (; L.rows - r > SHORT_MOST; r += SHORT_ROWS) tile<SHORT_ROWS>(L, r, t);
      rest<SHORT_MOST>(L, r, t);
    } else {
      for (; r + TILE_ROWS <= L.rows; r += TILE_ROWS) tile<TILE_ROWS>(L, r, t);
      rest<TILE_ROWS - 1>(L, r, t);
    }
  }
#else
  const int64_t depth = L.depth();
  for (int64_t c = t_from * TILE; c < t_to * TILE && c < L.out; c++) {
    const int8_t* w = L.packed + (c / TILE) * TILE * depth + (c % TILE) * DEPTH;
    for (int64_t r = 0; r < L.rows; r++) {
      const uint8_t* a = L.codes + r * depth;
      int32_t s = 0;
      for (int64_t k = 0; k < L.in; k++) s += (int32_t)a[k] * (int32_t)w[(k / DEPTH) * STEP + k % DEPTH];
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
    // the largest |x|, eight lanes at a time (a maximum is exact in any order; the scalar chain
    // waited on each comparison's latency)
    typedef float lanes8 __attribute__((vector_size(32)));
    const lanes8 zero = {};
    lanes8 tops = zero;
    int64_t k = 0;
    for (; k + 8 <= in; k += 8) {
      lanes8 a;
      memcpy(&a, xr + k, sizeof(a));
      a = a < zero ? -a : a;  // fabsf but for -0.0, which no maximum above 0 takes
      tops = a > tops ? a : tops;
    }
    float m = 0.0f;
    for (int u = 0; u < 8; u++) m = tops[u] > m ? tops[u] : m;
    for (; k < in; k++) {
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

// How later calls tile their rows: 0, tiles of TILE_ROWS; 1, short tiles (SHORT_ROWS, the last up to SHORT_MOST).
// The same bits either way (exact integer sums).
void int8_tiling(int64_t short_rows) { short_tiles = short_rows; }

// Where later calls' tiles of one row, of a few rows and of many prefetch (prefetch_into): 0 nowhere, 1 L1, 2 L2.
// The same bits either way.
void int8_prefetch(int64_t one_row, int64_t few_rows, int64_t many_rows) {
  prefetch_into[0] = one_row;
  prefetch_into[1] = few_rows;
  prefetch_into[2] = many_rows;
}

// From how many rows later calls multiply on AMX tiles (0: never), where the CPU has them and Linux grants them.
// Returns the rows set: 0 where there are no tiles to use. The same bits either way.
int64_t int8_amx(int64_t from_rows) {
#if defined(AMX_TILES)
  amx_from = from_rows > 0 && amx_permitted() ? from_rows : 0;
  return amx_from;
#else
  (void)from_rows;
  return 0;
#endif
}

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
