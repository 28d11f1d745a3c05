// int8dyn's decoder layers as one native call a pass (mars_demo/engine/backends/cpu/native_layers.py).
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
// The whole pass runs in one OpenMP team (torch's threads): each step splits its rows, columns,
// SiLU chunks or (row, head) units over the team and ends at a barrier, instead of a parallel
// region for each linear and attention (~150 a pass) with the row-wise steps on one thread between
// them. Everything a thread computes is computed whole by it, so the split changes no bits.
//
// Built at run time by native.py (g++ -O3 -march=native -fopenmp; a * b + c not fused, as in
// int8_linear.cpp, except in the attention, which is compiled as row_attention.cpp is).
#include "int8_linear.cpp"
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#include "row_attention.cpp"
#pragma GCC pop_options

#include <stddef.h>

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
  void* const* keys;  // per layer: (batch, kv heads, room, record) buffers of floats, halves or int8 records
  void* const* values;
  int64_t cache_kind;  // FLOATS, HALVES (IEEE fp16) or RECORDS (int8 with their scale): lanes.h
  int64_t cache_batch_stride, cache_head_stride, cache_key_stride;  // in elements, the same in every layer
  int64_t start;  // keys held before this pass
  const int64_t* ranges;  // visible keys as in row_attention.cpp, or null: causal
  const int64_t* offsets;
  float scale, inverse;
  int64_t threads, attention_threads;
  const int64_t* live;  // the rows (b * rows + i) that are fed a token, ascending, or null: every row
  int64_t n_live;  // their count
  const float* final_norm;  // the model's last RMSNorm, applied to the fed rows after the layers, or null: none
  float final_eps;
};

// transformers' RMSNorm of row x (n floats): weight * (x * 1 / sqrt(mean(x^2) + eps)); out may be x itself.
void rms_norm_row(const float* x, int64_t n, const float* weight, float eps, float* out) {
  v8f lanes = splat(0.0f);
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const v8f a = load8(x + k);
    lanes += a * a;
  }
  float sum = hsum8(lanes);
  for (; k < n; k++) sum += x[k] * x[k];
  const float inv = 1.0f / sqrtf(sum / (float)n + eps);
  for (k = 0; k < n; k++) out[k] = weight[k] * (x[k] * inv);
}

enum CacheKind : int64_t { FLOATS = 0, HALVES = 1, INT8_RECORDS = 2 };

// A row's keys or values (d floats) into the cache: as they are, rounded to halves, or as an int8 record.
inline void store(const Pass& p, void* buffer, int64_t at, const float* x, int64_t d) {
  if (p.cache_kind == INT8_RECORDS) return to_record((int8_t*)buffer + at, x, d);
#if HALF_CACHE
  if (p.cache_kind == HALVES) return to_halves((Half*)buffer + at, x, d);
#endif
  memcpy((float*)buffer + at, x, d * sizeof(float));
}

// RoPE on the q and k heads of row r of qkv, in place, then its keys and values into the cache.
void rope_and_store_row(const Pass& p, int64_t r, float* qkv, int64_t width, void* keys, void* values) {
  const int64_t d = p.dim, half = d / 2, rotated = p.heads + p.kv_heads;
  const int64_t b = r / p.rows, i = r % p.rows;
  const float* c = p.cos + b * p.rope_batch_stride + i * d;
  const float* s = p.sin + b * p.rope_batch_stride + i * d;
  float* row = qkv + r * width;
  for (int64_t h = 0; h < rotated; h++) {  // a * cos + rotate_half(a) * sin, both halves at once
    float* a = row + h * d;
    for (int64_t t = 0; t < half; t++) {
      const float x = a[t], y = a[t + half];
      a[t] = x * c[t] + y * s[t];
      a[t + half] = y * c[t + half] + x * s[t + half];
    }
  }
  for (int64_t g = 0; g < p.kv_heads; g++) {
    const int64_t at = b * p.cache_batch_stride + g * p.cache_head_stride + (p.start + i) * p.cache_key_stride;
    store(p, keys, at, row + (p.heads + g) * d, d);
    store(p, values, at, row + (rotated + g) * d, d);
  }
}

// SiLU(gate) * up for chunks from .. to - 1 of the rows of gate_up (rows, 2 * n) into act (rows, n). A
// row has chunks(n) chunks of VALUE_LANES elements, the last one maybe shorter: an element is always
// computed the same way (a vector's lane, or the short chunk's scalar loop), whichever thread takes it.
inline int64_t chunks(int64_t n) { return (n + VALUE_LANES - 1) / VALUE_LANES; }

void silu_times_up(const float* gate_up, int64_t n, float* act, int64_t from, int64_t to) {
  for (int64_t chunk = from; chunk < to; chunk++) {
    const int64_t r = chunk / chunks(n), k = chunk % chunks(n) * VALUE_LANES;
    const float* g = gate_up + r * 2 * n;
    const float* u = g + n;
    float* a = act + r * n;
    if (k + VALUE_LANES <= n) {
      vv x, up;
      memcpy(&x, g + k, sizeof(x));
      memcpy(&up, u + k, sizeof(up));
      const vv zero = vv{} + 0.0f, one = vv{} + 1.0f;
      const vv e = exp_lanes<vv, vvi>(x < zero ? x : -x);  // exp(-|x|): never overflows
      const vv q = one / (one + e);
      const vv sigmoid = x < zero ? e * q : q;
      const vv out = (x * sigmoid) * up;
      memcpy(a + k, &out, sizeof(out));
    } else {
      for (int64_t j = k; j < n; j++) a[j] = (g[j] * (1.0f / (1.0f + expf(-g[j])))) * u[j];
    }
  }
}

// Layer l's attention over the cache: q read in place from the q/k/v rows, (batch, heads, rows, dim) by strides.
template <typename KV>
CallOf<KV> attention_call(const Pass& p, int64_t l, const float* wide, int64_t width, float* out) {
  return {wide, p.rows * width, p.dim, width,
          (const KV*)p.keys[l], p.cache_batch_stride, p.cache_head_stride, p.cache_key_stride,
          (const KV*)p.values[l], p.cache_batch_stride, p.cache_head_stride, p.cache_key_stride,
          out, p.batch, p.heads, p.kv_heads, p.rows, p.start + p.rows, p.dim, p.ranges, p.offsets, p.scale};
}

// This thread's share [from, to) of n items split evenly over the team (nothing outside a team)
struct Share {
  int64_t t, team;
  void of(int64_t n, int64_t* from, int64_t* to) const {
    *from = n * t / team;
    *to = n * (t + 1) / team;
  }
};

inline void barrier() {
#if defined(_OPENMP)
#pragma omp barrier
#endif
}

// One thread's part of the pass: every step splits its rows, columns or (row, head) units over the
// team and ends at a barrier (but a layer's last residual, which the next layer's norm takes up on
// the same rows). A row's norm, coding, RoPE and residuals, a column's sums and a
// (row, head)'s attention are each computed whole by one thread, so how the work is split changes
// no bits.
//
// Holes (rows fed no token: a batch's padding, a narrower row's columns in a wide pass) are left out
// of everything but the attention when p.live lists the fed rows: the norms, linears and residuals
// run over the fed rows packed together (h, y, codes, the linears' outputs: row i is fed row
// live[i]), and the q/k/v rows are spread back to their places in `rect` (holes zero) for the
// attention, which reads them there. A hole's keys and values are not written (no row sees a hole),
// and its output is not read. A fed row is computed as in a pass without holes, bit for bit.
int run_part(const Pass& p, const Layer* layers, int64_t n_layers, const Share& me, float* h, float* wide,
             float* rect, float* act, float* y, uint8_t* codes, float* row_max) {
  const int64_t fed = p.live ? p.n_live : p.batch * p.rows, H = p.hidden;
  auto at = [&](int64_t i) { return p.live ? p.live[i] : i; };  // a packed row's place in the pass
  int failed = 0;
  int64_t r0, r1;
  me.of(fed, &r0, &r1);
  // a linear's sums over this thread's tiles, its inputs coded beforehand
  auto tiles_of = [&](const Int8Weights& w, float* out) {
    const Linear L{codes, row_max, fed, w.in, w.out, w.weight, w.sums, w.scale, w.bias, out};
    int64_t from, to;
    me.of(padded(w.out, TILE) / TILE, &from, &to);
    tiles(L, from, to);
  };
  auto code = [&](const float* x, int64_t in, bool placed) {  // placed: x's rows are the pass's, not packed
    for (int64_t r = r0; r < r1; r++)
      code_rows(x + (placed ? at(r) : r) * in, 1, in, in, p.inverse, codes + r * padded(in, DEPTH), row_max + r);
  };
  auto add_residual = [&](int64_t r) {  // x += y on packed row r: one rounding, as torch's add
    float* x = p.x + at(r) * H;
    for (int64_t k = 0; k < H; k++) x[k] = x[k] + y[r * H + k];
  };
  for (int64_t l = 0; l < n_layers; l++) {
    const Layer& L = layers[l];
    for (int64_t r = r0; r < r1; r++) rms_norm_row(p.x + at(r) * H, H, L.norm1, L.eps1, h + r * H);
    code(h, L.qkv.in, false);
    barrier();
    tiles_of(L.qkv, wide);
    barrier();
    const int64_t width = L.qkv.out;
    for (int64_t r = r0; r < r1; r++) {
      if (rect != wide) memcpy(rect + at(r) * width, wide + r * width, width * sizeof(float));
      rope_and_store_row(p, at(r), rect, width, p.keys[l], p.values[l]);
    }
    barrier();
    const Share attending{me.t, p.attention_threads < me.team ? p.attention_threads : me.team};
    if (me.t < attending.team) {
      int64_t from, to;
      if (p.cache_kind == INT8_RECORDS) {
        const CallOf<int8_t> c = attention_call<int8_t>(p, l, rect, L.qkv.out, act);
        unit_share(&c, me.t, attending.team, &from, &to);
        failed |= run_units(&c, from, to);
      } else
#if HALF_CACHE
      if (p.cache_kind == HALVES) {
        const CallOf<Half> c = attention_call<Half>(p, l, rect, L.qkv.out, act);
        unit_share(&c, me.t, attending.team, &from, &to);
        failed |= run_units(&c, from, to);
      } else
#endif
      {
        const CallOf<float> c = attention_call<float>(p, l, rect, L.qkv.out, act);
        unit_share(&c, me.t, attending.team, &from, &to);
        failed |= run_units(&c, from, to);
      }
    }
    barrier();
    code(act, L.o.in, true);
    barrier();
    tiles_of(L.o, y);
    barrier();
    for (int64_t r = r0; r < r1; r++) {
      add_residual(r);
      rms_norm_row(p.x + at(r) * H, H, L.norm2, L.eps2, h + r * H);
    }
    code(h, L.gate_up.in, false);
    barrier();
    tiles_of(L.gate_up, wide);
    barrier();
    const int64_t n = L.gate_up.out / 2;
    int64_t c0, c1;
    me.of(fed * chunks(n), &c0, &c1);
    silu_times_up(wide, n, act, c0, c1);
    barrier();
    code(act, L.down.in, false);
    barrier();
    tiles_of(L.down, y);
    barrier();
    // the residual, then (next layer) the norm: both this thread's rows, so no barrier between
    for (int64_t r = r0; r < r1; r++) add_residual(r);
  }
  if (p.final_norm)  // the model's last norm, in place: this thread's rows again
    for (int64_t r = r0; r < r1; r++) rms_norm_row(p.x + at(r) * H, H, p.final_norm, p.final_eps, p.x + at(r) * H);
  return failed;
}

int run(const Pass& p, const Layer* layers, int64_t n_layers) {
  const int64_t rows = p.batch * p.rows, H = p.hidden;
  int64_t widest = 0, widest_in = 0, widest_qkv = 0;
  for (int64_t l = 0; l < n_layers; l++) {
    const Layer& L = layers[l];
    widest_qkv = L.qkv.out > widest_qkv ? L.qkv.out : widest_qkv;
    const int64_t outs[4] = {L.qkv.out, L.o.out, L.gate_up.out, L.down.out};
    const int64_t ins[4] = {L.qkv.in, L.o.in, L.gate_up.in, L.down.in};
    for (int j = 0; j < 4; j++) {
      widest = outs[j] > widest ? outs[j] : widest;
      widest_in = ins[j] > widest_in ? ins[j] : widest_in;
    }
  }
  float* h = (float*)malloc(sizeof(float) * rows * H);  // a norm's output
  float* wide = (float*)malloc(sizeof(float) * rows * widest);  // q/k/v or gate/up rows (packed)
  // q/k/v rows in their places for the attention: with holes left out, its own, holes' rows zero
  float* rect = p.live ? (float*)calloc(rows * widest_qkv, sizeof(float)) : wide;
  float* act = (float*)malloc(sizeof(float) * rows * widest_in);  // the attention's output or SiLU * up
  float* y = (float*)malloc(sizeof(float) * rows * H);
  uint8_t* codes = (uint8_t*)malloc(rows * padded(widest_in, DEPTH) + 1);
  float* row_max = (float*)malloc(sizeof(float) * (rows + 1));
  int failed = !h || !wide || !rect || !act || !y || !codes || !row_max;
  if (!failed) {
#if defined(_OPENMP)
    // one team for the whole pass (torch's own OpenMP threads): a barrier between steps instead of
    // a parallel region each, and the row-wise steps split too
#pragma omp parallel num_threads(p.threads) reduction(| : failed)
    failed |= run_part(p, layers, n_layers, Share{omp_get_thread_num(), omp_get_num_threads()}, h, wide, rect, act,
                       y, codes, row_max);
#else
    failed = run_part(p, layers, n_layers, Share{0, 1}, h, wide, rect, act, y, codes, row_max);
#endif
  }
  free(h);
  if (rect != wide) free(rect);
  free(wide);
  free(act);
  free(y);
  free(codes);
  free(row_max);
  return failed;
}

// A struct's layout as native_layers.py's ctypes classes must match it: its size, its field count,
// then each field's offset and size in declaration order. Written into out (room entries at most);
// returns how many entries the whole layout has.
#define FIELD(S, f) (int64_t)offsetof(S, f), (int64_t)sizeof(S::f)

template <size_t N>
int64_t write_layout(int64_t size, const int64_t (&fields)[N], int64_t* out, int64_t room) {
  const int64_t head[2] = {size, (int64_t)(N / 2)};
  for (int64_t i = 0; i < (int64_t)N + 2 && i < room; ++i) out[i] = i < 2 ? head[i] : fields[i - 2];
  return (int64_t)N + 2;
}

}  // namespace

extern "C" {

// The decoder layers of one pass over x (pass.x, in place). Returns 0, or 1 when out of memory.
int decoder(const Pass* pass, const Layer* layers, int64_t n_layers) {
  if (pass->cache_kind == HALVES && !HALF_CACHE) return 2;  // this build cannot read halves (no F16C)
  return run(*pass, layers, n_layers);
}

// Whether this build can keep the cache in halves (F16C).
int64_t half_cache_supported() { return HALF_CACHE; }

// n floats as the int8 record the cache gets (n + 4 bytes): tests hold cache.py's to_records to it.
void int8_record(const float* x, int64_t n, int8_t* out) { to_record(out, x, n); }

int64_t layout_Int8Weights(int64_t* out, int64_t room) {
  using S = Int8Weights;
  const int64_t fields[] = {FIELD(S, weight), FIELD(S, sums), FIELD(S, scale), FIELD(S, bias), FIELD(S, in),
                            FIELD(S, out)};
  return write_layout(sizeof(S), fields, out, room);
}

int64_t layout_Layer(int64_t* out, int64_t room) {
  using S = Layer;
  const int64_t fields[] = {FIELD(S, norm1), FIELD(S, norm2), FIELD(S, eps1), FIELD(S, eps2), FIELD(S, qkv),
                            FIELD(S, o), FIELD(S, gate_up), FIELD(S, down)};
  return write_layout(sizeof(S), fields, out, room);
}

int64_t layout_Pass(int64_t* out, int64_t room) {
  using S = Pass;
  const int64_t fields[] = {
      FIELD(S, x), FIELD(S, batch), FIELD(S, rows), FIELD(S, hidden), FIELD(S, heads), FIELD(S, kv_heads),
      FIELD(S, dim), FIELD(S, cos), FIELD(S, sin), FIELD(S, rope_batch_stride), FIELD(S, keys), FIELD(S, values),
      FIELD(S, cache_kind), FIELD(S, cache_batch_stride), FIELD(S, cache_head_stride), FIELD(S, cache_key_stride),
      FIELD(S, start), FIELD(S, ranges),
      FIELD(S, offsets), FIELD(S, scale), FIELD(S, inverse), FIELD(S, threads), FIELD(S, attention_threads),
      FIELD(S, live), FIELD(S, n_live), FIELD(S, final_norm), FIELD(S, final_eps)};
  return write_layout(sizeof(S), fields, out, room);
}
}
