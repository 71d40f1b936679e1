/* Matrix products with GGUF's quantized weights read as they are stored.
 *
 * Built by weights.py with the system C compiler into a cached shared library and called
 * through ctypes (as cpu_decode.c). Threads come from OpenMP, the runtime torch has loaded.
 *
 *   y[n, rows] = x[n, cols] . W[rows, cols]^T
 *
 * W is a GGUF tensor's data as the file holds it: row r is cols / QK blocks of the type's
 * bytes, one after another. Nothing is expanded to floats beforehand: each product reads
 * the packed blocks, so a decode step moves 4.5 to 8.5 bits per weight instead of 32.
 *
 * Activations are rounded first, per token and block of 32, to 16-bit codes with one
 * float scale (amax / 32767), so that block dot products run on integers (AVX2: pmovzx
 * widens the weights' codes, madd multiplies and sums pairs) and are scaled once per
 * block. (llama.cpp rounds to 8 bits: faster, but on SmolLM2 it moves the next-token
 * distribution by a KL of ~1e-2 and flips greedy tokens of plain chat prompts; 16 bits
 * keep it near float32.) Each block also keeps s = d * sum(codes), which turns a weight
 * offset (Q4_1, Q5_1, the K-quants' minima) into one multiply per block. The product is
 * therefore the exact dot product of the dequantized weights with the rounded
 * activations, up to float32 accumulation.
 *
 * Batch invariance: y[b, r] depends only on row r and token b, computed by one thread
 * in one fixed order whatever n, the tiling or the thread count: a token's outputs are
 * the same bits alone or in any batch (so prefill, extend and decode agree).
 *
 * Block layouts (ggml's; d, m: fp16; q: codes; a value is d * q + m unless said):
 *   Q4_0 [d, qs[16]]            q = nibble - 8; qs[j] low nibble: value j, high: j + 16
 *   Q4_1 [d, m, qs[16]]         q = nibble
 *   Q5_0 [d, qh[4], qs[16]]     q = (nibble | bit j of qh << 4) - 16
 *   Q5_1 [d, m, qh[4], qs[16]]  q = nibble | bit j of qh << 4
 *   Q8_0 [d, qs[32] int8]
 *   Q4_K [d, dmin, scales[12], qs[128]]            256 values: 8 groups of 32, each with
 *        a 6-bit scale sc and min mn (packed in scales): value = d sc q - dmin mn;
 *        qs[32 g' .. +32]: low nibbles group 2 g', high nibbles group 2 g' + 1
 *   Q5_K [d, dmin, scales[12], qh[32], qs[128]]   as Q4_K, plus bit 2 g' (low group) or
 *        2 g' + 1 (high group) of qh[l] as the fifth bit
 *   Q6_K [ql[128], qh[64], scales[16] int8, d]    256 values: 16 groups of 16, value =
 *        d sc (q - 32), q = 4 bits of ql | 2 bits of qh << 4 (see dequant_q6_k)
 */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define USE_AVX2 1
#endif

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

typedef struct {  /* one activation block of 32 */
    float d;        /* scale: value = d * q */
    float s;        /* d * sum(q) */
    int16_t q[32];  /* codes, |q| <= 32767 */
} xblock;

static inline float half(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, bits;
    if (e == 0) {  /* zero or subnormal: m * 2^-24 */
        float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    bits = e == 31 ? sign | 0x7f800000u | (m << 13) : sign | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* The 6-bit scale and min of group j of a Q4_K / Q5_K super-block. */
static void scale_min(int j, const uint8_t *s, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* ---- block sizes ---- */

static int block_values(int type) { return type >= T_Q4_K ? 256 : 32; }

static int block_bytes(int type) {
    switch (type) {
    case T_Q4_0: return 18;
    case T_Q4_1: return 20;
    case T_Q5_0: return 22;
    case T_Q5_1: return 24;
    case T_Q8_0: return 34;
    case T_Q4_K: return 144;
    case T_Q5_K: return 176;
    case T_Q6_K: return 210;
    default: return 0;
    }
}

static int64_t row_bytes(int type, int64_t cols) {
    int bv = block_values(type), bb = block_bytes(type);
    if (bb == 0 || cols % bv != 0) return -1;
    return cols / bv * bb;
}

/* ---- dequantization (embedding rows, tests' second opinion, the portable dot) ---- */

static void dequant_block(int type, const uint8_t *b, float *y) {
    switch (type) {
    case T_Q4_0: case T_Q4_1: {
        float d = half(b), m = type == T_Q4_1 ? half(b + 2) : -8.0f * d;
        const uint8_t *qs = b + (type == T_Q4_1 ? 4 : 2);
        for (int j = 0; j < 16; j++) {
            y[j] = d * (qs[j] & 0xF) + m;
            y[j + 16] = d * (qs[j] >> 4) + m;
        }
        break;
    }
    case T_Q5_0: case T_Q5_1: {
        float d = half(b), m = type == T_Q5_1 ? half(b + 2) : -16.0f * d;
        const uint8_t *p = b + (type == T_Q5_1 ? 4 : 2);
        uint32_t qh = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
        const uint8_t *qs = p + 4;
        for (int j = 0; j < 16; j++) {
            y[j] = d * ((qs[j] & 0xF) | (((qh >> j) & 1) << 4)) + m;
            y[j + 16] = d * ((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
        }
        break;
    }
    case T_Q8_0: {
        float d = half(b);
        for (int j = 0; j < 32; j++) y[j] = d * (int8_t)b[2 + j];
        break;
    }
    case T_Q4_K: case T_Q5_K: {
        float d = half(b), dmin = half(b + 2);
        const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (type == T_Q5_K ? 48 : 16);
        for (int g = 0; g < 4; g++) {
            int sc0, mn0, sc1, mn1;
            scale_min(2 * g, scales, &sc0, &mn0);
            scale_min(2 * g + 1, scales, &sc1, &mn1);
            const uint8_t *q = qs + 32 * g;
            for (int l = 0; l < 32; l++) {
                int lo = q[l] & 0xF, hi = q[l] >> 4;
                if (type == T_Q5_K) {
                    lo |= ((qh[l] >> (2 * g)) & 1) << 4;
                    hi |= ((qh[l] >> (2 * g + 1)) & 1) << 4;
                }
                y[64 * g + l] = d * sc0 * lo - dmin * mn0;
                y[64 * g + 32 + l] = d * sc1 * hi - dmin * mn1;
            }
        }
        break;
    }
    case T_Q6_K: {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = half(b + 208);
        for (int n = 0; n < 2; n++, ql += 64, qh += 32, sc += 8, y += 128) {
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                y[l] = d * sc[is] * (((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
                y[l + 32] = d * sc[is + 2] * (((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                y[l + 64] = d * sc[is + 4] * (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                y[l + 96] = d * sc[is + 6] * (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
        break;
    }
    }
}

static void dequant_row(int type, const uint8_t *w, int64_t cols, float *y) {
    int bv = block_values(type), bb = block_bytes(type);
    for (int64_t i = 0; i < cols / bv; i++) dequant_block(type, w + i * bb, y + i * bv);
}

/* out[i] = row ids[i] of W as floats (every row when ids is NULL). Returns -1 for an
 * unknown type or a row length the type's blocks do not divide. */
int radixkv_dequant_rows(int type, const uint8_t *w, int64_t cols, const int64_t *ids, int64_t n, float *out,
                         int threads) {
    int64_t rb = row_bytes(type, cols);
    if (rb < 0) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) dequant_row(type, w + (ids ? ids[i] : i) * rb, cols, out + i * cols);
    return 0;
}

/* ---- activations ---- */

static void quantize_row(const float *x, int64_t nb, xblock *out) {
    for (int64_t i = 0; i < nb; i++, x += 32) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 32767.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < 32; j++) {
            int q = (int)lrintf(x[j] * id);
            q = q > 32767 ? 32767 : q < -32767 ? -32767 : q;
            out[i].q[j] = (int16_t)q;
            sum += q;
        }
        out[i].d = d;
        out[i].s = d * (float)sum;
    }
}

/* out = x with each block of 32 replaced by its rounding d * q: what the kernel
 * multiplies, for the dense path of long inputs (weights.py). */
void radixkv_round_activations(const float *x, int64_t n, int64_t cols, float *out, int threads) {
    int64_t nb = cols / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < n; b++) {
        xblock blk;
        for (int64_t i = 0; i < nb; i++) {
            quantize_row(x + b * cols + i * 32, 1, &blk);
            for (int j = 0; j < 32; j++) out[b * cols + i * 32 + j] = blk.d * (float)blk.q[j];
        }
    }
}

/* ---- one row against a few tokens ----
 *
 * Codes go to 16-bit lanes (pmovzx), and madd multiplies them with the activations' 16-bit
 * codes, summing pairs into 32-bit lanes; a block's integer sum is exact, turned to float
 * once and scaled by d * dx. Up to NT_MAX tokens share each unpacked block. Blocks (or
 * K-quant groups) alternate between two accumulators, two dependency chains; a token's
 * sums take the same steps whatever nt, so its result does not depend on its neighbours. */
#define NT_MAX 4

#ifdef USE_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256i bytes16(const uint8_t *p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256i xhalf(const xblock *x, int h) { return _mm256_loadu_si256((const __m256i *)(x->q + 16 * h)); }

/* 16-bit lane j = 0x10 where bit j of the 16 bits at p is set */
static inline __m256i bit5(const uint8_t *p) {
    const __m256i lane = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                           (short)32768);
    uint16_t v = (uint16_t)(p[0] | (p[1] << 8));
    __m256i hit = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((short)v), lane), lane);
    return _mm256_and_si256(hit, _mm256_set1_epi16(0x10));
}

/* sum over the block of w x, as 8 float lanes: w0, w1 the 16-bit codes of values 0..15, 16..31 */
static inline __m256 block_sum(__m256i w0, __m256i w1, const xblock *x) {
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(w0, xhalf(x, 0)), _mm256_madd_epi16(w1, xhalf(x, 1))));
}
#endif

/* The 32-value types: codes u stand for d u + m (Q4_0: m = -8 d, Q5_0: m = -16 d; Q8_0's
 * codes are signed, m = 0), so sum_j (d u_j + m) dx q_j = d dx sum(u q) + m s. */
static inline __attribute__((always_inline)) void dot_blocks(int type, const uint8_t *w, const xblock *const *xs,
                                                             const int nt, int64_t nb, float *out) {
    const int bb = block_bytes(type), offset = type == T_Q4_1 || type == T_Q5_1;
    const int five = type == T_Q5_0 || type == T_Q5_1, q8 = type == T_Q8_0;
    const float base = five ? -16.0f : -8.0f;
    float corr[NT_MAX][2];
#ifdef USE_AVX2
    __m256 acc[NT_MAX][2];
    for (int t = 0; t < nt; t++) {
        acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        corr[t][0] = corr[t][1] = 0.0f;
    }
    const __m256i f = _mm256_set1_epi16(0xF);
    for (int64_t i = 0; i < nb; i++, w += bb) {
        const int k = (int)(i & 1);
        float d = half(w), m = q8 ? 0.0f : offset ? half(w + 2) : base * d;
        const uint8_t *p = w + 2 + 2 * offset;
        __m256i w0, w1;
        if (q8) {
            w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
            w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 16)));
        } else {
            __m256i v = bytes16(five ? p + 4 : p);  /* byte j: value j (low nibble), value j + 16 (high) */
            w0 = _mm256_and_si256(v, f);
            w1 = _mm256_srli_epi16(v, 4);
            if (five) {
                w0 = _mm256_or_si256(w0, bit5(p));
                w1 = _mm256_or_si256(w1, bit5(p + 2));
            }
        }
        for (int t = 0; t < nt; t++) {
            const xblock *x = xs[t] + i;
            __m256 v = block_sum(w0, w1, x), sc = _mm256_set1_ps(d * x->d);
            if (k) acc[t][1] = _mm256_fmadd_ps(sc, v, acc[t][1]);
            else acc[t][0] = _mm256_fmadd_ps(sc, v, acc[t][0]);
            corr[t][k] = fmaf(m, x->s, corr[t][k]);
        }
    }
    for (int t = 0; t < nt; t++) out[t] = hsum(_mm256_add_ps(acc[t][0], acc[t][1])) + (corr[t][0] + corr[t][1]);
#else
    float sum[NT_MAX][2];
    for (int t = 0; t < nt; t++) sum[t][0] = sum[t][1] = corr[t][0] = corr[t][1] = 0.0f;
    for (int64_t i = 0; i < nb; i++, w += bb) {
        const int k = (int)(i & 1);
        float d = half(w), m = q8 ? 0.0f : offset ? half(w + 2) : base * d;
        const uint8_t *p = w + 2 + 2 * offset, *qs = five ? p + 4 : p;
        uint32_t qh = five ? (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24 : 0;
        int u[32];
        for (int j = 0; j < 16; j++) {
            u[j] = q8 ? (int)(int8_t)p[j] : (int)((qs[j] & 0xF) | (((qh >> j) & 1) << 4));
            u[j + 16] = q8 ? (int)(int8_t)p[j + 16] : (int)((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
        }
        for (int t = 0; t < nt; t++) {
            const xblock *x = xs[t] + i;
            int isum = 0;
            for (int j = 0; j < 32; j++) isum += u[j] * x->q[j];
            sum[t][k] = fmaf(d * x->d, (float)isum, sum[t][k]);
            corr[t][k] = fmaf(m, x->s, corr[t][k]);
        }
    }
    for (int t = 0; t < nt; t++) out[t] = (sum[t][0] + sum[t][1]) + (corr[t][0] + corr[t][1]);
#endif
}

/* Q4_K, Q5_K: per group of 32, sum_j (d sc u_j - dmin mn) dx q_j = d sc dx sum(u q) - dmin mn s;
 * qs[32 g .. +32] holds group 2 g (low nibbles) and 2 g + 1 (high), qh bit 2 g / 2 g + 1 the fifth bit. */
static inline __attribute__((always_inline)) void dot_q45_k(int type, const uint8_t *w, const xblock *const *xs,
                                                            const int nt, int64_t nb, float *out) {
    const int bb = block_bytes(type), five = type == T_Q5_K;
    float corr[NT_MAX];
#ifdef USE_AVX2
    __m256 acc[NT_MAX][2];
    for (int t = 0; t < nt; t++) {
        acc[t][0] = acc[t][1] = _mm256_setzero_ps();
        corr[t] = 0.0f;
    }
    const __m256i f = _mm256_set1_epi16(0xF), one = _mm256_set1_epi16(1);
#else
    float sum[NT_MAX][2];
    for (int t = 0; t < nt; t++) sum[t][0] = sum[t][1] = corr[t] = 0.0f;
#endif
    for (int64_t i = 0; i < nb / 8; i++, w += bb) {
        float d = half(w), dmin = half(w + 2);
        const uint8_t *qh = w + 16, *qs = w + (five ? 48 : 16);
        for (int g = 0; g < 4; g++) {
            int sc0, mn0, sc1, mn1;
            scale_min(2 * g, w + 4, &sc0, &mn0);
            scale_min(2 * g + 1, w + 4, &sc1, &mn1);
            const uint8_t *q = qs + 32 * g;
#ifdef USE_AVX2
            __m256i v0 = bytes16(q), v1 = bytes16(q + 16);  /* values 0..15 and 16..31 of both groups */
            __m256i lo0 = _mm256_and_si256(v0, f), lo1 = _mm256_and_si256(v1, f);
            __m256i hi0 = _mm256_srli_epi16(v0, 4), hi1 = _mm256_srli_epi16(v1, 4);
            if (five) {
                __m256i h0 = bytes16(qh), h1 = bytes16(qh + 16);
                __m128i c0 = _mm_cvtsi32_si128(2 * g), c1 = _mm_cvtsi32_si128(2 * g + 1);
                lo0 = _mm256_or_si256(lo0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h0, c0), one), 4));
                lo1 = _mm256_or_si256(lo1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h1, c0), one), 4));
                hi0 = _mm256_or_si256(hi0, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h0, c1), one), 4));
                hi1 = _mm256_or_si256(hi1, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h1, c1), one), 4));
            }
            for (int t = 0; t < nt; t++) {
                const xblock *x0 = xs[t] + 8 * i + 2 * g, *x1 = x0 + 1;
                acc[t][0] = _mm256_fmadd_ps(_mm256_set1_ps(d * sc0 * x0->d), block_sum(lo0, lo1, x0), acc[t][0]);
                acc[t][1] = _mm256_fmadd_ps(_mm256_set1_ps(d * sc1 * x1->d), block_sum(hi0, hi1, x1), acc[t][1]);
                corr[t] = fmaf(-dmin, fmaf((float)mn0, x0->s, (float)mn1 * x1->s), corr[t]);
            }
#else
            for (int t = 0; t < nt; t++) {
                const xblock *x0 = xs[t] + 8 * i + 2 * g, *x1 = x0 + 1;
                int s0 = 0, s1 = 0;
                for (int l = 0; l < 32; l++) {
                    int lo = q[l] & 0xF, hi = q[l] >> 4;
                    if (five) {
                        lo |= ((qh[l] >> (2 * g)) & 1) << 4;
                        hi |= ((qh[l] >> (2 * g + 1)) & 1) << 4;
                    }
                    s0 += lo * x0->q[l];
                    s1 += hi * x1->q[l];
                }
                sum[t][0] = fmaf(d * sc0 * x0->d, (float)s0, sum[t][0]);
                sum[t][1] = fmaf(d * sc1 * x1->d, (float)s1, sum[t][1]);
                corr[t] = fmaf(-dmin, fmaf((float)mn0, x0->s, (float)mn1 * x1->s), corr[t]);
            }
#endif
        }
    }
    for (int t = 0; t < nt; t++)
#ifdef USE_AVX2
        out[t] = hsum(_mm256_add_ps(acc[t][0], acc[t][1])) + corr[t];
#else
        out[t] = (sum[t][0] + sum[t][1]) + corr[t];
#endif
}

/* Q6_K: group c of 32 values (of 4 per half n) uses scales sc[8 n + 2 c] for its first 16 and
 * sc[8 n + 2 c + 1] for the last 16; values d sc (u - 32), u = 4 bits of ql | 2 bits of qh << 4. */
static inline __attribute__((always_inline)) void dot_q6_k(const uint8_t *w, const xblock *const *xs, const int nt,
                                                           int64_t nb, float *out) {
#ifdef USE_AVX2
    __m256 acc[NT_MAX][2];
    for (int t = 0; t < nt; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    const __m256i f = _mm256_set1_epi16(0xF), three = _mm256_set1_epi16(3), off = _mm256_set1_epi16(32);
#else
    float sum[NT_MAX][2];
    for (int t = 0; t < nt; t++) sum[t][0] = sum[t][1] = 0.0f;
#endif
    for (int64_t i = 0; i < nb / 8; i++, w += 210) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        float d = half(w + 208);
        for (int n = 0; n < 2; n++, ql += 64, qh += 32, sc += 8) {
            for (int c = 0; c < 4; c++) {
#ifdef USE_AVX2
                const uint8_t *lp = ql + (c & 1 ? 32 : 0);
                __m256i l0 = bytes16(lp), l1 = bytes16(lp + 16), h0 = bytes16(qh), h1 = bytes16(qh + 16);
                __m128i shift = _mm_cvtsi32_si128(2 * c);
                if (c >= 2) {
                    l0 = _mm256_srli_epi16(l0, 4);
                    l1 = _mm256_srli_epi16(l1, 4);
                }
                __m256i u0 = _mm256_or_si256(_mm256_and_si256(l0, f),
                                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h0, shift), three), 4));
                __m256i u1 = _mm256_or_si256(_mm256_and_si256(l1, f),
                                             _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h1, shift), three), 4));
                u0 = _mm256_sub_epi16(u0, off);
                u1 = _mm256_sub_epi16(u1, off);
                for (int t = 0; t < nt; t++) {
                    const xblock *x = xs[t] + 8 * i + 4 * n + c;
                    __m256 s0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(u0, xhalf(x, 0)));
                    __m256 s1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(u1, xhalf(x, 1)));
                    acc[t][0] = _mm256_fmadd_ps(_mm256_set1_ps(d * sc[2 * c] * x->d), s0, acc[t][0]);
                    acc[t][1] = _mm256_fmadd_ps(_mm256_set1_ps(d * sc[2 * c + 1] * x->d), s1, acc[t][1]);
                }
#else
                for (int t = 0; t < nt; t++) {
                    const xblock *x = xs[t] + 8 * i + 4 * n + c;
                    int s[2] = {0, 0};
                    for (int l = 0; l < 32; l++) {
                        int lq = c & 1 ? ql[l + 32] : ql[l];
                        int u = (c < 2 ? lq & 0xF : lq >> 4) | (((qh[l] >> (2 * c)) & 3) << 4);
                        s[l / 16] += (u - 32) * x->q[l];
                    }
                    sum[t][0] = fmaf(d * sc[2 * c] * x->d, (float)s[0], sum[t][0]);
                    sum[t][1] = fmaf(d * sc[2 * c + 1] * x->d, (float)s[1], sum[t][1]);
                }
#endif
            }
        }
    }
    for (int t = 0; t < nt; t++)
#ifdef USE_AVX2
        out[t] = hsum(_mm256_add_ps(acc[t][0], acc[t][1]));
#else
        out[t] = sum[t][0] + sum[t][1];
#endif
}

/* Row w against nt tokens (xs[t]: token t's blocks), out[t] = the dot products; nt is made a
 * constant per call, so the token loops unroll and the accumulators stay in registers. */
#define DOT_NT(N)                                                                                       \
    switch (type) {                                                                                     \
    case T_Q4_K: case T_Q5_K: dot_q45_k(type, w, xs, N, nb, out); break;                                \
    case T_Q6_K: dot_q6_k(w, xs, N, nb, out); break;                                                    \
    default: dot_blocks(type, w, xs, N, nb, out);                                                       \
    }

static void dot_row(int type, const uint8_t *w, const xblock *const *xs, int nt, int64_t nb, float *out) {
    switch (nt) {
    case 1: DOT_NT(1); break;
    case 2: DOT_NT(2); break;
    case 3: DOT_NT(3); break;
    default: DOT_NT(4); break;
    }
}

/* ---- the product ---- */

#define ROW_CHUNK 16   /* rows one task computes (their packed bytes stay in L1/L2) */
#define TOKEN_TILE 64  /* tokens whose quantized activations stay in L2 while a chunk runs */

static int last_threads;

/* The threads the last product ran on (what tests check the thread count against). */
int radixkv_qmatmul_last_threads(void) { return last_threads; }

/* y[n, rows] = x[n, cols] . W^T. Returns 0; -1 for an unknown type or a row length its
 * blocks do not divide; -2 when the activation buffer cannot be allocated. */
int radixkv_qmatmul(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x, int64_t n, float *y,
                    int threads) {
    int64_t rb = row_bytes(type, cols);
    if (rb < 0) return -1;
    int64_t nb = cols / 32;
    xblock *xq = malloc(sizeof(xblock) * (size_t)(nb * n));
    if (!xq) return -2;
#pragma omp parallel num_threads(threads)
    {
        if (omp_get_thread_num() == 0) last_threads = omp_get_num_threads();
#pragma omp for schedule(static)
        for (int64_t b = 0; b < n; b++) quantize_row(x + b * cols, nb, xq + b * nb);
        int64_t chunks = (rows + ROW_CHUNK - 1) / ROW_CHUNK;
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            int64_t r0 = c * ROW_CHUNK, r1 = r0 + ROW_CHUNK < rows ? r0 + ROW_CHUNK : rows;
            for (int64_t t0 = 0; t0 < n; t0 += TOKEN_TILE) {
                int64_t t1 = t0 + TOKEN_TILE < n ? t0 + TOKEN_TILE : n;
                for (int64_t r = r0; r < r1; r++)
                    for (int64_t b = t0; b < t1; b += NT_MAX) {
                        int nt = t1 - b < NT_MAX ? (int)(t1 - b) : NT_MAX;
                        const xblock *xs[NT_MAX];
                        float out[NT_MAX];
                        for (int t = 0; t < nt; t++) xs[t] = xq + (b + t) * nb;
                        dot_row(type, w + r * rb, xs, nt, nb, out);
                        for (int t = 0; t < nt; t++) y[(b + t) * rows + r] = out[t];
                    }
            }
        }
    }
    free(xq);
    return 0;
}

/* ---- the steps between the products, for native models ----
 *
 * A decode step of a small model spends as long in its elementwise steps (norms, rotary
 * embedding, SwiGLU, residual adds) as in its products when each is a few torch calls;
 * these do each in one call. Row-parallel; every row's arithmetic is the same whatever n. */

/* With add: x += add first (the residual). Then out = w * x / sqrt(mean(x^2) + eps), per row. */
void radixkv_add_rms_norm(float *x, const float *add, const float *w, float eps, int64_t n, int64_t d, float *out,
                          int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n > 1)
    for (int64_t r = 0; r < n; r++) {
        float *xr = x + r * d, *o = out + r * d;
        if (add)
            for (int64_t j = 0; j < d; j++) xr[j] += add[r * d + j];
        double ss = 0.0;
        for (int64_t j = 0; j < d; j++) ss += (double)xr[j] * xr[j];
        float inv = 1.0f / sqrtf((float)(ss / (double)d) + eps);
        for (int64_t j = 0; j < d; j++) o[j] = w[j] * (xr[j] * inv);
    }
}

/* out[n, inter] = silu(gate) * up, gate_up [n, 2 * inter] (gate first). */
void radixkv_silu_mul(const float *gu, int64_t n, int64_t inter, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n > 1)
    for (int64_t r = 0; r < n; r++) {
        const float *g = gu + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t j = 0; j < inter; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* Rotary embedding in place on the first `heads` heads of each row (q and k, half-split
 * layout): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin; cos/sin [n, d] (token r's row). */
void radixkv_rope(float *x, int64_t n, int64_t row_stride, int64_t heads, int64_t d, const float *cos,
                  const float *sin) {
    int64_t half_d = d / 2;
    for (int64_t r = 0; r < n; r++) {
        const float *c = cos + r * d, *s = sin + r * d;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + r * row_stride + h * d, *x2 = x1 + half_d;
            for (int64_t j = 0; j < half_d; j++) {
                float a = x1[j], b = x2[j];
                x1[j] = a * c[j] - b * s[j];
                x2[j] = b * c[j + half_d] + a * s[j + half_d];
            }
        }
    }
}
