// Greedy candidates and their confidences on the CPU (mars_demo/engine/acceptance.py).
//
// For each row of logits: the first index of its largest value (torch's argmax) and that token's
// softmax probability, 1 / sum_j exp(l_j - max). Through torch that is a softmax over the whole
// vocabulary written to memory, an argmax and a gather, ~45 us a row of 49k logits on a 2-core EPYC;
// here two reads of the row, ~5-10 us. The sum runs in vector lanes by position, then a fixed tree,
// so a row's confidence never depends on the other rows of the call.
//
// Built at run time by native.py (g++ -O3 -march=native -fopenmp, no fast-math) and called through
// ctypes. Threads: torch's own OpenMP team, a row each.
#include <math.h>
#include <stdint.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#include "lanes.h"

namespace {

void greedy_row(const float* l, int64_t vocab, int64_t* token, float* confidence) {
  constexpr int64_t W = VALUE_LANES;
  // the largest value and where each lane first saw its own (a maximum is exact in any order)
  vv tops = vv{} + l[0];
  vvi at = vvi{} + 0;  // the start of the vector where the lane's maximum first appeared
  int64_t j = 0;
  for (; j + W <= vocab; j += W) {
    vv x;
    memcpy(&x, l + j, sizeof(x));
    const vvi here = vvi{} + (int32_t)j;
    at = x > tops ? here : at;
    tops = x > tops ? x : tops;
  }
  float top = l[0];
  int64_t first = 0;
  for (int u = 0; u < W; u++) {  // the lowest index among the lanes holding the maximum
    const int64_t index = at[u] + u;
    if (tops[u] > top || (tops[u] == top && index < first)) top = tops[u], first = index;
  }
  for (; j < vocab; j++)
    if (l[j] > top) top = l[j], first = j;
  // the sum of exp(l - top) over the row, in lanes by position
  vv lanes = vv{} + 0.0f;
  for (j = 0; j + W <= vocab; j += W) {
    vv x;
    memcpy(&x, l + j, sizeof(x));
    lanes += exp_lanes<vv, vvi>(x - top);
  }
  float sum = 0.0f;
  for (int u = 0; u < W; u++) sum += lanes[u];
  for (; j < vocab; j++) sum += expf(l[j] - top);
  *token = first;
  *confidence = 1.0f / sum;
}

}  // namespace

extern "C" {

// tokens[r], confidences[r] for rows r of logits (rows, vocab; rows `stride` floats apart).
int greedy(const float* logits, int64_t rows, int64_t vocab, int64_t stride, int64_t* tokens, float* confidences,
           int64_t threads) {
#pragma omp parallel for num_threads(threads) if (rows > 1 && threads > 1)
  for (int64_t r = 0; r < rows; r++) greedy_row(logits + r * stride, vocab, tokens + r, confidences + r);
  return 0;
}
}
