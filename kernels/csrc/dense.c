/* Dense weights: plain float32 rows (f32_matmul), bf16 rows in float32 math (bf16w_matmul) and bf16 B tiles on AMX (bf16_matmul_amx). */
#include "isa.h"
#include "tiles.h"

#ifndef TILE_512
/* TILE_ROWS over plain rows on AVX2, where `fetch`: each 4-row block's first tokens also fetch the same rows of the
 * next tile (none past the last row) */
static void plain_rows(const float *x, int64_t M, int64_t K, const float *w, int64_t t0, int rows, float *out,
                       int64_t N, int fetch)
{
    for (int j = 0; j < rows; j += 4) {
        const int64_t later = t0 + j + QTILE;
        const float *ahead = fetch && later + 4 <= N ? w + later * K : NULL;
        tile_dots(x, M, K, w + (t0 + j) * K, rows - j < 4 ? rows - j : 4, out, N, t0 + j, ahead);
    }
}
#endif

/* out [M, N] = x [M, K] w^T for a plain float32 weight w [N, K] (K a multiple of 8), for decode-sized M:
 * each thread streams its QTILE-row tiles of w once, dotted with every token where they are (the same
 * blocks as the quantized kernels, with nothing to dequantize). On AVX2, from 2 tokens the next tile's rows are
 * fetched into L2 while the first tokens are multiplied with this one's, so that reading the weights and
 * multiplying them overlap (a verify step's few tokens then cost little more than one); at 1 token the bare
 * stream is faster. AVX-512 fetches the whole next tile at a tile's start, from 3 tokens (docs/benchmarks-history.md,
 * "float32 weights: plain rows and our kernel"; same file, "float32 plain rows: the next tile fetched during
 * the first tokens"). */
int f32_matmul(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *out)
{
    if (K % 8) return -2;
#pragma omp parallel for schedule(static)
    for (int64_t t0 = 0; t0 < N; t0 += QTILE) {
        const int rows = N - t0 < QTILE ? (int)(N - t0) : QTILE;
#ifdef TILE_512
        const int64_t next = t0 + QTILE, ahead = N - next < QTILE ? N - next : QTILE;
        for (int64_t b = 0; M >= 3 && b < ahead * K * 4; b += 64)
            __builtin_prefetch((const char *)(w + next * K) + b, 0, 2);  /* into L2 */
#endif
        for (int64_t r0 = 0; r0 < M; r0 += MCHUNK) {
            const int64_t mc = M - r0 < MCHUNK ? M - r0 : MCHUNK;
#ifdef TILE_512
            TILE_ROWS(x + r0 * K, mc, K, w + t0 * K, rows, out + r0 * N, N, t0);
#else
            plain_rows(x + r0 * K, mc, K, w, t0, rows, out + r0 * N, N, M >= 2 && r0 == 0);
#endif
        }
    }
    return 0;
}

/* out [M, N] = x [M, K] w^T for a bfloat16 weight w [N, K] (K a multiple of 8) in float32 math: each thread widens
 * its QTILE rows of w into a buffer (exact), then the float32 register blocks above. A token's outputs are summed
 * in one order whatever M is and wherever the token sits in x (the deterministic mode's 16-bit linear,
 * docs/engine.md "Deterministic inference"). */
int bf16w_matmul(const float *x, int64_t M, int64_t K, const uint16_t *w, int64_t N, float *out)
{
    if (K % 8) return -2;
    int failed = 0;
#pragma omp parallel
    {
        float *buf = malloc(sizeof(float) * QTILE * K);
        if (!buf) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t0 = 0; t0 < N; t0 += QTILE) {
            if (!buf) continue;
            const int rows = N - t0 < QTILE ? (int)(N - t0) : QTILE;
            const uint16_t *src = w + t0 * K;
            for (int64_t i = 0; i < rows * K; ++i) buf[i] = bf16_to_f32(src[i]);
            for (int64_t r0 = 0; r0 < M; r0 += MCHUNK) {
                const int64_t mc = M - r0 < MCHUNK ? M - r0 : MCHUNK;
                TILE_ROWS(x + r0 * K, mc, K, buf, rows, out + r0 * N, N, t0);
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

#ifdef AMX
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
        if (y_kind == KIND_BF16)
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
        if (x_kind == KIND_BF16) {
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
    if (x_kind != KIND_BF16 || padded != M) {
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
int bf16_matmul_amx(const void *x, int x_kind, int64_t M, int64_t K, const uint16_t *w, int64_t N, int y_kind,
                    void *y)
{
    (void)x, (void)x_kind, (void)M, (void)K, (void)w, (void)N, (void)y_kind, (void)y;
    return -3;
}
#endif
