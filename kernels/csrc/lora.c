/* The multi-LoRA delta of decode-like batches, each adapter read in place through a pointer table. */
#include "isa.h"

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
    const float *token_weights;     /* [N] each token's weight on its slot's delta (a mix); NULL: 1 */
    const int64_t *offsets;         /* [num_slices + 1] output offset of each slice */
    int64_t in_features, num_slices, max_rank;
    int64_t rows;                   /* h's stride per token: num_slices * max_rank, padded to whole fours */
    void *y;                        /* [T, out_total] */
};
/* the factor on token n's shrink: its slot's scale, times its weight in a mix (NULL weights: the
 * scale alone, so the unweighted path computes exactly what it did before weights existed) */
static inline float lora_token_scale(const struct lora_call *c, int64_t s, int64_t n)
{
    return c->token_weights ? c->scales[s] * c->token_weights[n] : c->scales[s];
}
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
         const int64_t *tokens, const int64_t *token_slots, const float *token_weights,           \
         const int64_t *offsets, int64_t num_tokens,                                               \
         int64_t in_features, int64_t num_slices, int64_t max_rank, T *y)                          \
{                                                                                                  \
    const struct lora_call c = {x, a_ptrs, b_ptrs, ranks, scales, tokens, token_slots, token_weights, \
                                offsets, in_features, num_slices, max_rank, num_slices * max_rank + 3, y}; \
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
        for (int64_t k = 0; k < k_all; ++k) h[q * rows + k] *= lora_token_scale(c, s, n0 + q); \
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
        for (int64_t k = 0; k < k_all; ++k) h[q * rows + k] *= lora_token_scale(c, s, n0 + q); \
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
