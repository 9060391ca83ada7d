/* CPU kernels (float32 math; bfloat16 / float16 data converted as read) for what the PyTorch path can only do
 * through copies.
 * Built by cpu_kernels.py with -fopenmp; OpenMP resolves to the runtime torch already loaded,
 * so these share torch's thread pool. Each returns 0, or -1 when a buffer could not be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_FP8 = 3 };  /* KV_FP8: float8 e4m3fn (vLLM's fp8 KV cache) */
/* weight kinds of the quantized kernels besides 4 (q4 by rows) and 8 (q8): q4 in AMX tile order (`quant.pack_tiles`),
 * [N / 16][K / 32][16 rows][16 bytes] and d, m [N / 16][K / 32][16], N padded to 16 rows of zeros; d and m float32
 * (Q4_TILES) or float16 where that holds them exactly (Q4_TILES_F16: a GGUF's scales, 1/6 fewer bytes to read) */
#define Q4_TILES 5
#define Q4_TILES_F16 6

static inline int64_t kv_elem(int kind) { return kind == KV_F32 ? 4 : kind == KV_FP8 ? 1 : 2; }

/* float8 e4m3fn (bias 7, no infinities, largest 448): exact to float32. Normal: sign, exponent + 120,
 * the 3 mantissa bits on top of float32's; exponent 0: m * 2^-9. (0x7F, NaN, is never written.) */
static inline float fp8_to_f32(uint8_t b)
{
    const uint32_t em = b & 0x7Fu;
    float v;
    if (em < 8) {
        v = (float)em * (1.0f / 512.0f);
    } else {
        const uint32_t bits = (em << 20) + (120u << 23);
        memcpy(&v, &bits, sizeof v);
    }
    return b & 0x80u ? -v : v;
}

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

/* 1 when built with F16C: a float16 KV cache can be read (converted 8 values per instruction). */
int kv_f16_supported(void)
{
#ifdef __F16C__
    return 1;
#else
    return 0;
#endif
}

/* One K or V row of n values: float32 rows are used in place; float16 and bfloat16 rows are
 * converted into buf (bfloat16 is the top half of a float32: a shift, exact). */
static inline const float *kv_row(const void *cache, int64_t offset, int64_t n, int kind, float *buf)
{
    if (kind == KV_F32) return (const float *)cache + offset;
    if (kind == KV_FP8) {
        const uint8_t *src = (const uint8_t *)cache + offset;
        int64_t i = 0;
#ifdef __AVX2__
        /* normal values by moving the bits, exponent 0 by converting m; the sign on top */
        const __m256i low7 = _mm256_set1_epi32(0x7F), bias = _mm256_set1_epi32(120 << 23);
        for (; i + 8 <= n; i += 8) {
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + i)));
            const __m256i em = _mm256_and_si256(v, low7);
            const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(em, 20), bias));
            const __m256 tiny = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(1.0f / 512.0f));
            const __m256 exponent0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), em));
            const __m256 mag = _mm256_blendv_ps(normal, tiny, exponent0);
            const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_andnot_si256(low7, v), 24));
            _mm256_storeu_ps(buf + i, _mm256_or_ps(mag, sign));
        }
#endif
        for (; i < n; ++i) buf[i] = fp8_to_f32(src[i]);
        return buf;
    }
    const uint16_t *src = (const uint16_t *)cache + offset;
    int64_t i = 0;
    if (kind == KV_BF16) {
#ifdef __AVX2__
        for (; i + 8 <= n; i += 8) {
            __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + i)));
            _mm256_storeu_ps(buf + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
        }
#endif
        for (; i < n; ++i) {
            const uint32_t bits = (uint32_t)src[i] << 16;
            memcpy(buf + i, &bits, sizeof bits);
        }
        return buf;
    }
#ifdef __F16C__
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; ++i) buf[i] = _cvtsh_ss(src[i]);
#endif
    return buf;
}

/* Paged attention for short query chunks, reading each request's K/V blocks in place: the
 * PyTorch path must first gather them into a padded copy, which at decode costs more than the
 * attention itself (BENCHMARKS.md, "Engine speed").
 *
 * One task per query token (per (token, kv head) when there are few tokens): the Hq / Hkv query
 * heads of a group share each K and V row. One pass over the context in chunks of ATT_CHUNK
 * positions with an online softmax (the chunk's scores in L1, the running max and sum rescaled once per chunk, exp vectorized): no
 * score buffer per context length, and no scalar expf per score, which cost more than the dots.
 * Causal, lower-right aligned: query i of a request with query_len n and context seq_len sees
 * keys 0 .. seq_len - n + i. The query and output are float32 or bfloat16 (q_kind); the math is
 * float32.
 */
#define ATT_CHUNK 32
#define ATT_MAX_HEADS 64 /* query heads one task takes at most */

#if defined(__AVX2__) && defined(__FMA__)
/* e^x for 8 floats: Cephes' polynomial (as in avx_mathfun), relative error about 2e-7 */
static inline __m256 exp8(__m256 x)
{
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447505531f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

static inline float dot_f32(const float *a, const float *b, int64_t n)
{
    int64_t i = 0;
    float tail = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    __m256 s = _mm256_add_ps(s0, s1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    tail = _mm_cvtss_f32(h);
#endif
    for (; i < n; ++i) tail += a[i] * b[i];
    return tail;
}

/* s[i] = e^(s[i] - shift) for i < n; returns their sum */
static inline float exp_shifted(float *s, int64_t n, float shift)
{
    int64_t i = 0;
    float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc = _mm256_setzero_ps(), sh = _mm256_set1_ps(shift);
    for (; i + 8 <= n; i += 8) {
        __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), sh));
        _mm256_storeu_ps(s + i, p);
        acc = _mm256_add_ps(acc, p);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < 8; ++j) sum += lanes[j];
#endif
    for (; i < n; ++i) {
        s[i] = expf(s[i] - shift);
        sum += s[i];
    }
    return sum;
}

static inline float bf16_to_f32(uint16_t h)
{
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}

static inline uint16_t bf16_round(float f)
{
    union { float f; uint32_t u; } v = { f };
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* quiet NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* o[D] += sum_p w[p] * rows[p, :] for n rows `stride` floats apart: o's vectors stay in registers
 * across the rows (a load and an FMA per 8 values, no store until the end) */
static inline void add_weighted_rows(float *o, const float *w, const float *rows, int64_t n, int64_t stride, int64_t D)
{
    int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; d + 32 <= D; d += 32) {
        __m256 a0 = _mm256_loadu_ps(o + d), a1 = _mm256_loadu_ps(o + d + 8);
        __m256 a2 = _mm256_loadu_ps(o + d + 16), a3 = _mm256_loadu_ps(o + d + 24);
        for (int64_t p = 0; p < n; ++p) {
            const __m256 wp = _mm256_set1_ps(w[p]);
            const float *r = rows + p * stride + d;
            a0 = _mm256_fmadd_ps(wp, _mm256_loadu_ps(r), a0);
            a1 = _mm256_fmadd_ps(wp, _mm256_loadu_ps(r + 8), a1);
            a2 = _mm256_fmadd_ps(wp, _mm256_loadu_ps(r + 16), a2);
            a3 = _mm256_fmadd_ps(wp, _mm256_loadu_ps(r + 24), a3);
        }
        _mm256_storeu_ps(o + d, a0);
        _mm256_storeu_ps(o + d + 8, a1);
        _mm256_storeu_ps(o + d + 16, a2);
        _mm256_storeu_ps(o + d + 24, a3);
    }
    for (; d + 8 <= D; d += 8) {
        __m256 a = _mm256_loadu_ps(o + d);
        for (int64_t p = 0; p < n; ++p) a = _mm256_fmadd_ps(_mm256_set1_ps(w[p]), _mm256_loadu_ps(rows + p * stride + d), a);
        _mm256_storeu_ps(o + d, a);
    }
#endif
    for (; d < D; ++d) {
        float a = o[d];
        for (int64_t p = 0; p < n; ++p) a += w[p] * rows[p * stride + d];
        o[d] = a;
    }
}

/* n rows of one head's D values, `row` elements apart from `first`, as float32 rows: float32 in
 * place (*stride = row), else converted into buf [n, D] (*stride = D) */
static inline const float *kv_rows(const void *cache, int64_t first, int64_t n, int64_t row, int64_t D, int kind,
                                   float *buf, int64_t *stride)
{
    if (kind == KV_F32) {
        *stride = row;
        return (const float *)cache + first;
    }
    for (int64_t p = 0; p < n; ++p) kv_row(cache, first + p * row, D, kind, buf + p * D);
    *stride = D;
    return buf;
}

/* The next chunk of a request's context from c0: it stays inside one block, ATT_CHUNK positions or
 * the rest of the block. Returns its length and sets *first to its first row's element offset, and
 * *ahead to the chunk after it (-1: none), which the caller prefetches a row at a time while it
 * computes this one (block tables scatter a request's blocks, so the hardware prefetcher loses the
 * stream at each block; one burst of prefetches for a whole chunk stalls on the miss buffers). */
static inline int64_t context_chunk(const int64_t *table, int64_t c0, int64_t ctx, int64_t block_size, int64_t row,
                                    int64_t head_off, int64_t *first, int64_t *ahead)
{
    int64_t n = ctx - c0 < ATT_CHUNK ? ctx - c0 : ATT_CHUNK;
    n = n < block_size - c0 % block_size ? n : block_size - c0 % block_size;
    *first = (table[c0 / block_size] * block_size + c0 % block_size) * row + head_off;
    const int64_t next = c0 + n;
    *ahead = next < ctx ? (table[next / block_size] * block_size + next % block_size) * row + head_off : -1;
    return n;
}

/* Ask for row p of the chunk at `ahead` (one head's bytes of K and of V) before it is read */
static inline void prefetch_row(const void *k_cache, const void *v_cache, int64_t ahead, int64_t p, int64_t row,
                                int64_t head_bytes, int64_t elem)
{
    if (ahead < 0) return;
    const int64_t at = (ahead + p * row) * elem;
    for (int64_t b = 0; b < head_bytes; b += 64) {
        __builtin_prefetch((const char *)k_cache + at + b);
        __builtin_prefetch((const char *)v_cache + at + b);
    }
}

/* Online softmax over one chunk's scores s [G, ATT_CHUNK] (n used): exponentiated in place under the
 * running max, what was summed under an older max rescaled. */
static inline void softmax_chunk(float *s, int64_t n, int64_t G, int64_t D, float *best, float *total, float *o)
{
    for (int64_t g = 0; g < G; ++g) {
        float *sg = s + g * ATT_CHUNK, top = best[g];
        int64_t p = 0;
#ifdef __AVX512F__
        __m512 m = _mm512_set1_ps(top);  /* not a chain of scalar compares: exact all the same */
        for (; p + 16 <= n; p += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sg + p));
        top = _mm512_reduce_max_ps(m);
#endif
        for (; p < n; ++p) top = sg[p] > top ? sg[p] : top;
        if (top > best[g]) {
            const float alpha = expf(best[g] - top);
            for (int64_t d = 0; d < D; ++d) o[g * D + d] *= alpha;
            total[g] *= alpha;
            best[g] = top;
        }
        total[g] += exp_shifted(sg, n, best[g]);
    }
}

static inline void normalize_heads(float *o, const float *total, int64_t G, int64_t D)
{
    for (int64_t g = 0; g < G; ++g) {
        const float inv = total[g] > 0.f ? 1.f / total[g] : 0.f;
        for (int64_t d = 0; d < D; ++d) o[g * D + d] *= inv;
    }
}

/* o[H * G, D] = softmax(q K^T) V over positions 0..ctx-1 of H adjacent kv heads (the first at
 * head_off in each row), G query heads each; q [H * G, D] already scaled. A chunk of rows inside
 * one block at a time (contiguous rows, no division per row), converted once for the G heads. */
static void attend_kv_heads(const float *q, int64_t H, int64_t G, int64_t D, const void *k_cache,
                            const void *v_cache, const int64_t *table, int64_t ctx, int64_t block_size, int64_t row,
                            int64_t head_off, int kv_kind, float *o)
{
    float best[H * G], total[H * G], s[H * G * ATT_CHUNK], buf[ATT_CHUNK * D];
    const int64_t elem = kv_elem(kv_kind);
    for (int64_t g = 0; g < H * G; ++g) {
        best[g] = -INFINITY;
        total[g] = 0.f;
    }
    for (int64_t i = 0; i < H * G * D; ++i) o[i] = 0.f;
    for (int64_t c0 = 0, n = 0; c0 < ctx; c0 += n) {
        int64_t first, ahead;
        n = context_chunk(table, c0, ctx, block_size, row, head_off, &first, &ahead);
        for (int64_t h = 0; h < H; ++h) {
            const int64_t hg = h * G;
            int64_t stride;
            const float *k = kv_rows(k_cache, first + h * D, n, row, D, kv_kind, buf, &stride);
            for (int64_t p = 0; p < n; ++p) {
                prefetch_row(k_cache, v_cache, ahead + h * D, p, row, D * elem, elem);
                for (int64_t g = 0; g < G; ++g)
                    s[(hg + g) * ATT_CHUNK + p] = dot_f32(q + (hg + g) * D, k + p * stride, D);
            }
            softmax_chunk(s + hg * ATT_CHUNK, n, G, D, best + hg, total + hg, o + hg * D);
            const float *v = kv_rows(v_cache, first + h * D, n, row, D, kv_kind, buf, &stride);
            for (int64_t g = 0; g < G; ++g)
                add_weighted_rows(o + (hg + g) * D, s + (hg + g) * ATT_CHUNK, v, n, stride, D);
        }
    }
    normalize_heads(o, total, H * G, D);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512DQ__) && defined(__AVX512BW__)
#define ATT_BF16_DOT 1
/* bfloat16 query and K/V on CPUs with AVX512-BF16 (the CPUs where dtype auto picks bfloat16): q.k by
 * bf16 pair dot products straight from the cache (vdpbf16ps: exact products, float32 sums; no
 * conversion of K), eight scores reduced at once, V converted once per chunk and accumulated with
 * 16-lane FMAs. About a fifth of the instructions of the float32 path per position. */
static inline __m256 sum_halves(__m512 v)
{
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
}

/* [sum(a[0]), ..., sum(a[7])] */
static inline __m256 sum8x8(const __m256 *a)
{
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline void add_weighted_rows16(float *o, const float *w, const float *rows, int64_t n, int64_t D)
{
    for (int64_t d = 0; d < D; d += 32) {
        __m512 a0 = _mm512_loadu_ps(o + d), a1 = _mm512_loadu_ps(o + d + 16);
        for (int64_t p = 0; p < n; ++p) {
            const __m512 wp = _mm512_set1_ps(w[p]);
            a0 = _mm512_fmadd_ps(wp, _mm512_loadu_ps(rows + p * D + d), a0);
            a1 = _mm512_fmadd_ps(wp, _mm512_loadu_ps(rows + p * D + d + 16), a1);
        }
        _mm512_storeu_ps(o + d, a0);
        _mm512_storeu_ps(o + d + 16, a1);
    }
}

/* attend_kv_heads for bf16 q (unscaled, [H * G, D]) and K/V; D a multiple of 32 up to 128,
 * H * G up to ATT_MAX_HEADS */
/* 32 float8 e4m3 values as bf16 (exact): normal ones by moving the bits, exponent 0 (m * 2^-9) from a
 * table, the sign on top */
static inline __m512i fp8x32_to_bf16(const uint8_t *src)
{
    const __m512i tiny_values = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                 0x3C60, 0x3C40, 0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0);
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)src));
    const __m512i low7 = _mm512_set1_epi16(0x7F), em = _mm512_and_si512(v, low7);
    const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(em, 4), _mm512_set1_epi16(120 << 7));
    const __m512i mag = _mm512_mask_blend_epi16(_mm512_cmplt_epu16_mask(em, _mm512_set1_epi16(8)), normal,
                                                _mm512_permutexvar_epi16(em, tiny_values));
    return _mm512_or_si512(mag, _mm512_slli_epi16(_mm512_andnot_si512(low7, v), 8));
}

/* attend_kv_heads for bf16 q (unscaled, [H * G, D]) and bf16 or float8 e4m3 K/V (fp8: each chunk's K
 * rows widened to bf16 once for the G heads, V rows to float32); D a multiple of 32 up to 128, H * G up
 * to ATT_MAX_HEADS */
static void attend_kv_heads_bf16(const uint16_t *q, int64_t H, int64_t G, int64_t D, float scale,
                                 const void *k_cache, const void *v_cache, int fp8, const int64_t *table, int64_t ctx,
                                 int64_t block_size, int64_t row, int64_t head_off, float *o)
{
    float best[H * G], total[H * G], s[H * G * ATT_CHUNK], buf[ATT_CHUNK * D];
    uint16_t kbuf[fp8 ? ATT_CHUNK * D : 1];
    __m512i qv[ATT_MAX_HEADS][4];
    const int64_t parts = D / 32, elem = fp8 ? 1 : 2;
    for (int64_t g = 0; g < H * G; ++g) {
        best[g] = -INFINITY;
        total[g] = 0.f;
        for (int64_t i = 0; i < parts; ++i) qv[g][i] = _mm512_loadu_si512(q + g * D + 32 * i);
    }
    for (int64_t i = 0; i < H * G * D; ++i) o[i] = 0.f;
    for (int64_t c0 = 0, n = 0; c0 < ctx; c0 += n) {
        int64_t first, ahead;
        n = context_chunk(table, c0, ctx, block_size, row, head_off, &first, &ahead);
        for (int64_t h = 0; h < H; ++h) {
            const int64_t hg = h * G, at = first + h * D;
            const uint16_t *keys = (const uint16_t *)k_cache + at;
            int64_t key_stride = row;
            if (fp8) {
                for (int64_t p = 0; p < n; ++p)
                    for (int64_t d = 0; d < D; d += 32)
                        _mm512_storeu_si512(kbuf + p * D + d,
                                            fp8x32_to_bf16((const uint8_t *)k_cache + at + p * row + d));
                keys = kbuf, key_stride = D;
            }
            for (int64_t p0 = 0; p0 < n; p0 += 8) {  /* s rows hold ATT_CHUNK: a full 8-store always fits */
                for (int64_t g = hg; g < hg + G; ++g) {
                    __m256 r[8];
                    for (int64_t j = 0; j < 8; ++j) {
                        __m512 acc = _mm512_setzero_ps();
                        if (p0 + j < n) {
                            const uint16_t *kr = keys + (p0 + j) * key_stride;
                            for (int64_t i = 0; i < parts; ++i)
                                acc = _mm512_dpbf16_ps(acc, (__m512bh)qv[g][i],
                                                       (__m512bh)_mm512_loadu_si512(kr + 32 * i));
                        }
                        r[j] = sum_halves(acc);
                    }
                    _mm256_storeu_ps(s + g * ATT_CHUNK + p0, _mm256_mul_ps(sum8x8(r), _mm256_set1_ps(scale)));
                }
            }
            softmax_chunk(s + hg * ATT_CHUNK, n, G, D, best + hg, total + hg, o + hg * D);
            for (int64_t p = 0; p < n; ++p) {
                prefetch_row(k_cache, v_cache, ahead + h * D, p, row, elem * D, elem);
                for (int64_t d = 0; d < D; d += 32) {
                    const __m512i vb = fp8 ? fp8x32_to_bf16((const uint8_t *)v_cache + at + p * row + d)
                                           : _mm512_loadu_si512((const uint16_t *)v_cache + at + p * row + d);
                    _mm512_storeu_ps(buf + p * D + d, _mm512_castsi512_ps(_mm512_slli_epi32(
                        _mm512_cvtepu16_epi32(_mm512_castsi512_si256(vb)), 16)));
                    _mm512_storeu_ps(buf + p * D + d + 16, _mm512_castsi512_ps(_mm512_slli_epi32(
                        _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(vb, 1)), 16)));
                }
            }
            for (int64_t g = hg; g < hg + G; ++g) add_weighted_rows16(o + g * D, s + g * ATT_CHUNK, buf, n, D);
        }
    }
    normalize_heads(o, total, H * G, D);
}
#endif

int paged_attention_f32(
    const void *query,          /* [T, Hq, D], float32 or bfloat16 (q_kind) */
    const void *k_cache,        /* [num_blocks, block_size, Hkv, D], float32, float16 or bfloat16 (kv_kind) */
    const void *v_cache,        /* same */
    const int64_t *block_tables, /* [B, table_width] */
    int64_t table_width,
    const int64_t *seq_lens,    /* [B] context length after this step */
    const int64_t *query_start, /* [B + 1] */
    const int64_t *token_request, /* [T] request index of each query token */
    int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, int kv_kind, int q_kind,
    void *out)                  /* [T, Hq, D], q_kind */
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* one token's K (or V) row, all heads */
    /* Enough tokens to share the threads: one task per token over all its kv heads, so a task
     * reads whole rows (blocks stream contiguously, no line fetched by one core and used by the
     * other). Few tokens: a task per (token, kv head), so every thread has work. */
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    const int64_t heads = num_tokens >= 4 * threads && num_heads <= ATT_MAX_HEADS ? num_kv_heads : 1; /* per task */
    int bf16_dot = 0;
#ifdef ATT_BF16_DOT
    bf16_dot = q_kind == KV_BF16 && (kv_kind == KV_BF16 || kv_kind == KV_FP8) && head_dim % 32 == 0 &&
               head_dim <= 128 &&
               group <= ATT_MAX_HEADS;
#endif

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tokens * (num_kv_heads / heads); ++task) {
        const int64_t t = task / (num_kv_heads / heads), h = task % (num_kv_heads / heads) * heads;
        const int64_t b = token_request[t];
        const int64_t query_len = query_start[b + 1] - query_start[b];
        const int64_t ctx = seq_lens[b] - query_len + (t - query_start[b]) + 1;
        const int64_t first = (t * num_heads + h * group) * head_dim, n = heads * group * head_dim;
        float q[n], o[n];
#ifdef ATT_BF16_DOT
        if (bf16_dot) {
            attend_kv_heads_bf16((const uint16_t *)query + first, heads, group, head_dim, scale, k_cache, v_cache,
                                 kv_kind == KV_FP8, block_tables + b * table_width, ctx, block_size, row,
                                 h * head_dim, o);
            for (int64_t i = 0; i < n; ++i) ((uint16_t *)out)[first + i] = bf16_round(o[i]);
            continue;
        }
#endif
        for (int64_t i = 0; i < n; ++i)
            q[i] = scale * (q_kind == KV_BF16 ? bf16_to_f32(((const uint16_t *)query)[first + i])
                                              : ((const float *)query)[first + i]);
        attend_kv_heads(q, heads, group, head_dim, k_cache, v_cache, block_tables + b * table_width, ctx, block_size,
                        row, h * head_dim, kv_kind, o);
        for (int64_t i = 0; i < n; ++i) {
            if (q_kind == KV_BF16) ((uint16_t *)out)[first + i] = bf16_round(o[i]);
            else ((float *)out)[first + i] = o[i];
        }
    }
    return 0;
}

/* Multi-LoRA delta for tokens of many adapters with a few tokens each (decode batches):
 *   y[t, off[i]:off[i+1]] += scale[s] * (A[s][i*r:(i+1)*r, :] @ x[t]) @ Bt[s][:, off[i]:off[i+1]]
 * for each slice i of a fused projection, s the token's slot and r its own rank. Each slot
 * points at its adapter's weights where they already lie (A [num_slices * r, in] and B stored
 * transposed, Bt [r, out_total]: compact, no padding to a max rank, no copy into a stacked
 * buffer). The shrink is r dot products over contiguous rows; the expand is r contiguous
 * axpys into the token's output row, which stays in L1. Accumulation is float32 in both
 * variants; the bfloat16 one rounds y once, to nearest even, as torch's conversion does.
 */
static inline float bf16_load(const uint16_t *p, int64_t i)
{
    union { uint32_t u; float f; } v = { (uint32_t)p[i] << 16 };
    return v.f;
}


static inline float f32_load(const float *p, int64_t i) { return p[i]; }

/* The multi-LoRA delta's two inner loops per adapter weight type W (float32 or bfloat16): four
 * rows of A dotted with a token's x (shrink), and four rows of Bt scaled into the output row
 * (expand); x and the output row are float32 scratch, so the kernels below differ only in W. */
#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8_bf16(const uint16_t *p)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define LORA_VECTOR_LOOPS(LOAD8)                                                                   \
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;                                    \
    for (; d + 8 <= n; d += 8) {                                                                   \
        const __m256 xv = _mm256_loadu_ps(x + d);                                                  \
        s0 = _mm256_fmadd_ps(LOAD8(r0 + d), xv, s0);                                               \
        s1 = _mm256_fmadd_ps(LOAD8(r1 + d), xv, s1);                                               \
        s2 = _mm256_fmadd_ps(LOAD8(r2 + d), xv, s2);                                               \
        s3 = _mm256_fmadd_ps(LOAD8(r3 + d), xv, s3);                                               \
    }                                                                                              \
    out[0] = hsum8(s0), out[1] = hsum8(s1), out[2] = hsum8(s2), out[3] = hsum8(s3);
#define LORA_AXPY_LOOP(LOAD8)                                                                      \
    const __m256 v0 = _mm256_set1_ps(h[0]), v1 = _mm256_set1_ps(h[1]);                             \
    const __m256 v2 = _mm256_set1_ps(h[2]), v3 = _mm256_set1_ps(h[3]);                             \
    for (; o + 8 <= hi; o += 8) {                                                                  \
        __m256 a = _mm256_loadu_ps(acc + o);                                                       \
        a = _mm256_fmadd_ps(v0, LOAD8(b0 + o), a);                                                 \
        a = _mm256_fmadd_ps(v1, LOAD8(b1 + o), a);                                                 \
        a = _mm256_fmadd_ps(v2, LOAD8(b2 + o), a);                                                 \
        a = _mm256_fmadd_ps(v3, LOAD8(b3 + o), a);                                                 \
        _mm256_storeu_ps(acc + o, a);                                                              \
    }
#else
#define LORA_VECTOR_LOOPS(LOAD8) out[0] = out[1] = out[2] = out[3] = 0.f;
#define LORA_AXPY_LOOP(LOAD8)
#endif

static inline void prefetch_bytes(const void *p, int64_t bytes)
{
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i, 0, 3);
}

#define LORA_LOOPS(SUFFIX, W, WLOAD, LOAD8)                                                        \
static void lora_dot4_##SUFFIX(const float *x, const W *r0, const W *r1, const W *r2, const W *r3, \
                               int64_t n, float *out)                                              \
{                                                                                                  \
    int64_t d = 0;                                                                                 \
    LORA_VECTOR_LOOPS(LOAD8)                                                                       \
    for (; d < n; ++d) {                                                                           \
        out[0] += WLOAD(r0, d) * x[d], out[1] += WLOAD(r1, d) * x[d];                              \
        out[2] += WLOAD(r2, d) * x[d], out[3] += WLOAD(r3, d) * x[d];                              \
    }                                                                                              \
}                                                                                                  \
static void lora_axpy4_##SUFFIX(float *acc, const float *h, const W *b0, const W *b1, const W *b2, \
                                const W *b3, int64_t o, int64_t hi)                                \
{                                                                                                  \
    LORA_AXPY_LOOP(LOAD8)                                                                          \
    for (; o < hi; ++o)                                                                            \
        acc[o] += h[0] * WLOAD(b0, o) + h[1] * WLOAD(b1, o) + h[2] * WLOAD(b2, o) + h[3] * WLOAD(b3, o); \
}
LORA_LOOPS(f32, float, f32_load, load8_f32)
#if !(defined(__AVX512F__) && defined(__AVX512BW__))  /* else bf16 adapters take the AVX-512 kernel below */
LORA_LOOPS(bf16, uint16_t, bf16_load, load8_bf16)
#endif

/* Four rows of A against four tokens of the same adapter: each row is read once for the four.
 * out[q * stride + i] = row i . x[q]. */
#if defined(__AVX2__) && defined(__FMA__)
#define LORA_VECTOR_LOOPS4(LOAD8)                                                                  \
    __m256 s[4][4];                                                                                \
    for (int i = 0; i < 4; ++i)                                                                    \
        for (int q = 0; q < 4; ++q) s[i][q] = _mm256_setzero_ps();                                 \
    for (; d + 8 <= n; d += 8) {                                                                   \
        const __m256 x0 = _mm256_loadu_ps(x[0] + d), x1 = _mm256_loadu_ps(x[1] + d);               \
        const __m256 x2 = _mm256_loadu_ps(x[2] + d), x3 = _mm256_loadu_ps(x[3] + d);               \
        for (int i = 0; i < 4; ++i) {                                                              \
            const __m256 w = LOAD8(r[i] + d);                                                      \
            s[i][0] = _mm256_fmadd_ps(w, x0, s[i][0]), s[i][1] = _mm256_fmadd_ps(w, x1, s[i][1]);  \
            s[i][2] = _mm256_fmadd_ps(w, x2, s[i][2]), s[i][3] = _mm256_fmadd_ps(w, x3, s[i][3]);  \
        }                                                                                          \
    }                                                                                              \
    for (int i = 0; i < 4; ++i)                                                                    \
        for (int q = 0; q < 4; ++q) out[q * stride + i] = hsum8(s[i][q]);
#else
#define LORA_VECTOR_LOOPS4(LOAD8)                                                                  \
    for (int i = 0; i < 4; ++i)                                                                    \
        for (int q = 0; q < 4; ++q) out[q * stride + i] = 0.f;
#endif
#define LORA_LOOPS4(SUFFIX, W, WLOAD, LOAD8)                                                       \
static void lora_dot4x4_##SUFFIX(const float *const *x, const W *const *r, int64_t n, float *out,  \
                                 int64_t stride)                                                   \
{                                                                                                  \
    int64_t d = 0;                                                                                 \
    LORA_VECTOR_LOOPS4(LOAD8)                                                                      \
    for (; d < n; ++d)                                                                             \
        for (int i = 0; i < 4; ++i)                                                                \
            for (int q = 0; q < 4; ++q) out[q * stride + i] += WLOAD(r[i], d) * x[q][d];          \
}
LORA_LOOPS4(f32, float, f32_load, load8_f32)
#if !(defined(__AVX512F__) && defined(__AVX512BW__))
LORA_LOOPS4(bf16, uint16_t, bf16_load, load8_bf16)
#endif

/* y[t] += scale[s] * (x[t] A[s]^T) Bt[s] for each listed token t with slot s. `tokens` come grouped
 * by slot (LoRABatch.token_order): up to four consecutive tokens of one adapter are taken together,
 * so its weights are read once for them, not once per token. One call's arguments: */
#define LORA_GROUP 4
struct lora_call {
    const void *x;                  /* [T, in] */
    const int64_t *a_ptrs, *b_ptrs; /* [S] address of slot s's A [num_slices * r_s, in], Bt [r_s, out_total] */
    const int64_t *ranks;           /* [S] r_s (0: the slot does not touch this projection) */
    const float *scales;            /* [S] */
    const int64_t *tokens;          /* [N] rows of x / y that have a slot */
    const int64_t *token_slots;     /* [N] their slots */
    const int64_t *offsets;         /* [num_slices + 1] output offset of each slice */
    int64_t in_features, num_slices, max_rank;
    int64_t rows;                   /* h's stride per token: num_slices * max_rank, padded to whole fours */
    void *y;                        /* [T, out_total] */
};
/* one group: tokens[n0 .. n0 + nt) of one slot, with this thread's float32 scratch */
typedef void (*lora_group_fn)(const struct lora_call *c, int64_t n0, int64_t nt, float *scratch);

/* runs `group` over the call's groups on the OpenMP threads, each with `scratch_floats` of its own */
static int lora_run(const struct lora_call *c, int64_t num_tokens, lora_group_fn group, int64_t scratch_floats)
{
    int64_t *starts = malloc(sizeof(int64_t) * (num_tokens + 1)), num_groups = 0;
    if (!starts) return -1;
    for (int64_t n = 0; n < num_tokens; ++n)
        if (n == 0 || c->token_slots[n] != c->token_slots[n - 1] || n - starts[num_groups - 1] == LORA_GROUP)
            starts[num_groups++] = n;
    starts[num_groups] = num_tokens;
    int failed = 0;
#pragma omp parallel
    {
        float *scratch = malloc(sizeof(float) * scratch_floats);
        if (!scratch) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t g = 0; g < num_groups; ++g) {
            const int64_t r = c->ranks[c->token_slots[starts[g]]];
            if (scratch && r > 0 && r <= c->max_rank) group(c, starts[g], starts[g + 1] - starts[g], scratch);
        }
        free(scratch);
    }
    free(starts);
    return failed ? -1 : 0;
}

/* the exported kernel NAME (x and y of type T) over GROUP, with SCRATCH floats per thread */
#define LORA_ENTRY(NAME, T, GROUP, SCRATCH)                                                        \
int NAME(const T *x, const int64_t *a_ptrs, const int64_t *b_ptrs, const int64_t *ranks, const float *scales, \
         const int64_t *tokens, const int64_t *token_slots, const int64_t *offsets, int64_t num_tokens, \
         int64_t in_features, int64_t num_slices, int64_t max_rank, T *y)                          \
{                                                                                                  \
    const struct lora_call c = {x, a_ptrs, b_ptrs, ranks, scales, tokens, token_slots, offsets, in_features, \
                                num_slices, max_rank, num_slices * max_rank + 3, y};               \
    return lora_run(&c, num_tokens, GROUP, SCRATCH);                                               \
}

/* one group, AVX2 or scalar: x and y of type T (widened into float32 scratch), the adapter's A and Bt
 * of type W (SUFFIX: its loops above) */
#define LORA_GROUP_FN(NAME, T, LOAD, STORE, W, SUFFIX)                                             \
static void NAME(const struct lora_call *c, int64_t n0, int64_t nt, float *acc)                   \
{                                                                                                  \
    const T *x = c->x;                                                                             \
    T *y = c->y;                                                                                   \
    const int64_t in_features = c->in_features, num_slices = c->num_slices, rows = c->rows;        \
    const int64_t out_total = c->offsets[num_slices], s = c->token_slots[n0], r = c->ranks[s];     \
    const int64_t *tokens = c->tokens, *offsets = c->offsets;                                      \
    float *h = acc + LORA_GROUP * out_total, *xf = h + LORA_GROUP * rows;                          \
    const W *a = (const W *)(intptr_t)c->a_ptrs[s];                                                \
    const W *bt = (const W *)(intptr_t)c->b_ptrs[s];                                               \
    const float *xs[LORA_GROUP];                                                                   \
    for (int q = 0; q < LORA_GROUP; ++q) { /* missing tokens repeat the first */                   \
        xs[q] = xf + (q < nt ? q : 0) * in_features;                                               \
        if (q < nt)                                                                                \
            for (int64_t d = 0; d < in_features; ++d)                                              \
                xf[q * in_features + d] = LOAD(x + tokens[n0 + q] * in_features, d);               \
    }                                                                                              \
    const int64_t k_all = num_slices * r;                                                          \
    for (int64_t k = 0; k < k_all; k += 4) { /* rows past k_all repeat the last one */             \
        /* the next four rows (or Bt's first) on their way while these compute: each token reads    \
         * its own adapter, a stream too short for the hardware prefetcher */                       \
        const int64_t next = k_all - k - 4 < 4 ? k_all - k - 4 : 4;                                \
        if (next > 0)                                                                              \
            prefetch_bytes(a + (k + 4) * in_features, sizeof(W) * in_features * next);              \
        else                                                                                       \
            prefetch_bytes(bt, sizeof(W) * out_total * (r < 4 ? r : 4));                           \
        const W *rk[4];                                                                            \
        for (int i = 0; i < 4; ++i) rk[i] = a + (k + i < k_all ? k + i : k) * in_features;         \
        if (nt == 1)                                                                               \
            lora_dot4_##SUFFIX(xf, rk[0], rk[1], rk[2], rk[3], in_features, h + k);                 \
        else                                                                                       \
            lora_dot4x4_##SUFFIX(xs, rk, in_features, h + k, rows);                                \
    }                                                                                              \
    for (int64_t q = 0; q < nt; ++q) {                                                             \
        for (int64_t k = 0; k < k_all; ++k) h[q * rows + k] *= c->scales[s];                      \
        const T *yt = y + tokens[n0 + q] * out_total;                                              \
        for (int64_t o = 0; o < out_total; ++o) acc[q * out_total + o] = LOAD(yt, o);              \
    }                                                                                              \
    for (int64_t j = 0; j < r; j += 4) { /* Bt four whole rows at a time, in memory order */       \
        const int64_t nj = r - j < 4 ? r - j : 4; /* missing rows weigh 0 */                      \
        if (j + 4 < r)                                                                             \
            prefetch_bytes(bt + (j + 4) * out_total, sizeof(W) * out_total * (r - j - 4 < 4 ? r - j - 4 : 4)); \
        const W *b[4];                                                                             \
        for (int q = 0; q < 4; ++q) b[q] = bt + (j + (q < nj ? q : 0)) * out_total;                \
        for (int64_t q = 0; q < nt; ++q) /* the same four rows, from L1 after the first */         \
            for (int64_t i = 0; i < num_slices; ++i) {                                             \
                float w4[4] = {0.f, 0.f, 0.f, 0.f};                                                \
                for (int e = 0; e < nj; ++e) w4[e] = h[q * rows + i * r + j + e];                  \
                lora_axpy4_##SUFFIX(acc + q * out_total, w4, b[0], b[1], b[2], b[3], offsets[i], offsets[i + 1]); \
            }                                                                                      \
    }                                                                                              \
    for (int64_t q = 0; q < nt; ++q) {                                                             \
        T *yt = y + tokens[n0 + q] * out_total;                                                    \
        for (int64_t o = 0; o < out_total; ++o) STORE(yt, o, acc[q * out_total + o]);             \
    }                                                                                              \
}
/* per thread: the group's output rows, h, x */
#define LORA_SCRATCH (LORA_GROUP * (offsets[num_slices] + num_slices * max_rank + 3 + in_features))

#define F32_STORE(p, i, v) ((p)[i] = (v))
#define BF16_STORE(p, i, v) ((p)[i] = bf16_round(v))
LORA_GROUP_FN(lora_group_f32, float, f32_load, F32_STORE, float, f32)
LORA_ENTRY(sgmv_lora_table_f32, float, lora_group_f32, LORA_SCRATCH)

/* bfloat16 adapters (on a bfloat16 model, and on a float32 one: half the bytes read per token) */
#if defined(__AVX512F__) && defined(__AVX512BW__)
/* bfloat16 adapters on AVX-512. A 32-value load of bf16 is 16 lanes of pairs: a lane shifted up 16
 * bits is its even value as float32, the lane's top half alone its odd value, so A and Bt are widened
 * without a shuffle (the port that shuffles is the one the FMAs share on AVX-512 CPUs), x is laid out
 * once per token in the same split (per 32 values: the 16 even, then the 16 odd), and the outputs are
 * summed per lane as even / odd halves, put back in order once per 32 outputs. Float32 math, as the
 * AVX2 kernel above; only the order of the sums differs.
 * Each token streams its own adapter, a few KB per row block: too short for the hardware prefetcher, so
 * A is prefetched 8 rows ahead and Bt's rows 512 bytes ahead as they are read. A step of 16 tokens
 * (SmolLM2's 120 LoRA calls): one adapter 2.8 -> 2.0 ms (the loops), 16 adapters 7.2 -> 5.7 ms (the
 * prefetches; without them 7.4), BENCHMARKS.md. */
#define LORA_PF_ROWS 8
#define LORA_PF_BT 256
static inline __m512 bf16_even(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
static inline __m512 bf16_odd(__m512i v)
{
    return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u)));
}
static inline __mmask32 mask32(int64_t left) { return left >= 32 ? ~(__mmask32)0 : ((__mmask32)1 << left) - 1; }
static inline __mmask16 mask16(int64_t left)
{
    return left >= 16 ? (__mmask16)0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}

static void lora_split_x_f32(const float *x, int64_t n, float *xp)
{
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t c = 0; c < n; c += 32) {
        const __m512 lo = _mm512_maskz_loadu_ps(mask16(n - c), x + c);
        const __m512 hi = _mm512_maskz_loadu_ps(mask16(n - c - 16), x + c + 16);
        _mm512_storeu_ps(xp + c, _mm512_permutex2var_ps(lo, even, hi));
        _mm512_storeu_ps(xp + c + 16, _mm512_permutex2var_ps(lo, odd, hi));
    }
}

static void lora_split_x_bf16(const uint16_t *x, int64_t n, float *xp)
{
    for (int64_t c = 0; c < n; c += 32) {
        const __m512i v = _mm512_maskz_loadu_epi16(mask32(n - c), x + c);
        _mm512_storeu_ps(xp + c, bf16_even(v));
        _mm512_storeu_ps(xp + c + 16, bf16_odd(v));
    }
}

/* out[q * stride + i] = row i . x_q for four rows of A and NT tokens (NT a constant once inlined) */
static inline __attribute__((always_inline)) void lora_dot_512(const float *const *xp, const int NT,
                                                                const uint16_t *const *r, int64_t n, float *out,
                                                                int64_t stride)
{
    __m512 se[4][4], so[4][4];
    for (int i = 0; i < 4; ++i)
        for (int q = 0; q < NT; ++q) se[i][q] = so[i][q] = _mm512_setzero_ps();
    for (int64_t c = 0; c < n; c += 32) {
        const __mmask32 m = mask32(n - c);
        __m512 xe[4], xo[4];
        for (int q = 0; q < NT; ++q) xe[q] = _mm512_loadu_ps(xp[q] + c), xo[q] = _mm512_loadu_ps(xp[q] + c + 16);
        for (int i = 0; i < 4; ++i) {
            _mm_prefetch((const char *)(r[i] + c + LORA_PF_ROWS * n), _MM_HINT_T0);
            const __m512i v = _mm512_maskz_loadu_epi16(m, r[i] + c);
            const __m512 ve = bf16_even(v), vo = bf16_odd(v);
            for (int q = 0; q < NT; ++q)
                se[i][q] = _mm512_fmadd_ps(ve, xe[q], se[i][q]), so[i][q] = _mm512_fmadd_ps(vo, xo[q], so[i][q]);
        }
    }
    for (int i = 0; i < 4; ++i)
        for (int q = 0; q < NT; ++q) out[q * stride + i] = _mm512_reduce_add_ps(_mm512_add_ps(se[i][q], so[i][q]));
}

static inline void y_add_f32(float *y, __m512 v, __mmask16 m)
{
    _mm512_mask_storeu_ps(y, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, y), v));
}

static inline void y_add_bf16(uint16_t *y, __m512 v, __mmask16 m)
{
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, y));
    const __m512 sum = _mm512_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)), v);
#ifdef __AVX512BF16__
    _mm256_mask_storeu_epi16(y, m, (__m256i)_mm512_cvtneps_pbh(sum));
#else
    const __m512i u = _mm512_castps_si512(sum);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i top = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    _mm256_mask_storeu_epi16(y, m, _mm512_cvtepi32_epi16(top));
#endif
}

/* y_q[lo:hi] += sum_j h_q[j] Bt[j][lo:hi] for NT tokens: per 32 outputs, every row of Bt's slice in
 * turn (r streams read in step), the sums in registers until the end */
#define LORA_EXPAND_512(T, YADD)                                                                   \
static inline __attribute__((always_inline)) void lora_expand_512_##T(                            \
    T *const *y, const int NT, const float *h, int64_t rows, const uint16_t *bt, int64_t r,        \
    int64_t out_total, int64_t lo, int64_t hi)                                                     \
{                                                                                                  \
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0); \
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));                          \
    for (int64_t o = lo; o < hi; o += 32) {                                                        \
        const __mmask32 m = mask32(hi - o);                                                        \
        __m512 se[4], so[4];                                                                       \
        for (int q = 0; q < NT; ++q) se[q] = so[q] = _mm512_setzero_ps();                          \
        for (int64_t j = 0; j < r; ++j) {                                                          \
            _mm_prefetch((const char *)(bt + j * out_total + o + LORA_PF_BT), _MM_HINT_T0);        \
            const __m512i v = _mm512_maskz_loadu_epi16(m, bt + j * out_total + o);                \
            const __m512 ve = bf16_even(v), vo = bf16_odd(v);                                      \
            for (int q = 0; q < NT; ++q) {                                                         \
                const __m512 w = _mm512_set1_ps(h[q * rows + j]);                                  \
                se[q] = _mm512_fmadd_ps(w, ve, se[q]), so[q] = _mm512_fmadd_ps(w, vo, so[q]);       \
            }                                                                                      \
        }                                                                                          \
        for (int q = 0; q < NT; ++q) {                                                             \
            YADD(y[q] + o, _mm512_permutex2var_ps(se[q], first, so[q]), mask16(hi - o));           \
            YADD(y[q] + o + 16, _mm512_permutex2var_ps(se[q], second, so[q]), mask16(hi - o - 16)); \
        }                                                                                          \
    }                                                                                              \
}
LORA_EXPAND_512(float, y_add_f32)
LORA_EXPAND_512(uint16_t, y_add_bf16)

/* one group (up to four tokens of one adapter): shrink into h (scaled), then expand into y */
#define LORA_GROUP_512(T, SPLIT)                                                                   \
static inline __attribute__((always_inline)) void lora_group_512_##T##_n(                         \
    const struct lora_call *c, int64_t n0, const int NT, float *xp)                                \
{                                                                                                  \
    const int64_t in_features = c->in_features, num_slices = c->num_slices, rows = c->rows;        \
    const int64_t padded = (in_features + 31) / 32 * 32, out_total = c->offsets[num_slices];       \
    const int64_t s = c->token_slots[n0], r = c->ranks[s], k_all = num_slices * r;                 \
    const uint16_t *a = (const uint16_t *)(intptr_t)c->a_ptrs[s];                                  \
    const uint16_t *bt = (const uint16_t *)(intptr_t)c->b_ptrs[s];                                 \
    float *h = xp + LORA_GROUP * padded;                                                           \
    const float *xs[4];                                                                            \
    T *ys[4];                                                                                      \
    for (int q = 0; q < NT; ++q) {                                                                 \
        const int64_t t = c->tokens[n0 + q];                                                       \
        SPLIT((const T *)c->x + t * in_features, in_features, xp + q * padded);                    \
        xs[q] = xp + q * padded, ys[q] = (T *)c->y + t * out_total;                                \
    }                                                                                              \
    for (int64_t k = 0; k < k_all; k += 4) { /* rows past k_all repeat the last one */             \
        const uint16_t *rk[4];                                                                     \
        for (int i = 0; i < 4; ++i) rk[i] = a + (k + i < k_all ? k + i : k) * in_features;         \
        lora_dot_512(xs, NT, rk, in_features, h + k, rows);                                        \
    }                                                                                              \
    for (int q = 0; q < NT; ++q)                                                                   \
        for (int64_t k = 0; k < k_all; ++k) h[q * rows + k] *= c->scales[s];                       \
    for (int64_t i = 0; i < num_slices; ++i)                                                       \
        lora_expand_512_##T(ys, NT, h + i * r, rows, bt, r, out_total, c->offsets[i], c->offsets[i + 1]); \
}                                                                                                  \
static void lora_group_512_##T(const struct lora_call *c, int64_t n0, int64_t nt, float *xp)      \
{                                                                                                  \
    switch (nt) { /* a constant token count in each inlined copy: its sums stay in registers */    \
    case 1: lora_group_512_##T##_n(c, n0, 1, xp); break;                                           \
    case 2: lora_group_512_##T##_n(c, n0, 2, xp); break;                                           \
    case 3: lora_group_512_##T##_n(c, n0, 3, xp); break;                                           \
    default: lora_group_512_##T##_n(c, n0, 4, xp);                                                 \
    }                                                                                              \
}
LORA_GROUP_512(float, lora_split_x_f32)
LORA_GROUP_512(uint16_t, lora_split_x_bf16)
/* per thread: x split for up to four tokens, h */
#define LORA_SCRATCH_512 (LORA_GROUP * ((in_features + 31) / 32 * 32 + num_slices * max_rank + 3))
LORA_ENTRY(sgmv_lora_table_bf16, uint16_t, lora_group_512_uint16_t, LORA_SCRATCH_512)
LORA_ENTRY(sgmv_lora_table_f32_bf16w, float, lora_group_512_float, LORA_SCRATCH_512)
#else
LORA_GROUP_FN(lora_group_bf16, uint16_t, bf16_load, BF16_STORE, uint16_t, bf16)
LORA_GROUP_FN(lora_group_f32_bf16w, float, f32_load, F32_STORE, uint16_t, bf16)
LORA_ENTRY(sgmv_lora_table_bf16, uint16_t, lora_group_bf16, LORA_SCRATCH)
LORA_ENTRY(sgmv_lora_table_f32_bf16w, float, lora_group_f32_bf16w, LORA_SCRATCH)
#endif

/* ---- weight-only quantized matmul: out[M, N] = x[M, K] @ dequant(W)[N, K]^T, float32 x ----------------
 * q4: groups of 32 along K, w = d * q + m (q in 0..15) in GGUF Q4_1's nibble order (byte j of a group
 *     holds element j in its low nibble and element j + 16 in its high one); q [N, K / 2].
 * q8: groups of G along K, w = d * q; q int8 [N, K]; G = K is per channel.
 * One token (M == 1): four weight rows at a time, each group dequantized in registers and multiplied
 * at once (x read once for the four). More tokens: a tile of rows dequantized into an L1 buffer once
 * per call, then register blocks of FMAs over it (AVX2: 3 tokens x 4 rows; AVX-512: 6 x 4, a block of
 * tokens' x kept in L1 while the tile's rows pass over it). */

#define QTILE 8
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define TILE_512 1  /* the tiles' dequantizing and products on 512-bit vectors */
#endif

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 q4_lanes(__m128i nibbles, int part)
{   /* eight of the 16 nibbles (low or high half of the 16 bytes) as floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part ? _mm_srli_si128(nibbles, 8) : nibbles));
}
#endif

static void dequant_q4_row(const uint8_t *q, const float *d, const float *m, int64_t K, float *out)
{
    for (int64_t g = 0; g < K / 32; g++) {
        const uint8_t *b = q + g * 16;
        float *o = out + g * 32;
#ifdef TILE_512
        const __m128i low = _mm_set1_epi8(0x0F), bytes = _mm_loadu_si128((const __m128i *)b);
        const __m512 scale = _mm512_set1_ps(d[g]), shift = _mm512_set1_ps(m[g]);
        const __m512i lo = _mm512_cvtepu8_epi32(_mm_and_si128(bytes, low));
        const __m512i hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low));
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), scale, shift));
        _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), scale, shift));
#elif defined(__AVX2__) && defined(__FMA__)
        const __m128i low = _mm_set1_epi8(0x0F);
        __m128i bytes = _mm_loadu_si128((const __m128i *)b);
        __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
        __m256 scale = _mm256_set1_ps(d[g]), shift = _mm256_set1_ps(m[g]);
        _mm256_storeu_ps(o, _mm256_fmadd_ps(q4_lanes(lo, 0), scale, shift));
        _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(q4_lanes(lo, 1), scale, shift));
        _mm256_storeu_ps(o + 16, _mm256_fmadd_ps(q4_lanes(hi, 0), scale, shift));
        _mm256_storeu_ps(o + 24, _mm256_fmadd_ps(q4_lanes(hi, 1), scale, shift));
#else
        for (int j = 0; j < 16; j++) {
            o[j] = d[g] * (float)(b[j] & 0x0F) + m[g];
            o[j + 16] = d[g] * (float)(b[j] >> 4) + m[g];
        }
#endif
    }
}

static void dequant_q8_row(const int8_t *q, const float *d, int64_t K, int64_t G, float *out)
{
    for (int64_t g = 0; g < K / G; g++) {
        const float scale = d[g];
        int64_t i = g * G;
#ifdef TILE_512
        for (; i < (g + 1) * G; i += 16) {  /* G is a multiple of 8: at most one half vector at the end */
            const __mmask16 m = mask16((g + 1) * G - i);
            const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, q + i)));
            _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(v, _mm512_set1_ps(scale)));
        }
#endif
        for (; i < (g + 1) * G; i++) out[i] = scale * (float)q[i];
    }
}

#ifdef TILE_512
/* 4 row sums (16 lanes each) -> one vector of the 4 totals */
static inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3)
{
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

#define TILE_TOKENS 6

/* out[t0 + t, n0 .. n0 + nb - 1] for NT tokens from the 4 rows w (rows past nb: any row, not stored);
 * 4 x NT accumulators of 16 lanes, x and w read once per 16 k for all of them */
static inline __attribute__((always_inline)) void tile_block(const float *x, int64_t K, const float *const *w,
                                                             const int NT, int nb, float *out, int64_t N,
                                                             int64_t k0, int64_t k1)
{
    __m512 acc[TILE_TOKENS][4];
    for (int t = 0; t < NT; t++)
        for (int i = 0; i < 4; i++) acc[t][i] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += 16) {
        const __mmask16 m = mask16(k1 - k);  /* all set but at a tail */
        const __m512 w0 = _mm512_maskz_loadu_ps(m, w[0] + k), w1 = _mm512_maskz_loadu_ps(m, w[1] + k);
        const __m512 w2 = _mm512_maskz_loadu_ps(m, w[2] + k), w3 = _mm512_maskz_loadu_ps(m, w[3] + k);
        for (int t = 0; t < NT; t++) {
            const __m512 u = _mm512_maskz_loadu_ps(m, x + t * K + k);
            acc[t][0] = _mm512_fmadd_ps(u, w0, acc[t][0]);
            acc[t][1] = _mm512_fmadd_ps(u, w1, acc[t][1]);
            acc[t][2] = _mm512_fmadd_ps(u, w2, acc[t][2]);
            acc[t][3] = _mm512_fmadd_ps(u, w3, acc[t][3]);
        }
    }
    const __mmask8 rows = (__mmask8)((1u << nb) - 1);
    for (int t = 0; t < NT; t++) {
        __m128 v = sum4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]);
        if (k0) v = _mm_add_ps(v, _mm_maskz_loadu_ps(rows, out + t * N));  /* the earlier K blocks' sums */
        _mm_mask_storeu_ps(out + t * N, rows, v);
    }
}
#endif

#ifndef TILE_512  /* else tile_rows_512 below */
/* out[r, n0 + j] for r < M, j < nb, from nb dequantized rows w[j * K ...] */
static void tile_dots(const float *x, int64_t M, int64_t K, const float *w, int nb, float *out, int64_t N,
                      int64_t n0)
{
    int64_t r = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; nb == 4 && r + 3 <= M; r += 3) {  /* 3 tokens x 4 rows: 12 FMA chains, 7 loads per 12 FMAs */
        const float *x0 = x + r * K, *x1 = x0 + K, *x2 = x1 + K;
        __m256 a[3][4];
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 4; j++) a[i][j] = _mm256_setzero_ps();
        for (int64_t k = 0; k < K; k += 8) {
            __m256 u0 = _mm256_loadu_ps(x0 + k), u1 = _mm256_loadu_ps(x1 + k), u2 = _mm256_loadu_ps(x2 + k);
            for (int j = 0; j < 4; j++) {
                __m256 wj = _mm256_loadu_ps(w + j * K + k);
                a[0][j] = _mm256_fmadd_ps(u0, wj, a[0][j]);
                a[1][j] = _mm256_fmadd_ps(u1, wj, a[1][j]);
                a[2][j] = _mm256_fmadd_ps(u2, wj, a[2][j]);
            }
        }
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 4; j++) out[(r + i) * N + n0 + j] = hsum8(a[i][j]);
    }
    for (; nb == 4 && r + 2 <= M; r += 2) {  /* 2 tokens x 4 rows: 8 independent FMA chains */
        const float *x0 = x + r * K, *x1 = x0 + K;
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
        for (int64_t k = 0; k < K; k += 8) {
            __m256 u = _mm256_loadu_ps(x0 + k), v = _mm256_loadu_ps(x1 + k);
            __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + K + k);
            __m256 w2 = _mm256_loadu_ps(w + 2 * K + k), w3 = _mm256_loadu_ps(w + 3 * K + k);
            a00 = _mm256_fmadd_ps(u, w0, a00); a01 = _mm256_fmadd_ps(u, w1, a01);
            a02 = _mm256_fmadd_ps(u, w2, a02); a03 = _mm256_fmadd_ps(u, w3, a03);
            a10 = _mm256_fmadd_ps(v, w0, a10); a11 = _mm256_fmadd_ps(v, w1, a11);
            a12 = _mm256_fmadd_ps(v, w2, a12); a13 = _mm256_fmadd_ps(v, w3, a13);
        }
        float *o0 = out + r * N + n0, *o1 = o0 + N;
        o0[0] = hsum8(a00); o0[1] = hsum8(a01); o0[2] = hsum8(a02); o0[3] = hsum8(a03);
        o1[0] = hsum8(a10); o1[1] = hsum8(a11); o1[2] = hsum8(a12); o1[3] = hsum8(a13);
    }
    for (; nb == 4 && r < M; r++) {  /* the odd token: 4 chains */
        const float *x0 = x + r * K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t k = 0; k < K; k += 8) {
            __m256 u = _mm256_loadu_ps(x0 + k);
            a0 = _mm256_fmadd_ps(u, _mm256_loadu_ps(w + k), a0);
            a1 = _mm256_fmadd_ps(u, _mm256_loadu_ps(w + K + k), a1);
            a2 = _mm256_fmadd_ps(u, _mm256_loadu_ps(w + 2 * K + k), a2);
            a3 = _mm256_fmadd_ps(u, _mm256_loadu_ps(w + 3 * K + k), a3);
        }
        float *o0 = out + r * N + n0;
        o0[0] = hsum8(a0); o0[1] = hsum8(a1); o0[2] = hsum8(a2); o0[3] = hsum8(a3);
    }
#endif
    for (; r < M; r++)
        for (int j = 0; j < nb; j++) {
            float acc[8] = {0};
            for (int64_t k = 0; k < K; k += 8)
                for (int t = 0; t < 8; t++) acc[t] += x[r * K + k + t] * w[j * K + k + t];
            out[r * N + n0 + j] = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        }
}
#endif

/* one token: rows n0..n0+3 dequantized group by group in registers; xsum[g] carries the q4 min term */
static void q4_one_token(const float *x, const float *xsum, int64_t K, const uint8_t *q, const float *d,
                         const float *m, float *out, int64_t n0, int nb)
{
    const int64_t groups = K / 32;
#if defined(__AVX2__) && defined(__FMA__)
    if (nb == 4) {
        const __m128i low = _mm_set1_epi8(0x0F);
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + g * 32;
            __m256 x0 = _mm256_loadu_ps(xg), x1 = _mm256_loadu_ps(xg + 8);
            __m256 x2 = _mm256_loadu_ps(xg + 16), x3 = _mm256_loadu_ps(xg + 24);
            for (int j = 0; j < 4; j++) {
                const int64_t row = n0 + j;
                __m128i bytes = _mm_loadu_si128((const __m128i *)(q + row * (K / 2) + g * 16));
                __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
                __m256 t = _mm256_mul_ps(x0, q4_lanes(lo, 0));
                t = _mm256_fmadd_ps(x1, q4_lanes(lo, 1), t);
                t = _mm256_fmadd_ps(x2, q4_lanes(hi, 0), t);
                t = _mm256_fmadd_ps(x3, q4_lanes(hi, 1), t);
                acc[j] = _mm256_fmadd_ps(t, _mm256_set1_ps(d[row * groups + g]), acc[j]);
            }
        }
        for (int j = 0; j < 4; j++) {
            float mins = 0.0f;
            for (int64_t g = 0; g < groups; g++) mins += m[(n0 + j) * groups + g] * xsum[g];
            out[n0 + j] = hsum8(acc[j]) + mins;
        }
        return;
    }
#endif
    float w[32];
    for (int j = 0; j < nb; j++) {
        float total = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
            dequant_q4_row(q + (n0 + j) * (K / 2) + g * 16, d + (n0 + j) * groups + g, m + (n0 + j) * groups + g,
                           32, w);
            for (int t = 0; t < 32; t++) total += x[g * 32 + t] * w[t];
        }
        out[n0 + j] = total;
    }
}

#ifdef TILE_512
/* out[r, n0 + j] for r < M, j < rows, from the tile's dequantized rows w[j * K ...]: a block of TILE_TOKENS
 * tokens' x and the tile's rows, up to TILE_K of K at a time (equal parts), stay in L1 while every 4-row
 * block of the tile passes over them */
#define TILE_K 768
static void tile_rows_512(const float *x, int64_t M, int64_t K, const float *w, int rows, float *out, int64_t N,
                          int64_t n0)
{
    const int64_t parts = (K + TILE_K - 1) / TILE_K, part = (K / parts + 15) / 16 * 16;
    for (int64_t k0 = 0; k0 < K; k0 += part)
        for (int64_t r = 0; r < M; r += TILE_TOKENS)
            for (int j = 0; j < rows; j += 4) {
                const int64_t k1 = K - k0 > part ? k0 + part : K;
                const int nb = rows - j < 4 ? rows - j : 4;
                const float *wj = w + j * K, *x0 = x + r * K;
                const float *four[4] = {wj, wj + (nb > 1) * K, wj + (nb > 2) * 2 * K, wj + (nb > 3) * 3 * K};
                float *o = out + r * N + n0 + j;
                switch (M - r < TILE_TOKENS ? M - r : TILE_TOKENS) {
                case 1: tile_block(x0, K, four, 1, nb, o, N, k0, k1); break;
                case 2: tile_block(x0, K, four, 2, nb, o, N, k0, k1); break;
                case 3: tile_block(x0, K, four, 3, nb, o, N, k0, k1); break;
                case 4: tile_block(x0, K, four, 4, nb, o, N, k0, k1); break;
                case 5: tile_block(x0, K, four, 5, nb, o, N, k0, k1); break;
                default: tile_block(x0, K, four, 6, nb, o, N, k0, k1);
                }
            }
}
#define TILE_ROWS(x, M, K, w, rows, out, N, n0) tile_rows_512(x, M, K, w, rows, out, N, n0)
#else
#define TILE_ROWS(x, M, K, w, rows, out, N, n0)                                                    \
    for (int j = 0; j < (rows); j += 4)                                                            \
        tile_dots(x, M, K, (w) + j * (K), (rows) - j < 4 ? (rows) - j : 4, out, N, (n0) + j)
#endif

/* Tiles of QTILE weight rows (dequantized once into an L2-sized buffer) times chunks of MCHUNK tokens
 * (kept in L1/L2 while the tile's row blocks pass over them). */
#define MCHUNK 24
#define QUANT_TILES(DEQUANT_ROW)                                                                   \
    int failed = 0;                                                                                \
    _Pragma("omp parallel")                                                                        \
    {                                                                                              \
        float *w = malloc(sizeof(float) * QTILE * K);                                              \
        if (!w) failed = 1;                                                                        \
        _Pragma("omp for schedule(static)")                                                        \
        for (int64_t t0 = 0; t0 < N; t0 += QTILE) {                                                \
            if (!w) continue;                                                                      \
            const int rows = N - t0 < QTILE ? (int)(N - t0) : QTILE;                               \
            for (int j = 0; j < rows; j++) {                                                       \
                const int64_t n = t0 + j;                                                          \
                DEQUANT_ROW;                                                                       \
            }                                                                                      \
            for (int64_t r0 = 0; r0 < M; r0 += MCHUNK) {                                           \
                const int64_t mc = M - r0 < MCHUNK ? M - r0 : MCHUNK;                              \
                TILE_ROWS(x + r0 * K, mc, K, w, rows, out + r0 * N, N, t0);                        \
            }                                                                                      \
        }                                                                                          \
        free(w);                                                                                   \
    }                                                                                              \
    return failed ? -1 : 0;

int q4_matmul(const float *x, int64_t M, int64_t K, const uint8_t *q, const float *d, const float *m,
              int64_t N, float *out)
{
    if (K % 32) return -2;
    const int64_t groups = K / 32;
    if (M == 1) {
        float *xsum = malloc(sizeof(float) * groups);
        if (!xsum) return -1;
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int t = 0; t < 32; t++) s += x[g * 32 + t];
            xsum[g] = s;
        }
#pragma omp parallel for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += 4)
            q4_one_token(x, xsum, K, q, d, m, out, n0, N - n0 < 4 ? (int)(N - n0) : 4);
        free(xsum);
        return 0;
    }
    QUANT_TILES(dequant_q4_row(q + n * (K / 2), d + n * groups, m + n * groups, K, w + j * K))
}

int q8_matmul(const float *x, int64_t M, int64_t K, const int8_t *q, const float *d, int64_t G, int64_t N,
              float *out)
{
    if (G <= 0 || K % G || G % 8) return -2;
    const int64_t groups = K / G;
    QUANT_TILES(dequant_q8_row(q + n * K, d + n * groups, K, G, w + j * K))
}

/* out [M, N] = x [M, K] w^T for a plain float32 weight w [N, K] (K a multiple of 8), for decode-sized M:
 * each thread streams its QTILE-row tiles of w once, dotted with every token where they are (the same
 * blocks as the quantized kernels, with nothing to dequantize). From 3 tokens the next tile is fetched
 * into L2 while this one is multiplied (1.1-1.2x at 4-16 tokens); at 1-2 tokens the bare stream is
 * faster (BENCHMARKS.md, "float32 weights: plain rows and our kernel"). */
int f32_matmul(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *out)
{
    if (K % 8) return -2;
#pragma omp parallel for schedule(static)
    for (int64_t t0 = 0; t0 < N; t0 += QTILE) {
        const int rows = N - t0 < QTILE ? (int)(N - t0) : QTILE;
        const int64_t next = t0 + QTILE, ahead = N - next < QTILE ? N - next : QTILE;
        for (int64_t b = 0; M >= 3 && b < ahead * K * 4; b += 64)
            __builtin_prefetch((const char *)(w + next * K) + b, 0, 2);  /* into L2 */
        for (int64_t r0 = 0; r0 < M; r0 += MCHUNK) {
            const int64_t mc = M - r0 < MCHUNK ? M - r0 : MCHUNK;
            TILE_ROWS(x + r0 * K, mc, K, w + t0 * K, rows, out + r0 * N, N, t0);
        }
    }
    return 0;
}

/* The whole weight dequantized into out [N, K] (float32, or bfloat16 rounded to nearest even) for a
 * dense GEMM: from prefill-sized calls on, oneDNN's GEMM on the dequantized weight beats the kernels
 * above, whose per-tile dequantize and 2-3 token blocks stay far from the FMA peak. */
int quant_dequantize(int kind, const void *q, const float *d, const float *m, int64_t G, int64_t N, int64_t K,
                     int out_kind, void *out)
{
    if (K % 32 || (kind == 8 && (G <= 0 || K % G))) return -2;
#ifndef __F16C__
    if (kind == Q4_TILES_F16) return -2;
#endif
    const int64_t groups = K / (kind == 8 ? G : 32);
#pragma omp parallel
    {
        float row[K];
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            float *dst = out_kind == 0 ? (float *)out + n * K : row;
            if (kind == 4)
                dequant_q4_row((const uint8_t *)q + n * (K / 2), d + n * groups, m + n * groups, K, dst);
            else if (kind == Q4_TILES || kind == Q4_TILES_F16)
                for (int64_t g = 0; g < groups; g++) {
                    const int64_t at = (n / 16) * groups + g, i = 16 * at + n % 16;  /* row n % 16 of that tile */
#ifdef __F16C__
                    const float dd = kind == Q4_TILES_F16 ? _cvtsh_ss(((const uint16_t *)d)[i]) : d[i];
                    const float mm = kind == Q4_TILES_F16 ? _cvtsh_ss(((const uint16_t *)m)[i]) : m[i];
#else
                    const float dd = d[i], mm = m[i];  /* Q4_TILES_F16 refused above */
#endif
                    dequant_q4_row((const uint8_t *)q + 256 * at + 16 * (n % 16), &dd, &mm, 32, dst + 32 * g);
                }
            else
                dequant_q8_row((const int8_t *)q + n * K, d + n * groups, K, G, dst);
            if (out_kind != 0) {
                uint16_t *o = (uint16_t *)out + n * K;
                int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
                for (; i + 16 <= K; i += 16)
                    _mm256_storeu_si256((__m256i *)(o + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + i)));
#endif
                for (; i < K; i++) o[i] = bf16_round(row[i]);
            }
        }
    }
    return 0;
}

/* ---- the same matmuls on activations quantized to int8 (llama.cpp's Q8_0 / Q8_1 for its Q4_1 and Q8_0
 * weights): each token's x in groups of 32, x ~ dx * qx with qx in -127..127 (dx = max |x| / 127), and
 * sx = dx * sum(qx) for the q4 min term. A group's dot product is then one u8 x s8 integer instruction
 * (AVX-512 VNNI / AVX-VNNI, or AVX2's maddubs) instead of dequantizing 32 weights to float: at decode
 * batch sizes the float kernels above are bound by that dequantizing, not by reading the weights. */

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define X8_DOT 1
static inline __m256i dot_u8s8(__m256i u, __m256i s) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s); }
#elif defined(__AVXVNNI__)
#define X8_DOT 1
static inline __m256i dot_u8s8(__m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s); }
#elif defined(__AVX2__) && defined(__FMA__)
#define X8_DOT 1
static inline __m256i dot_u8s8(__m256i u, __m256i s)
{   /* u <= 128 and |s| <= 127: the int16 pair sums (at most 32512) cannot saturate */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
#endif

int x8_supported(void)
{
#ifdef X8_DOT
    return 1;
#else
    return 0;
#endif
}

/* x [M, K] -> qx [M, K] int8, dx and sx [M, K / 32]; rounding to nearest even, like torch.round */
static void quantize_x8(const float *x, int64_t M, int64_t K, int8_t *qx, float *dx, float *sx)
{
    for (int64_t i = 0; i < M * (K / 32); i++) {
        const float *v = x + i * 32;
        float amax = 0.0f;
        for (int t = 0; t < 32; t++) amax = fmaxf(amax, fabsf(v[t]));
        const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int t = 0; t < 32; t++) {
            const int q = (int)nearbyintf(v[t] * inv);
            qx[i * 32 + t] = (int8_t)q;
            sum += q;
        }
        dx[i] = d;
        sx[i] = d * (float)sum;
    }
}

#ifdef X8_DOT
static inline __m256i q4_bytes(const uint8_t *b)
{   /* a group's 16 bytes of nibbles as its 32 values in order: low nibbles (0..15), then high (16..31) */
    const __m128i low = _mm_set1_epi8(0x0F), bytes = _mm_loadu_si128((const __m128i *)b);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), _mm_and_si128(bytes, low));
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* Two groups per 512-bit instruction, eight groups' scales multiplied at once and spread to their
 * halves by a permute; the groups left over (K = 576 has 18) take the 256-bit path. */
#define X8_WIDE 1
static inline __m512 pair_scale(__m256 s8, int k)
{
    const __m512i idx = _mm512_set_epi32(2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1, 2 * k + 1,
                                         2 * k + 1, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k, 2 * k);
    return _mm512_permutexvar_ps(idx, _mm512_castps256_ps512(s8));
}

static inline __m512i q4_pair_bytes(const uint8_t *b)
{   /* two groups' 32 bytes -> [g0 low, g0 high, g1 low, g1 high] nibbles: the values in order */
    const __m256i low = _mm256_set1_epi8(0x0F), bytes = _mm256_loadu_si256((const __m256i *)b);
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, low)),
                                         _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low), 1);
    return _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
}

/* rows n0..n0+nb-1 over groups [0, g8), g8 a multiple of 8: their dot products and q4 min terms */
static void q4_x8_wide(const int8_t *qx, const float *dx, const float *sx, int64_t K, const uint8_t *q,
                       const float *d, const float *m, int64_t n0, int nb, int64_t g8, float *dots, float *mins)
{
    const int64_t groups = K / 32;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    __m256 macc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < g8; g += 8) {
        const __m256 dx8 = _mm256_loadu_ps(dx + g), sx8 = _mm256_loadu_ps(sx + g);
        __m512i xg[4];
        for (int k = 0; k < 4; k++) xg[k] = _mm512_loadu_si512((const void *)(qx + (g + 2 * k) * 32));
        for (int j = 0; j < nb; j++) {
            const int64_t at = (n0 + j) * groups + g;
            const __m256 s8 = _mm256_mul_ps(_mm256_loadu_ps(d + at), dx8);
            macc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(m + at), sx8, macc[j]);
            const uint8_t *row = q + (n0 + j) * (K / 2) + g * 16;
            for (int k = 0; k < 4; k++) {
                const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q4_pair_bytes(row + k * 32), xg[k]);
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), pair_scale(s8, k), acc[j]);
            }
        }
    }
    for (int j = 0; j < nb; j++) {
        dots[j] = _mm512_reduce_add_ps(acc[j]);
        mins[j] = hsum8(macc[j]);
    }
}

static void q8_x8_wide(const int8_t *qx, const float *dx, int64_t K, const int8_t *q, const float *d, int64_t G,
                       int64_t n0, int nb, int64_t g8, float *dots)
{
    const int64_t per = G / 32;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t g = 0; g < g8; g += 8) {
        const __m256 dx8 = _mm256_loadu_ps(dx + g);
        __m512i xg[4];
        for (int k = 0; k < 4; k++) xg[k] = _mm512_loadu_si512((const void *)(qx + (g + 2 * k) * 32));
        for (int j = 0; j < nb; j++) {
            const float *dn = d + (n0 + j) * (K / G);
            float wd[8];
            for (int t = 0; t < 8; t++) wd[t] = dn[(g + t) / per];
            const __m256 s8 = _mm256_mul_ps(_mm256_loadu_ps(wd), dx8);
            const int8_t *row = q + (n0 + j) * K + g * 32;
            for (int k = 0; k < 4; k++) {
                const __m512i w = _mm512_loadu_si512((const void *)(row + k * 64));
                /* |w| times x with w's sign: AVX-512 has no sign_epi8, so x is negated where w < 0 */
                const __m512i xs = _mm512_mask_sub_epi8(xg[k], _mm512_movepi8_mask(w), _mm512_setzero_si512(), xg[k]);
                const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(w), xs);
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), pair_scale(s8, k), acc[j]);
            }
        }
    }
    for (int j = 0; j < nb; j++) dots[j] = _mm512_reduce_add_ps(acc[j]);
}
#endif

static void q4_x8_rows(const int8_t *qx, const float *dx, const float *sx, int64_t K, const uint8_t *q,
                       const float *d, const float *m, float *out, int64_t n0, int nb)
{
    const int64_t groups = K / 32;
    float dots[4] = {0.0f, 0.0f, 0.0f, 0.0f}, mins[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int64_t g0 = 0;
#ifdef X8_WIDE
    g0 = groups / 8 * 8;
    if (g0) q4_x8_wide(qx, dx, sx, K, q, d, m, n0, nb, g0, dots, mins);
#endif
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = g0; g < groups; g++) {
        const __m256i xg = _mm256_loadu_si256((const __m256i *)(qx + g * 32));
        for (int j = 0; j < nb; j++) {
            const int64_t at = (n0 + j) * groups + g;
            const __m256i p = dot_u8s8(q4_bytes(q + (n0 + j) * (K / 2) + g * 16), xg);
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d[at] * dx[g]), acc[j]);
            mins[j] += m[at] * sx[g];
        }
    }
    for (int j = 0; j < nb; j++) out[n0 + j] = dots[j] + hsum8(acc[j]) + mins[j];
}

static void q8_x8_rows(const int8_t *qx, const float *dx, int64_t K, const int8_t *q, const float *d, int64_t G,
                       float *out, int64_t n0, int nb)
{
    const int64_t groups = K / 32, per = G / 32;
    float dots[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    int64_t g0 = 0;
#ifdef X8_WIDE
    g0 = groups / 8 * 8;
    if (g0) q8_x8_wide(qx, dx, K, q, d, G, n0, nb, g0, dots);
#endif
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = g0; g < groups; g++) {
        const __m256i xg = _mm256_loadu_si256((const __m256i *)(qx + g * 32));
        for (int j = 0; j < nb; j++) {
            const __m256i w = _mm256_loadu_si256((const __m256i *)(q + (n0 + j) * K + g * 32));
            /* u8 x s8 needs one unsigned side: |w| times x with w's sign (|-128| reads as 128 unsigned) */
            const __m256i p = dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xg, w));
            const float scale = d[(n0 + j) * (K / G) + g / per] * dx[g];
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(scale), acc[j]);
        }
    }
    for (int j = 0; j < nb; j++) out[n0 + j] = dots[j] + hsum8(acc[j]);
}
#endif

/* Every token against four weight rows at a time; returns -3 where the CPU has no integer dot path. */
#define X8_MATMUL(ROWS)                                                                            \
    int8_t *qx = malloc(M * K);                                                                    \
    float *dx = malloc(sizeof(float) * M * (K / 32)), *sx = malloc(sizeof(float) * M * (K / 32));  \
    if (!qx || !dx || !sx) {                                                                       \
        free(qx), free(dx), free(sx);                                                              \
        return -1;                                                                                 \
    }                                                                                              \
    quantize_x8(x, M, K, qx, dx, sx);                                                              \
    _Pragma("omp parallel for schedule(static)")                                                   \
    for (int64_t n0 = 0; n0 < N; n0 += 4)                                                          \
        for (int64_t r = 0; r < M; r++) {                                                          \
            const int nb = N - n0 < 4 ? (int)(N - n0) : 4;                                         \
            ROWS;                                                                                  \
        }                                                                                          \
    free(qx), free(dx), free(sx);                                                                  \
    return 0;

int q4_matmul_x8(const float *x, int64_t M, int64_t K, const uint8_t *q, const float *d, const float *m,
                 int64_t N, float *out)
{
    if (K % 32) return -2;
    if (M <= 0) return 0;
#ifdef X8_DOT
    X8_MATMUL(q4_x8_rows(qx + r * K, dx + r * (K / 32), sx + r * (K / 32), K, q, d, m, out + r * N, n0, nb))
#else
    (void)x, (void)M, (void)q, (void)d, (void)m, (void)N, (void)out;
    return -3;
#endif
}

int q8_matmul_x8(const float *x, int64_t M, int64_t K, const int8_t *q, const float *d, int64_t G, int64_t N,
                 float *out)
{
    if (K % 32 || G <= 0 || G % 32 || K % G) return -2;
    if (M <= 0) return 0;
#ifdef X8_DOT
    X8_MATMUL(q8_x8_rows(qx + r * K, dx + r * (K / 32), K, q, d, G, out + r * N, n0, nb))
#else
    (void)x, (void)M, (void)q, (void)d, (void)N, (void)out;
    return -3;
#endif
}

/* the entry point of a bf16 kernel this build lacks: -3, and quant.py takes another path */
#define UNBUILT_BF16_MATMUL(NAME)                                                                  \
int NAME(int kind, const void *x, int x_kind, int64_t M, int64_t K, const void *q, const float *d, const float *m, \
         int64_t G, int64_t N, int y_kind, void *y)                                                \
{                                                                                                  \
    (void)kind, (void)x, (void)x_kind, (void)M, (void)K, (void)q, (void)d, (void)m, (void)G, (void)N, (void)y_kind, \
        (void)y;                                                                                   \
    return -3;                                                                                     \
}

/* ---- bfloat16 pairs, shared by the two kernels below (AVX512-BF16 dot products, AMX tiles) ------------
 * Both multiply a group of 32 weights as 16 bf16 pairs (k r, k r + 16), r < 16: in a q4 byte those are its
 * two nibbles, so a group dequantizes with one permute, and x is laid out in the same pairs once per call.
 * The weights' bf16 values are the dense path's (float32 d * q + m rounded to nearest even): these paths
 * round as it does. */

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(TILE_512)  /* TILE_512: sum4 */
#define BF16_PAIRS 1

/* 32 values (as float lanes lo = k 0..15, hi = k 16..31) -> 16 bf16 pairs: lane r = (k r, k r + 16) */
static inline __m512i bf16_pairs(__m512 lo, __m512 hi)
{
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* one q4 group (16 bytes, GGUF's nibble order; w = d q + m) as 16 bf16 pairs: the group's 16 possible values
 * rounded to bf16 once, then picked per nibble by one permute */
static inline __m512i q4_pairs(const uint8_t *bytes, float d, float m)
{
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i table = (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(values, _mm512_set1_ps(d), _mm512_set1_ps(m)));
    /* byte r -> the word pair (low nibble, high nibble) */
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    /* (v | v << 12) & 0x000F000F: ternary-logic truth table 0xA8 */
    const __m512i index = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
    return _mm512_permutexvar_epi16(index, _mm512_castsi256_si512(table));
}

/* group g of weight row n (q4 / q8 as the float kernels take them) as 16 bf16 pairs. q4: the row's 16
 * possible values d * q + m rounded to bf16 once, then picked per nibble by one permute. */
static inline __m512i weight_pairs(int kind, const void *q, const float *d, const float *m, int64_t K, int64_t G,
                                   int64_t n, int64_t g)
{
    if (kind == 4) {
        const int64_t s = n * (K / 32) + g;
        return q4_pairs((const uint8_t *)q + n * (K / 2) + 16 * g, d[s], m[s]);
    }
    const int8_t *row = (const int8_t *)q + n * K + 32 * g;
    const __m512 dv = _mm512_set1_ps(d[n * (K / G) + 32 * g / G]);
    const __m512i low = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)row));
    const __m512i high = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 16)));
    return bf16_pairs(_mm512_mul_ps(_mm512_cvtepi32_ps(low), dv), _mm512_mul_ps(_mm512_cvtepi32_ps(high), dv));
}

/* group g of x's token t (float32 or bf16: x_kind) as 16 bf16 pairs */
static inline __m512i x_pair(const void *x, int x_kind, int64_t K, int64_t t, int64_t g)
{
    const int64_t i = t * K + 32 * g;
    if (x_kind == KV_BF16) {
        const uint16_t *b = (const uint16_t *)x + i;
        return _mm512_or_si512(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)b)),
                               _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(b + 16))),
                                                 16));
    }
    return bf16_pairs(_mm512_loadu_ps((const float *)x + i), _mm512_loadu_ps((const float *)x + i + 16));
}

/* x [M, K] (float32 or bf16: x_kind) -> xp[token][g]: each group of 32 as 16 bf16 pairs */
static void x_pairs(const void *x, int x_kind, int64_t M, int64_t K, __m512i *xp)
{
#pragma omp for schedule(static)
    for (int64_t t = 0; t < M; t++)
        for (int64_t g = 0; g < K / 32; g++) xp[t * (K / 32) + g] = x_pair(x, x_kind, K, t, g);
}
#endif

/* ---- the same matmuls with AVX512-BF16 dot products (Cooper Lake, Zen 4, Sapphire Rapids without the
 * tiles): a tile of DP_ROWS weight rows dequantized to bf16 pairs in L1 once per call, then 4 rows x up
 * to 6 tokens of `vdpbf16ps` over it (24 accumulators; 32 multiply-adds per instruction, 4x an AVX2 FMA).
 * Dequantizing is a few instructions per 32 weights whatever the number of tokens, and it reads 4-bit
 * weights where the dense path reads a bf16 copy. Against the float kernel on AVX-512 it wins only where
 * `vdpbf16ps` outruns two float FMAs: quant.py measures which (`dpbf16_wins`). */

#ifdef BF16_PAIRS
#define DP_ROWS 16
#define DP_TOKENS 6

/* y[t][n0 .. n0 + 3] for NT tokens from 4 weight rows w[i * groups ...] and the tokens' pairs */
static inline __attribute__((always_inline)) void dp_block(const __m512i *w, const __m512i *xp, int64_t groups,
                                                           const int NT, int64_t n0, int64_t N, int y_kind, void *y,
                                                           int64_t t0)
{
    __m512 acc[DP_TOKENS][4];
    for (int t = 0; t < NT; t++)
        for (int i = 0; i < 4; i++) acc[t][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        const __m512bh w0 = (__m512bh)w[g], w1 = (__m512bh)w[groups + g];
        const __m512bh w2 = (__m512bh)w[2 * groups + g], w3 = (__m512bh)w[3 * groups + g];
        for (int t = 0; t < NT; t++) {
            const __m512bh xv = (__m512bh)xp[t * groups + g];
            acc[t][0] = _mm512_dpbf16_ps(acc[t][0], w0, xv);
            acc[t][1] = _mm512_dpbf16_ps(acc[t][1], w1, xv);
            acc[t][2] = _mm512_dpbf16_ps(acc[t][2], w2, xv);
            acc[t][3] = _mm512_dpbf16_ps(acc[t][3], w3, xv);
        }
    }
    const __mmask8 rows = N - n0 >= 4 ? 0xF : (__mmask8)((1u << (N - n0)) - 1);
    for (int t = 0; t < NT; t++) {
        const __m128 v = sum4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]);
        if (y_kind == KV_BF16)
            _mm_mask_storeu_epi16((uint16_t *)y + (t0 + t) * N + n0, rows, (__m128i)_mm_cvtneps_pbh(v));
        else
            _mm_mask_storeu_ps((float *)y + (t0 + t) * N + n0, rows, v);
    }
}

int quant_matmul_dpbf16(int kind, const void *x, int x_kind, int64_t M, int64_t K, const void *q, const float *d,
                        const float *m, int64_t G, int64_t N, int y_kind, void *y)
{
    if (K % 32 || (kind == 8 && (G <= 0 || G % 32 || K % G))) return -2;
    if (M <= 0) return 0;
    const int64_t groups = K / 32;
    __m512i *xp = aligned_alloc(64, (size_t)(M * groups) * sizeof(__m512i));
    if (!xp) return -1;
    int failed = 0;
#pragma omp parallel
    {
        x_pairs(x, x_kind, M, K, xp);  /* ends in the omp for's barrier */
        __m512i *w = aligned_alloc(64, (size_t)(DP_ROWS * groups) * sizeof(__m512i));
        if (!w) failed = 1;
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += DP_ROWS) {
            if (!w) continue;
            for (int64_t j = 0; j < DP_ROWS; j++)
                for (int64_t g = 0; g < groups; g++)
                    w[j * groups + g] = n0 + j < N ? weight_pairs(kind, q, d, m, K, G, n0 + j, g)
                                                   : _mm512_setzero_si512();
            for (int64_t j = 0; j < DP_ROWS && n0 + j < N; j += 4)
                for (int64_t t0 = 0; t0 < M; t0 += DP_TOKENS) {
                    const __m512i *wj = w + j * groups, *xt = xp + t0 * groups;
                    switch (M - t0 < DP_TOKENS ? M - t0 : DP_TOKENS) {
                    case 1: dp_block(wj, xt, groups, 1, n0 + j, N, y_kind, y, t0); break;
                    case 2: dp_block(wj, xt, groups, 2, n0 + j, N, y_kind, y, t0); break;
                    case 3: dp_block(wj, xt, groups, 3, n0 + j, N, y_kind, y, t0); break;
                    case 4: dp_block(wj, xt, groups, 4, n0 + j, N, y_kind, y, t0); break;
                    case 5: dp_block(wj, xt, groups, 5, n0 + j, N, y_kind, y, t0); break;
                    default: dp_block(wj, xt, groups, 6, n0 + j, N, y_kind, y, t0);
                    }
                }
        }
        free(w);
    }
    free(xp);
    return failed ? -1 : 0;
}

int dpbf16_supported(void) { return 1; }
#else
int dpbf16_supported(void) { return 0; }

UNBUILT_BF16_MATMUL(quant_matmul_dpbf16)
#endif

/* ---- the same matmuls on AMX (Sapphire Rapids and later): tiles of the weight dequantized to bfloat16
 * in L1 and multiplied by the tile unit, float32 accumulation. Computed as y^T = W x^T so that the weight
 * tile is 16 rows of W as stored (no transpose): A = W rows n x 32 k of one group, B = x^T's pairs, C =
 * 16 n x 16 tokens, A's rows in the pairs above. Per weight this is a few vector instructions whatever the
 * number of tokens, where the float kernel pays one multiply per weight and token: from a few tokens on
 * it beats both the float and the int8 kernel (BENCHMARKS.md, "q4 in bf16 on AMX"). */

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(BF16_PAIRS)
#include <sys/syscall.h>
#include <unistd.h>
#define AMX 1

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tile_config;

/* 16 rows (from row n0) of group g of a q4 / q8 weight as a bf16 A tile [16][32] (rows past N: zero) */
static inline void amx_weight_tile(int kind, const void *q, const float *d, const float *m, int64_t K, int64_t G,
                                   int64_t N, int64_t n0, int64_t g, uint16_t *tile)
{
    if (kind == Q4_TILES || kind == Q4_TILES_F16) {  /* the tile's 16 rows of group g together: one stream */
        const int64_t at = (n0 / 16) * (K / 32) + g;
        if (n0 >= N) {  /* the second block of a strip past the last row */
            for (int64_t i = 0; i < 16; i++) _mm512_store_si512((__m512i *)(tile + 32 * i), _mm512_setzero_si512());
            return;
        }
        const uint8_t *bytes = (const uint8_t *)q + 256 * at;
        float scales[32] __attribute__((aligned(64)));
        const float *dt = d + 16 * at, *mt = m + 16 * at;
        if (kind == Q4_TILES_F16) {  /* the tile's 16 d and 16 m widened once, then broadcast per row as float32's */
            const __m256i *dh = (const __m256i *)((const uint16_t *)d + 16 * at);
            const __m256i *mh = (const __m256i *)((const uint16_t *)m + 16 * at);
            _mm512_store_ps(scales, _mm512_cvtph_ps(_mm256_loadu_si256(dh)));
            _mm512_store_ps(scales + 16, _mm512_cvtph_ps(_mm256_loadu_si256(mh)));
            dt = scales, mt = scales + 16;
        }
        for (int64_t i = 0; i < 16; i++)
            _mm512_store_si512((__m512i *)(tile + 32 * i), q4_pairs(bytes + 16 * i, dt[i], mt[i]));
        return;
    }
    for (int64_t i = 0; i < 16; i++)
        _mm512_store_si512((__m512i *)(tile + 32 * i),
                           n0 + i < N ? weight_pairs(kind, q, d, m, K, G, n0 + i, g) : _mm512_setzero_si512());
}

/* every tile 16 rows of 64 bytes, in the calling thread */
static inline void amx_configure(void)
{
    amx_tile_config config = {.palette = 1};
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
}

/* lane i -> 16 i: where row i of a tile of 16 x 64 bytes starts, in 4-byte elements (a column, gathered or
 * scattered) */
static inline __m512i tile_rows16(void)
{
    return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                              _mm512_set1_epi32(16));
}

int amx_supported(void)
{
    /* Linux hands out the tile registers' state only on request (ARCH_REQ_XCOMP_PERM, XTILEDATA) */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}

/* C tile (+ a second one, or NULL) [16 n][16 tokens] -> y[token][n0 + i], the rows and tokens that exist:
 * a column of C gathered per token (scalar transposed writes cost as much as the tile products) */
static inline void amx_store(const float *c, const float *c2, int64_t n0, int64_t t0, int64_t M, int64_t N,
                             int y_kind, void *y)
{
    const __m512i column = tile_rows16();
    if (n0 >= N) return;  /* the second row block of a strip past the last row */
    const __mmask16 rows = N - n0 >= 16 ? 0xFFFF : (__mmask16)((1u << (N - n0)) - 1);
    for (int64_t t = 0; t < 16 && t0 + t < M; t++) {
        __m512 v = _mm512_i32gather_ps(column, c + t, 4);
        if (c2) v = _mm512_add_ps(v, _mm512_i32gather_ps(column, c2 + t, 4));
        if (y_kind == KV_BF16)
            _mm256_mask_storeu_epi16((uint16_t *)y + (t0 + t) * N + n0, rows, (__m256i)_mm512_cvtneps_pbh(v));
        else
            _mm512_mask_storeu_ps((float *)y + (t0 + t) * N + n0, rows, v);
    }
}

/* the four C tiles: zeroed before a block's products, stored into c[4][256] after them */
static inline void amx_zero_c(void)
{
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

static inline void amx_store_c(float c[4][256])
{
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
}

/* x [M, K] (float32 or bf16: x_kind) times the q4 / q8 weight (as q4_matmul / q8_matmul take it; G: q8's
 * group) -> y [M, N] (float32 or bf16: y_kind). Four C tiles accumulate at once (16 weight rows times 4 x
 * 16 tokens; up to 32 tokens, 2 x 16 rows times 2 x 16 tokens; up to 16, even and odd groups apart): a
 * tile product's latency is several of its issue slots. Weight tiles are dequantized one group ahead of
 * their products: a tile load cannot take data from stores still in flight, it waits for them to retire,
 * and right before it that wait stalled every group (1.1x faster at 16 and 64 tokens; two ahead: the same). */
int quant_matmul_amx(int kind, const void *x, int x_kind, int64_t M, int64_t K, const void *q, const float *d,
                     const float *m, int64_t G, int64_t N, int y_kind, void *y)
{
    if (K % 32 || (kind == 8 && (G <= 0 || G % 32 || K % G))) return -2;
    if (M <= 0) return 0;
    const int64_t groups = K / 32, blocks = (M + 15) / 16 + ((M + 15) / 16 > 1 && (M + 15) / 16 % 2);  /* even past 1 */
    /* xt[block][group][r][token][2] = (x[token][32 g + r], x[token][32 g + r + 16]): one B tile per block and group */
    uint16_t *xt = aligned_alloc(64, (size_t)(blocks * groups * 512) * sizeof(uint16_t));
    if (!xt) return -1;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t bg = 0; bg < blocks * groups; bg++) {
            const int64_t b = bg / groups, g = bg % groups;
            int32_t *tile = (int32_t *)(xt + bg * 512);  /* [pair r][token]: a token's pairs are a column */
            for (int64_t t = 0; t < 16; t++) {
                const int64_t token = 16 * b + t;
                const __m512i pairs = token < M ? x_pair(x, x_kind, K, token, g) : _mm512_setzero_si512();
                _mm512_i32scatter_epi32(tile + t, tile_rows16(), pairs, 4);
            }
        }
        amx_configure();
        uint16_t a[4][512] __attribute__((aligned(64)));  /* weight tiles: this group's and the next's */
        float c[4][256] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < N; n0 += 32) {
            if (blocks > 2) {  /* 16 weight rows times 4 x 16 tokens: each weight tile dequantized once */
                for (int64_t nn = n0; nn < n0 + 32 && nn < N; nn += 16)
                    for (int64_t b = 0; b < blocks; b += 4) {
                        const int64_t nb = blocks - b < 4 ? blocks - b : 4;
                        const uint16_t *xb = xt + b * groups * 512;
                        amx_zero_c();
                        amx_weight_tile(kind, q, d, m, K, G, N, nn, 0, a[0]);
                        for (int64_t g = 0; g < groups; g++) {
                            if (g + 1 < groups) amx_weight_tile(kind, q, d, m, K, G, N, nn, g + 1, a[(g + 1) & 1]);
                            _tile_loadd(4, a[g & 1], 64);
                            _tile_loadd(5, xb + g * 512, 64);
                            _tile_dpbf16ps(0, 4, 5);
                            _tile_loadd(6, xb + (groups + g) * 512, 64);
                            _tile_dpbf16ps(1, 4, 6);
                            if (nb > 2) {
                                _tile_loadd(7, xb + (2 * groups + g) * 512, 64);
                                _tile_dpbf16ps(2, 4, 7);
                                _tile_loadd(5, xb + (3 * groups + g) * 512, 64);
                                _tile_dpbf16ps(3, 4, 5);
                            }
                        }
                        amx_store_c(c);
                        for (int64_t j = 0; j < nb; j++) amx_store(c[j], NULL, nn, 16 * (b + j), M, N, y_kind, y);
                    }
                continue;
            }
            /* the tiles of 2 x 16 weight rows, dequantized per group into L1 right before their products */
            for (int64_t b = 0; b < blocks; b += 2) {
                const uint16_t *b0 = xt + b * groups * 512, *b1 = b0 + groups * 512;
                amx_zero_c();
                amx_weight_tile(kind, q, d, m, K, G, N, n0, 0, a[0]);
                amx_weight_tile(kind, q, d, m, K, G, N, n0 + 16, 0, a[1]);
                for (int64_t g = 0; g < groups; g++) {
                    uint16_t (*now)[512] = a + 2 * (g & 1), (*next)[512] = a + 2 * ((g + 1) & 1);
                    if (g + 1 < groups) {
                        amx_weight_tile(kind, q, d, m, K, G, N, n0, g + 1, next[0]);
                        amx_weight_tile(kind, q, d, m, K, G, N, n0 + 16, g + 1, next[1]);
                    }
                    _tile_loadd(4, now[0], 64);
                    _tile_loadd(5, now[1], 64);
                    if (blocks == 1 && g % 2) {  /* odd groups into C tiles 2, 3 (summed at the end) */
                        _tile_loadd(7, b0 + g * 512, 64);
                        _tile_dpbf16ps(2, 4, 7);
                        _tile_dpbf16ps(3, 5, 7);
                        continue;
                    }
                    _tile_loadd(6, b0 + g * 512, 64);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 5, 6);
                    if (blocks > 1) {
                        _tile_loadd(7, b1 + g * 512, 64);
                        _tile_dpbf16ps(2, 4, 7);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                }
                amx_store_c(c);
                if (blocks == 1) {
                    amx_store(c[0], c[2], n0, 0, M, N, y_kind, y);
                    amx_store(c[1], c[3], n0 + 16, 0, M, N, y_kind, y);
                } else {
                    amx_store(c[0], NULL, n0, 16 * b, M, N, y_kind, y);
                    amx_store(c[1], NULL, n0 + 16, 16 * b, M, N, y_kind, y);
                    amx_store(c[2], NULL, n0, 16 * (b + 1), M, N, y_kind, y);
                    amx_store(c[3], NULL, n0 + 16, 16 * (b + 1), M, N, y_kind, y);
                }
            }
        }
        _tile_release();
    }
    free(xt);
    return 0;
}

/* ---- a dense bf16 weight on AMX: y = x W^T with x's rows as the A tiles, read where they are (16 tokens x the
 * 32 k of one group), and W packed once at load into B tiles, [32 k as 16 pairs][16 n][2] per 16 rows and group
 * (`pack_bf16_amx` in cpu_kernels.py). Per group 2 x 2 tiles (32 tokens x 32 rows), tokens in chunks that stay
 * in L2, a block's outputs written while the next block's products run; x is copied only when it is float32 or
 * its tokens are not whole 16s. Against oneDNN's bf16 linear on packed weights: no ~15 us of set-up per call,
 * decode-sized calls at the speed of reading the weight; 0.8x at 2048 tokens (BENCHMARKS.md, "Dense bf16 weights
 * on AMX"). */

/* C tile [16 tokens][16 n] (+ c2, or NULL) -> y[t0 + i][n0 ..], the tokens and rows that exist */
static inline void amx_store_tokens(const float *c, const float *c2, int64_t t0, int64_t n0, int64_t M, int64_t N,
                                    int y_kind, void *y)
{
    if (n0 >= N) return;
    const __mmask16 cols = mask16(N - n0);
    for (int64_t i = 0; i < 16 && t0 + i < M; i++) {
        __m512 v = _mm512_load_ps(c + 16 * i);
        if (c2) v = _mm512_add_ps(v, _mm512_load_ps(c2 + 16 * i));
        if (y_kind == KV_BF16)
            _mm256_mask_storeu_epi16((uint16_t *)y + (t0 + i) * N + n0, cols, (__m256i)_mm512_cvtneps_pbh(v));
        else
            _mm512_mask_storeu_ps((float *)y + (t0 + i) * N + n0, cols, v);
    }
}

/* a 32 x 32 block's C tiles (two blocks of 16 tokens; or one, its even and odd groups apart) -> y */
static inline void amx_write_block(float c[4][256], int two, int64_t t0, int64_t n0, int64_t M, int64_t N,
                                   int y_kind, void *y)
{
    amx_store_tokens(c[0], two ? NULL : c[2], t0, n0, M, N, y_kind, y);
    amx_store_tokens(c[1], two ? NULL : c[3], t0, n0 + 16, M, N, y_kind, y);
    if (two) {
        amx_store_tokens(c[2], NULL, t0 + 16, n0, M, N, y_kind, y);
        amx_store_tokens(c[3], NULL, t0 + 16, n0 + 16, M, N, y_kind, y);
    }
}

/* x [M, K] as bf16 rows, tokens padded to 16 with zeros */
static void bf16_rows(const void *x, int x_kind, int64_t M, int64_t K, uint16_t *out, int64_t padded)
{
    for (int64_t t = 0; t < M; t++) {
        if (x_kind == KV_BF16) {
            memcpy(out + t * K, (const uint16_t *)x + t * K, (size_t)K * 2);
            continue;
        }
        for (int64_t i = 0; i < K; i += 16)
            _mm256_storeu_si256((__m256i *)(out + t * K + i),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps((const float *)x + t * K + i)));
    }
    memset(out + M * K, 0, (size_t)((padded - M) * K) * 2);
}

#define AMX_CHUNK_TOKENS 128
int bf16_matmul_amx(const void *x, int x_kind, int64_t M, int64_t K, const uint16_t *w, int64_t N, int y_kind,
                    void *y)
{
    if (K % 32) return -2;
    if (M <= 0) return 0;
    const int64_t groups = K / 32, padded = (M + 15) / 16 * 16, strips = (N + 31) / 32;
    const uint16_t *xb = x;
    uint16_t *copy = NULL;
    if (x_kind != KV_BF16 || padded != M) {
        copy = aligned_alloc(64, (size_t)(padded * K) * 2);
        if (!copy) return -1;
        bf16_rows(x, x_kind, M, K, copy, padded);
        xb = copy;
    }
#pragma omp parallel
    {
        amx_configure();
        float c[2][4][256] __attribute__((aligned(64)));  /* a block's C tiles, written during the next one's */
        int cur = 0, pending = 0, ptwo = 0;
        int64_t pt0 = 0, pn0 = 0;
        for (int64_t chunk = 0; chunk < padded; chunk += AMX_CHUNK_TOKENS)  /* x's chunk stays in L2 */
#pragma omp for schedule(static) nowait
        for (int64_t s = 0; s < strips; s++) {
            const uint16_t *b0 = w + 2 * s * groups * 512, *b1 = b0 + groups * 512;
            const int64_t n0 = 32 * s, end = chunk + AMX_CHUNK_TOKENS < padded ? chunk + AMX_CHUNK_TOKENS : padded;
            for (int64_t t0 = chunk; t0 < end; t0 += 32) {
                const uint16_t *a0 = xb + t0 * K, *a1 = a0 + 16 * K;
                const int two = end - t0 >= 32;
                amx_zero_c();
                for (int64_t g = 0; g < groups; g++) {
                    _tile_loadd(4, a0 + 32 * g, K * 2);
                    _tile_loadd(6, b0 + g * 512, 64);
                    _tile_loadd(7, b1 + g * 512, 64);
                    if (two) {
                        _tile_loadd(5, a1 + 32 * g, K * 2);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    } else if (g % 2) {  /* one block of tokens: odd groups into C tiles 2, 3, summed at the end */
                        _tile_dpbf16ps(2, 4, 6);
                        _tile_dpbf16ps(3, 4, 7);
                    } else {
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                    }
                    if (pending && g == groups / 2) {  /* the tile unit works on while the last block is written */
                        amx_write_block(c[cur ^ 1], ptwo, pt0, pn0, M, N, y_kind, y);
                        pending = 0;
                    }
                }
                amx_store_c(c[cur]);
                pending = 1, ptwo = two, pt0 = t0, pn0 = n0, cur ^= 1;
            }
        }
        if (pending) amx_write_block(c[cur ^ 1], ptwo, pt0, pn0, M, N, y_kind, y);
        _tile_release();
    }
    free(copy);
    return 0;
}
#else
int amx_supported(void) { return 0; }

UNBUILT_BF16_MATMUL(quant_matmul_amx)

int bf16_matmul_amx(const void *x, int x_kind, int64_t M, int64_t K, const uint16_t *w, int64_t N, int y_kind,
                    void *y)
{
    (void)x, (void)x_kind, (void)M, (void)K, (void)w, (void)N, (void)y_kind, (void)y;
    return -3;
}
#endif

/* ---- the small per-layer ops, fused: one call each where PyTorch dispatches several ops ------------
 * At decode sizes a layer's norms, RoPE, KV write and SiLU cost more in op dispatch than in arithmetic
 * (a bfloat16 RMSNorm alone is seven ops). Each kernel takes float32 or bfloat16 tensors (kind) and
 * rounds where PyTorch's bfloat16 ops round, so the two paths give the same values. */

static inline float load_kind(const void *p, int64_t i, int kind)
{
    return kind == KV_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* v as the kind stores it (bfloat16: rounded to nearest even) */
static inline float as_kind(float v, int kind)
{
    return kind == KV_BF16 ? bf16_to_f32(bf16_round(v)) : v;
}

static inline void store_kind(void *p, int64_t i, float v, int kind)
{
    if (kind == KV_BF16) ((uint16_t *)p)[i] = bf16_round(v);
    else if (kind == KV_FP8) ((uint8_t *)p)[i] = fp8_round(v);
#ifdef __F16C__
    else if (kind == KV_F16) ((uint16_t *)p)[i] = _cvtss_sh(v, 0);
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
    return kind == KV_BF16 ? bf16x8_load((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

static inline __m256 round8_kind(__m256 v, int kind)
{
    return kind == KV_BF16 ? bf16x8_round(v) : v;
}

static inline void store8_kind(void *p, int64_t i, __m256 v, int kind)
{
    if (kind == KV_BF16) bf16x8_store((uint16_t *)p + i, v);
    else if (kind == KV_FP8) {
        float lanes[8];
        _mm256_storeu_ps(lanes, v);
        for (int j = 0; j < 8; ++j) ((uint8_t *)p)[i + j] = fp8_round(lanes[j]);
    }
#ifdef __F16C__
    else if (kind == KV_F16) _mm_storeu_si128((__m128i *)((uint16_t *)p + i), _mm256_cvtps_ph(v, 0));
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
                store8_kind(dst, at + i, dst_kind == KV_FP8 ? round8_kind(lo, kind) : lo, dst_kind);
                store8_kind(dst, at + i + half, dst_kind == KV_FP8 ? round8_kind(hi, kind) : hi, dst_kind);
            }
#endif
            for (; i < half; i++) {
                const float a = load_kind(qkv, src + i, kind), b = load_kind(qkv, src + i + half, kind);
                const int64_t c = t * D + i;
                /* x * cos + rotate_half(x) * sin, each product rounded as the reference's ops round */
                const float lo = as_kind(a * load_kind(cos, c, kind), kind) + as_kind(-b * load_kind(sin, c, kind), kind);
                const float hi = as_kind(b * load_kind(cos, c + half, kind), kind) +
                                 as_kind(a * load_kind(sin, c + half, kind), kind);
                store_kind(dst, at + i, dst_kind == KV_FP8 ? as_kind(lo, kind) : lo, dst_kind);
                store_kind(dst, at + i + half, dst_kind == KV_FP8 ? as_kind(hi, kind) : hi, dst_kind);
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
        if (kind == KV_F32) {
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
