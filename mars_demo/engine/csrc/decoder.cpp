// int8dyn's decoder layers as one native call a pass (mars_demo/engine/decoder.py).
//
// A llama-family layer: RMSNorm, the q/k/v linear, RoPE, the keys and values written into the
// cache's buffers, the row-exact attention, the o linear and the residual; RMSNorm, the gate/up
// linear, SiLU(gate) * up, the down linear and the residual. The linears are int8_linear.cpp's, the
// attention row_attention.cpp's, both included here whole. What this file adds is everything
// between them, which through torch is ~25 small ops a layer at 5-10 us of dispatch each: most of
// a one-token pass on a small CPU.
//
// Every step but the attention works on one row at a time, and the attention is row-exact, so a
// row's output never depends on the other rows of the call: a one-token pass and the same row in
// a wider pass (MARS, exact mode, a batch) agree bit for bit. Against the torch layers (lean.py)
// the norms and the SiLU round differently (~1e-6 relative); the RoPE, the residuals and the linears
// round alike.
//
// Built at run time by native.py (g++ -O3 -march=native -fopenmp; a * b + c not fused, as in
// int8_linear.cpp, except in the attention, which is compiled as row_attention.cpp is).
#include "int8_linear.cpp"
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#include "row_attention.cpp"
#pragma GCC pop_options

namespace {

struct Int8Weights {  // one linear as int8gemm.Weights holds it
  const int8_t* weight;  // packed (int8_linear.cpp)
  const int32_t* sums;
  const float* scale;
  const float* bias;  // or null
  int64_t in, out;
};

struct Layer {
  const float* norm1;
  const float* norm2;
  float eps1, eps2;
  Int8Weights qkv, o, gate_up, down;
};

struct Pass {
  float* x;  // (batch * rows, hidden): in, then out
  int64_t batch, rows, hidden, heads, kv_heads, dim;
  const float* cos;  // (batch or 1, rows, dim)
  const float* sin;  // the same, its first half negated
  int64_t rope_batch_stride;  // 0 when one table serves every sequence
  float* const* keys;  // per layer: (batch, kv heads, room, dim) buffers
  float* const* values;
  int64_t cache_batch_stride, cache_head_stride;  // in floats, the same in every layer
  int64_t start;  // keys held before this pass
  const int64_t* ranges;  // visible keys as in row_attention.cpp, or null: causal
  const int64_t* offsets;
  float scale, inverse;
  int64_t threads, attention_threads;
};

// The rows of one step: split over threads only when there are many of them (a prefill).
constexpr int64_t THREADED_ROWS = 64;

// transformers' RMSNorm of each row: weight * (x * 1 / sqrt(mean(x^2) + eps)).
void rms_norm(const float* x, int64_t rows, int64_t n, const float* weight, float eps, float* out, int64_t threads) {
#pragma omp parallel for num_threads(threads) if (rows >= THREADED_ROWS)
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * n;
    v8f lanes = splat(0.0f);
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
      const v8f a = load8(xr + k);
      lanes += a * a;
    }
    float sum = hsum8(lanes);
    for (; k < n; k++) sum += xr[k] * xr[k];
    const float inv = 1.0f / sqrtf(sum / (float)n + eps);
    float* o = out + r * n;
    for (k = 0; k < n; k++) o[k] = weight[k] * (xr[k] * inv);
  }
}

void linear(const Int8Weights& w, const float* x, int64_t rows, float* y, uint8_t* codes, float* row_max,
            const Pass& p) {
  code_rows(x, rows, w.in, w.in, p.inverse, codes, row_max);
  Linear L{codes, row_max, rows, w.in, w.out, w.weight, w.sums, w.scale, w.bias, y};
  run_linear(L, p.threads);
}

// x += y, row by row (the residual: one rounding, as torch's add)
void add_into(float* x, const float* y, int64_t count) {
  for (int64_t i = 0; i < count; i++) x[i] = x[i] + y[i];
}

// RoPE on the q and k heads of each row of qkv, in place, then its keys and values into the cache.
void rope_and_store(const Pass& p, float* qkv, int64_t width, float* keys, float* values) {
  const int64_t d = p.dim, half = d / 2, rotated = p.heads + p.kv_heads;
#pragma omp parallel for num_threads(p.threads) if (p.batch * p.rows >= THREADED_ROWS)
  for (int64_t r = 0; r < p.batch * p.rows; r++) {
    const int64_t b = r / p.rows, i = r % p.rows;
    const float* c = p.cos + b * p.rope_batch_stride + i * d;
    const float* s = p.sin + b * p.rope_batch_stride + i * d;
    float* row = qkv + r * width;
    float turned[512];
    for (int64_t h = 0; h < rotated; h++) {
      float* a = row + h * d;
      for (int64_t t = 0; t < d; t++) turned[t] = a[t < half ? t + half : t - half];
      for (int64_t t = 0; t < d; t++) a[t] = a[t] * c[t] + turned[t] * s[t];
    }
    for (int64_t g = 0; g < p.kv_heads; g++) {
      const int64_t at = b * p.cache_batch_stride + g * p.cache_head_stride + (p.start + i) * d;
      memcpy(keys + at, row + (p.heads + g) * d, d * sizeof(float));
      memcpy(values + at, row + (rotated + g) * d, d * sizeof(float));
    }
  }
}

// SiLU(gate) * up for each row of gate_up (rows, 2 * n) into act (rows, n)
void silu_times_up(const float* gate_up, int64_t rows, int64_t n, float* act, int64_t threads) {
#pragma omp parallel for num_threads(threads) if (rows >= THREADED_ROWS)
  for (int64_t r = 0; r < rows; r++) {
    const float* g = gate_up + r * 2 * n;
    const float* u = g + n;
    float* a = act + r * n;
    int64_t k = 0;
    for (; k + VALUE_LANES <= n; k += VALUE_LANES) {
      vv x, up;
      memcpy(&x, g + k, sizeof(x));
      memcpy(&up, u + k, sizeof(up));
      const vv zero = vv{} + 0.0f, one = vv{} + 1.0f;
      const vv e = exp_lanes<vv, vvi>(x < zero ? x : -x);  // exp(-|x|): never overflows
      const vv r = one / (one + e);
      const vv sigmoid = x < zero ? e * r : r;
      const vv out = (x * sigmoid) * up;
      memcpy(a + k, &out, sizeof(out));
    }
    for (; k < n; k++) a[k] = (g[k] * (1.0f / (1.0f + expf(-g[k])))) * u[k];
  }
}

int run(const Pass& p, const Layer* layers, int64_t n_layers) {
  const int64_t rows = p.batch * p.rows, H = p.hidden;
  int64_t widest = 0, widest_in = 0;
  for (int64_t l = 0; l < n_layers; l++) {
    const Layer& L = layers[l];
    const int64_t outs[4] = {L.qkv.out, L.o.out, L.gate_up.out, L.down.out};
    const int64_t ins[4] = {L.qkv.in, L.o.in, L.gate_up.in, L.down.in};
    for (int j = 0; j < 4; j++) {
      widest = outs[j] > widest ? outs[j] : widest;
      widest_in = ins[j] > widest_in ? ins[j] : widest_in;
    }
  }
  float* h = (float*)malloc(sizeof(float) * rows * H);  // a norm's output
  float* wide = (float*)malloc(sizeof(float) * rows * widest);  // q/k/v or gate/up rows
  float* act = (float*)malloc(sizeof(float) * rows * widest_in);  // the attention's output or SiLU * up
  float* y = (float*)malloc(sizeof(float) * rows * H);
  uint8_t* codes = (uint8_t*)malloc(rows * padded(widest_in, DEPTH) + 1);
  float* row_max = (float*)malloc(sizeof(float) * (rows + 1));
  int failed = !h || !wide || !act || !y || !codes || !row_max;
  for (int64_t l = 0; l < n_layers && !failed; l++) {
    const Layer& L = layers[l];
    rms_norm(p.x, rows, H, L.norm1, L.eps1, h, p.threads);
    linear(L.qkv, h, rows, wide, codes, row_max, p);
    rope_and_store(p, wide, L.qkv.out, p.keys[l], p.values[l]);
    // q read in place from the q/k/v rows: (batch, heads, rows, dim) by strides
    const Call c = {wide, p.rows * L.qkv.out, p.dim, L.qkv.out,
                    p.keys[l], p.cache_batch_stride, p.cache_head_stride, p.dim,
                    p.values[l], p.cache_batch_stride, p.cache_head_stride, p.dim,
                    act, p.batch, p.heads, p.kv_heads, p.rows, p.start + p.rows, p.dim, p.ranges, p.offsets, p.scale};
    failed |= attend_all(&c, p.attention_threads);
    linear(L.o, act, rows, y, codes, row_max, p);
    add_into(p.x, y, rows * H);
    rms_norm(p.x, rows, H, L.norm2, L.eps2, h, p.threads);
    linear(L.gate_up, h, rows, wide, codes, row_max, p);
    silu_times_up(wide, rows, L.gate_up.out / 2, act, p.threads);
    linear(L.down, act, rows, y, codes, row_max, p);
    add_into(p.x, y, rows * H);
  }
  free(h);
  free(wide);
  free(act);
  free(y);
  free(codes);
  free(row_max);
  return failed;
}

}  // namespace

extern "C" {

// The decoder layers of one pass over x (pass.x, in place). Returns 0, or 1 when out of memory.
int decoder(const Pass* pass, const Layer* layers, int64_t n_layers) { return run(*pass, layers, n_layers); }
}
