/* pdserve's fused CPU kernels for bf16 activations (common/model/cpu_kernels/__init__.py builds
 * and loads this file; fused_ops.CpuFusedOps and attention/torch_backend.py call it).
 *
 * Every kernel does its math in fp32 and rounds to bf16 where the torch reference
 * (fused_ops.TorchOps, rope.RopeTable, torch SDPA) rounds, so results agree with it within
 * bf16 rounding (tests/model/test_cpu_kernels.py). Built with -ffp-contract=off: no FMA
 * contraction the reference's separate mul/add would not do.
 *
 * Threads: OpenMP from the same libgomp torch loaded (one pool); the caller passes the
 * thread count (torch.get_num_threads()) and kernels go parallel only above a work size.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

typedef uint16_t bf16;

static inline float bf2f(bf16 v) { uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f; }
static inline bf16 f2bf(float f) {  /* round to nearest even, as torch */
  uint32_t u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (bf16)(u >> 16);
}

#define PAR_MIN_ELEMS 65536  /* below this many elements a kernel stays on the calling thread */

int pdserve_abi_version(void) { return 1; }

/* residual[t] = bf16(x[t] + residual[t]); x[t] = bf16(w * bf16(rmsnorm(residual[t]))) */
void add_rms_norm_bf16(bf16* x, bf16* res, const bf16* w, int64_t T, int64_t H, float eps, int nthreads) {
  #pragma omp parallel for num_threads(nthreads) if (T * H >= PAR_MIN_ELEMS) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    bf16* xr = x + t * H; bf16* rr = res + t * H;
    float ss = 0.f;
    for (int64_t i = 0; i < H; i++) {
      bf16 r = f2bf(bf2f(xr[i]) + bf2f(rr[i]));
      rr[i] = r;
      float f = bf2f(r);
      ss += f * f;
    }
    float inv = 1.0f / sqrtf(ss / (float)H + eps);
    for (int64_t i = 0; i < H; i++) xr[i] = f2bf(bf2f(w[i]) * bf2f(f2bf(bf2f(rr[i]) * inv)));
  }
}

/* out[t] = bf16(w * bf16(rmsnorm(x[t]))) (out may be x) */
void rms_norm_bf16(const bf16* x, bf16* out, const bf16* w, int64_t T, int64_t H, float eps, int nthreads) {
  #pragma omp parallel for num_threads(nthreads) if (T * H >= PAR_MIN_ELEMS) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    const bf16* xr = x + t * H; bf16* o = out + t * H;
    float ss = 0.f;
    for (int64_t i = 0; i < H; i++) { float f = bf2f(xr[i]); ss += f * f; }
    float inv = 1.0f / sqrtf(ss / (float)H + eps);
    for (int64_t i = 0; i < H; i++) o[i] = f2bf(bf2f(w[i]) * bf2f(f2bf(bf2f(xr[i]) * inv)));
  }
}

/* out[t, i] = bf16(bf16(silu(gate[t, i])) * up[t, i]); gate_up[t] = [gate | up], I each */
void silu_mul_bf16(const bf16* gu, bf16* out, int64_t T, int64_t I, int nthreads) {
  #pragma omp parallel for num_threads(nthreads) if (T * I >= PAR_MIN_ELEMS) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    const bf16* g = gu + t * 2 * I; const bf16* u = g + I; bf16* o = out + t * I;
    for (int64_t i = 0; i < I; i++) {
      float a = bf2f(g[i]);
      o[i] = f2bf(bf2f(f2bf(a / (1.0f + expf(-a)))) * bf2f(u[i]));
    }
  }
}

/* Pool row of `slot`'s layer-`layer` K (V: + page_size); page sizes are powers of two in
 * practice, where this is a shift and a mask instead of a 64-bit division. */
static inline int64_t pool_row(int64_t slot, int64_t page_size, int64_t num_layers, int64_t layer) {
  int64_t page, off;
  if ((page_size & (page_size - 1)) == 0) {
    int sh = __builtin_ctzll((unsigned long long)page_size);
    page = slot >> sh; off = slot & (page_size - 1);
  } else {
    page = slot / page_size; off = slot % page_size;
  }
  return page * 2 * num_layers * page_size + off + 2 * layer * page_size;
}

/* Rotate one head in place (HF rotate_half): [x1*c - x2*s | x2*c + x1*s], fp32, rounded once. */
static inline void rotate(bf16* h, const float* cs, int64_t D) {
  int64_t half = D / 2;
  const float* c = cs; const float* s = cs + half;
  for (int64_t i = 0; i < half; i++) {
    float x1 = bf2f(h[i]), x2 = bf2f(h[i + half]);
    float a = x1 * c[i], b = x2 * (-s[i]);
    float d = x2 * c[i], e = x1 * s[i];
    h[i] = f2bf(a + b);
    h[i + half] = f2bf(d + e);
  }
}

/* q [T, Hq, D] and k [T, Hk, D] (row strides q_stride, k_stride; heads contiguous) rotated in
 * place at positions[t] (cos_sin: [context, D] fp32 = [cos | sin]); then, when pool is not NULL,
 * k and v (row stride v_stride) copied to the pool rows of slots[t]: row = (slot / ps) * 2 * L * ps
 * + slot % ps + (2 * layer + kind) * ps, each row Hk * D elements (common/cache/kv_pool.py). */
void rope_kv_bf16(bf16* q, int64_t q_stride, bf16* k, int64_t k_stride, const bf16* v, int64_t v_stride,
                  int64_t T, int64_t Hq, int64_t Hk, int64_t D, const int64_t* positions,
                  const float* cos_sin, bf16* pool, const int64_t* slots, int64_t num_layers,
                  int64_t page_size, int64_t layer, int nthreads) {
  #pragma omp parallel for num_threads(nthreads) if (T * (Hq + Hk) * D >= PAR_MIN_ELEMS) schedule(static)
  for (int64_t t = 0; t < T; t++) {
    const float* cs = cos_sin + positions[t] * D;
    bf16* qr = q + t * q_stride; bf16* kr = k + t * k_stride;
    for (int64_t h = 0; h < Hq; h++) rotate(qr + h * D, cs, D);
    for (int64_t h = 0; h < Hk; h++) rotate(kr + h * D, cs, D);
    if (pool) {
      int64_t base = pool_row(slots[t], page_size, num_layers, layer);
      int64_t kv = Hk * D;
      memcpy(pool + base * kv, kr, kv * sizeof(bf16));
      memcpy(pool + (base + page_size) * kv, v + t * v_stride, kv * sizeof(bf16));
    }
  }
}

/* ---- paged decode attention ---------------------------------------------------------------- */

static inline void load_f32(const bf16* p, float* out, int64_t D) {
#ifdef __AVX512F__
  int64_t i = 0;
  for (; i + 16 <= D; i += 16) {
    __m512i v = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(p + i))), 16);
    _mm512_storeu_ps(out + i, _mm512_castsi512_ps(v));
  }
  for (; i < D; i++) out[i] = bf2f(p[i]);
#else
  for (int64_t i = 0; i < D; i++) out[i] = bf2f(p[i]);
#endif
}

static inline float dot_f32(const float* a, const float* b, int64_t D) {
#ifdef __AVX512F__
  if ((D & 15) == 0) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= D; i += 32) {
      acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
    }
    if (i < D) acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  }
#endif
  float acc = 0.f;
  for (int64_t i = 0; i < D; i++) acc += a[i] * b[i];
  return acc;
}

static inline void axpy_f32(float* o, float p, const float* v, int64_t D) {
#ifdef __AVX512F__
  if ((D & 15) == 0) {
    __m512 pp = _mm512_set1_ps(p);
    for (int64_t i = 0; i < D; i += 16)
      _mm512_storeu_ps(o + i, _mm512_fmadd_ps(pp, _mm512_loadu_ps(v + i), _mm512_loadu_ps(o + i)));
    return;
  }
#endif
  for (int64_t i = 0; i < D; i++) o[i] += p * v[i];
}

#define MAX_GROUP 16
#define MAX_HEAD_DIM 256
#define KEY_BLOCK 64  /* keys scored together: one max, one rescale, vectorised exp per block */

/* exp over n floats in place (n <= KEY_BLOCK); -inf -> 0. AVX-512: range reduction to
 * 2^k * exp(r), |r| <= ln2/2, degree-6 polynomial (rel. error ~2e-7, far below bf16's 4e-3). */
static inline void exp_inplace(float* x, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), ln2hi = _mm512_set1_ps(0.693359375f),
               ln2lo = _mm512_set1_ps(-2.12194440e-4f), lo = _mm512_set1_ps(-87.3f), hi = _mm512_set1_ps(88.3f);
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    __mmask16 dead = _mm512_cmp_ps_mask(v, lo, _CMP_LT_OQ);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(_mm512_sub_ps(v, _mm512_mul_ps(k, ln2hi)), _mm512_mul_ps(k, ln2lo));
    __m512 p = _mm512_set1_ps(1.3981999507e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512 e = _mm512_scalef_ps(p, k);
    _mm512_storeu_ps(x + i, _mm512_maskz_mov_ps(~dead, e));
  }
#endif
  for (; i < n; i++) x[i] = expf(x[i]);
}

/* One query token per row r (n rows): q [*, Hk * G, D] (row stride q_stride) row token[r], its
 * keys are the first seq_len[r] slots of req_to_token[req[r]] (int64, or int32 with rt_int32;
 * row stride rt_stride), read in place from the pool (layout as rope_kv_bf16). out
 * [*, Hk * G * D] row token[r]. Per (row, kv head) the G query heads that share it go through
 * the keys in blocks of KEY_BLOCK: scores, then one online-softmax rescale per block, then the
 * V sum; fp32 throughout, rounded once. */
int decode_attention_bf16(const bf16* q, int64_t q_stride, bf16* out, const bf16* pool, const void* req_to_token,
                          int64_t rt_stride, int rt_int32, const int64_t* req, const int64_t* seq_len,
                          const int64_t* token, int64_t n, int64_t Hk, int64_t G, int64_t D,
                          int64_t num_layers, int64_t page_size, int64_t layer, float scale, int nthreads) {
  if (G > MAX_GROUP || D > MAX_HEAD_DIM) return -1;
  int64_t work = 0;
  for (int64_t r = 0; r < n; r++) work += seq_len[r];
  int64_t kvw = Hk * D;
  #pragma omp parallel for num_threads(nthreads) if (work * Hk * D * G >= 4 * PAR_MIN_ELEMS) schedule(dynamic, 1) collapse(2)
  for (int64_t r = 0; r < n; r++) {
    for (int64_t h = 0; h < Hk; h++) {
      float qf[MAX_GROUP][MAX_HEAD_DIM];
      float acc[MAX_GROUP][MAX_HEAD_DIM];
      float sc[MAX_GROUP][KEY_BLOCK];
      float m[MAX_GROUP], l[MAX_GROUP];
      float kf[MAX_HEAD_DIM];
      const bf16* kp[KEY_BLOCK];
      const bf16* vp[KEY_BLOCK];
      const bf16* qr = q + token[r] * q_stride + h * G * D;
      for (int64_t g = 0; g < G; g++) {
        load_f32(qr + g * D, qf[g], D);
        for (int64_t i = 0; i < D; i++) { qf[g][i] *= scale; acc[g][i] = 0.f; }
        m[g] = -INFINITY; l[g] = 0.f;
      }
      const int64_t* slots64 = (const int64_t*)req_to_token + req[r] * rt_stride;
      const int32_t* slots32 = (const int32_t*)req_to_token + req[r] * rt_stride;
      int64_t L = seq_len[r];
      for (int64_t j0 = 0; j0 < L; j0 += KEY_BLOCK) {
        int64_t nb = L - j0 < KEY_BLOCK ? L - j0 : KEY_BLOCK;
        for (int64_t j = 0; j < nb; j++) {
          int64_t base = pool_row(rt_int32 ? (int64_t)slots32[j0 + j] : slots64[j0 + j], page_size, num_layers, layer);
          kp[j] = pool + base * kvw + h * D;
          vp[j] = pool + (base + page_size) * kvw + h * D;
        }
        for (int64_t j = 0; j < nb; j++) {
          load_f32(kp[j], kf, D);  /* converted once for the G heads */
          for (int64_t g = 0; g < G; g++) sc[g][j] = dot_f32(qf[g], kf, D);
        }
        for (int64_t g = 0; g < G; g++) {
          float mx = m[g];
          for (int64_t j = 0; j < nb; j++) mx = sc[g][j] > mx ? sc[g][j] : mx;
          float c = expf(m[g] - mx);  /* first block: exp(-inf) = 0 */
          for (int64_t j = 0; j < nb; j++) sc[g][j] -= mx;
          exp_inplace(sc[g], nb);
          float sum = 0.f;
          for (int64_t j = 0; j < nb; j++) sum += sc[g][j];
          l[g] = l[g] * c + sum;
          m[g] = mx;
          if (c != 1.0f)
            for (int64_t i = 0; i < D; i++) acc[g][i] *= c;
        }
        for (int64_t j = 0; j < nb; j++) {
          load_f32(vp[j], kf, D);
          for (int64_t g = 0; g < G; g++) axpy_f32(acc[g], sc[g][j], kf, D);
        }
      }
      bf16* o = out + token[r] * Hk * G * D + h * G * D;
      for (int64_t g = 0; g < G; g++) {
        float inv = l[g] > 0.f ? 1.0f / l[g] : 0.f;
        for (int64_t i = 0; i < D; i++) o[g * D + i] = f2bf(acc[g][i] * inv);
      }
    }
  }
  return 0;
}

/* ---- batch-1 linear on oneDNN's packed weight -------------------------------------------- */

/* y[N] = x[K] @ W^T (+ bias), one row, W as oneDNN packs it for bf16 on AVX-512 (packed_linear:
 * mkldnn._reorder_linear_weight): "AB16b32a2b" = blocks of 32 outputs x 32 inputs, each block
 * [16 input pairs][32 outputs][2 inputs], blocks input-fastest. Per input pair one vdpbf16ps
 * per 16 outputs, every weight byte read once: at one row this streams the weights at the
 * memory's speed where oneDNN's batch-1 path reached ~60-70% of it. Returns -1 where the CPU or
 * the compiler has no AVX512-BF16 or the shape is not whole blocks (the caller keeps oneDNN;
 * PackedLinear checks the numbers against oneDNN once per weight before using it). */
int gemv_packed_bf16(const bf16* x, const bf16* w, const bf16* bias, bf16* y, int64_t K, int64_t N, int nthreads) {
#if defined(__AVX512BF16__)
  if (K % 32 || N % 32) return -1;
  int64_t nb = N / 32, kb = K / 32;
  #pragma omp parallel for num_threads(nthreads) if (N * K >= 4 * PAR_MIN_ELEMS) schedule(static)
  for (int64_t b = 0; b < nb; b++) {
    const bf16* wb = w + b * kb * 1024;
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), c0 = _mm512_setzero_ps(), c1 = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < K / 2; kp += 2) {
      const bf16* r0 = wb + (kp >> 4) * 1024 + (kp & 15) * 64;
      const bf16* r1 = r0 + 64;
      uint32_t x0, x1;
      memcpy(&x0, x + 2 * kp, 4);
      memcpy(&x1, x + 2 * kp + 2, 4);
      __m512bh b0 = (__m512bh)_mm512_set1_epi32((int)x0), b1 = (__m512bh)_mm512_set1_epi32((int)x1);
      a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(r0), b0);
      a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(r0 + 32), b0);
      c0 = _mm512_dpbf16_ps(c0, (__m512bh)_mm512_loadu_si512(r1), b1);
      c1 = _mm512_dpbf16_ps(c1, (__m512bh)_mm512_loadu_si512(r1 + 32), b1);
    }
    a0 = _mm512_add_ps(a0, c0);
    a1 = _mm512_add_ps(a1, c1);
    float out[32];
    _mm512_storeu_ps(out, a0);
    _mm512_storeu_ps(out + 16, a1);
    for (int i = 0; i < 32; i++) y[b * 32 + i] = f2bf(bias ? out[i] + bf2f(bias[b * 32 + i]) : out[i]);
  }
  return 0;
#else
  (void)x; (void)w; (void)bias; (void)y; (void)K; (void)N; (void)nthreads;
  return -1;
#endif
}
