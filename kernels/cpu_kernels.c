/* CPU kernels (float32 math; bfloat16 / float16 data converted as read) for what the PyTorch path can only do
 * through copies.
 * Built by cpu_kernels.py with -fopenmp; OpenMP resolves to the runtime torch already loaded,
 * so these share torch's thread pool. Each returns 0, or -1 when a buffer could not be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2 };

/* 1 when built with F16C: a float16 KV cache can be read (converted 8 values per instruction). */
int kv_f16_supported(void)
{
#ifdef __F16C__
    return 1;
#else
    return 0;
#endif
}

/* Ask for the row `ahead` positions on (block tables scatter a request's rows, so the hardware
 * prefetcher loses the stream at every block boundary). */
static inline void prefetch_row(const void *cache, const int64_t *table, int64_t pos, int64_t ctx,
                                int64_t block_size, int64_t row_bytes)
{
    if (pos >= ctx) return;
    const char *p = (const char *)cache + (table[pos / block_size] * block_size + pos % block_size) * row_bytes;
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(p + b);
}

/* One K or V row of n values: float32 rows are used in place; float16 and bfloat16 rows are
 * converted into buf (bfloat16 is the top half of a float32: a shift, exact). */
static inline const float *kv_row(const void *cache, int64_t offset, int64_t n, int kind, float *buf)
{
    if (kind == KV_F32) return (const float *)cache + offset;
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
 * One task per query token, all heads: each K and V row (all kv heads, contiguous) is read
 * once and serves the Hq / Hkv query heads of each group. Scores for the whole context go to
 * a per-task buffer, then softmax, then the weighted sum of V rows. Causal, lower-right aligned: query i of
 * a request with query_len n and context seq_len sees keys 0 .. seq_len - n + i.
 */

int paged_attention_f32(
    const float *query,         /* [T, Hq, D] */
    const void *k_cache,        /* [num_blocks, block_size, Hkv, D], float32, float16 or bfloat16 (kv_kind) */
    const void *v_cache,        /* same */
    const int64_t *block_tables, /* [B, table_width] */
    int64_t table_width,
    const int64_t *seq_lens,    /* [B] context length after this step */
    const int64_t *query_start, /* [B + 1] */
    const int64_t *token_request, /* [T] request index of each query token */
    int64_t num_tokens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, float scale, int kv_kind,
    float *out)                 /* [T, Hq, D] */
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row = num_kv_heads * head_dim; /* one token's K (or V) row, all heads */
    int failed = 0;

#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t b = token_request[t];
        const int64_t query_len = query_start[b + 1] - query_start[b];
        const int64_t ctx = seq_lens[b] - query_len + (t - query_start[b]) + 1;
        const int64_t *table = block_tables + b * table_width;
        const float *q = query + t * num_heads * head_dim;
        float *o = out + t * num_heads * head_dim;
        float *scores = malloc(sizeof(float) * num_heads * (ctx > 0 ? ctx : 1)); /* [Hq, ctx] */
        if (!scores) {
            failed = 1;
            continue;
        }
        float best[num_heads], total[num_heads], row_buf[row];
        for (int64_t j = 0; j < num_heads; ++j) best[j] = -INFINITY;
        const int64_t row_bytes = row * (kv_kind == KV_F32 ? 4 : 2), ahead = 4;
        for (int64_t pos = 0; pos < ctx; ++pos) {
            prefetch_row(k_cache, table, pos + ahead, ctx, block_size, row_bytes);
            const float *k = kv_row(k_cache, (table[pos / block_size] * block_size + pos % block_size) * row, row,
                                    kv_kind, row_buf);
            for (int64_t j = 0; j < num_heads; ++j) {
                const float *qj = q + j * head_dim, *kj = k + (j / group) * head_dim;
                float dot = 0.f;
                for (int64_t d = 0; d < head_dim; ++d) dot += qj[d] * kj[d];
                dot *= scale;
                scores[j * ctx + pos] = dot;
                if (dot > best[j]) best[j] = dot;
            }
        }
        for (int64_t j = 0; j < num_heads; ++j) {
            float sum = 0.f;
            for (int64_t pos = 0; pos < ctx; ++pos) {
                const float p = expf(scores[j * ctx + pos] - best[j]);
                scores[j * ctx + pos] = p;
                sum += p;
            }
            total[j] = sum;
        }
        for (int64_t i = 0; i < num_heads * head_dim; ++i) o[i] = 0.f;
        for (int64_t pos = 0; pos < ctx; ++pos) {
            prefetch_row(v_cache, table, pos + ahead, ctx, block_size, row_bytes);
            const float *v = kv_row(v_cache, (table[pos / block_size] * block_size + pos % block_size) * row, row,
                                    kv_kind, row_buf);
            for (int64_t j = 0; j < num_heads; ++j) {
                const float p = scores[j * ctx + pos], *vj = v + (j / group) * head_dim;
                float *oj = o + j * head_dim;
                for (int64_t d = 0; d < head_dim; ++d) oj[d] += p * vj[d];
            }
        }
        for (int64_t j = 0; j < num_heads; ++j) {
            const float inv = total[j] > 0.f ? 1.f / total[j] : 0.f;
            for (int64_t d = 0; d < head_dim; ++d) o[j * head_dim + d] *= inv;
        }
        free(scores);
    }
    return failed ? -1 : 0;
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

static inline uint16_t bf16_round(float f)
{
    union { float f; uint32_t u; } v = { f };
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* quiet NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float f32_load(const float *p, int64_t i) { return p[i]; }

#define SGMV_LORA_TABLE(NAME, T, LOAD, STORE)                                                       \
int NAME(                                                                                          \
    const T *x,                 /* [T, in] */                                                      \
    const int64_t *a_ptrs,      /* [S] address of slot s's A [num_slices * r_s, in] */             \
    const int64_t *b_ptrs,      /* [S] address of slot s's Bt [r_s, out_total] */                  \
    const int64_t *ranks,       /* [S] r_s (0: the slot does not touch this projection) */        \
    const float *scales,        /* [S] */                                                          \
    const int64_t *tokens,      /* [N] rows of x / y that have a slot */                           \
    const int64_t *token_slots, /* [N] their slots */                                              \
    const int64_t *offsets,     /* [num_slices + 1] output offset of each slice */                 \
    int64_t num_tokens, int64_t in_features, int64_t num_slices, int64_t max_rank,                 \
    T *y)                       /* [T, out_total] */                                               \
{                                                                                                  \
    const int64_t out_total = offsets[num_slices];                                                 \
    int failed = 0;                                                                                \
    _Pragma("omp parallel")                                                                        \
    {                                                                                              \
        float *acc = malloc(sizeof(float) * (out_total + num_slices * max_rank));                  \
        float *h = acc + out_total;                                                                \
        if (!acc) failed = 1;                                                                      \
        _Pragma("omp for schedule(dynamic, 1)")                                                    \
        for (int64_t n = 0; n < num_tokens; ++n) {                                                 \
            const int64_t t = tokens[n], s = token_slots[n], r = ranks[s];                         \
            if (!acc || r <= 0 || r > max_rank) continue;                                          \
            const T *a = (const T *)(intptr_t)a_ptrs[s];                                           \
            const T *bt = (const T *)(intptr_t)b_ptrs[s];                                          \
            const T *xt = x + t * in_features;                                                     \
            T *yt = y + t * out_total;                                                             \
            /* four rows at a time: x is loaded once for four independent FMA chains */         \
            int64_t k = 0;                                                                         \
            for (; k + 4 <= num_slices * r; k += 4) {                                              \
                const T *r0 = a + k * in_features, *r1 = r0 + in_features;                         \
                const T *r2 = r1 + in_features, *r3 = r2 + in_features;                            \
                float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;                                      \
                for (int64_t d = 0; d < in_features; ++d) {                                        \
                    const float xv = LOAD(xt, d);                                                  \
                    d0 += LOAD(r0, d) * xv; d1 += LOAD(r1, d) * xv;                                \
                    d2 += LOAD(r2, d) * xv; d3 += LOAD(r3, d) * xv;                                \
                }                                                                                  \
                h[k] = d0 * scales[s]; h[k + 1] = d1 * scales[s];                                  \
                h[k + 2] = d2 * scales[s]; h[k + 3] = d3 * scales[s];                              \
            }                                                                                      \
            for (; k < num_slices * r; ++k) {                                                      \
                const T *row = a + k * in_features;                                                \
                float dot = 0.f;                                                                   \
                for (int64_t d = 0; d < in_features; ++d) dot += LOAD(row, d) * LOAD(xt, d);       \
                h[k] = dot * scales[s];                                                            \
            }                                                                                      \
            for (int64_t o = 0; o < out_total; ++o) acc[o] = LOAD(yt, o);                          \
            /* four rank rows of Bt per pass over the output row: a quarter of its loads/stores */ \
            for (int64_t i = 0; i < num_slices; ++i) {                                             \
                const float *hi = h + i * r;                                                       \
                const int64_t lo = offsets[i], hi_o = offsets[i + 1];                              \
                int64_t j = 0;                                                                     \
                for (; j + 4 <= r; j += 4) {                                                       \
                    const T *b0 = bt + j * out_total, *b1 = b0 + out_total;                        \
                    const T *b2 = b1 + out_total, *b3 = b2 + out_total;                            \
                    const float h0 = hi[j], h1 = hi[j + 1], h2 = hi[j + 2], h3 = hi[j + 3];        \
                    for (int64_t o = lo; o < hi_o; ++o)                                            \
                        acc[o] += h0 * LOAD(b0, o) + h1 * LOAD(b1, o) + h2 * LOAD(b2, o) + h3 * LOAD(b3, o); \
                }                                                                                  \
                for (; j < r; ++j) {                                                               \
                    const T *row = bt + j * out_total;                                             \
                    for (int64_t o = lo; o < hi_o; ++o) acc[o] += hi[j] * LOAD(row, o);            \
                }                                                                                  \
            }                                                                                      \
            for (int64_t o = 0; o < out_total; ++o) STORE(yt, o, acc[o]);                          \
        }                                                                                          \
        free(acc);                                                                                 \
    }                                                                                              \
    return failed ? -1 : 0;                                                                        \
}

#define F32_STORE(p, i, v) ((p)[i] = (v))
#define BF16_STORE(p, i, v) ((p)[i] = bf16_round(v))
SGMV_LORA_TABLE(sgmv_lora_table_f32, float, f32_load, F32_STORE)
SGMV_LORA_TABLE(sgmv_lora_table_bf16, uint16_t, bf16_load, BF16_STORE)
