/* The register blocks of the float matmuls, shared by quant.c (over weight rows dequantized into a tile)
 * and dense.c (f32_matmul, over plain float32 rows), and the AMX tile helpers both files' tile kernels use.
 * A tile of QTILE weight rows times every token: AVX2 3 tokens x 4 rows; AVX-512 6 x 4, a block of tokens'
 * x kept in L1 while the tile's rows pass over it. */
#ifndef LORAPLEX_TILES_H
#define LORAPLEX_TILES_H

#include "isa.h"

#define QTILE 8
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
/* Fetches into L2 the 64-byte lines of `ahead`'s 4 rows (NULL: none) at k, one line a row every 16 floats: the
 * next tile's rows stream in while the first block of tokens is multiplied, not after it. */
#define FETCH_AHEAD(ahead, K, k)                                                                   \
    do {                                                                                           \
        if ((ahead) && !((k) & 15))                                                                \
            for (int f = 0; f < 4; f++) __builtin_prefetch((ahead) + f * (K) + (k), 0, 2);         \
    } while (0)

/* out[r, n0 + j] for r < M, j < nb, from nb dequantized rows w[j * K ...]; `ahead` (4 rows, or NULL): rows to
 * fetch while the first tokens are multiplied */
static void tile_dots(const float *x, int64_t M, int64_t K, const float *w, int nb, float *out, int64_t N,
                      int64_t n0, const float *ahead)
{
    int64_t r = 0;
    (void)ahead;  /* only the AVX2 blocks fetch */
#if defined(__AVX2__) && defined(__FMA__)
    for (; nb == 4 && r + 3 <= M; r += 3) {  /* 3 tokens x 4 rows: 12 FMA chains, 7 loads per 12 FMAs */
        const float *x0 = x + r * K, *x1 = x0 + K, *x2 = x1 + K;
        __m256 a[3][4];
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 4; j++) a[i][j] = _mm256_setzero_ps();
        const float *fetch = r ? NULL : ahead;
        for (int64_t k = 0; k < K; k += 8) {
            FETCH_AHEAD(fetch, K, k);
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
        const float *fetch = r ? NULL : ahead;
        for (int64_t k = 0; k < K; k += 8) {
            FETCH_AHEAD(fetch, K, k);
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
        for (int64_t k = 0; k < K; k += 8) {  /* 1 token (the bare stream is faster), or the last of an odd count */
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
        tile_dots(x, M, K, (w) + j * (K), (rows) - j < 4 ? (rows) - j : 4, out, N, (n0) + j, NULL)
#endif
/* Tiles of QTILE weight rows (dequantized once into an L2-sized buffer) times chunks of MCHUNK tokens
 * (kept in L1/L2 while the tile's row blocks pass over them). */
#define MCHUNK 24

#ifdef AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tile_config;
/* every tile 16 rows of 64 bytes, in the calling thread */
static inline void amx_configure(void)
{
    amx_tile_config config = {.palette = 1};
    for (int t = 0; t < 8; t++) config.rows[t] = 16, config.colsb[t] = 64;
    _tile_loadconfig(&config);
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
#endif

#endif
