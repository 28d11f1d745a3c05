// Row-exact attention for short passes on the CPU (mars_demo/engine/backends/cpu/rowattn.py).
//
// Every query row attends alone: its output depends only on its query and on the sequence of keys
// and values it may see, never on the other rows of the call, their number or the keys it may not
// see. A row computed in a one-token pass and the same row in a wider pass (MARS, exact mode) or a
// batch therefore agree bit for bit. Within a row the order of every sum is fixed by the row's own
// visible keys: scores are dot products over the head dimension (8-lane partial sums of fused
// multiply-adds, then a fixed tree; eight keys' trees at once), the softmax sums in 8 lanes by position, and the values
// accumulate key by key.
//
// Built at run time by native.py (g++ -O3 -march=native -fopenmp, no fast-math) and called through
// ctypes by rowattn.py. Threads: torch's own OpenMP team.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include <type_traits>

#include "lanes.h"

// KV: how the keys and values are stored: float, Half (IEEE fp16, read as floats: lanes.h), or int8_t
// (records of d int8 values and their fp32 scale: lanes.h; a key's stride counts the scale's 4 bytes)
template <typename KV>
struct CallOf {
  const float* q; int64_t qb, qh, qr;   // query (batch, heads, rows, dim): strides in elements, dim contiguous
  const KV* k; int64_t kb, kh, ks;      // keys (batch, kv heads, keys, dim)
  const KV* v; int64_t vb, vh, vs;      // values, as keys
  float* out;                           // (batch, rows, heads, dim), contiguous
  int64_t batch, heads, kv_heads, rows, keys, dim;
  const int64_t* ranges;                // [start, end) pairs of visible keys, by row; null: causal
  const int64_t* offsets;               // row (b * rows + i) owns ranges offsets[r] .. offsets[r + 1] - 1
  float scale;
};

// While a block of eight keys is scored, the keys AHEAD visible keys on and the values of the eight are
// asked for (prefetches: no bits change). A batch's rows each read their own keys and values, so at
// 8 rows of a few hundred keys those are a quarter of the bytes a pass reads; read one short
// stream after another they came at about half the rate the weights stream at. With both in flight
// the value pass finds its values in L1 or L2.
constexpr int64_t AHEAD = 32;
template <typename KV>
constexpr bool RECORDS = std::is_same<KV, int8_t>::value;  // int8 records: scaled by their last 4 bytes

// A record's scale, 1 for floats and halves (not applied to them: their bits stay as they were).
template <typename KV>
static inline float scale_of(const KV* record, int64_t d) {
  if constexpr (RECORDS<KV>) return record_scale(record, d);
  return 1.0f;
}

// The scales of eight keys' records, as a vector.
template <typename KV>
static inline v8f scales8(const KV* const* kj, int64_t d) {
  return v8f{scale_of(kj[0], d), scale_of(kj[1], d), scale_of(kj[2], d), scale_of(kj[3], d),
             scale_of(kj[4], d), scale_of(kj[5], d), scale_of(kj[6], d), scale_of(kj[7], d)};
}

template <typename KV>
static inline void fetch_keys(const KV* const* k, const KV* const* v, int64_t d) {
  const int64_t bytes = d * (int64_t)sizeof(KV) + (RECORDS<KV> ? 4 : 0);
  for (int u = 0; u < 8; u++)
    for (int64_t at = 0; at < bytes; at += 64) {
      __builtin_prefetch((const char*)k[u] + at);
      __builtin_prefetch((const char*)v[u] + at);
    }
}

constexpr int64_t MAX_TOGETHER = 64;  // heads of a key group taken together at most

// Heads of a key group whose scores for a block of eight keys are summed at once from an fp16 cache: each
// key's 8 values of a step are loaded and converted once for all of them, not once a head (8-10% off the
// attention of 1-8 rows at 200 keys; from fp32 keys, where a load costs little, it was 5-10% slower, so
// those go a head at a time). A head keeps 8 sums: 3 heads and their queries fit AVX-512's 32 registers.
constexpr int SCORE_HEADS = VALUE_LANES == 16 ? 3 : 1;

// Scores of NH heads (queries qs, rows of outs) for the 8 keys kj: each head's 8 sums are the ones it makes
// alone, step by step in the same order, so which heads go together changes no bits.
template <int D8, int NH, typename KV>
static inline void score_block(const float* const* qs, const KV* const* kj, float* const* outs, float scale) {
  v8f acc[NH][8];
#pragma GCC unroll 8
  for (int h = 0; h < NH; h++)
#pragma GCC unroll 8
    for (int u = 0; u < 8; u++) acc[h][u] = splat(0.0f);
  for (int64_t t = 0; t < D8 * 8; t += 8) {
    v8f qt[NH];
#pragma GCC unroll 8
    for (int h = 0; h < NH; h++) qt[h] = load8(qs[h] + t);
#pragma GCC unroll 8
    for (int u = 0; u < 8; u++) {
      const v8f k = load8(kj[u] + t);
#pragma GCC unroll 8
      for (int h = 0; h < NH; h++) acc[h][u] = fma8(qt[h], k, acc[h][u]);
    }
  }
  v8f keys = splat(1.0f);
  if constexpr (RECORDS<KV>) keys = scales8(kj, D8 * 8);
#pragma GCC unroll 8
  for (int h = 0; h < NH; h++) {
    v8f sums = sums8(acc[h][0], acc[h][1], acc[h][2], acc[h][3], acc[h][4], acc[h][5], acc[h][6], acc[h][7]);
    if constexpr (RECORDS<KV>) sums = sums * keys;
    store8(outs[h], sums * scale);
  }
}

// Heads whose value sums a thread keeps in registers at once: up to 24 vectors of sums on AVX-512
// (32 registers), 12 on AVX2 (16), at least one head; a head's sums are D8 * 8 / VALUE_LANES vectors.
constexpr int64_t VALUE_REGISTERS = VALUE_LANES == 16 ? 24 : 12;
template <int D8>
constexpr int64_t HEAD_BLOCK =
    VALUE_REGISTERS / (D8 * 8 / VALUE_LANES) > 1 ? VALUE_REGISTERS / (D8 * 8 / VALUE_LANES) : 1;

// The weighted values of NH heads (scores p, a head's stride apart; outputs d floats apart) over
// the visible keys, key by key from zero: each head's sums exactly as it would make them alone.
template <int D8, int NH, typename KV>
static inline void weigh_values_n(const float* p, int64_t stride, float* out, int64_t d, const KV* v,
                                  int64_t vs, const int64_t* ranges, int64_t n_ranges) {
  constexpr int N = D8 * 8 / VALUE_LANES;
  vv acc[NH][N];
  for (int h = 0; h < NH; h++)
    for (int u = 0; u < N; u++) acc[h][u] = vv{};
  int64_t at = 0;
  for (int64_t g = 0; g < n_ranges; g++)
    for (int64_t j = ranges[2 * g]; j < ranges[2 * g + 1]; j++, at++) {
      const KV* vj = v + j * vs;
      // each head's weight of this value: its score, times a record's scale; in every lane (x - 0 is x, exactly)
      vv weights[NH];
      for (int h = 0; h < NH; h++)
        weights[h] = (RECORDS<KV> ? p[h * stride + at] * scale_of(vj, d) : p[h * stride + at]) - vv{};
      for (int u = 0; u < N; u++) {
        const vv value = load_lanes(vj + VALUE_LANES * u);
        for (int h = 0; h < NH; h++) acc[h][u] = fma_lanes(weights[h], value, acc[h][u]);
      }
    }
  for (int h = 0; h < NH; h++)
    for (int u = 0; u < N; u++) memcpy(out + h * d + VALUE_LANES * u, &acc[h][u], sizeof(vv));
}

template <int D8, typename KV>
static void weigh_values(int64_t n, const float* p, int64_t stride, float* out, int64_t d, const KV* v,
                         int64_t vs, const int64_t* ranges, int64_t n_ranges) {
  switch (n) {
#define HEADS(k) \
  case k: \
    if constexpr (k <= HEAD_BLOCK<D8>) return weigh_values_n<D8, k>(p, stride, out, d, v, vs, ranges, n_ranges);
    HEADS(1) HEADS(2) HEADS(3) HEADS(4) HEADS(5) HEADS(6)
#undef HEADS
  }
}

// One row, heads h0 .. h1 - 1: q row (b, i) over its visible keys. D8: dim / 8 when the dim is 64 or
// 128 (the accumulators stay in registers), 0 for any dim. A model always takes the same branch.
//
// The heads that share a key group (GQA) are taken together: each block of eight keys is scored
// for all of them while it is in L1, and each value vector is loaded once for a block of them, so
// the keys and values come from L2 once for the group, not once a head. Each head's arithmetic is
// the one it would do alone, in the same order (partial sums stored and reloaded are exact), so
// which heads a thread takes together changes no bits.
template <int D8, typename KV>
static void attend_row(const CallOf<KV>* c, int64_t b, int64_t i, int64_t h0, int64_t h1, float* scores,
                       int64_t* cols) {
  const int64_t d = c->dim, group = c->heads / c->kv_heads, stride = c->keys + 16;  // a head's scores
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
  // the visible keys' columns in order: blocks of eight keys are scored across the edges of the row's runs
  // (a batch row's keys are many runs: rejected drafts and a narrower row's holes are hidden columns), not
  // each run's last few keys one at a time.
  int64_t seen = 0;
  for (int64_t g = 0; g < n_ranges; g++)
    for (int64_t j = ranges[2 * g]; j < ranges[2 * g + 1]; j++) cols[seen++] = j;
  const int64_t d8 = D8 > 0 ? D8 * 8 : d - d % 8;
  for (int64_t first = h0; first < h1;) {
    const int64_t kvh = first / group;
    int64_t last = (kvh + 1) * group < h1 ? (kvh + 1) * group : h1;  // heads first .. last - 1 share kvh
    last = last - first > MAX_TOGETHER ? first + MAX_TOGETHER : last;
    const KV* kbase = c->k + b * c->kb + kvh * c->kh;
    const KV* vbase = c->v + b * c->vb + kvh * c->vh;
    auto query = [&](int64_t h) { return c->q + b * c->qb + h * c->qh + i * c->qr; };
    auto output = [&](int64_t h) { return c->out + ((b * c->rows + i) * c->heads + h) * d; };
    // scores, in the order of the visible keys; eight keys at a time for independent chains, the last block's
    // unused lanes given the last key again (the softmax overwrites them)
    int64_t m = 0;
    for (; m < seen; m += 8) {
      const KV* kj[8];
      const KV* ahead[8];
      const KV* values[8];
      for (int u = 0; u < 8; u++) {
        const int64_t key = cols[m + u < seen ? m + u : seen - 1];
        kj[u] = kbase + key * c->ks;
        values[u] = vbase + key * c->vs;
        // the keys AHEAD visible keys on (past the last, the last's: a prefetch of a line already asked for)
        ahead[u] = kbase + cols[m + AHEAD + u < seen ? m + AHEAD + u : seen - 1] * c->ks;
      }
      fetch_keys(ahead, values, d);
      if constexpr (D8 > 0 && SCORE_HEADS > 1 && !std::is_same<KV, float>::value) {  // fp16, int8: heads at once
        for (int64_t h = first; h < last; h += SCORE_HEADS) {
          const int64_t n = last - h < SCORE_HEADS ? last - h : SCORE_HEADS;
          const float* qs[SCORE_HEADS];
          float* outs[SCORE_HEADS];
          for (int64_t i = 0; i < n; i++) qs[i] = query(h + i), outs[i] = scores + (h + i - first) * stride + m;
          if (n == 3) score_block<D8, SCORE_HEADS == 3 ? 3 : 1>(qs, kj, outs, c->scale);
          else if (n == 2) score_block<D8, SCORE_HEADS >= 2 ? 2 : 1>(qs, kj, outs, c->scale);
          else score_block<D8, 1>(qs, kj, outs, c->scale);
        }
        continue;
      }
      for (int64_t h = first; h < last; h++) {
        const float* q = query(h);
        v8f a0 = splat(0.0f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        for (int64_t t = 0; t < d8; t += 8) {
          const v8f qt = load8(q + t);
          a0 = fma8(qt, load8(kj[0] + t), a0);
          a1 = fma8(qt, load8(kj[1] + t), a1);
          a2 = fma8(qt, load8(kj[2] + t), a2);
          a3 = fma8(qt, load8(kj[3] + t), a3);
          a4 = fma8(qt, load8(kj[4] + t), a4);
          a5 = fma8(qt, load8(kj[5] + t), a5);
          a6 = fma8(qt, load8(kj[6] + t), a6);
          a7 = fma8(qt, load8(kj[7] + t), a7);
        }
        v8f block = sums8(a0, a1, a2, a3, a4, a5, a6, a7);
        if (D8 == 0) {
          for (int u = 0; u < 8; u++) {
            float tail = block[u];
            for (int64_t t = d8; t < d; t++) tail = fma1(q[t], to_float(kj[u][t]), tail);
            block[u] = tail;
          }
        }
        if constexpr (RECORDS<KV>) block = block * scales8(kj, d);
        store8(scores + (h - first) * stride + m, block * c->scale);
      }
    }
    m = seen;
    if (m == 0) {  // nothing visible (a padding row): zeros
      for (int64_t h = first; h < last; h++) memset(output(h), 0, d * sizeof(float));
      first = last;
      continue;
    }
    // each head's softmax: its largest score (a vector of running maxima; a maximum is exact in any
    // order), then the exponentials and their sum in 8 lanes by position
    float inv[MAX_TOGETHER];
    for (int64_t h = first; h < last; h++) {
      float* sh = scores + (h - first) * stride;
      v8f tops = splat(sh[0]);
      int64_t j = 0;
      for (; j + 8 <= m; j += 8) {
        const v8f sj = load8(sh + j);
        tops = sj > tops ? sj : tops;
      }
      float top = tops[0];
      for (int u = 1; u < 8; u++) top = tops[u] > top ? tops[u] : top;
      for (; j < m; j++) top = sh[j] > top ? sh[j] : top;
      for (j = m; j < m + 8; j++) sh[j] = -INFINITY;  // the tail's unused lanes: exp gives 0
      v8f lanes = splat(0.0f);
      for (j = 0; j < m; j += 8) {
        v8f e = exp8(load8(sh + j) - top);
        store8(sh + j, e);
        lanes += e;
      }
      inv[h - first] = 1.0f / hsum8(lanes);
    }
    // values, key by key: a block of the group's heads at a time, their sums in registers, each
    // value vector loaded once for the block (independent chains: one head's few alone would wait
    // on each other's latency)
    if constexpr (D8 > 0) {
      for (int64_t h = first; h < last; h += HEAD_BLOCK<D8>) {
        const int64_t n = last - h < HEAD_BLOCK<D8> ? last - h : HEAD_BLOCK<D8>;
        weigh_values<D8>(n, scores + (h - first) * stride, stride, output(h), d, vbase, c->vs, ranges, n_ranges);
      }
    } else {
      for (int64_t h = first; h < last; h++) {
        const float* p = scores + (h - first) * stride;
        float* out = output(h);
        memset(out, 0, d * sizeof(float));
        int64_t at = 0;
        for (int64_t g = 0; g < n_ranges; g++)
          for (int64_t j = ranges[2 * g]; j < ranges[2 * g + 1]; j++, at++) {
            const KV* vj = vbase + j * c->vs;
            const float weight = RECORDS<KV> ? p[at] * scale_of(vj, d) : p[at];
            for (int64_t t = 0; t < d; t++) out[t] = fma1(weight, to_float(vj[t]), out[t]);
          }
      }
    }
    for (int64_t h = first; h < last; h++) {
      float* out = output(h);
      for (int64_t t = 0; t < d; t++) out[t] *= inv[h - first];
    }
    first = last;
  }
}

// Units ((b * kv_heads + g) * rows + i) * group + j, first .. last - 1: row i's head g * group + j,
// each computed whole by one thread, so how the units are split over threads changes no bits. A
// key group's rows are consecutive units, so a thread's share covers as few groups as it can: each
// group's keys and values come from memory into one thread's cache, and its rows find them there
// (a one-row call splits by heads alike).
template <typename KV>
static int run_units(const CallOf<KV>* c, int64_t first, int64_t last) {
  const int64_t group = c->heads / c->kv_heads;  // a key group's heads' scores (attend_row)
  float* scores = (float*)malloc(group * (c->keys + 16) * sizeof(float));
  int64_t* cols = (int64_t*)malloc((c->keys + 1) * sizeof(int64_t));  // a row's visible keys (attend_row)
  if (!scores || !cols) {
    free(scores);
    free(cols);
    return 1;
  }
  while (first < last) {
    const int64_t sequence_group = first / (c->rows * group), unit = first % (c->rows * group);
    const int64_t b = sequence_group / c->kv_heads, g = sequence_group % c->kv_heads;
    const int64_t i = unit / group, h0 = g * group + unit % group;
    const int64_t h1 = h0 + (last - first) < (g + 1) * group ? h0 + (last - first) : (g + 1) * group;
    if (c->dim == 64)
      attend_row<8>(c, b, i, h0, h1, scores, cols);
    else if (c->dim == 128)
      attend_row<16>(c, b, i, h0, h1, scores, cols);
    else
      attend_row<0>(c, b, i, h0, h1, scores, cols);
    first += h1 - h0;
  }
  free(scores);
  free(cols);
  return 0;
}

// The keys row r (b * rows + i) sees.
template <typename KV>
static inline int64_t visible_keys(const CallOf<KV>* c, int64_t r) {
  if (!c->ranges) return c->keys - c->rows + r % c->rows + 1;
  int64_t n = 0;
  for (int64_t g = c->offsets[r]; g < c->offsets[r + 1]; g++) n += c->ranges[2 * g + 1] - c->ranges[2 * g];
  return n;
}

// What a unit costs beyond its keys, counted in keys (its query, softmax and output).
constexpr int64_t UNIT_KEYS = 16;

// Thread t's units [from, to) in a team of n: each boundary is the first unit before which the units' costs
// (their keys plus UNIT_KEYS) reach that share of the whole, found in one scan. Rows of one batch see different
// numbers of keys (prompts of different lengths, a wide pass's masks), so an even split by count leaves one
// thread waiting.
template <typename KV>
static void unit_share(const CallOf<KV>* c, int64_t t, int64_t n, int64_t* from, int64_t* to) {
  const int64_t group = c->heads / c->kv_heads, total = c->batch * c->rows * c->heads;
  *from = t <= 0 ? 0 : total;
  *to = total;
  if (t <= 0 && t + 1 >= n) return;
  int64_t whole = 0;
  for (int64_t r = 0; r < c->batch * c->rows; r++) whole += (visible_keys(c, r) + UNIT_KEYS) * c->heads;
  const int64_t first_goal = whole * t / n, last_goal = whole * (t + 1) / n;
  bool started = t <= 0;
  int64_t sum = 0, u = 0;
  for (int64_t sg = 0; sg < c->batch * c->kv_heads; sg++)  // units in their order: (b, g), then i, then j
    for (int64_t i = 0; i < c->rows; i++) {
      const int64_t cost = visible_keys(c, sg / c->kv_heads * c->rows + i) + UNIT_KEYS;
      for (int64_t j = 0; j < group; j++, u++) {
        if (!started && sum >= first_goal) *from = u, started = true;
        if (t + 1 < n && sum >= last_goal) {
          *to = u;
          return;
        }
        sum += cost;
      }
    }
}

// All units of c, split by their cost (unit_share) over up to `threads` of torch's OpenMP threads.
static int attend_all(const CallOf<float>* c, int64_t threads) {
  const int64_t total = c->batch * c->rows * c->heads;
  if (threads > total) threads = total;
  int failed = 0;
#if defined(_OPENMP)
  if (threads > 1) {
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
      int64_t from, to;
      unit_share(c, omp_get_thread_num(), omp_get_num_threads(), &from, &to);
      failed |= run_units(c, from, to);
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
  CallOf<float> c = {q, qb, qh, qr, k, kb, kh, ks, v, vb, vh, vs, out, batch, heads, kv_heads, rows, keys, dim,
            ranges, offsets, scale};
  return attend_all(&c, threads);
}

// The runs of nonzero entries of row[0 .. end), appended to ranges as [start, stop) pairs (n of them so far);
// their keys are added to work.
template <typename T>
static inline void append_runs(const T* row, int64_t end, int64_t* ranges, int64_t& n, int64_t& work) {
  for (int64_t j = 0; j < end;) {
    if (!row[j]) {
      j++;
      continue;
    }
    const int64_t start = j;
    while (j < end && row[j]) j++;
    ranges[2 * n] = start;
    ranges[2 * n + 1] = j;
    work += j - start;
    n++;
  }
}

// The visible ranges of a causal pass of q_len rows per sequence under a 2-D padding mask (rowattn.Visible.padded,
// whose numpy steps it replaces: a batch's every pass builds them, and a dozen array ops after a pass that streamed
// the weights through the caches cost more than the pass's attention steering needs). pad: (rows, keys), 1 where
// a key is attended, 0 for a hole; row i of a sequence's pass sees its attended keys up to keys - q_len + i, and a
// row that is itself a hole sees none (nothing reads its output: its attention would be work for nothing).
// Writes ranges ([start, end) pairs, in row order), offsets (rows * q_len + 1), live (the pass rows whose own
// column is attended, ascending) and counts (live rows, visible (row, key) pairs); returns the number of ranges.
// ranges must have room for rows * q_len * ((keys + 1) / 2) pairs (rowattn.py keeps that under 2^31).
extern "C" int padding_ranges(const int64_t* pad, int64_t rows, int64_t keys, int64_t q_len, int64_t* ranges,
                              int64_t* offsets, int64_t* live, int64_t* counts) {
  int64_t n = 0, n_live = 0, work = 0;
  offsets[0] = 0;
  for (int64_t b = 0; b < rows; b++)
    for (int64_t i = 0; i < q_len; i++) {
      const int64_t cut = keys - q_len + i + 1;  // this row's own column is cut - 1
      if (pad[b * keys + cut - 1]) {
        append_runs(pad + b * keys, cut, ranges, n, work);
        live[n_live++] = b * q_len + i;
      }
      offsets[b * q_len + i + 1] = n;
    }
  counts[0] = n_live;
  counts[1] = work;
  return (int)n;
}

// The same from a full mask (rowattn.Visible from a 4-D mask: exact mode's fallback group, trees): allowed is
// (rows * q_len, keys) bytes, nonzero where that row may see that key; a row's own column is keys - q_len + i.
extern "C" int mask_ranges(const uint8_t* allowed, int64_t rows, int64_t keys, int64_t q_len, int64_t* ranges,
                           int64_t* offsets, int64_t* live, int64_t* counts) {
  int64_t n = 0, n_live = 0, work = 0;
  offsets[0] = 0;
  for (int64_t r = 0; r < rows * q_len; r++) {
    if (allowed[r * keys + keys - q_len + r % q_len]) {  // a hole sees none (padding_ranges)
      append_runs(allowed + r * keys, keys, ranges, n, work);
      live[n_live++] = r;
    }
    offsets[r + 1] = n;
  }
  counts[0] = n_live;
  counts[1] = work;
  return (int)n;
}
