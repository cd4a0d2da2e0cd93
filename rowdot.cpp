// A few rows of activations times a weight matrix, the product that decoding a token is made of: every
// weight is read once and used once per row, so its speed is the bandwidth it reads weights at. torch's
// kernels read float32 near memory speed but bf16 and int8 below it (docs/benchmarks.md); this file reads
// all three at it. quantize.py builds it on first use (torch.utils.cpp_extension, -O3 -march=native, one
// build per CPU) and runs torch's own products where it cannot; tests/test_quantize.py pins it to
// quantize.reference_rowdot, that fallback's arithmetic.
//
// smallgpt::rowdot(x, weight, scale, bias) -> (M, N): x (M, K) float32 or bfloat16, M small (a decoded
// token, a server's batch); weight (N, K) float32, bfloat16, or int8 with scale (N, ceil(K / 32)) float16,
// one scale per block of 32 weights of a row (llama.cpp's Q8_0); bias (N,) or none. Accumulates in float32;
// returns x's dtype. Intrinsics for AVX-512 (VNNI for int8) and AVX2; plain C++ on any other CPU.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int BLOCK = 32;  // int8 weights per scale
// Software prefetch this many bytes ahead of the row being read: the hardware's own prefetcher leaves the
// threads waiting on memory (1.2-1.7x slower over a model's weights on a Xeon; tuned there, 2-8 KiB alike).
constexpr int64_t PREFETCH = 2048, PREFETCH_Q8 = 4096;

// The vector unit: AVX-512 (16 float lanes), AVX2 with FMA (8), or one lane (any other CPU, which the
// compiler may still vectorise). widen() turns LANES weights of any of the three types into float32.
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr int LANES = 16;
typedef __m512 vec;
inline vec zero() { return _mm512_setzero_ps(); }
inline vec set1(float a) { return _mm512_set1_ps(a); }
inline vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec widen(const float* p) { return _mm512_loadu_ps(p); }
inline vec widen(const c10::BFloat16* p) {  // bf16 is float32's top half: shift it back into place
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline vec widen(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
inline float sum(vec a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int LANES = 8;
typedef __m256 vec;
inline vec zero() { return _mm256_setzero_ps(); }
inline vec set1(float a) { return _mm256_set1_ps(a); }
inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec widen(const float* p) { return _mm256_loadu_ps(p); }
inline vec widen(const c10::BFloat16* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline vec widen(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline float sum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
constexpr int LANES = 1;
typedef float vec;
inline vec zero() { return 0.f; }
inline vec set1(float a) { return a; }
inline vec fma(vec a, vec b, vec c) { return a * b + c; }
inline vec widen(const float* p) { return *p; }
inline vec widen(const c10::BFloat16* p) { return static_cast<float>(*p); }
inline vec widen(const int8_t* p) { return static_cast<float>(*p); }
inline float sum(vec a) { return a; }
#endif
static_assert(BLOCK % LANES == 0, "a block is whole vectors");

inline float scalar(float w) { return w; }
inline float scalar(c10::BFloat16 w) { return static_cast<float>(w); }
inline float scalar(int8_t w) { return static_cast<float>(w); }

// One weight row against every row of x (float32, M x K): the row is read from memory once, then from cache.
template <typename T>
inline void row_times(const T* w, const float* x, int64_t M, int64_t K, float* out, int64_t stride) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    vec a0 = zero(), a1 = zero();
    int64_t k = 0;
    for (; k + 2 * LANES <= K; k += 2 * LANES) {
      if ((k * sizeof(T)) % 64 == 0) __builtin_prefetch(w + k + PREFETCH / sizeof(T));
      a0 = fma(widen(w + k), widen(xm + k), a0);
      a1 = fma(widen(w + k + LANES), widen(xm + k + LANES), a1);
    }
    float s = sum(a0) + sum(a1);
    for (; k < K; ++k) s += scalar(w[k]) * xm[k];
    out[m * stride] = s;
  }
}

// int8: x is quantised too, per block of 32 as the weights are (scale amax / 127, rounded half away from
// zero: llama.cpp's Q8_0 x Q8_0 product), so each block's dot product is an exact integer; the row is the sum
// of those times both blocks' scales. Where AVX-512 VNNI is there, 64 byte products per instruction.
struct QuantisedX {
  int64_t M, K, blocks;
  std::vector<int8_t> q;       // (M, K)
  std::vector<float> value;    // q as floats (exact), for the float path
  std::vector<float> scale;    // (M, blocks)
  std::vector<int32_t> minus;  // (M, K / 4): -128 x the sum of each 4 q's (VNNI's unsigned operand is w + 128)

  QuantisedX(const float* x, int64_t M_, int64_t K_)
      : M(M_), K(K_), blocks((K_ + BLOCK - 1) / BLOCK), q(M_ * K_), value(M_ * K_), scale(M_ * blocks), minus(M_ * (K_ / 4)) {
    for (int64_t m = 0; m < M; ++m) {
      int64_t b = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
      // whole blocks sixteen lanes at a time (the scalar loop below costs a decode step 0.25 ms at 12x768):
      // the same arithmetic, rounding as floor(a) + floor(2 (a - floor(a))), exact in float32
      const __m512 sign = _mm512_set1_ps(-0.f), top = _mm512_set1_ps(127.f);
      for (; (b + 1) * BLOCK <= K; ++b) {
        const float* xb = x + m * K + b * BLOCK;
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        if (!(amax == amax)) break;  // a NaN: the scalar loop's handling
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        scale[m * blocks + b] = d;
        for (int half = 0; half < 2; ++half) {
          const __m512 v = _mm512_mul_ps(half ? x1 : x0, _mm512_set1_ps(id)), a = _mm512_abs_ps(v);
          const __m512 f = _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
          const __m512 twice = _mm512_add_ps(_mm512_sub_ps(a, f), _mm512_sub_ps(a, f));
          __m512 r = _mm512_min_ps(_mm512_add_ps(f, _mm512_roundscale_ps(twice, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)), top);
          r = _mm512_or_ps(r, _mm512_and_ps(v, sign));  // v's sign back
          const int64_t k = m * K + b * BLOCK + 16 * half;
          _mm512_storeu_ps(&value[k], r);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(&q[k]), _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(r)));
        }
      }
#endif
      for (; b < blocks; ++b) {
        const int64_t k0 = b * BLOCK, k1 = std::min<int64_t>(K, k0 + BLOCK);
        float amax = 0.f;
        for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::abs(x[m * K + k]));
        const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
        scale[m * blocks + b] = d;
        for (int64_t k = k0; k < k1; ++k) {
          float r = std::round(x[m * K + k] * id);  // half away from zero
          r = r == r ? std::min(127.f, std::max(-127.f, r)) : 0.f;  // (a NaN in x: no undefined cast)
          q[m * K + k] = static_cast<int8_t>(r);
          value[m * K + k] = r;
        }
      }
      for (int64_t j = 0; j < K / 4; ++j) {
        const int8_t* g = &q[m * K + 4 * j];
        minus[m * (K / 4) + j] = -128 * (g[0] + g[1] + g[2] + g[3]);
      }
    }
  }
};

inline float row_times_q8(const int8_t* w, const c10::Half* ws, const QuantisedX& x, int64_t m) {
  const int64_t K = x.K, full = K / BLOCK;
  const int8_t* xq = x.q.data() + m * K;
  const float* xv = x.value.data() + m * K;
  const float* xs = x.scale.data() + m * x.blocks;
  int64_t b = 0;
  float s = 0.f;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const int32_t* minus = x.minus.data() + m * (K / 4);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  __m512 acc = _mm512_setzero_ps();
  for (; b + 2 <= full; b += 2) {  // two blocks: lanes 0-7 the first's partial sums, 8-15 the second's
    const int64_t k = b * BLOCK;
    __builtin_prefetch(w + k + PREFETCH_Q8);
    const __m512i wu = _mm512_xor_si512(_mm512_loadu_si512(w + k), flip);  // w + 128, unsigned
    const __m512i dot = _mm512_dpbusd_epi32(_mm512_loadu_si512(minus + k / 4), wu, _mm512_loadu_si512(xq + k));
    int32_t two;  // the two blocks' float16 scales
    std::memcpy(&two, ws + b, 4);
    const __m128 pair = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(two)),
                                   _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(xs + b))));
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(pair)), acc);
  }
  s = _mm512_reduce_add_ps(acc);
#else
  vec acc = zero();
  for (; b < full; ++b) {  // products of integers summed in float32: exact (|sum| < 2^24)
    const int64_t k = b * BLOCK;
    if (b % 2 == 0) __builtin_prefetch(w + k + PREFETCH_Q8);
    vec part = zero();
    for (int j = 0; j < BLOCK; j += LANES) part = fma(widen(w + k + j), widen(xv + k + j), part);
    acc = fma(part, set1(static_cast<float>(ws[b]) * xs[b]), acc);
  }
  s = sum(acc);
#endif
  for (; b < x.blocks; ++b) {  // what is left: an odd last block, a partial one
    float t = 0.f;
    for (int64_t k = b * BLOCK; k < std::min<int64_t>(K, (b + 1) * BLOCK); ++k) t += static_cast<float>(w[k]) * xv[k];
    s += t * (static_cast<float>(ws[b]) * xs[b]);
  }
  return s;
}

at::Tensor rowdot(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "rowdot: x (M, K) and weight (N, K)");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && (!scale || scale->device().is_cpu()) &&
              (!bias || bias->device().is_cpu()), "rowdot: CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rowdot: x float32 or bfloat16");
  TORCH_CHECK(weight.is_contiguous(), "rowdot: weight must be contiguous (row-major)");
  const auto wt = weight.scalar_type();
  TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16 || wt == at::kChar, "rowdot: weight float32, bfloat16 or int8");
  TORCH_CHECK((wt == at::kChar) == scale.has_value(), "rowdot: int8 weights take a scale, others none");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const int64_t blocks = (K + BLOCK - 1) / BLOCK;
  if (scale) {
    TORCH_CHECK(scale->scalar_type() == at::kHalf && scale->is_contiguous() && scale->size(0) == N &&
                scale->numel() == N * blocks, "rowdot: scale (N, ceil(K / 32)) float16, contiguous");
  }
  if (bias) TORCH_CHECK(bias->numel() == N, "rowdot: bias (N,)");

  const bool as_is = x.scalar_type() == at::kFloat && x.is_contiguous();  // (each call here costs a dispatch)
  const at::Tensor xf = as_is ? x : x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  at::Tensor out = at::empty({M, N}, xf.options());
  float* op = out.data_ptr<float>();
  const at::Tensor bf = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = bias ? bf.data_ptr<float>() : nullptr;
  const void* wp = weight.data_ptr();
  const c10::Half* sp = scale ? scale->data_ptr<c10::Half>() : nullptr;
  const QuantisedX xq = wt == at::kChar ? QuantisedX(xp, M, K) : QuantisedX(xp, 0, K);
  // one contiguous range of rows per thread (torch's pool, set_num_threads): each streams its own part
  const int64_t grain = std::max<int64_t>(16, N / (4 * at::get_num_threads()) + 1);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      if (wt == at::kFloat) {
        row_times(static_cast<const float*>(wp) + n * K, xp, M, K, op + n, N);
      } else if (wt == at::kBFloat16) {
        row_times(static_cast<const c10::BFloat16*>(wp) + n * K, xp, M, K, op + n, N);
      } else {
        for (int64_t m = 0; m < M; ++m) op[m * N + n] = row_times_q8(static_cast<const int8_t*>(wp) + n * K, sp + n * blocks, xq, m);
      }
      if (bp) {
        for (int64_t m = 0; m < M; ++m) op[m * N + n] += bp[n];
      }
    }
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// One query a row over a decode step's static cache: softmax(q.k / sqrt(D) + mask) v per head, in float32.
// q (B, H, 1, D); k, v (B, Hkv, K, D), H a multiple of Hkv (grouped heads); mask (B or 1, H or 1, 1, K): a boolean
// (true: seen) or an additive bias (-inf: hidden). SDPA's CPU kernel calls a small GEMM per head for this,
// several times this loop's time at one query (docs/benchmarks.md).
at::Tensor one_query_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(3) == k.size(3) &&
              q.size(0) == k.size(0) && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "one_query_attention: q (B, H, 1, D), k and v (B, Hkv, K, D)");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && mask.device().is_cpu(),
              "one_query_attention: CPU tensors");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "one_query_attention: float32");
  const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), K = k.size(2), D = q.size(3);
  TORCH_CHECK(mask.dim() == 4 && (mask.size(0) == B || mask.size(0) == 1) && (mask.size(1) == 1 || mask.size(1) == H) &&
              mask.size(2) == 1 && mask.size(3) == K, "one_query_attention: mask (B or 1, H or 1, 1, K)");
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), mc = mask.contiguous();
  const bool seen = mc.scalar_type() == at::kBool;
  TORCH_CHECK(seen || mc.scalar_type() == at::kFloat, "one_query_attention: a bool or float32 mask");
  at::Tensor out = at::empty({B, H, 1, D}, qc.options());
  const float *qp = qc.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(K);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H, g = h / (H / Hkv), mh = mc.size(1) == 1 ? 0 : h, mb = mc.size(0) == 1 ? 0 : b;
      const float* kb = kp + (b * Hkv + g) * K * D;
      const float* vb = vp + (b * Hkv + g) * K * D;
      float top = -INFINITY;
      for (int64_t j = 0; j < K; ++j) {
        float s;
        if (seen && !mc.data_ptr<bool>()[(mb * mc.size(1) + mh) * K + j]) {
          s = -INFINITY;
        } else {
          row_times(kb + j * D, qp + bh * D, 1, D, &s, 1);
          s *= scale;
          if (!seen) s += mc.data_ptr<float>()[(mb * mc.size(1) + mh) * K + j];
        }
        p[j] = s;
        top = std::max(top, s);
      }
      float total = 0.f;
      for (int64_t j = 0; j < K; ++j) total += (p[j] = p[j] == -INFINITY ? 0.f : std::exp(p[j] - top));
      float* o = op + bh * D;
      std::fill(o, o + D, 0.f);
      for (int64_t j = 0; j < K; ++j) {
        if (p[j] == 0.f) continue;
        const float w = p[j] / total;
        for (int64_t d = 0; d < D; ++d) o[d] += w * vb[j * D + d];
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(smallgpt, m) {
  m.def("rowdot(Tensor x, Tensor weight, Tensor? scale, Tensor? bias) -> Tensor");
  m.def("one_query_attention(Tensor q, Tensor k, Tensor v, Tensor mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(smallgpt, CPU, m) {
  m.impl("rowdot", rowdot);
  m.impl("one_query_attention", one_query_attention);
}
