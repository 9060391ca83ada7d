/* Paged attention over K/V blocks read in place (float32, bfloat16, float16 or float8 e4m3 caches), and
 * kv_f16_supported. */
#include "isa.h"

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
    if (kind == KIND_F32) return (const float *)cache + offset;
    if (kind == KIND_FP8) {
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
    if (kind == KIND_BF16) {
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
 * keys 0 .. seq_len - n + i; with a sliding window W only the last W of them (q - k < W, as
 * transformers' sliding-window mask): the walk over the context starts at the window, so blocks before
 * it are never read (the KV manager frees them). A soft cap c turns each scaled score s into
 * c tanh(s / c) before the softmax (Gemma 2), once per chunk of scores. The query and output are float32
 * or bfloat16 (q_kind); the math is float32.
 */
#define ATT_CHUNK 32
#define ATT_MAX_HEADS 64 /* query heads one task takes at most */
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
/* s[i] = cap * tanh(s[i] / cap) for i < n, as 1 - 2 / (e^(2x) + 1): exp8 saturates, so large |x| give +-1 */
static inline void soft_cap(float *s, int64_t n, float cap)
{
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 two_over_cap = _mm256_set1_ps(2.f / cap), one = _mm256_set1_ps(1.f), c = _mm256_set1_ps(cap);
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_mul_ps(_mm256_loadu_ps(s + i), two_over_cap));
        const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, one)));
        _mm256_storeu_ps(s + i, _mm256_mul_ps(c, t));
    }
#endif
    for (; i < n; ++i) s[i] = cap * tanhf(s[i] / cap);
}

/* The scores of G heads' chunk (rows ATT_CHUNK apart, n used) soft-capped; cap 0: none */
static inline void soft_cap_heads(float *s, int64_t n, int64_t G, float cap)
{
    if (cap == 0.f) return;
    for (int64_t g = 0; g < G; ++g) soft_cap(s + g * ATT_CHUNK, n, cap);
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
    if (kind == KIND_F32) {
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

/* o[H * G, D] = softmax(cap(q K^T)) V over positions start..ctx-1 of H adjacent kv heads (the first at
 * head_off in each row), G query heads each; q [H * G, D] already scaled; cap 0: no soft cap. A chunk of
 * rows inside one block at a time (contiguous rows, no division per row), converted once for the G heads. */
static void attend_kv_heads(const float *q, int64_t H, int64_t G, int64_t D, const void *k_cache,
                            const void *v_cache, const int64_t *table, int64_t start, int64_t ctx, float cap,
                            int64_t block_size, int64_t row, int64_t head_off, int kv_kind, float *o)
{
    float best[H * G], total[H * G], s[H * G * ATT_CHUNK], buf[ATT_CHUNK * D];
    const int64_t elem = kv_elem(kv_kind);
    for (int64_t g = 0; g < H * G; ++g) {
        best[g] = -INFINITY;
        total[g] = 0.f;
    }
    for (int64_t i = 0; i < H * G * D; ++i) o[i] = 0.f;
    for (int64_t c0 = start, n = 0; c0 < ctx; c0 += n) {
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
            soft_cap_heads(s + hg * ATT_CHUNK, n, G, cap);
            softmax_chunk(s + hg * ATT_CHUNK, n, G, D, best + hg, total + hg, o + hg * D);
            const float *v = kv_rows(v_cache, first + h * D, n, row, D, kv_kind, buf, &stride);
            for (int64_t g = 0; g < G; ++g)
                add_weighted_rows(o + (hg + g) * D, s + (hg + g) * ATT_CHUNK, v, n, stride, D);
        }
    }
    normalize_heads(o, total, H * G, D);
}

#ifdef ATT_BF16_DOT
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
                                 const void *k_cache, const void *v_cache, int fp8, const int64_t *table,
                                 int64_t start, int64_t ctx, float cap, int64_t block_size, int64_t row,
                                 int64_t head_off, float *o)
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
    for (int64_t c0 = start, n = 0; c0 < ctx; c0 += n) {
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
            soft_cap_heads(s + hg * ATT_CHUNK, n, G, cap);
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
    int64_t block_size, float scale,
    int64_t window,             /* sliding window: a query sees the last `window` positions; 0: all */
    float softcap,              /* scores become softcap * tanh(score / softcap); 0: no cap */
    int kv_kind, int q_kind,
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
    bf16_dot = q_kind == KIND_BF16 && (kv_kind == KIND_BF16 || kv_kind == KIND_FP8) && head_dim % 32 == 0 &&
               head_dim <= 128 &&
               group <= ATT_MAX_HEADS;
#endif

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tokens * (num_kv_heads / heads); ++task) {
        const int64_t t = task / (num_kv_heads / heads), h = task % (num_kv_heads / heads) * heads;
        const int64_t b = token_request[t];
        const int64_t query_len = query_start[b + 1] - query_start[b];
        const int64_t ctx = seq_lens[b] - query_len + (t - query_start[b]) + 1;
        const int64_t start = window > 0 && ctx > window ? ctx - window : 0; /* the window's first position */
        const int64_t first = (t * num_heads + h * group) * head_dim, n = heads * group * head_dim;
        float q[n], o[n];
#ifdef ATT_BF16_DOT
        if (bf16_dot) {
            attend_kv_heads_bf16((const uint16_t *)query + first, heads, group, head_dim, scale, k_cache, v_cache,
                                 kv_kind == KIND_FP8, block_tables + b * table_width, start, ctx, softcap,
                                 block_size, row, h * head_dim, o);
            for (int64_t i = 0; i < n; ++i) ((uint16_t *)out)[first + i] = bf16_round(o[i]);
            continue;
        }
#endif
        for (int64_t i = 0; i < n; ++i)
            q[i] = scale * (q_kind == KIND_BF16 ? bf16_to_f32(((const uint16_t *)query)[first + i])
                                              : ((const float *)query)[first + i]);
        attend_kv_heads(q, heads, group, head_dim, k_cache, v_cache, block_tables + b * table_width, start, ctx,
                        softcap, block_size, row, h * head_dim, kv_kind, o);
        for (int64_t i = 0; i < n; ++i) {
            if (q_kind == KIND_BF16) ((uint16_t *)out)[first + i] = bf16_round(o[i]);
            else ((float *)out)[first + i] = o[i];
        }
    }
    return 0;
}
