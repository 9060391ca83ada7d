/* A layer's small ops fused: residual add + RMSNorm, RoPE + KV write, SiLU * up (float32 and bfloat16). */
#include "isa.h"

/* float32 -> e4m3fn, to nearest even, saturating at +-448 as torch's conversion does (NaN -> NaN) */
static inline uint8_t fp8_round(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    const float a = fabsf(f);
    if (a != a) return 0x7F;
    if (a >= 448.0f) return sign | 0x7E;
    if (a < 1.0f / 64.0f) return sign | (uint8_t)nearbyintf(a * 512.0f);  /* subnormal (8 -> 2^-6: 0x08) */
    uint32_t au = u & 0x7FFFFFFFu;
    au += 0x7FFFFu + ((au >> 20) & 1u);
    return sign | (uint8_t)((((au >> 23) - 120u) << 3) | ((au >> 20) & 7u));
}
/* ---- the small per-layer ops, fused: one call each where PyTorch dispatches several ops ------------
 * At decode sizes a layer's norms, RoPE, KV write and SiLU cost more in op dispatch than in arithmetic
 * (a bfloat16 RMSNorm alone is seven ops). Each kernel takes float32 or bfloat16 tensors (kind) and
 * rounds where PyTorch's bfloat16 ops round, so the two paths give the same values. */

static inline float load_kind(const void *p, int64_t i, int kind)
{
    return kind == KIND_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* v as the kind stores it (bfloat16: rounded to nearest even) */
static inline float as_kind(float v, int kind)
{
    return kind == KIND_BF16 ? bf16_to_f32(bf16_round(v)) : v;
}

static inline void store_kind(void *p, int64_t i, float v, int kind)
{
    if (kind == KIND_BF16) ((uint16_t *)p)[i] = bf16_round(v);
    else if (kind == KIND_FP8) ((uint8_t *)p)[i] = fp8_round(v);
#ifdef __F16C__
    else if (kind == KIND_F16) ((uint16_t *)p)[i] = _cvtss_sh(v, 0);
#endif
    else ((float *)p)[i] = v;
}

#if defined(__AVX2__) && defined(__FMA__)
/* 8 bfloat16 values as float32 lanes, and back (round to nearest even; NaN stays NaN) */
static inline __m256 bf16x8_load(const uint16_t *p)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __m256i bf16x8_rounded_bits(__m256 v)
{
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
}

static inline __m256 bf16x8_round(__m256 v)
{
    return _mm256_castsi256_ps(_mm256_and_si256(bf16x8_rounded_bits(v), _mm256_set1_epi32((int)0xffff0000u)));
}

static inline void bf16x8_store(uint16_t *p, __m256 v)
{
    const __m256i top = _mm256_srli_epi32(bf16x8_rounded_bits(v), 16);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
}

/* the same for any kind: float32 or bfloat16 loads; float32, bfloat16 or float16 stores */
static inline __m256 load8_kind(const void *p, int64_t i, int kind)
{
    return kind == KIND_BF16 ? bf16x8_load((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

static inline __m256 round8_kind(__m256 v, int kind)
{
    return kind == KIND_BF16 ? bf16x8_round(v) : v;
}

static inline void store8_kind(void *p, int64_t i, __m256 v, int kind)
{
    if (kind == KIND_BF16) bf16x8_store((uint16_t *)p + i, v);
    else if (kind == KIND_FP8) {
        float lanes[8];
        _mm256_storeu_ps(lanes, v);
        for (int j = 0; j < 8; ++j) ((uint8_t *)p)[i + j] = fp8_round(lanes[j]);
    }
#ifdef __F16C__
    else if (kind == KIND_F16) _mm_storeu_si128((__m128i *)((uint16_t *)p + i), _mm256_cvtps_ph(v, 0));
#endif
    else _mm256_storeu_ps((float *)p + i, v);
}
#endif

/* out = RMSNorm(x) * w over M rows of K; with residual: residual += x first (in place, rounded to
 * the kind) and the norm is of that sum (vLLM's fused add). float32: x * inv * w as F.rms_norm;
 * bfloat16: w * round(x * inv) with the statistics in float32, as the reference model computes. */
static int add_rms_norm_x1(const void *x, void *residual, const void *w, int64_t M, int64_t K, float eps, int kind,
                           void *out)
{
    for (int64_t i = 0; i < M; i++) {
        const int64_t row = i * K;
        const void *src = x;
        float sum = 0.0f;
        if (residual) {
            for (int64_t j = 0; j < K; j++) {
                const float v = as_kind(load_kind(residual, row + j, kind) + load_kind(x, row + j, kind), kind);
                store_kind(residual, row + j, v, kind);
                sum += v * v;
            }
            src = residual;
        } else {
            for (int64_t j = 0; j < K; j++) {
                const float v = load_kind(x, row + j, kind);
                sum += v * v;
            }
        }
        const float inv = 1.0f / sqrtf(sum / (float)K + eps);
        for (int64_t j = 0; j < K; j++)
            store_kind(out, row + j, as_kind(load_kind(src, row + j, kind) * inv, kind) * load_kind(w, j, kind), kind);
    }
    return 0;
}

#if defined(__AVX2__) && defined(__FMA__)
/* add_rms_norm for K a multiple of 8: the same roundings, 8 lanes at a time */
static void add_rms_norm_x8(const void *x, void *residual, const void *w, int64_t M, int64_t K, float eps, int kind,
                            void *out)
{
    for (int64_t i = 0; i < M; i++) {
        const int64_t row = i * K;
        const void *src = residual ? residual : x;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t j = 0; j < K; j += 8) {
            __m256 v = load8_kind(x, row + j, kind);
            if (residual) {
                v = round8_kind(_mm256_add_ps(load8_kind(residual, row + j, kind), v), kind);
                store8_kind(residual, row + j, v, kind);
            }
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum8(acc) / (float)K + eps));
        for (int64_t j = 0; j < K; j += 8) {
            const __m256 h = round8_kind(_mm256_mul_ps(load8_kind(src, row + j, kind), inv), kind);
            store8_kind(out, row + j, _mm256_mul_ps(h, load8_kind(w, j, kind)), kind);
        }
    }
}
#endif

int add_rms_norm(const void *x, void *residual, const void *w, int64_t M, int64_t K, float eps, int kind,
                 void *out)
{
#if defined(__AVX2__) && defined(__FMA__)
    if (K % 8 == 0) {
        add_rms_norm_x8(x, residual, w, M, K, eps, kind, out);
        return 0;
    }
#endif
    return add_rms_norm_x1(x, residual, w, M, K, eps, kind, out);
}

/* RoPE (rotate-half) on the q and k heads of each token's fused qkv row, q written to q_out
 * [T, Hq, D], rotated k and v written into the caches at slots[t] (-1: not written) in cache_kind
 * (the model's kind, or float16 under a float32 model). cos, sin [T, D] in the model's kind. */
int rope_write_kv(const void *qkv, const void *cos, const void *sin, int64_t T, int64_t Hq, int64_t Hkv,
                  int64_t D, const int64_t *slots, void *k_cache, void *v_cache, int cache_kind, int kind,
                  void *q_out)
{
    const int64_t half = D / 2, width = (Hq + 2 * Hkv) * D;
#pragma omp parallel for schedule(static) if (T > 16)
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slots[t];
        for (int64_t h = 0; h < Hq + Hkv; h++) {
            const int64_t src = t * width + h * D;
            void *dst = h < Hq ? q_out : k_cache;
            const int64_t at = h < Hq ? (t * Hq + h) * D : (slot * Hkv + h - Hq) * D;
            const int dst_kind = h < Hq ? kind : cache_kind;
            if (h >= Hq && slot < 0) continue;
            int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
            for (; half % 8 == 0 && i < half; i += 8) {
                const __m256 a = load8_kind(qkv, src + i, kind), b = load8_kind(qkv, src + i + half, kind);
                const int64_t c = t * D + i;
                const __m256 lo = _mm256_sub_ps(round8_kind(_mm256_mul_ps(a, load8_kind(cos, c, kind)), kind),
                                                round8_kind(_mm256_mul_ps(b, load8_kind(sin, c, kind)), kind));
                const __m256 hi = _mm256_add_ps(round8_kind(_mm256_mul_ps(b, load8_kind(cos, c + half, kind)), kind),
                                                round8_kind(_mm256_mul_ps(a, load8_kind(sin, c + half, kind)), kind));
                /* an fp8 cache takes k as the model's dtype holds it, then rounded again (as torch's .to does) */
                store8_kind(dst, at + i, dst_kind == KIND_FP8 ? round8_kind(lo, kind) : lo, dst_kind);
                store8_kind(dst, at + i + half, dst_kind == KIND_FP8 ? round8_kind(hi, kind) : hi, dst_kind);
            }
#endif
            for (; i < half; i++) {
                const float a = load_kind(qkv, src + i, kind), b = load_kind(qkv, src + i + half, kind);
                const int64_t c = t * D + i;
                /* x * cos + rotate_half(x) * sin, each product rounded as the reference's ops round */
                const float lo = as_kind(a * load_kind(cos, c, kind), kind) + as_kind(-b * load_kind(sin, c, kind), kind);
                const float hi = as_kind(b * load_kind(cos, c + half, kind), kind) +
                                 as_kind(a * load_kind(sin, c + half, kind), kind);
                store_kind(dst, at + i, dst_kind == KIND_FP8 ? as_kind(lo, kind) : lo, dst_kind);
                store_kind(dst, at + i + half, dst_kind == KIND_FP8 ? as_kind(hi, kind) : hi, dst_kind);
            }
        }
        if (slot < 0) continue;
        const int64_t v_src = t * width + (Hq + Hkv) * D, v_dst = slot * Hkv * D;
        if (cache_kind == kind) {
            const int64_t elem = kv_elem(kind);
            memcpy((char *)v_cache + v_dst * elem, (const char *)qkv + v_src * elem, Hkv * D * elem);
            continue;
        }
        int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; j + 8 <= Hkv * D; j += 8) store8_kind(v_cache, v_dst + j, load8_kind(qkv, v_src + j, kind), cache_kind);
#endif
        for (; j < Hkv * D; j++) store_kind(v_cache, v_dst + j, load_kind(qkv, v_src + j, kind), cache_kind);
    }
    return 0;
}


/* out [T, I] = silu(gate) * up from the fused gate_up rows [T, 2I]; bfloat16 rounds silu's result
 * before the product, as the two ops do. */
int silu_mul(const void *gate_up, int64_t T, int64_t I, int kind, void *out)
{
#pragma omp parallel for schedule(static) if (T > 4)
    for (int64_t t = 0; t < T; t++) {
        const int64_t row = t * 2 * I;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        if (kind == KIND_F32) {
            const float *g = (const float *)gate_up + row, *u = g + I;
            float *o = (float *)out + t * I;
            for (; i + 8 <= I; i += 8) {
                const __m256 x = _mm256_loadu_ps(g + i);
                const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
                const __m256 act = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
                _mm256_storeu_ps(o + i, _mm256_mul_ps(act, _mm256_loadu_ps(u + i)));
            }
        } else {
            const uint16_t *g = (const uint16_t *)gate_up + row, *u = g + I;
            uint16_t *o = (uint16_t *)out + t * I;
            for (; i + 8 <= I; i += 8) {
                const __m256 x = bf16x8_load(g + i);
                const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
                const __m256 act = bf16x8_round(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
                bf16x8_store(o + i, _mm256_mul_ps(act, bf16x8_load(u + i)));
            }
        }
#endif
        for (; i < I; i++) {
            const float g = load_kind(gate_up, row + i, kind);
            store_kind(out, t * I + i, as_kind(g / (1.0f + expf(-g)), kind) * load_kind(gate_up, row + I + i, kind), kind);
        }
    }
    return 0;
}

