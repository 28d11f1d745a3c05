// Vector helpers of the native kernels (row_attention.cpp, decoder.cpp, greedy.cpp): GCC vector
// types of 8 floats, sums in fixed orders, and Cephes' expf polynomial at any vector width.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f load8(const float* p) {
  v8f v;
  memcpy(&v, p, sizeof(v));
  return v;
}

static inline void store8(float* p, v8f v) { memcpy(p, &v, sizeof(v)); }

// a * b + c with one rounding where the CPU has FMA, else two: written out rather than left to the compiler,
// whose choice to fuse a * b + c (under fp-contract=fast) can differ between a template's instantiations,
// so that, say, scoring three heads together and scoring one alone would round differently.
static inline v8f fma8(v8f a, v8f b, v8f c) {
#if defined(__FMA__)
  return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}
static inline float fma1(float a, float b, float c) {
#if defined(__FMA__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

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

// fma8 at the values' width
static inline vv fma_lanes(vv a, vv b, vv c) {
#if VALUE_LANES == 16
  return (vv)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return fma8(a, b, c);
#endif
}

static inline v8f splat(float a) { return v8f{a, a, a, a, a, a, a, a}; }

// Keys and values stored as IEEE fp16 (Half: its bits) and read as floats. Converting a half to a float
// is exact, so a row's arithmetic on what it reads is the float arithmetic, in the same order; a float
// becomes a half by rounding to nearest even, one value at a time, so rows stay independent bit for bit.
// Needs F16C (every AVX2 CPU has it): HALF_CACHE says whether this build has it.
typedef uint16_t Half;
static inline float to_float(float x) { return x; }
static inline vv load_lanes(const float* p) {
  vv v;
  memcpy(&v, p, sizeof(v));
  return v;
}
#if defined(__F16C__)
#define HALF_CACHE 1
static inline v8f load8(const Half* p) { return (v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
static inline float to_float(Half h) { return _cvtsh_ss(h); }
static inline vv load_lanes(const Half* p) {
#if VALUE_LANES == 16
  return (vv)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
#else
  return (vv)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#endif
}
// n floats into halves
static inline void to_halves(Half* out, const float* x, int64_t n) {
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    _mm_storeu_si128((__m128i*)(out + k), _mm256_cvtps_ph(_mm256_loadu_ps(x + k), _MM_FROUND_TO_NEAREST_INT));
  for (; k < n; k++) out[k] = _cvtss_sh(x[k], _MM_FROUND_TO_NEAREST_INT);
}
#else
#define HALF_CACHE 0
#endif

// Keys and values stored as int8 records (MARS_DEMO_INT8_CACHE): a head's d values rounded to int8 at the
// scale that puts its largest magnitude at 127, then that fp32 scale's 4 bytes. Converting an int8 to a
// float is exact; the record's scale multiplies a key's whole score and a value's whole weight
// (row_attention.cpp), so a row's arithmetic stays its own, bit for bit.
static inline float to_float(int8_t x) { return (float)x; }
static inline v8f load8(const int8_t* p) {
#if defined(__AVX2__)
  return (v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#else
  return v8f{(float)p[0], (float)p[1], (float)p[2], (float)p[3], (float)p[4], (float)p[5], (float)p[6], (float)p[7]};
#endif
}
static inline vv load_lanes(const int8_t* p) {
#if VALUE_LANES == 16
  return (vv)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#else
  return (vv)load8(p);
#endif
}
// A record's scale: the 4 bytes after its d values.
static inline float record_scale(const int8_t* record, int64_t d) {
  float s;
  memcpy(&s, record + d, sizeof(s));
  return s;
}
// n floats into a record: x / scale rounded half to even (the default rounding mode), within +-127. lean.py's
// torch layers write the same bits (cache.py, ``to_records``).
static inline void to_record(int8_t* out, const float* x, int64_t n) {
  float top = 0.0f;
  for (int64_t k = 0; k < n; k++) top = fabsf(x[k]) > top ? fabsf(x[k]) : top;
  const float scale = top / 127.0f;
  for (int64_t k = 0; k < n; k++) {
    float q = scale > 0.0f ? nearbyintf(x[k] / scale) : 0.0f;
    q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
    out[k] = (int8_t)q;
  }
  memcpy(out + n, &scale, sizeof(scale));
}

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
