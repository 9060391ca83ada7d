/* Weight-only quantized matmuls (q4 / q8) on float32 x, on int8 activations, on AVX512-BF16 dot products and
 * on AMX tiles; a whole quantized weight dequantized; and the *_supported() of those paths. */
#include "isa.h"
#include "tiles.h"

/* ---- weight-only quantized matmul: out[M, N] = x[M, K] @ dequant(W)[N, K]^T, float32 x ----------------
 * q4: groups of 32 along K, w = d * q + m (q in 0..15) in GGUF Q4_1's nibble order (byte j of a group
 *     holds element j in its low nibble and element j + 16 in its high one); q [N, K / 2].
 * q8: groups of G along K, w = d * q; q int8 [N, K]; G = K is per channel.
 * One token (M == 1): four weight rows at a time, each group dequantized in registers and multiplied
 * at once (x read once for the four). More tokens: a tile of rows dequantized into an L1 buffer once
 * per call, then register blocks of FMAs over it (AVX2: 3 tokens x 4 rows; AVX-512: 6 x 4, a block of
 * tokens' x kept in L1 while the tile's rows pass over it: tiles.h). */

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

/* Tiles of QTILE weight rows (dequantized once into an L2-sized buffer) times chunks of MCHUNK tokens
 * (kept in L1/L2 while the tile's row blocks pass over them). */
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
/* The whole weight dequantized into out [N, K] (float32, or bfloat16 rounded to nearest even) for a
 * dense GEMM: from prefill-sized calls on, oneDNN's GEMM on the dequantized weight beats the kernels
 * above, whose per-tile dequantize and 2-3 token blocks stay far from the FMA peak. */
int quant_dequantize(int kind, const void *q, const float *d, const float *m, int64_t G, int64_t N, int64_t K,
                     int out_kind, void *out)
{
    if (K % 32 || (kind == KIND_Q8 && (G <= 0 || K % G))) return -2;
#ifndef __F16C__
    if (kind == KIND_Q4_TILES_F16) return -2;
#endif
    const int64_t groups = K / (kind == KIND_Q8 ? G : 32);
#pragma omp parallel
    {
        float row[K];
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            float *dst = out_kind == KIND_F32 ? (float *)out + n * K : row;
            if (kind == KIND_Q4)
                dequant_q4_row((const uint8_t *)q + n * (K / 2), d + n * groups, m + n * groups, K, dst);
            else if (kind == KIND_Q4_TILES || kind == KIND_Q4_TILES_F16)
                for (int64_t g = 0; g < groups; g++) {
                    const int64_t at = (n / 16) * groups + g, i = 16 * at + n % 16;  /* row n % 16 of that tile */
#ifdef __F16C__
                    const float dd = kind == KIND_Q4_TILES_F16 ? _cvtsh_ss(((const uint16_t *)d)[i]) : d[i];
                    const float mm = kind == KIND_Q4_TILES_F16 ? _cvtsh_ss(((const uint16_t *)m)[i]) : m[i];
#else
                    const float dd = d[i], mm = m[i];  /* KIND_Q4_TILES_F16 refused above */
#endif
                    dequant_q4_row((const uint8_t *)q + 256 * at + 16 * (n % 16), &dd, &mm, 32, dst + 32 * g);
                }
            else
                dequant_q8_row((const int8_t *)q + n * K, d + n * groups, K, G, dst);
            if (out_kind != KIND_F32) {
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
 * batch sizes the float kernels above are bound by that dequantizing, not by reading the weights (isa.h: X8_DOT,
 * dot_u8s8). */

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

#ifdef BF16_PAIRS

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
    if (kind == KIND_Q4) {
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
    if (x_kind == KIND_BF16) {
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
        if (y_kind == KIND_BF16)
            _mm_mask_storeu_epi16((uint16_t *)y + (t0 + t) * N + n0, rows, (__m128i)_mm_cvtneps_pbh(v));
        else
            _mm_mask_storeu_ps((float *)y + (t0 + t) * N + n0, rows, v);
    }
}

int quant_matmul_dpbf16(int kind, const void *x, int x_kind, int64_t M, int64_t K, const void *q, const float *d,
                        const float *m, int64_t G, int64_t N, int y_kind, void *y)
{
    if (K % 32 || (kind == KIND_Q8 && (G <= 0 || G % 32 || K % G))) return -2;
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
 * it beats both the float and the int8 kernel (docs/benchmarks-history.md, "q4 in bf16 on AMX"). */

#ifdef AMX
#include <sys/syscall.h>
#include <unistd.h>

/* 16 rows (from row n0) of group g of a q4 / q8 weight as a bf16 A tile [16][32] (rows past N: zero) */
static inline void amx_weight_tile(int kind, const void *q, const float *d, const float *m, int64_t K, int64_t G,
                                   int64_t N, int64_t n0, int64_t g, uint16_t *tile)
{
    if (kind == KIND_Q4_TILES || kind == KIND_Q4_TILES_F16) {  /* the tile's 16 rows of group g together: one stream */
        const int64_t at = (n0 / 16) * (K / 32) + g;
        if (n0 >= N) {  /* the second block of a strip past the last row */
            for (int64_t i = 0; i < 16; i++) _mm512_store_si512((__m512i *)(tile + 32 * i), _mm512_setzero_si512());
            return;
        }
        const uint8_t *bytes = (const uint8_t *)q + 256 * at;
        float scales[32] __attribute__((aligned(64)));
        const float *dt = d + 16 * at, *mt = m + 16 * at;
        if (kind == KIND_Q4_TILES_F16) {  /* the tile's 16 d and 16 m widened once, then broadcast per row as
                                           * float32's */
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
        if (y_kind == KIND_BF16)
            _mm256_mask_storeu_epi16((uint16_t *)y + (t0 + t) * N + n0, rows, (__m256i)_mm512_cvtneps_pbh(v));
        else
            _mm512_mask_storeu_ps((float *)y + (t0 + t) * N + n0, rows, v);
    }
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
    if (K % 32 || (kind == KIND_Q8 && (G <= 0 || G % 32 || K % G))) return -2;
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
#else
int amx_supported(void) { return 0; }

UNBUILT_BF16_MATMUL(quant_matmul_amx)
#endif
