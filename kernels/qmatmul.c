/* Matrix products with GGUF's quantized weights read as they are stored.
 *
 * Built by weights.py with the system C compiler into a cached shared library and called
 * through ctypes (as cpu_decode.c). Threads come from OpenMP, the runtime torch has loaded.
 *
 *   y[n, rows] = x[n, cols] . W[rows, cols]^T
 *
 * W is a GGUF tensor's data, every byte as the file holds it: row r is cols / QK blocks of
 * the type's bytes (for the 32-value types rearranged within the row: the split layout,
 * below; Q4_0, Q4_1 and Q8_0 interleaved across 16 rows instead: the stored panels,
 * further below). Nothing is expanded to floats beforehand: each product reads the packed blocks,
 * so a decode step moves 4.5 to 8.5 bits per weight instead of 32.
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
 * the same bits alone or in any batch (so prefill, extend and decode agree), and for the
 * 32-value types on either path (a row at a time, or the integer panels).
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
 *        d sc (q - 32), q = 4 bits of ql | 2 bits of qh << 4 (see dequant_block)
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

#include "vexp.h"  /* INLINE, exp_nonpositive, exp8_nonpositive, half_to_float, WITH_CONSTANT_ROWS */

enum { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };
#define PANELS 0x100  /* ORed into a type: the matrix is stored as panels (see stored_panels) */
#define PANELS8 0x200 /* the same for Q4_0 and Q4_1 against 8-bit activations: codes in the byte tiles' order */
#define STORED (PANELS | PANELS8)
#define TILE_MR 6  /* the tokens a tile takes at most (see tile) */

/* the little-endian fp16 at p */
static inline float half(const uint8_t *p) { return half_to_float((uint16_t)(p[0] | (p[1] << 8))); }

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

/* ---- the split layout of the 32-value types ----
 *
 * A PackedMatrix holds each row of a 32-value type with its blocks' fields gathered by
 * kind: [d of every block (fp16)] [m of every block (Q4_1, Q5_1)] [qh of every block (Q5)]
 * [codes of every block], the same bytes as ggml's [d m qh qs][d m qh qs]... rearranged
 * within the row. The AVX2 dot then converts eight blocks' scales with one instruction and
 * scales eight block sums at once. The K-quants keep ggml's layout (their scales already
 * serve 256 values). */

static int is_split(int type) { return type < T_Q4_K; }

typedef struct {  /* where block i's fields start in a split row of nb blocks */
    int64_t m, qh, qs;  /* byte offsets of the m, qh and codes arrays */
    int has_m, has_qh, code_bytes;
} split_fields;

static split_fields fields_of(int type, int64_t nb) {
    split_fields f;
    f.has_m = type == T_Q4_1 || type == T_Q5_1;
    f.has_qh = type == T_Q5_0 || type == T_Q5_1;
    f.code_bytes = type == T_Q8_0 ? 32 : 16;
    f.m = 2 * nb;
    f.qh = f.m + 2 * nb * f.has_m;
    f.qs = f.qh + 4 * nb * f.has_qh;
    return f;
}

/* Block i of a split row, put back in ggml's layout into blk. */
static void gather_block(int type, const uint8_t *row, int64_t nb, int64_t i, uint8_t *blk) {
    split_fields f = fields_of(type, nb);
    memcpy(blk, row + 2 * i, 2);
    blk += 2;
    if (f.has_m) {
        memcpy(blk, row + f.m + 2 * i, 2);
        blk += 2;
    }
    if (f.has_qh) {
        memcpy(blk, row + f.qh + 4 * i, 4);
        blk += 4;
    }
    memcpy(blk, row + f.qs + f.code_bytes * i, (size_t)f.code_bytes);
}

/* Block i in ggml's layout (blk) written into a split row. */
static void scatter_block(int type, const uint8_t *blk, int64_t nb, int64_t i, uint8_t *row) {
    split_fields f = fields_of(type, nb);
    memcpy(row + 2 * i, blk, 2);
    blk += 2;
    if (f.has_m) {
        memcpy(row + f.m + 2 * i, blk, 2);
        blk += 2;
    }
    if (f.has_qh) {
        memcpy(row + f.qh + 4 * i, blk, 4);
        blk += 4;
    }
    memcpy(row + f.qs + f.code_bytes * i, blk, (size_t)f.code_bytes);
}

/* rows x cols of type from ggml's layout (to_split) into the kernels' layout, or back.
 * The K-quants are copied as they are. Returns -1 for an unknown type or width. */
int radixkv_repack(int type, const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst, int to_split) {
    int64_t rb = row_bytes(type, cols);
    if (rb < 0) return -1;
    if (!is_split(type)) {
        memcpy(dst, src, (size_t)(rows * rb));
        return 0;
    }
    int64_t nb = cols / 32, bb = block_bytes(type);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < nb; i++) {
            if (to_split) scatter_block(type, src + r * rb + i * bb, nb, i, dst + r * rb);
            else gather_block(type, src + r * rb, nb, i, dst + r * rb + i * bb);
        }
    return 0;
}

/* ---- dequantization (embedding rows, the prefill path, tests' second opinion) ---- */

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


/* ---- activations ----
 *
 * A token's rounded activations: codes q[32 i + j] and, per block i, its scale d[i] and
 * s[i] = d[i] * sum(codes of block i). Codes span +-act_max: 32767 (16-bit codes, the
 * default) or 127 (8-bit, llama.cpp's activation precision: the integer panels then take
 * pmaddubsw, twice pmaddwd's multiply-adds an instruction, or AVX512-VNNI's vpdpbusd, four
 * times). Every product's integer sums are exact either way, so a token's bits depend on
 * act_max, never on the path. */
typedef struct {
    const int16_t *q;
    const float *d, *s;
} xrow;

static void quantize_block(const float *x, int act_max, int16_t *q, int8_t *q8, float *d_out, float *s_out) {
#ifdef USE_AVX2  /* the same arithmetic eight lanes at a time (cvtps rounds to nearest even, as lrintf) */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int k = 0; k < 4; k++) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[k] = _mm256_loadu_ps(x + 8 * k)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    float d = amax / (float)act_max, id = d > 0.0f ? 1.0f / d : 0.0f;
    const __m256i hi = _mm256_set1_epi32(act_max), lo = _mm256_set1_epi32(-act_max);
    __m256i c[4], total = _mm256_setzero_si256();
    for (int k = 0; k < 4; k++) {
        c[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(id)));
        c[k] = _mm256_max_epi32(_mm256_min_epi32(c[k], hi), lo);
        total = _mm256_add_epi32(total, c[k]);
    }
    /* packs interleaves 128-bit lanes: permute them back to values 0..15, 16..31 */
    const __m256i lo16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8),
                  hi16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), 0xD8);
    _mm256_storeu_si256((__m256i *)q, lo16);
    _mm256_storeu_si256((__m256i *)(q + 16), hi16);
    if (q8) _mm256_storeu_si256((__m256i *)q8, _mm256_permute4x64_epi64(_mm256_packs_epi16(lo16, hi16), 0xD8));
    __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
    int sum = _mm_cvtsi128_si32(_mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1)));
#else
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    float d = amax / (float)act_max, id = d > 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int j = 0; j < 32; j++) {
        int v = (int)lrintf(x[j] * id);
        v = v > act_max ? act_max : v < -act_max ? -act_max : v;
        q[j] = (int16_t)v;
        if (q8) q8[j] = (int8_t)v;
        sum += v;
    }
#endif
    *d_out = d;
    *s_out = d * (float)sum;
}

/* out = x with each block of 32 replaced by its rounding d * q (codes within +-act_max):
 * what the kernel multiplies, for the dense path of long inputs (weights.py). */
void radixkv_round_activations(const float *x, int64_t n, int64_t cols, float *out, int act_max, int threads) {
    int64_t nb = cols / 32;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < n; b++) {
        int16_t q[32];
        float d, s;
        for (int64_t i = 0; i < nb; i++) {
            quantize_block(x + b * cols + i * 32, act_max, q, NULL, &d, &s);
            for (int j = 0; j < 32; j++) out[b * cols + i * 32 + j] = d * (float)q[j];
        }
    }
}

/* ---- one row against a few tokens ----
 *
 * Codes go to 16-bit lanes (pmovzx), and madd multiplies them with the activations' 16-bit
 * codes, summing pairs into 32-bit lanes; a block's integer sum is exact, turned to float
 * once and scaled by d * dx. Up to NT_MAX tokens share each unpacked block. A token's sums
 * take the same steps whatever nt, so its result does not depend on its neighbours.
 *
 * The 32-value types' float steps, here and on the integer panels below (the same order
 * in both and in the portable loops, so every path gives a token the same bits): block i
 * of a row updates lane i % 8 of eight sums, y = fma(m, s, fma(d dx, its integer sum, y)),
 * blocks in order; the result is the lanes' sum as lanes8 adds them. */
#define NT_MAX 4
#define ROWS_TOGETHER 2  /* rows dot_split takes side by side, at most */

/* the sum of eight lanes v: ((v0 + v4) + (v2 + v6)) + ((v1 + v5) + (v3 + v7)) (hsum8's order) */
static inline float lanes8(const float *v) {
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
}

#ifdef USE_AVX2
/* the sum of v's eight lanes, in one fixed order */
INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline __m256i bytes16(const uint8_t *p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256i xcodes(const int16_t *q) { return _mm256_loadu_si256((const __m256i *)q); }

/* 16-bit lane j = 0x10 where bit j of the 16 bits at p is set */
static inline __m256i bit5(const uint8_t *p) {
    const __m256i lane = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                           (short)32768);
    uint16_t v = (uint16_t)(p[0] | (p[1] << 8));
    __m256i hit = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((short)v), lane), lane);
    return _mm256_and_si256(hit, _mm256_set1_epi16(0x10));
}

/* sum over a block of w x as 8 int32 lanes: w0, w1 the 16-bit codes of values 0..15, 16..31 */
static inline __m256i block_isum(__m256i w0, __m256i w1, const int16_t *q) {
    return _mm256_add_epi32(_mm256_madd_epi16(w0, xcodes(q)), _mm256_madd_epi16(w1, xcodes(q + 16)));
}

static inline __m256 block_sum(__m256i w0, __m256i w1, const int16_t *q) {
    return _mm256_cvtepi32_ps(block_isum(w0, w1, q));
}

/* The 16-bit codes of block i of a split row (values 0..15 in w[0], 16..31 in w[1]). */
static inline __attribute__((always_inline)) void split_codes(int type, const uint8_t *qs, const uint8_t *qh,
                                                              int64_t i, __m256i w[2]) {
    if (type == T_Q8_0) {
        w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs + 32 * i)));
        w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qs + 32 * i + 16)));
    } else {
        __m256i v = bytes16(qs + 16 * i);  /* byte j: value j (low nibble), value j + 16 (high) */
        w[0] = _mm256_and_si256(v, _mm256_set1_epi16(0xF));
        w[1] = _mm256_srli_epi16(v, 4);
        if (type == T_Q5_0 || type == T_Q5_1) {
            w[0] = _mm256_or_si256(w[0], bit5(qh + 4 * i));
            w[1] = _mm256_or_si256(w[1], bit5(qh + 4 * i + 2));
        }
    }
}

/* split_codes with the type a constant in each call (its branches fold) */
static inline __attribute__((always_inline)) void block_codes(int type, const uint8_t *qs, const uint8_t *qh, int64_t i,
                                                              __m256i w[2]) {
    switch (type) {
    case T_Q4_0: split_codes(T_Q4_0, qs, qh, i, w); break;
    case T_Q4_1: split_codes(T_Q4_1, qs, qh, i, w); break;
    case T_Q5_0: split_codes(T_Q5_0, qs, qh, i, w); break;
    case T_Q5_1: split_codes(T_Q5_1, qs, qh, i, w); break;
    default: split_codes(T_Q8_0, qs, qh, i, w); break;
    }
}

/* int32 sums of eight blocks (8 lanes each) -> one vector of the eight totals, in order */
static inline __m256i reduce8(__m256i a01, __m256i a23, __m256i a45, __m256i a67) {
    __m256i lo = _mm256_hadd_epi32(a01, a23), hi = _mm256_hadd_epi32(a45, a67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}
#else
/* The 16-bit codes of block i of a split row (nb blocks), u[32]: block_codes' values. */
static void unpack_block(int type, const uint8_t *row, int64_t nb, int64_t i, int16_t u[32]) {
    const split_fields f = fields_of(type, nb);
    uint8_t blk[34];
    gather_block(type, row, nb, i, blk);
    const uint8_t *p = blk + 2 + 2 * f.has_m, *c = f.has_qh ? p + 4 : p;
    const uint32_t bits = f.has_qh ? (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24 : 0;
    for (int j = 0; j < 16; j++) {
        if (type == T_Q8_0) {
            u[j] = (int8_t)c[j], u[j + 16] = (int8_t)c[j + 16];
        } else {
            u[j] = (int16_t)((c[j] & 0xF) | (((bits >> j) & 1) << 4));
            u[j + 16] = (int16_t)((c[j] >> 4) | (((bits >> (j + 16)) & 1) << 4));
        }
    }
}
#endif

#ifdef USE_AVX2
/* Blocks i0 .. i0 + r (r <= 8, a constant 8 for whole groups: the masks fold away) of a
 * split row into lane i0 + j's of acc[t], one lane a block: acc = fma(m, s, fma(d dx,
 * isum, acc)). Missing blocks' lanes add zero (their d, m and the tokens' scales zero; the
 * 16-byte fp16 loads stay inside the row: other fields follow d and m). */
static inline __attribute__((always_inline)) void split_group(int type, const uint8_t *row, const split_fields f,
                                                              float base, const xrow *xs, const int nt, int64_t i0,
                                                              const int r, __m256 *acc) {
    const uint8_t *qs = row + f.qs, *qh = row + f.qh;
    __m256i pair[NT_MAX][4];
    for (int p = 0; p < 4; p++) {  /* blocks i0 + 2p, i0 + 2p + 1 */
        __m256i a[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, b[2] = {a[0], a[1]};
        if (2 * p < r) split_codes(type, qs, qh, i0 + 2 * p, a);
        if (2 * p + 1 < r) split_codes(type, qs, qh, i0 + 2 * p + 1, b);
        for (int t = 0; t < nt; t++) {
            const int16_t *q = xs[t].q + 32 * (i0 + 2 * p);
            pair[t][p] = _mm256_hadd_epi32(2 * p < r ? block_isum(a[0], a[1], q) : _mm256_setzero_si256(),
                                           2 * p + 1 < r ? block_isum(b[0], b[1], q + 32) : _mm256_setzero_si256());
        }
    }
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(r), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + 2 * i0)));
    __m256 m = f.has_m ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + f.m + 2 * i0)))
                       : _mm256_mul_ps(d, _mm256_set1_ps(base));
    if (r < 8) d = _mm256_and_ps(d, _mm256_castsi256_ps(keep)), m = _mm256_and_ps(m, _mm256_castsi256_ps(keep));
    for (int t = 0; t < nt; t++) {
        const __m256 sums = _mm256_cvtepi32_ps(reduce8(pair[t][0], pair[t][1], pair[t][2], pair[t][3]));
        const __m256 dx = r < 8 ? _mm256_maskload_ps(xs[t].d + i0, keep) : _mm256_loadu_ps(xs[t].d + i0);
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), sums, acc[t]);
        if (type != T_Q8_0) {  /* Q8_0: m = 0 */
            const __m256 sx = r < 8 ? _mm256_maskload_ps(xs[t].s + i0, keep) : _mm256_loadu_ps(xs[t].s + i0);
            acc[t] = _mm256_fmadd_ps(m, sx, acc[t]);
        }
    }
}
#endif

/* The 32-value types, split rows: codes u stand for d u + m (Q4_0: m = -8 d, Q5_0: m = -16 d;
 * Q8_0's codes are signed, m = 0), so sum_j (d u_j + m) dx q_j = d dx sum(u q) + m s. AVX2 takes
 * eight blocks at a time: their integer sums reduced into one vector, scaled by the eight
 * d dx at once, the offsets m s likewise. R <= ROWS_TOGETHER rows (row, row + rb, ...; R a
 * constant) go side by side, group by group, so their chains of float steps overlap; each
 * row's steps are its own (the same bits whatever R): out[t * stride + q] for row q, token t. */
static inline __attribute__((always_inline)) void dot_split(int type, const uint8_t *row, int64_t rb, const int R,
                                                            const xrow *xs, const int nt, int64_t nb, float *out,
                                                            int64_t stride) {
    const split_fields f = fields_of(type, nb);
    const float base = type == T_Q5_0 ? -16.0f : type == T_Q4_0 ? -8.0f : 0.0f;
#ifdef USE_AVX2
    __m256 acc[ROWS_TOGETHER][NT_MAX];
    for (int q = 0; q < R; q++)
        for (int t = 0; t < nt; t++) acc[q][t] = _mm256_setzero_ps();
    int64_t i0 = 0;
    for (; i0 + 8 <= nb; i0 += 8)
        for (int q = 0; q < R; q++) split_group(type, row + q * rb, f, base, xs, nt, i0, 8, acc[q]);
    if (i0 < nb)  /* the last nb % 8 blocks */
        for (int q = 0; q < R; q++) split_group(type, row + q * rb, f, base, xs, nt, i0, (int)(nb - i0), acc[q]);
    for (int q = 0; q < R; q++)
        for (int t = 0; t < nt; t++) out[t * stride + q] = hsum8(acc[q][t]);  /* lanes8's order */
#else
    for (int q = 0; q < R; q++, row += rb) {
        float sum[NT_MAX][8];
        for (int t = 0; t < nt; t++)
            for (int k = 0; k < 8; k++) sum[t][k] = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const int k = (int)(i & 7);
            const float d = half(row + 2 * i), m = type == T_Q8_0 ? 0.0f : f.has_m ? half(row + f.m + 2 * i) : base * d;
            int16_t u[32];
            unpack_block(type, row, nb, i, u);
            for (int t = 0; t < nt; t++) {
                const int16_t *q = xs[t].q + 32 * i;
                int isum = 0;
                for (int j = 0; j < 32; j++) isum += u[j] * q[j];
                sum[t][k] = fmaf(m, xs[t].s[i], fmaf(d * xs[t].d[i], (float)isum, sum[t][k]));
            }
        }
        for (int t = 0; t < nt; t++) out[t * stride + q] = lanes8(sum[t]);
    }
#endif
}

/* Q4_K, Q5_K: per group of 32, sum_j (d sc u_j - dmin mn) dx q_j = d sc dx sum(u q) - dmin mn s;
 * qs[32 g .. +32] holds group 2 g (low nibbles) and 2 g + 1 (high), qh bit 2 g / 2 g + 1 the fifth bit. */
static inline __attribute__((always_inline)) void dot_q45_k(int type, const uint8_t *w, const xrow *xs,
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
                const int64_t b = 8 * i + 2 * g;
                const int16_t *q0 = xs[t].q + 32 * b, *q1 = q0 + 32;
                const float dx0 = xs[t].d[b], dx1 = xs[t].d[b + 1], sx0 = xs[t].s[b], sx1 = xs[t].s[b + 1];
                acc[t][0] = _mm256_fmadd_ps(_mm256_set1_ps(d * sc0 * dx0), block_sum(lo0, lo1, q0), acc[t][0]);
                acc[t][1] = _mm256_fmadd_ps(_mm256_set1_ps(d * sc1 * dx1), block_sum(hi0, hi1, q1), acc[t][1]);
                corr[t] = fmaf(-dmin, fmaf((float)mn0, sx0, (float)mn1 * sx1), corr[t]);
            }
#else
            for (int t = 0; t < nt; t++) {
                const int64_t b = 8 * i + 2 * g;
                const int16_t *q0 = xs[t].q + 32 * b, *q1 = q0 + 32;
                const float dx0 = xs[t].d[b], dx1 = xs[t].d[b + 1], sx0 = xs[t].s[b], sx1 = xs[t].s[b + 1];
                int s0 = 0, s1 = 0;
                for (int l = 0; l < 32; l++) {
                    int lo = q[l] & 0xF, hi = q[l] >> 4;
                    if (five) {
                        lo |= ((qh[l] >> (2 * g)) & 1) << 4;
                        hi |= ((qh[l] >> (2 * g + 1)) & 1) << 4;
                    }
                    s0 += lo * q0[l];
                    s1 += hi * q1[l];
                }
                sum[t][0] = fmaf(d * sc0 * dx0, (float)s0, sum[t][0]);
                sum[t][1] = fmaf(d * sc1 * dx1, (float)s1, sum[t][1]);
                corr[t] = fmaf(-dmin, fmaf((float)mn0, sx0, (float)mn1 * sx1), corr[t]);
            }
#endif
        }
    }
    for (int t = 0; t < nt; t++)
#ifdef USE_AVX2
        out[t] = hsum8(_mm256_add_ps(acc[t][0], acc[t][1])) + corr[t];
#else
        out[t] = (sum[t][0] + sum[t][1]) + corr[t];
#endif
}

/* Q6_K: group c of 32 values (of 4 per half n) uses scales sc[8 n + 2 c] for its first 16 and
 * sc[8 n + 2 c + 1] for the last 16; values d sc (u - 32), u = 4 bits of ql | 2 bits of qh << 4. */
static inline __attribute__((always_inline)) void dot_q6_k(const uint8_t *w, const xrow *xs, const int nt,
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
                    const int64_t b = 8 * i + 4 * n + c;
                    const int16_t *q = xs[t].q + 32 * b;
                    const float dx = xs[t].d[b];
                    __m256 s0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(u0, xcodes(q)));
                    __m256 s1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(u1, xcodes(q + 16)));
                    acc[t][0] = _mm256_fmadd_ps(_mm256_set1_ps(d * sc[2 * c] * dx), s0, acc[t][0]);
                    acc[t][1] = _mm256_fmadd_ps(_mm256_set1_ps(d * sc[2 * c + 1] * dx), s1, acc[t][1]);
                }
#else
                for (int t = 0; t < nt; t++) {
                    const int64_t b = 8 * i + 4 * n + c;
                    const int16_t *q = xs[t].q + 32 * b;
                    const float dx = xs[t].d[b];
                    int s[2] = {0, 0};
                    for (int l = 0; l < 32; l++) {
                        int lq = c & 1 ? ql[l + 32] : ql[l];
                        int u = (c < 2 ? lq & 0xF : lq >> 4) | (((qh[l] >> (2 * c)) & 3) << 4);
                        s[l / 16] += (u - 32) * q[l];
                    }
                    sum[t][0] = fmaf(d * sc[2 * c] * dx, (float)s[0], sum[t][0]);
                    sum[t][1] = fmaf(d * sc[2 * c + 1] * dx, (float)s[1], sum[t][1]);
                }
#endif
            }
        }
    }
    for (int t = 0; t < nt; t++)
#ifdef USE_AVX2
        out[t] = hsum8(_mm256_add_ps(acc[t][0], acc[t][1]));
#else
        out[t] = sum[t][0] + sum[t][1];
#endif
}

/* nrows rows of W from w (row bytes rb) against nt tokens (xs[t]: token t's blocks): out[t *
 * stride + q] = row q's dot product with token t. The type and nt are constants in each
 * expansion, so the loops unroll and the accumulators stay in registers; the 32-value types
 * take rows in pairs for up to two tokens (dot_split with R = 2: the same bits as alone). */
static inline __attribute__((always_inline)) void rows_of(int type, const uint8_t *w, int64_t rb, int64_t nrows,
                                                          const xrow *xs, const int nt, int64_t nb, float *out,
                                                          int64_t stride) {
    int64_t q = 0;
    if (is_split(type)) {
        if (nt <= 2)  /* more tokens hold more accumulators: one row at a time */
            for (; q + ROWS_TOGETHER <= nrows; q += ROWS_TOGETHER)
                dot_split(type, w + q * rb, rb, ROWS_TOGETHER, xs, nt, nb, out + q, stride);
        for (; q < nrows; q++) dot_split(type, w + q * rb, rb, 1, xs, nt, nb, out + q, stride);
        return;
    }
    for (; q < nrows; q++) {
        float o[NT_MAX];
        if (type == T_Q6_K) dot_q6_k(w + q * rb, xs, nt, nb, o);
        else dot_q45_k(type, w + q * rb, xs, nt, nb, o);
        for (int t = 0; t < nt; t++) out[t * stride + q] = o[t];
    }
}

#define ROWS_NT(N)                                                                                      \
    switch (type) {                                                                                     \
    case T_Q4_0: rows_of(T_Q4_0, w, rb, nrows, xs, N, nb, out, stride); break;                          \
    case T_Q4_1: rows_of(T_Q4_1, w, rb, nrows, xs, N, nb, out, stride); break;                          \
    case T_Q5_0: rows_of(T_Q5_0, w, rb, nrows, xs, N, nb, out, stride); break;                          \
    case T_Q5_1: rows_of(T_Q5_1, w, rb, nrows, xs, N, nb, out, stride); break;                          \
    case T_Q8_0: rows_of(T_Q8_0, w, rb, nrows, xs, N, nb, out, stride); break;                          \
    case T_Q4_K: rows_of(T_Q4_K, w, rb, nrows, xs, N, nb, out, stride); break;                          \
    case T_Q5_K: rows_of(T_Q5_K, w, rb, nrows, xs, N, nb, out, stride); break;                          \
    default: rows_of(T_Q6_K, w, rb, nrows, xs, N, nb, out, stride);                                     \
    }

static void dot_rows(int type, const uint8_t *w, int64_t rb, int64_t nrows, const xrow *xs, int nt, int64_t nb,
                     float *out, int64_t stride) {
    switch (nt) {
    case 1: ROWS_NT(1); break;
    case 2: ROWS_NT(2); break;
    case 3: ROWS_NT(3); break;
    default: ROWS_NT(4); break;
    }
}


/* ---- dequantization of whole rows (embedding rows, the prefill path) ---- */

/* One row of the kernels' layout (split for the 32-value types) as floats. AVX2 takes a
 * 32-value type's block from its 16-bit codes (d u + m: products of an fp16 and a small
 * integer are exact in float32, so the one rounding is the add's, as in the scalar code). */
#ifdef USE_AVX2
/* y[0..32) = d * code + m (a multiply, then an add: the bits every dequantization gives) for
 * a block's 16-bit codes c (values 0..15, 16..31) */
static void dequant_codes(const __m256i c[2], float d, float m, float *y) {
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    for (int h = 0; h < 2; h++) {
        const __m256i lo = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(c[h]));
        const __m256i hi = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(c[h], 1));
        _mm256_storeu_ps(y + 16 * h, _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(lo)), vm));
        _mm256_storeu_ps(y + 16 * h + 8, _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(hi)), vm));
    }
}
#endif

static void dequant_row(int type, const uint8_t *w, int64_t cols, float *y) {
    int bv = block_values(type), bb = block_bytes(type);
    int64_t nb = cols / bv;
#ifdef USE_AVX2
    if (is_split(type)) {
        const split_fields f = fields_of(type, nb);
        const float base = type == T_Q5_0 ? -16.0f : type == T_Q4_0 ? -8.0f : 0.0f;
        for (int64_t i = 0; i < nb; i++, y += 32) {
            __m256i c[2];
            block_codes(type, w + f.qs, w + f.qh, i, c);
            const float d = half(w + 2 * i), m = f.has_m ? half(w + f.m + 2 * i) : base * d;
            dequant_codes(c, d, m, y);
        }
        return;
    }
#endif
    uint8_t blk[34];
    for (int64_t i = 0; i < nb; i++) {
        if (is_split(type)) gather_block(type, w, nb, i, blk);
        dequant_block(type, is_split(type) ? blk : w + i * bb, y + i * bv);
    }
}
static void panel_row(int kind, const uint8_t *w, int64_t r, int64_t cols, float *y);
int64_t radixkv_panel_bytes(int kind, int64_t rows, int64_t cols);

/* out[i] = row ids[i] of W (the kernels' layout) as floats (every row when ids is NULL).
 * Returns -1 for an unknown type or a row length the type's blocks do not divide. */
int radixkv_dequant_rows(int type, const uint8_t *w, int64_t cols, const int64_t *ids, int64_t n, float *out,
                         int threads) {
    if (type & STORED) {
        if (radixkv_panel_bytes(type, 1, cols) < 0) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < n; i++) panel_row(type, w, ids ? ids[i] : i, cols, out + i * cols);
        return 0;
    }
    int64_t rb = row_bytes(type, cols);
    if (rb < 0) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; i++) dequant_row(type, w + (ids ? ids[i] : i) * rb, cols, out + i * cols);
    return 0;
}


/* ---- the product ---- */

#define ROW_CHUNK 16   /* rows one task computes (their packed bytes stay in L1/L2) */

typedef struct {  /* a matrix in the kernels' layout, as weights.py describes it */
    int type;
    int act_max;  /* its inputs' codes: +-32767 or +-127 (see quantize_block) */
    int64_t rows, cols;
    const uint8_t *w;
} qmat;

typedef struct {  /* room for n tokens' rounded activations of up to `blocks` blocks each */
    int16_t *q;
    float *d, *s;
    /* where the codes fit in bytes (act_max 127), the byte tiles' copy, in their order: the
     * tokens in groups of TILE_MR (a tile's), each group's codes [cols / 4][TILE_MR] quads
     * and its blocks' d and s [nb][2][TILE_MR], so that a tile reads its tokens' quads and
     * scales from one pointer at constant offsets (six tokens' pointers spill registers) */
    int8_t *q8;
    float *ds8;
} xbuf;

/* bytes: room for the codes as bytes too (products whose act_max is 127: quantize_rows
 * writes them) */
static int xbuf_alloc(xbuf *b, int64_t n, int64_t blocks, int bytes) {
    const size_t padded = (size_t)((n + TILE_MR - 1) / TILE_MR * TILE_MR * blocks);  /* whole groups */
    b->q = malloc(sizeof(int16_t) * 32 * (size_t)(n * blocks));
    b->d = malloc(sizeof(float) * 2 * (size_t)(n * blocks));
    b->s = b->d ? b->d + n * blocks : NULL;
    b->q8 = bytes ? malloc(32 * padded) : NULL;
    b->ds8 = bytes ? malloc(sizeof(float) * 2 * padded) : NULL;
    if (b->q && b->d && ((b->q8 && b->ds8) || !bytes)) return 0;
    free(b->q);
    free(b->d);
    free(b->q8);
    free(b->ds8);
    return -2;
}

static void xbuf_free(xbuf *b) {
    free(b->q);
    free(b->d);
    free(b->q8);
    free(b->ds8);
}

/* where token r's block i of nb goes in the byte tiles' copy: its eight quads at
 * [j * TILE_MR * 4] from the first, its d and s at [0] and [TILE_MR] */
static inline int8_t *tile_quads(const xbuf *xb, int64_t r, int64_t i, int64_t nb) {
    const int64_t t = r % TILE_MR, g = r - t;  /* g: the group's first token */
    return xb->q8 + g * nb * 32 + i * 8 * TILE_MR * 4 + t * 4;
}
static inline float *tile_scales(const xbuf *xb, int64_t r, int64_t i, int64_t nb) {
    const int64_t t = r % TILE_MR, g = r - t;
    return xb->ds8 + g * nb * 2 + i * 2 * TILE_MR + t;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* quantize_block's arithmetic on up to 16 blocks at a time, in three passes: every block's
 * largest magnitude; their d and 1 / d in one vector division each (IEEE divisions: the
 * scalar code's bits); then each block's codes, clamped and summed as there (the same
 * codes, d and s). One block at a time (a reduction, two divisions, the codes through a
 * copy on the stack, a division to find the block) ran 1.25-1.35x as long a block. */
#define ROUND_512 1
static void round_run_512(const float *x, int64_t r, int64_t i0, int64_t nblocks, int64_t nb, int act_max,
                          const xbuf *xb) {
    const __m512i hi = _mm512_set1_epi32(act_max), lo = _mm512_set1_epi32(-act_max);
    for (int64_t c = 0; c < nblocks; c += 16) {
        const int m = nblocks - c < 16 ? (int)(nblocks - c) : 16;
        const __mmask16 live = (__mmask16)((1u << m) - 1);
        const float *xc = x + 32 * c;
        const int64_t k0 = r * nb + i0 + c;  /* the run's first block in xb */
        float amax[16] = {0}, inv[16];
        int32_t sum[16];
        for (int j = 0; j < m; j++) {
            const __m512 a = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xc + 32 * j)),
                                           _mm512_abs_ps(_mm512_loadu_ps(xc + 32 * j + 16)));
            amax[j] = _mm512_reduce_max_ps(a);
        }
        const __m512 d = _mm512_div_ps(_mm512_loadu_ps(amax), _mm512_set1_ps((float)act_max));
        _mm512_storeu_ps(inv, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_GT_OQ),
                                                  _mm512_set1_ps(1.0f), d));
        for (int j = 0; j < m; j++) {
            const __m512 id = _mm512_set1_ps(inv[j]);
            const __m512i c0 = _mm512_max_epi32(
                _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xc + 32 * j), id)), hi), lo);
            const __m512i c1 = _mm512_max_epi32(
                _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xc + 32 * j + 16), id)), hi), lo);
            sum[j] = _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
            _mm512_storeu_si512(xb->q + 32 * (k0 + j), _mm512_inserti64x4(_mm512_castsi256_si512(
                                    _mm512_cvtepi32_epi16(c0)), _mm512_cvtepi32_epi16(c1), 1));
            if (act_max <= 127) {
                const __m128i b0 = _mm512_cvtepi32_epi8(c0), b1 = _mm512_cvtepi32_epi8(c1);
                int8_t *quads = tile_quads(xb, r, i0 + c + j, nb);
                const int32_t quad[8] = {_mm_cvtsi128_si32(b0), _mm_extract_epi32(b0, 1), _mm_extract_epi32(b0, 2),
                                         _mm_extract_epi32(b0, 3), _mm_cvtsi128_si32(b1), _mm_extract_epi32(b1, 1),
                                         _mm_extract_epi32(b1, 2), _mm_extract_epi32(b1, 3)};
                for (int u = 0; u < 8; u++) memcpy(quads + u * TILE_MR * 4, quad + u, 4);
            }
        }
        const __m512 sc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(live, sum)));
        _mm512_mask_storeu_ps(xb->d + k0, live, d);
        _mm512_mask_storeu_ps(xb->s + k0, live, sc);
        if (act_max <= 127)
            for (int j = 0; j < m; j++) {
                float *ds = tile_scales(xb, r, i0 + c + j, nb);
                ds[0] = xb->d[k0 + j], ds[TILE_MR] = xb->s[k0 + j];
            }
    }
}
#endif

/* blocks [i0, i0 + nblocks) of token r (of nb a token), the values x (the first block's),
 * rounded into xb: each block's codes, d and s, and where they fit in bytes their copy in
 * the byte tiles' order */
static void round_run(const float *x, int64_t r, int64_t i0, int64_t nblocks, int64_t nb, int act_max,
                      const xbuf *xb) {
#ifdef ROUND_512
    round_run_512(x, r, i0, nblocks, nb, act_max, xb);
#else
    for (int64_t i = i0; i < i0 + nblocks; i++, x += 32) {
        const int64_t k = r * nb + i;
        int8_t q8[32];
        quantize_block(x, act_max, xb->q + 32 * k, act_max <= 127 ? q8 : NULL, xb->d + k, xb->s + k);
        if (act_max > 127) continue;
        int8_t *quads = tile_quads(xb, r, i, nb);
        for (int j = 0; j < 8; j++) memcpy(quads + j * TILE_MR * 4, q8 + 4 * j, 4);
        float *ds = tile_scales(xb, r, i, nb);
        ds[0] = xb->d[k], ds[TILE_MR] = xb->s[k];
    }
#endif
}

/* n tokens' activations x[n, cols] rounded into xb (codes within +-act_max; as bytes too
 * where they fit), by every thread of a parallel region: each takes an equal run of the
 * blocks, row by row, and the region waits at a barrier for all of them */
static void quantize_rows(const float *x, int64_t n, int64_t cols, int act_max, const xbuf *xb) {
    const int64_t nb = cols / 32, blocks = n * nb;
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t k1 = blocks * (me + 1) / team;
    for (int64_t k = blocks * me / team; k < k1;) {
        const int64_t r = k / nb, i = k % nb, run = (nb - i < k1 - k) ? nb - i : k1 - k;
        round_run(x + 32 * k, r, i, run, nb, act_max, xb);
        k += run;
    }
#pragma omp barrier
}

/* token r's activations xr[cols] rounded into its place in xb: quantize_rows' blocks of that
 * row, for a caller that has just computed the row (the same codes, without another pass) */
static void quantize_row(const float *xr, int64_t r, int64_t cols, int act_max, const xbuf *xb) {
    round_run(xr, r, 0, cols / 32, cols / 32, act_max, xb);
}

/* rows [r0, r1) of y[n, rows] = x . W^T through dot_rows, from the rounded activations xb:
 * ROW_CHUNK rows at a time against every group of up to NT_MAX tokens (the chunk's bytes
 * stay in L1 across the groups) */
static void kernel_rows(const qmat *m, int64_t n, float *y, const xbuf *xb, int64_t r0, int64_t r1) {
    const int64_t nb = m->cols / 32, rb = row_bytes(m->type, m->cols), rows = m->rows;
    for (int64_t c = r0; c < r1; c += ROW_CHUNK) {
        const int64_t nrows = r1 - c < ROW_CHUNK ? r1 - c : ROW_CHUNK;
        for (int64_t b = 0; b < n; b += NT_MAX) {
            int nt = n - b < NT_MAX ? (int)(n - b) : NT_MAX;
            xrow xr[NT_MAX];
            for (int t = 0; t < nt; t++) xr[t] = (xrow){xb->q + (b + t) * nb * 32, xb->d + (b + t) * nb, xb->s + (b + t) * nb};
            dot_rows(m->type, m->w + c * rb, rb, nrows, xr, nt, nb, y + b * rows + c, rows);
        }
    }
}

static void split_panels(const qmat *m, int64_t n, float *y, const xbuf *xb);
static void stored_panels(const qmat *m, int64_t n, float *y, const xbuf *xb);

/* -1 unless type (stored as panels or not), cols and act_max describe a matrix of rows the
 * kernels take (PANELS8 holds byte codes: 8-bit activations only) */
static int check_matrix(int type, int64_t rows, int64_t cols, int act_max) {
    if (type & STORED) return radixkv_panel_bytes(type, rows, cols) < 0 || ((type & PANELS8) && act_max > 127) ? -1 : 0;
    return row_bytes(type, cols) < 0 ? -1 : 0;
}

/* From this many tokens on, products of the 32-value types take the integer panels (the
 * same bits as dot_rows: see split_panels); K-quants always take dot_rows here. */
#define PANELS_FROM 8

/* y[n, rows] = W^T times the activations already rounded into xb, called by every thread
 * of a parallel region (its loops are shared out among them; each ends with the region's
 * barrier). */
static void rounded_product(const qmat *m, int64_t n, float *y, const xbuf *xb) {
    const int64_t rows = m->rows;
    if (m->type & STORED) {
        stored_panels(m, n, y, xb);
        return;
    }
    if (is_split(m->type) && n >= PANELS_FROM) {
        split_panels(m, n, y, xb);
        return;
    }
    int64_t chunks = (rows + ROW_CHUNK - 1) / ROW_CHUNK;
#pragma omp for schedule(static)
    for (int64_t c = 0; c < chunks; c++)
        kernel_rows(m, n, y, xb, c * ROW_CHUNK, c * ROW_CHUNK + ROW_CHUNK < rows ? c * ROW_CHUNK + ROW_CHUNK : rows);
}

/* y[n, rows] = x[n, cols] . W^T, called by every thread of a parallel region */
static void product(const qmat *m, const float *x, int64_t n, float *y, const xbuf *xb) {
    quantize_rows(x, n, m->cols, m->act_max, xb);
    rounded_product(m, n, y, xb);
}

static int last_threads;

/* The threads the last product ran on (what tests check the thread count against). */
int radixkv_qmatmul_last_threads(void) { return last_threads; }

/* y[n, rows] = x[n, cols] . W^T, W in the kernels' layout (radixkv_repack), x rounded to
 * codes within +-act_max (32767 or 127). Returns 0; -1 for an unknown type or a row length
 * its blocks do not divide; -2 when the activation buffer cannot be allocated. */
int radixkv_qmatmul(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x, int64_t n, float *y,
                    int act_max, int threads) {
    if (check_matrix(type, rows, cols, act_max)) return -1;
    qmat m = {type, act_max, rows, cols, w};
    xbuf xb;
    if (xbuf_alloc(&xb, n, cols / 32, act_max <= 127)) return -2;
#pragma omp parallel num_threads(threads)
    {
        if (omp_get_thread_num() == 0) last_threads = omp_get_num_threads();
        product(&m, x, n, y, &xb);
    }
    xbuf_free(&xb);
    return 0;
}

/* ---- float32 weights, a few tokens ----
 *
 * The exact mode's decode products: y[n, rows] = x[n, cols] . W^T with W float32. A BLAS
 * runs a matrix-vector product on one core; these split the rows over the threads (a decode
 * step is bound by reading W, and two cores read faster than one). Each (row, token) dot
 * takes the same steps whatever n or the threads (two 8-lane accumulators over alternate
 * groups of 8 columns, then the tail), so a token's result does not depend on its batch. */
static inline __attribute__((always_inline)) void sdot_row(const float *w, const float *const *xs, const int nt,
                                                           int64_t cols, float *out) {
    int64_t j = 0;
#ifdef USE_AVX2
    __m256 acc[NT_MAX][2];
    for (int t = 0; t < nt; t++) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (; j + 16 <= cols; j += 16) {
        __m256 w0 = _mm256_loadu_ps(w + j), w1 = _mm256_loadu_ps(w + j + 8);
        for (int t = 0; t < nt; t++) {
            acc[t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xs[t] + j), acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xs[t] + j + 8), acc[t][1]);
        }
    }
    for (int t = 0; t < nt; t++) out[t] = hsum8(_mm256_add_ps(acc[t][0], acc[t][1]));
#else
    for (int t = 0; t < nt; t++) out[t] = 0.0f;
#endif
    for (int t = 0; t < nt; t++) {
        float tail = 0.0f;
        for (int64_t k = j; k < cols; k++) tail = fmaf(w[k], xs[t][k], tail);
        out[t] += tail;
    }
}

static void sdot_rows(const float *w, const float *const *xs, int nt, int64_t cols, float *out) {
    switch (nt) {
    case 1: sdot_row(w, xs, 1, cols, out); break;
    case 2: sdot_row(w, xs, 2, cols, out); break;
    case 3: sdot_row(w, xs, 3, cols, out); break;
    default: sdot_row(w, xs, 4, cols, out); break;
    }
}

void radixkv_sgemm_small(const float *w, int64_t rows, int64_t cols, const float *x, int64_t n, float *y,
                         int threads) {
    int64_t chunks = (rows + ROW_CHUNK - 1) / ROW_CHUNK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t r0 = c * ROW_CHUNK, r1 = r0 + ROW_CHUNK < rows ? r0 + ROW_CHUNK : rows;
        for (int64_t r = r0; r < r1; r++)
            for (int64_t b = 0; b < n; b += NT_MAX) {
                int nt = n - b < NT_MAX ? (int)(n - b) : NT_MAX;
                const float *xs[NT_MAX];
                float out[NT_MAX];
                for (int t = 0; t < nt; t++) xs[t] = x + (b + t) * cols;
                sdot_rows(w + r * cols, xs, nt, cols, out);
                for (int t = 0; t < nt; t++) y[(b + t) * rows + r] = out[t];
            }
    }
}

/* ---- dequantized products: the dense path of prefill and extend rows ----
 *
 * y[n, rows] = x[n, cols] . W^T in float32, W dequantized TILE_NR rows at a time into a
 * panel [cols][TILE_NR] that stays in cache; never the whole matrix (a BLAS product over a
 * dequantized copy streams 4 bytes a weight out to memory and back, which dominates at a
 * few dozen tokens). Tiles of TILE_MR tokens by the panel's TILE_NR rows (tile, below):
 * y[t, r] is one chain of fused multiply-adds over the columns in order, from zero,
 * whatever n, the tile or the thread count (and the portable loop takes the same steps):
 * a token's result does not depend on its batch. The K-quants take this path
 * (radixkv_qgemm, below), x the activations as the kernel rounds them. */

/* ---- a tile of outer products ----
 *
 * out[t ostride ..][0..TILE_NR) = sum over k < depth of x[t * depth + k] * panel[k][0..TILE_NR),
 * for t < mr <= TILE_MR rows of x (row stride depth); panel [depth][TILE_NR] 32-byte aligned,
 * out a scratch tile or the result's rows (tile_dest). Per k: two vectors of the panel, each
 * row's value broadcast, 2 mr fused multiply-adds (12 accumulators at most: the 16 AVX2 registers' share). Each
 * output is one chain of fused multiply-adds over k in order, from zero, whatever mr (and
 * the portable loop takes the same steps, fmaf rounding once as the lanes do), so a row's
 * result does not depend on the rows beside it. */
#define TILE_NR 16 /* columns: two 8-lane vectors */

/* Where a tile of tokens t.. puts the results of the panel of rows r0 .. r0 + nr of y[n, rows]:
 * a whole panel's straight into y's rows (*ostride = rows), a partial one's into the scratch
 * tile out (*ostride = TILE_NR), which tile_tail then copies into y */
INLINE float *tile_dest(float *y, int64_t rows, int64_t r0, int64_t nr, int64_t t, float *out, int64_t *ostride) {
    *ostride = nr == TILE_NR ? rows : TILE_NR;
    return nr == TILE_NR ? y + t * rows + r0 : out;
}

/* a partial panel's results, mr tokens from t, from the scratch tile out into y (tile_dest) */
INLINE void tile_tail(float *y, int64_t rows, int64_t r0, int64_t nr, int64_t t, int mr, const float *out) {
    if (nr < TILE_NR)
        for (int i = 0; i < mr; i++) memcpy(y + (t + i) * rows + r0, out + i * TILE_NR, sizeof(float) * (size_t)nr);
}

INLINE void tile_mr(const float *panel, int64_t depth, const float *x, const int mr, float *out, int64_t ostride) {
#ifdef USE_AVX2
    __m256 a[TILE_MR][2];
    for (int t = 0; t < mr; t++) a[t][0] = a[t][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < depth; k++) {
        const __m256 w0 = _mm256_load_ps(panel + k * TILE_NR), w1 = _mm256_load_ps(panel + k * TILE_NR + 8);
        for (int t = 0; t < mr; t++) {
            const __m256 xb = _mm256_broadcast_ss(x + t * depth + k);
            a[t][0] = _mm256_fmadd_ps(xb, w0, a[t][0]);
            a[t][1] = _mm256_fmadd_ps(xb, w1, a[t][1]);
        }
    }
    for (int t = 0; t < mr; t++) {
        _mm256_storeu_ps(out + t * ostride, a[t][0]);
        _mm256_storeu_ps(out + t * ostride + 8, a[t][1]);
    }
#else
    for (int t = 0; t < mr; t++)
        for (int r = 0; r < TILE_NR; r++) {
            float s = 0.0f;
            for (int64_t k = 0; k < depth; k++) s = fmaf(x[t * depth + k], panel[k * TILE_NR + r], s);
            out[t * ostride + r] = s;
        }
#endif
}

/* tile_mr with mr a constant in each call (both need it inlined where it is used) */
INLINE void tile(const float *panel, int64_t depth, const float *x, int mr, float *out, int64_t ostride) {
#define TILE(R) tile_mr(panel, depth, x, R, out, ostride)
    WITH_CONSTANT_ROWS(mr, TILE);
#undef TILE
}

/* [TILE_NR][width] 32-bit elements (rows 32-byte aligned, width a multiple of 8) as
 * [width][TILE_NR]: floats, or pairs of 16-bit codes (the integer panels). */
static void transpose_panel(const float *tmp, int64_t width, float *panel) {
#ifdef USE_AVX2
    for (int64_t k = 0; k < width; k += 8)  /* 8 x 8 transposes */
        for (int h = 0; h < TILE_NR; h += 8) {
            const float *src = tmp + h * width + k;
            __m256 r0 = _mm256_load_ps(src), r1 = _mm256_load_ps(src + width), r2 = _mm256_load_ps(src + 2 * width),
                   r3 = _mm256_load_ps(src + 3 * width), r4 = _mm256_load_ps(src + 4 * width),
                   r5 = _mm256_load_ps(src + 5 * width), r6 = _mm256_load_ps(src + 6 * width),
                   r7 = _mm256_load_ps(src + 7 * width);
            __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
                   t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
                   t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
            __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
                   u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
                   u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
                   u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
            float *dst = panel + k * TILE_NR + h;
            _mm256_store_ps(dst, _mm256_permute2f128_ps(u0, u4, 0x20));
            _mm256_store_ps(dst + TILE_NR, _mm256_permute2f128_ps(u1, u5, 0x20));
            _mm256_store_ps(dst + 2 * TILE_NR, _mm256_permute2f128_ps(u2, u6, 0x20));
            _mm256_store_ps(dst + 3 * TILE_NR, _mm256_permute2f128_ps(u3, u7, 0x20));
            _mm256_store_ps(dst + 4 * TILE_NR, _mm256_permute2f128_ps(u0, u4, 0x31));
            _mm256_store_ps(dst + 5 * TILE_NR, _mm256_permute2f128_ps(u1, u5, 0x31));
            _mm256_store_ps(dst + 6 * TILE_NR, _mm256_permute2f128_ps(u2, u6, 0x31));
            _mm256_store_ps(dst + 7 * TILE_NR, _mm256_permute2f128_ps(u3, u7, 0x31));
        }
#else
    for (int64_t k = 0; k < width; k++)
        for (int r = 0; r < TILE_NR; r++) memcpy(panel + k * TILE_NR + r, tmp + r * width + k, sizeof(float));
#endif
}

/* Rows [r0, r0 + nr) of W (nr <= TILE_NR) as a panel [cols][TILE_NR], missing rows zero. */
static void qg_panel(int type, const uint8_t *w, int64_t rb, int64_t r0, int64_t nr, int64_t cols, float *tmp,
                     float *panel) {
    for (int64_t r = 0; r < nr; r++) dequant_row(type, w + (r0 + r) * rb, cols, tmp + r * cols);
    for (int64_t r = nr; r < TILE_NR; r++) memset(tmp + r * cols, 0, sizeof(float) * (size_t)cols);
    transpose_panel(tmp, cols, panel);
}

/* ---- the 32-value types, many tokens: integer products ----
 *
 * y[n, rows] = x[n, cols] . W^T for the split types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): the
 * same quantity as radixkv_qmatmul (the weights' codes times the activations' 16-bit codes,
 * exact integer sums per block of 32, scaled once per block) for many tokens at once. Per
 * panel of TILE_NR rows the codes go to 16-bit pairs [cols / 2][TILE_NR] (18 KiB at 576
 * columns, 48 at 1536: in cache) beside each block's d and m of the rows; tiles of TILE_MR
 * tokens by the panel's rows then multiply a pair of codes of eight rows by a token's pair
 * broadcast: pmaddwd and an add, 16 multiply-adds for two instructions, or AVX512-VNNI's
 * vpdpwssd, 16 in one, where a float32 fused multiply-add does 8 (measured on two Zen 4
 * cores: 1.6x the float32 panels with VNNI, 1.2x with the AVX2 pair). A block's sums are exact
 * in int32; then the float steps of dot_split (y = fma(m, s, fma(d dx, float(sum), y)), s =
 * dx * the sum of the token's codes, in the block's lane of eight, then lanes8), whatever
 * n, the tile or the threads, and the portable loop takes the same steps: a token's result
 * is the same bits alone, in any batch, with or without VNNI, and on either path. */
#ifdef USE_AVX2
/* acc + the pairwise products of w and x summed in 32-bit lanes (one instruction with AVX512-VNNI) */
INLINE __m256i madd_acc(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, w, x);
#else
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
    __asm__("" : "+x"(acc));  /* keeps GCC from regrouping a block's sums (spilling them to the stack) */
    return acc;
#endif
}
#endif

/* A split row's 16-bit codes u[cols] and each block's d and m (a value is d u + m). */
static void row_codes(int type, const uint8_t *row, int64_t nb, int16_t *u, float *d, float *m) {
    const split_fields f = fields_of(type, nb);
    const float base = type == T_Q5_0 ? -16.0f : type == T_Q4_0 ? -8.0f : 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        d[i] = half(row + 2 * i);
        m[i] = f.has_m ? half(row + f.m + 2 * i) : base * d[i];
#ifdef USE_AVX2
        __m256i c[2];
        block_codes(type, row + f.qs, row + f.qh, i, c);
        _mm256_storeu_si256((__m256i *)(u + 32 * i), c[0]);
        _mm256_storeu_si256((__m256i *)(u + 32 * i + 16), c[1]);
#else
        unpack_block(type, row, nb, i, u + 32 * i);
#endif
    }
}

/* Rows [r0, r0 + nr) as an integer panel: codes [cols / 2][TILE_NR] pairs (through tmp,
 * [TILE_NR][cols] codes, and dtmp, 2 nb floats), dm [nb][2][TILE_NR]: each block's d of the
 * rows, then their m; missing rows zero. */
static void ig_panel(int type, const uint8_t *w, int64_t rb, int64_t r0, int64_t nr, int64_t cols, int16_t *tmp,
                     float *dtmp, int16_t *codes, float *dm) {
    const int64_t nb = cols / 32;
    for (int64_t r = 0; r < TILE_NR; r++) {
        if (r < nr) {
            row_codes(type, w + (r0 + r) * rb, nb, tmp + r * cols, dtmp, dtmp + nb);
        } else {
            memset(tmp + r * cols, 0, sizeof(int16_t) * (size_t)cols);
            memset(dtmp, 0, sizeof(float) * 2 * (size_t)nb);
        }
        for (int64_t i = 0; i < nb; i++) dm[i * 2 * TILE_NR + r] = dtmp[i], dm[i * 2 * TILE_NR + TILE_NR + r] = dtmp[nb + i];
    }
    transpose_panel((const float *)tmp, cols / 2, (float *)codes);
}

#define LANE_FLOATS (8 * TILE_NR)  /* a token's lanes in igtile's scratch */

#ifdef USE_AVX2
/* block i's exact integer sums a[t] (TILE_NR rows of token t) into the tokens' lane i % 8:
 * y = fma(m, s, fma(d dx, float(sum), y)), dot_split's float steps; token t's dx and s of
 * the block at xd[t ts] and xs[t ts]; first: the lane's first block (it starts from zero) */
INLINE void lanes_from(__m256 d0, __m256 d1, __m256 m0, __m256 m1, const float *xd, const float *xs,
                       const int64_t ts, const int mr, float *lanes, int64_t i, const int first,
                       __m256i a[TILE_MR][2]) {
    for (int t = 0; t < mr; t++) {
        const __m256 dx = _mm256_set1_ps(xd[t * ts]), sx = _mm256_set1_ps(xs[t * ts]);
        float *o = lanes + t * LANE_FLOATS + (i & 7) * TILE_NR;
        const __m256 y0 = first ? _mm256_setzero_ps() : _mm256_load_ps(o), y1 = first ? _mm256_setzero_ps() : _mm256_load_ps(o + 8);
        _mm256_store_ps(o, _mm256_fmadd_ps(m0, sx, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[t][0]), _mm256_mul_ps(d0, dx), y0)));
        _mm256_store_ps(o + 8, _mm256_fmadd_ps(m1, sx, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[t][1]), _mm256_mul_ps(d1, dx), y1)));
    }
}

/* lanes_from with the rows' d and m of block i from dm [nb][2][TILE_NR] */
INLINE void into_lanes(const float *dm, const float *xd, const float *xs, const int64_t ts, const int mr,
                       float *lanes, int64_t i, const int first, __m256i a[TILE_MR][2]) {
    const float *f = dm + i * 2 * TILE_NR;
    lanes_from(_mm256_load_ps(f), _mm256_load_ps(f + 8), _mm256_load_ps(f + 16), _mm256_load_ps(f + 24), xd, xs, ts,
               mr, lanes, i, first, a);
}

/* step k of block i for the tile's mr tokens: a[t] += w0, w1 times token t's k-th pair of codes
 * broadcast (pmaddwd and an add: each int32 lane a row's two products) */
INLINE void madd_tokens(__m256i a[TILE_MR][2], __m256i w0, __m256i w1, const int16_t *xq, int64_t cols, int64_t i,
                        int k, const int mr) {
    for (int t = 0; t < mr; t++) {
        int32_t pair;
        memcpy(&pair, xq + t * cols + 32 * i + 2 * k, sizeof pair);
        const __m256i xb = _mm256_set1_epi32(pair);
        a[t][0] = madd_acc(a[t][0], w0, xb);
        a[t][1] = madd_acc(a[t][1], w1, xb);
    }
}

/* block i of the tile into its lane; first: the lane's first block (the lane starts from zero) */
INLINE void igblock(const int16_t *codes, const float *dm, int64_t nb, int64_t cols, const int16_t *xq,
                    const float *xd, const float *xs, const int mr, float *lanes, int64_t i, const int first) {
    __m256i a[TILE_MR][2];  /* 12 int32 accumulators, two vectors of codes, a broadcast */
    for (int t = 0; t < mr; t++) a[t][0] = a[t][1] = _mm256_setzero_si256();
    const int16_t *c = codes + i * 32 * TILE_NR;  /* 16 pairs of the block's columns x TILE_NR rows */
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) {
        const __m256i w0 = _mm256_load_si256((const __m256i *)(c + 2 * TILE_NR * k));
        const __m256i w1 = _mm256_load_si256((const __m256i *)(c + 2 * TILE_NR * k + 16));
        madd_tokens(a, w0, w1, xq, cols, i, k, mr);
    }
    into_lanes(dm, xd + i, xs + i, nb, mr, lanes, i, first, a);
}

/* step k (four columns) of block i for the tile's mr tokens on bytes: s[t] (16-bit sums) +=
 * pmaddubsw of w0, w1 and token t's k-th quad of byte codes broadcast (xq8: the tile's
 * group of codes in xbuf's byte order); start: the sums start here */
INLINE void madd8_tokens(__m256i s[TILE_MR][2], __m256i w0, __m256i w1, const int8_t *xq8, int64_t i, int k,
                         const int mr, const int start) {
    for (int t = 0; t < mr; t++) {
        int32_t quad;
        memcpy(&quad, xq8 + ((i * 8 + k) * TILE_MR + t) * 4, sizeof quad);
        const __m256i xb = _mm256_set1_epi32(quad);
        const __m256i p0 = _mm256_maddubs_epi16(w0, xb), p1 = _mm256_maddubs_epi16(w1, xb);
        if (start) {
            s[t][0] = p0, s[t][1] = p1;
        } else {
            s[t][0] = _mm256_add_epi16(s[t][0], p0), s[t][1] = _mm256_add_epi16(s[t][1], p1);
            __asm__("" : "+x"(s[t][0]), "+x"(s[t][1]));  /* as madd_acc: no regrouping */
        }
    }
}

/* igblock on bytes, for 4- and 5-bit codes and 8-bit activations (act_max 127): codes8
 * [cols / 4][TILE_NR][4] (four columns of a row in a 32-bit lane), xq8 the tokens' codes as
 * bytes. pmaddubsw multiplies a row's four codes by the token's four and adds pairs into
 * 16-bit lanes (at most 2 x 15 x 127 = 3,810 for 4-bit codes, 7,874 for 5-bit); eight of
 * those (a block) sum in 16 bits for 4-bit codes (at most 30,480), four for 5-bit ones
 * (`wide`: the first half is widened and kept aside), then pmaddwd by ones gives each
 * row's exact int32 sum: igblock's integers, so the same float steps give the same bits. */
INLINE void igblock8(const uint8_t *codes8, const float *dm, const int8_t *xq8, const float *ds8, const int mr,
                     const int wide, float *lanes, int64_t i, const int first) {
    __m256i s[TILE_MR][2];  /* 12 16-bit sums (then their 32-bit ones), two vectors of codes, a broadcast */
    __m256i half[TILE_MR][2];  /* wide: the first four quads' 32-bit sums */
    const __m256i ones = _mm256_set1_epi16(1);
    const uint8_t *c = codes8 + i * 32 * TILE_NR;
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        if (wide && k == 4)
            for (int t = 0; t < mr; t++) half[t][0] = _mm256_madd_epi16(s[t][0], ones), half[t][1] = _mm256_madd_epi16(s[t][1], ones);
        const __m256i w0 = _mm256_load_si256((const __m256i *)(c + 4 * TILE_NR * k));
        const __m256i w1 = _mm256_load_si256((const __m256i *)(c + 4 * TILE_NR * k + 32));
        madd8_tokens(s, w0, w1, xq8, i, k, mr, k == 0 || (wide && k == 4));
    }
    for (int t = 0; t < mr; t++) {
        s[t][0] = _mm256_madd_epi16(s[t][0], ones), s[t][1] = _mm256_madd_epi16(s[t][1], ones);
        if (wide) s[t][0] = _mm256_add_epi32(half[t][0], s[t][0]), s[t][1] = _mm256_add_epi32(half[t][1], s[t][1]);
    }
    const float *ds = ds8 + i * 2 * TILE_MR;
    into_lanes(dm, ds, ds + TILE_MR, 1, mr, lanes, i, first, s);
}

/* the panel's 16-bit codes tmp [TILE_NR][cols] (each < 32) as codes8 [cols / 4][TILE_NR][4]
 * (once a panel, for all its tokens) */
static void panel_bytes(const int16_t *tmp, int64_t cols, uint8_t *codes8) {
    for (int64_t q = 0; q < cols / 4; q++)
        for (int r = 0; r < TILE_NR; r++)
            for (int j = 0; j < 4; j++) codes8[4 * (q * TILE_NR + r) + j] = (uint8_t)tmp[r * cols + 4 * q + j];
}
#endif

/* out[t ostride ..][0..TILE_NR) = the panel's rows times token t's codes (xq + t cols, scales
 * xd + t nb and sums xs + t nb), t < mr <= TILE_MR: a scratch tile (ostride TILE_NR) or, for a
 * whole panel, the result's rows (ostride its row length). The float steps
 * are dot_split's (block i into lane i % 8, then lanes8), the lanes in scratch ([mr][8]
 * [TILE_NR] floats, 32-byte aligned). */
#ifdef USE_AVX2
/* out[t ostride ..] = lanes8 of token t's lanes, eight rows at once (lanes never touched:
 * zero); ostride TILE_NR for a tile's scratch, or the result's row length to store there */
INLINE void lanes_out(const float *lanes, int64_t nb, const int mr, float *out, int64_t ostride) {
    for (int t = 0; t < mr; t++)
        for (int h = 0; h < TILE_NR; h += 8) {
            const float *l = lanes + t * LANE_FLOATS + h;
            __m256 v[8];
            for (int k = 0; k < 8; k++) v[k] = k < nb ? _mm256_load_ps(l + k * TILE_NR) : _mm256_setzero_ps();
            const __m256 s0 = _mm256_add_ps(v[0], v[4]), s1 = _mm256_add_ps(v[1], v[5]), s2 = _mm256_add_ps(v[2], v[6]),
                         s3 = _mm256_add_ps(v[3], v[7]);
            _mm256_storeu_ps(out + t * ostride + h, _mm256_add_ps(_mm256_add_ps(s0, s2), _mm256_add_ps(s1, s3)));
        }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* With AVX512-VNNI the byte tiles take a block's 16 rows in one zmm: vpdpbusd multiplies
 * each row's four unsigned codes by the token's four signed ones and adds the four products
 * into the row's int32 lane in one instruction (pmaddubsw, an add and a closing pmaddwd on
 * AVX2). And each lane's float sums stay in registers, stored once (the AVX2 tiles load
 * and store a token's lane at every block; see tile8_512). The integer sums are the same,
 * each lane's float steps the same in the same order: the same bits as the AVX2 tiles and
 * the portable loop. */
#define BYTE_TILES_512 1

/* step k (four columns) of block i: a[t] (16 rows' int32 sums) += w (the rows' four codes
 * each) times token t's k-th quad of byte codes broadcast; the sums start at k == 0 */
INLINE void dpbusd_tokens(__m512i a[TILE_MR], __m512i w, const int8_t *xq8, int64_t i, int k, const int mr) {
    for (int t = 0; t < mr; t++) {
        int32_t quad;
        memcpy(&quad, xq8 + ((i * 8 + k) * TILE_MR + t) * 4, sizeof quad);
        a[t] = _mm512_dpbusd_epi32(k == 0 ? _mm512_setzero_si512() : a[t], w, _mm512_set1_epi32(quad));
    }
}

/* block i of a byte tile into y[t] (the block's lane of token t), lanes_from's float steps;
 * the arguments as tile8_512's */
INLINE void block8_512(const int type, const int64_t head, const int64_t pb, const uint8_t *w, const float *dm,
                       const int8_t *xq8, const float *ds8, const int mr, int64_t i, __m512 y[TILE_MR]) {
    const __m512i low4 = _mm512_set1_epi8(0xF), high = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    __m512i a[TILE_MR];
    __m512 d, m;
    if (head) {
        const uint8_t *blk = w + i * pb, *c = blk + head;
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {  /* rows 0-7 are the low nibbles, rows 8-15 the high ones */
            const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(c + 32 * k)));
            dpbusd_tokens(a, _mm512_and_si512(_mm512_srlv_epi64(v, high), low4), xq8, i, k, mr);
        }
        d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        m = type == T_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk + 1))
                           : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    } else {
        const uint8_t *c = w + i * 32 * TILE_NR;
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++)
            dpbusd_tokens(a, _mm512_load_si512((const void *)(c + 4 * TILE_NR * k)), xq8, i, k, mr);
        d = _mm512_load_ps(dm + i * 2 * TILE_NR), m = _mm512_load_ps(dm + i * 2 * TILE_NR + TILE_NR);
    }
    const float *ds = ds8 + i * 2 * TILE_MR;
    for (int t = 0; t < mr; t++) {
        const __m512 dx = _mm512_set1_ps(ds[t]), sx = _mm512_set1_ps(ds[TILE_MR + t]);
        y[t] = _mm512_fmadd_ps(m, sx, _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[t]), _mm512_mul_ps(d, dx), y[t]));
    }
}

/* A byte tile (mr tokens by 16 rows) into the tile's lanes, then lanes_out. head > 0: w is
 * a stored PANELS8 panel of Q4_0 or Q4_1 (type), block i at w + i pb, its header (fp16 d,
 * Q4_1's fp16 m) head bytes, then its codes; head == 0: w is codes8 and dm the panel's d
 * and m (split_panels). xq8 and ds8: the tile's group in xbuf's byte order. Up to two
 * tokens (decode rows) all 8 lanes stay in registers and the blocks go in order (the
 * weights stream past once, in memory order); more, lane by lane (lane j's blocks j, j + 8,
 * ...), each lane's sums in registers. Either way each lane's steps keep their order. */
INLINE void tile8_512(const int type, const int64_t head, const int64_t pb, const uint8_t *w, const float *dm,
                      int64_t nb, const int8_t *xq8, const float *ds8, const int mr, float *lanes, float *out,
                      int64_t ostride) {
    if (mr <= 2) {
        __m512 y[8][TILE_MR];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            for (int t = 0; t < mr; t++) y[j][t] = _mm512_setzero_ps();
        for (int64_t i0 = 0; i0 < nb; i0 += 8)
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++)
                if (i0 + j < nb) block8_512(type, head, pb, w, dm, xq8, ds8, mr, i0 + j, y[j]);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++)
            for (int t = 0; t < mr; t++) _mm512_store_ps(lanes + t * LANE_FLOATS + j * TILE_NR, y[j][t]);
    } else {
        for (int64_t j = 0; j < 8 && j < nb; j++) {
            __m512 y[TILE_MR];
            for (int t = 0; t < mr; t++) y[t] = _mm512_setzero_ps();
            for (int64_t i = j; i < nb; i += 8) block8_512(type, head, pb, w, dm, xq8, ds8, mr, i, y);
            for (int t = 0; t < mr; t++) _mm512_store_ps(lanes + t * LANE_FLOATS + j * TILE_NR, y[t]);
        }
    }
    lanes_out(lanes, nb, mr, out, ostride);
}
#endif

/* igtile_mr on byte panels (igblock8; wide: 5-bit codes); xq8 and ds8: the tile's group in
 * xbuf's byte order */
INLINE void igtile8_mr(const uint8_t *codes8, const float *dm, int64_t nb, const int8_t *xq8, const float *ds8,
                       const int mr, const int wide, float *lanes, float *out, int64_t ostride) {
#ifdef BYTE_TILES_512
    (void)wide;  /* vpdpbusd sums in 32 bits: 5-bit codes need nothing more */
    tile8_512(0, 0, 0, codes8, dm, nb, xq8, ds8, mr, lanes, out, ostride);
#else
    int64_t i = 0;
    for (; i < nb && i < 8; i++) igblock8(codes8, dm, xq8, ds8, mr, wide, lanes, i, 1);
    for (; i < nb; i++) igblock8(codes8, dm, xq8, ds8, mr, wide, lanes, i, 0);
    lanes_out(lanes, nb, mr, out, ostride);
#endif
}

INLINE void igtile8(const uint8_t *codes8, const float *dm, int64_t nb, const int8_t *xq8, const float *ds8, int mr,
                    const int wide, float *lanes, float *out, int64_t ostride) {
#define IGTILE8W(R) igtile8_mr(codes8, dm, nb, xq8, ds8, R, 1, lanes, out, ostride)
#define IGTILE8N(R) igtile8_mr(codes8, dm, nb, xq8, ds8, R, 0, lanes, out, ostride)
    if (wide)
        WITH_CONSTANT_ROWS(mr, IGTILE8W);
    else
        WITH_CONSTANT_ROWS(mr, IGTILE8N);
#undef IGTILE8W
#undef IGTILE8N
}
#endif

INLINE void igtile_mr(const int16_t *codes, const float *dm, int64_t nb, int64_t cols, const int16_t *xq,
                      const float *xd, const float *xs, const int mr, float *lanes, float *out, int64_t ostride) {
#ifdef USE_AVX2
    int64_t i = 0;
    for (; i < nb && i < 8; i++) igblock(codes, dm, nb, cols, xq, xd, xs, mr, lanes, i, 1);
    for (; i < nb; i++) igblock(codes, dm, nb, cols, xq, xd, xs, mr, lanes, i, 0);
    lanes_out(lanes, nb, mr, out, ostride);
#else
    (void)lanes;
    for (int t = 0; t < mr; t++)
        for (int r = 0; r < TILE_NR; r++) {
            float y[8] = {0};
            for (int64_t i = 0; i < nb; i++) {
                int32_t sum = 0;
                for (int j = 0; j < 32; j++)
                    sum += (int32_t)codes[(i * 16 + j / 2) * 2 * TILE_NR + 2 * r + j % 2] * xq[t * cols + 32 * i + j];
                const float *f = dm + i * 2 * TILE_NR;
                y[i & 7] = fmaf(f[TILE_NR + r], xs[t * nb + i], fmaf((float)sum, f[r] * xd[t * nb + i], y[i & 7]));
            }
            out[t * ostride + r] = lanes8(y);
        }
#endif
}

INLINE void igtile(const int16_t *codes, const float *dm, int64_t nb, int64_t cols, const int16_t *xq,
                   const float *xd, const float *xs, int mr, float *lanes, float *out, int64_t ostride) {
#define IGTILE(R) igtile_mr(codes, dm, nb, cols, xq, xd, xs, R, lanes, out, ostride)
    WITH_CONSTANT_ROWS(mr, IGTILE);
#undef IGTILE
}

/* y[n, rows] = W^T times the rounded activations xb for a 32-value type on integer panels,
 * called by every thread of a parallel region: each thread takes a contiguous range of
 * panels (ends with a barrier). The 4- and 5-bit types against 8-bit activations (act_max
 * 127) take byte panels (igblock8), the rest 16-bit pairs (igblock). The bits are dot_rows',
 * so a thread that cannot have its scratch computes its rows through dot_rows instead. */
static void split_panels(const qmat *m, int64_t n, float *y, const xbuf *xb) {
    const int64_t cols = m->cols, nb = cols / 32, rb = row_bytes(m->type, cols), rows = m->rows;
    const int64_t panels = (rows + TILE_NR - 1) / TILE_NR, nth = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t p0 = panels * me / nth, p1 = panels * (me + 1) / nth;
    int16_t *tmp = aligned_alloc(32, sizeof(int16_t) * TILE_NR * (size_t)cols);  /* cols: a multiple of 32 */
    int16_t *codes = aligned_alloc(32, sizeof(int16_t) * TILE_NR * (size_t)cols);
    float *dm = aligned_alloc(64, sizeof(float) * 2 * TILE_NR * (size_t)nb), *dtmp = malloc(sizeof(float) * 2 * (size_t)nb);
    float *out = aligned_alloc(32, sizeof(float) * TILE_NR * TILE_MR);
    float *lanes = aligned_alloc(64, sizeof(float) * LANE_FLOATS * TILE_MR);  /* 64: the zmm byte tiles */
#ifdef USE_AVX2  /* 4- and 5-bit codes and 8-bit activations: the byte panels (igblock8) */
    const int wide = m->type == T_Q5_0 || m->type == T_Q5_1;  /* 5-bit codes */
    const int bytes = m->act_max <= 127 && (wide || m->type == T_Q4_0 || m->type == T_Q4_1);
#else
    const int bytes = 0, wide = 0;
    (void)wide;
#endif
    uint8_t *codes8 = bytes ? aligned_alloc(64, TILE_NR * (size_t)cols) : NULL;
    if (!tmp || !codes || !dm || !dtmp || !out || !lanes || (bytes && !codes8)) {
        kernel_rows(m, n, y, xb, p0 * TILE_NR, p1 * TILE_NR < rows ? p1 * TILE_NR : rows);
    } else {
        for (int64_t c = p0; c < p1; c++) {
            const int64_t r0 = c * TILE_NR, nr = rows - r0 < TILE_NR ? rows - r0 : TILE_NR;
            ig_panel(m->type, m->w, rb, r0, nr, cols, tmp, dtmp, codes, dm);
#ifdef USE_AVX2
            if (bytes) panel_bytes(tmp, cols, codes8);
#endif
            for (int64_t t = 0; t < n; t += TILE_MR) {
                const int mr = n - t < TILE_MR ? (int)(n - t) : TILE_MR;
                int64_t ostride;
                float *to = tile_dest(y, rows, r0, nr, t, out, &ostride);
#ifdef USE_AVX2
                if (bytes)
                    igtile8(codes8, dm, nb, xb->q8 + t * cols, xb->ds8 + t * nb * 2, mr, wide, lanes, to, ostride);
                else
#endif
                    igtile(codes, dm, nb, cols, xb->q + t * cols, xb->d + t * nb, xb->s + t * nb, mr, lanes, to,
                           ostride);
                tile_tail(y, rows, r0, nr, t, mr, out);
            }
        }
    }
    free(tmp), free(codes), free(dm), free(dtmp), free(out), free(lanes), free(codes8);
#pragma omp barrier
}

/* ---- panels kept in memory: Q4_0, Q4_1 and Q8_0 ----
 *
 * split_panels rebuilds each panel (16-bit pairs, transposed) for every product: at a
 * decode batch of 8 tokens that costs as much as the products themselves. A matrix of these
 * types can instead be stored as its panels, once, at load (llama.cpp repacks Q4_0 for its
 * CPU kernels alike): the same bytes per row and block, so no more memory, laid out so that
 * a few shifts and masks in registers give the tile its codes. Per panel of TILE_NR rows (the
 * last one padded with zero rows) and block i of 32 columns:
 *   fp16 d[TILE_NR], then for Q4_1 fp16 m[TILE_NR]   (Q4_0: m = -8 d; Q8_0: m = 0, as split)
 *   Q4: 8 vectors of 16 uint16; vector v, lane L: four 4-bit codes, from the low bits up:
 *       w0(2v)[L], w1(2v)[L], w0(2v + 1)[L], w1(2v + 1)[L]
 *   Q8_0: 16 vectors; vector k, lane L: w0(k)[L] in the low byte, w1(k)[L] in the high one
 * where w0(k)[L] is the code of row L / 2, column 32 i + 2 k + L % 2, and w1(k)[L] the
 * same for row 8 + L / 2: igblock's two vectors of step k. Against 8-bit activations
 * (PANELS8) Q4_0 and Q4_1 hold igblock8's order instead: 8 vectors of 32 bytes; vector k,
 * byte b: the code of row b / 4, column 32 i + 4 k + b % 4 in the low nibble, of row
 * 8 + b / 4 in the high one (a mask and a shift give igblock8's two byte vectors). The tiles then take igblock's
 * integer sums and its float steps, so a token's outputs are the same bits as on the split
 * layout, alone or in any batch (decode rows run on the panels too). The type argument of
 * the entry points carries PANELS or PANELS8 for such a matrix. */
#if defined(USE_AVX2) && defined(__F16C__)
#define HAVE_PANELS 1
#endif

#ifdef HAVE_PANELS
/* kind: a type with PANELS or PANELS8 */
static int panel_type(int kind) {
    const int type = kind & ~STORED;
    if (kind & PANELS8) return type == T_Q4_0 || type == T_Q4_1;
    return type == T_Q4_0 || type == T_Q4_1 || type == T_Q8_0;
}
/* the header (d, and m for Q4_1) and the codes of a block of a panel: ggml's bytes for TILE_NR rows */
static int64_t panel_head(int type) { return (type == T_Q4_1 ? 4 : 2) * TILE_NR; }
static int64_t panel_block(int type) { return panel_head(type) + (type == T_Q8_0 ? 32 : 16) * TILE_NR; }

/* code j of a ggml block: the value its sums take (Q4: the nibble; Q8_0: the signed byte) */
static int block_code(int type, const uint8_t *blk, int j) {
    if (type == T_Q8_0) return (int8_t)blk[2 + j];
    const uint8_t b = blk[(type == T_Q4_1 ? 4 : 2) + j % 16];
    return j < 16 ? b & 0xF : b >> 4;
}

/* where code (row r of the panel, column j of block i) sits: the byte offset within the
 * block's codes and the bit shift (kind: the type with PANELS or PANELS8) */
static void code_at(int kind, int r, int j, int64_t *byte, int *shift) {
    const int type = kind & ~STORED, k = j / 2, lane = 2 * (r % 8) + j % 2, hi = r >= 8;
    if (kind & PANELS8) {
        *byte = 32 * (j / 4) + 4 * (r % 8) + j % 4, *shift = 4 * hi;
    } else if (type == T_Q8_0) {
        *byte = 32 * k + 2 * lane + hi, *shift = 0;
    } else {
        const int s = 4 * hi + 8 * (k % 2);
        *byte = 32 * (k / 2) + 2 * lane + s / 8, *shift = s % 8;
    }
}

#endif

/* Bytes of a rows x cols matrix stored as panels (kind: the type with PANELS or PANELS8);
 * -1 where it cannot be (another type, a width its blocks do not divide, or a build without
 * AVX2 and F16C). */
int64_t radixkv_panel_bytes(int kind, int64_t rows, int64_t cols) {
#ifdef HAVE_PANELS
    if (!(kind & STORED) || !panel_type(kind) || rows <= 0 || cols <= 0 || cols % 32) return -1;
    return (rows + TILE_NR - 1) / TILE_NR * (cols / 32) * panel_block(kind & ~STORED);
#else
    (void)kind, (void)rows, (void)cols;
    return -1;
#endif
}

#ifdef HAVE_PANELS
/* code j of row pr of a panel's block p (its header and codes): block_code's value */
static int panel_code(int kind, const uint8_t *p, int pr, int j) {
    const int type = kind & ~STORED;
    int64_t byte;
    int shift;
    code_at(kind, pr, j, &byte, &shift);
    const uint8_t b = p[panel_head(type) + byte];
    return type == T_Q8_0 ? (int8_t)b : (b >> shift) & 0xF;
}

/* row pr of a panel's block p (its header and codes) from ggml's block blk; p starts zeroed */
static void panel_put(int kind, const uint8_t *blk, int pr, uint8_t *p) {
    const int type = kind & ~STORED;
    uint16_t *h = (uint16_t *)p;
    h[pr] = (uint16_t)(blk[0] | blk[1] << 8);
    if (type == T_Q4_1) h[TILE_NR + pr] = (uint16_t)(blk[2] | blk[3] << 8);
    for (int j = 0; j < 32; j++) {
        int64_t byte;
        int shift;
        code_at(kind, pr, j, &byte, &shift);
        p[panel_head(type) + byte] |= (uint8_t)((block_code(type, blk, j) & (type == T_Q8_0 ? 0xFF : 0xF)) << shift);
    }
}

/* ggml's block blk of row pr of a panel's block p */
static void panel_get(int kind, const uint8_t *p, int pr, uint8_t *blk) {
    const int type = kind & ~STORED;
    const uint16_t *h = (const uint16_t *)p;
    blk[0] = (uint8_t)h[pr], blk[1] = (uint8_t)(h[pr] >> 8);
    if (type == T_Q4_1) blk[2] = (uint8_t)h[TILE_NR + pr], blk[3] = (uint8_t)(h[TILE_NR + pr] >> 8);
    uint8_t *qs = blk + (type == T_Q4_1 ? 4 : 2);
    if (type != T_Q8_0) memset(qs, 0, 16);
    for (int j = 0; j < 32; j++) {
        const int c = panel_code(kind, p, pr, j);
        if (type == T_Q8_0) qs[j] = (uint8_t)c;
        else qs[j % 16] |= (uint8_t)(j < 16 ? c : c << 4);
    }
}
#endif

/* ggml's rows x cols (row_bytes each) into panels (radixkv_panel_bytes bytes), or with
 * to_panels 0 panels back into ggml's rows; kind: the type with PANELS or PANELS8. Returns
 * 0; -1 where the matrix cannot be panels. */
int radixkv_panels(int kind, const uint8_t *src, int64_t rows, int64_t cols, uint8_t *dst, int to_panels) {
#ifdef HAVE_PANELS
    const int64_t size = radixkv_panel_bytes(kind, rows, cols);
    if (size < 0) return -1;
    const int type = kind & ~STORED;
    const int64_t nb = cols / 32, rb = row_bytes(type, cols), bb = block_bytes(type), pb = panel_block(type);
    if (to_panels) memset(dst, 0, (size_t)size);  /* the padding rows stay zero */
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < nb; i++) {
            const int64_t at = ((r / TILE_NR) * nb + i) * pb, g = r * rb + i * bb;  /* the block in each layout */
            if (to_panels)
                panel_put(kind, src + g, (int)(r % TILE_NR), dst + at);
            else
                panel_get(kind, src + at, (int)(r % TILE_NR), dst + g);
        }
    return 0;
#else
    (void)kind, (void)src, (void)rows, (void)cols, (void)dst, (void)to_panels;
    return -1;
#endif
}

#ifdef HAVE_PANELS
/* row r of a panel matrix as floats: dequant_row's steps on the same codes, d and m */
static void panel_row(int kind, const uint8_t *w, int64_t r, int64_t cols, float *y) {
    const int type = kind & ~STORED;
    const int64_t nb = cols / 32, pb = panel_block(type);
    const int pr = (int)(r % TILE_NR);
    for (int64_t i = 0; i < nb; i++, y += 32) {
        const uint8_t *p = w + ((r / TILE_NR) * nb + i) * pb;
        int16_t u[32];
        for (int j = 0; j < 32; j++) u[j] = (int16_t)panel_code(kind, p, pr, j);
        const uint16_t *h = (const uint16_t *)p;
        const float d = _cvtsh_ss(h[pr]), m = type == T_Q4_1 ? _cvtsh_ss(h[TILE_NR + pr]) : type == T_Q4_0 ? -8.0f * d : 0.0f;
        const __m256i c[2] = {_mm256_loadu_si256((const __m256i *)u), _mm256_loadu_si256((const __m256i *)(u + 16))};
        dequant_codes(c, d, m, y);
    }
}

/* lanes_from with the d and m of a stored panel's block (its header: fp16 d, Q4_1's fp16 m) */
INLINE void head_into_lanes(const int type, const uint8_t *blk, const float *xd, const float *xs, const int64_t ts,
                            const int mr, float *lanes, int64_t i, const int first, __m256i a[TILE_MR][2]) {
    const __m128i *h = (const __m128i *)blk;
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128(h)), d1 = _mm256_cvtph_ps(_mm_loadu_si128(h + 1));
    __m256 m0 = _mm256_setzero_ps(), m1 = m0;  /* Q8_0 */
    if (type == T_Q4_1) m0 = _mm256_cvtph_ps(_mm_loadu_si128(h + 2)), m1 = _mm256_cvtph_ps(_mm_loadu_si128(h + 3));
    if (type == T_Q4_0) m0 = _mm256_mul_ps(d0, _mm256_set1_ps(-8.0f)), m1 = _mm256_mul_ps(d1, _mm256_set1_ps(-8.0f));
    lanes_from(d0, d1, m0, m1, xd, xs, ts, mr, lanes, i, first, a);
}

/* igblock on a stored panel: blk is block i's part of the panel (its header, then codes) */
INLINE void pblock(const int type, const uint8_t *blk, int64_t nb, int64_t cols, const int16_t *xq, const float *xd,
                   const float *xs, const int mr, float *lanes, int64_t i, const int first) {
    __m256i a[TILE_MR][2];
    for (int t = 0; t < mr; t++) a[t][0] = a[t][1] = _mm256_setzero_si256();
    const uint8_t *c = blk + panel_head(type);
    const __m256i low4 = _mm256_set1_epi16(0xF);
    __m256i v = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) {
        __m256i w0, w1;
        if (type == T_Q8_0) {
            v = _mm256_loadu_si256((const __m256i *)(c + 32 * k));
            w0 = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8), w1 = _mm256_srai_epi16(v, 8);
        } else if (k % 2 == 0) {
            v = _mm256_loadu_si256((const __m256i *)(c + 16 * k));
            w0 = _mm256_and_si256(v, low4), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        } else {
            w0 = _mm256_and_si256(_mm256_srli_epi16(v, 8), low4), w1 = _mm256_srli_epi16(v, 12);
        }
        madd_tokens(a, w0, w1, xq, cols, i, k, mr);
    }
    head_into_lanes(type, blk, xd + i, xs + i, nb, mr, lanes, i, first, a);
}

/* igblock8 on a stored PANELS8 panel (Q4_0, Q4_1): the same byte products and exact sums
 * (xq8 and ds8: the tile's group in xbuf's byte order) */
INLINE void pblock8(const int type, const uint8_t *blk, const int8_t *xq8, const float *ds8, const int mr,
                    float *lanes, int64_t i, const int first) {
    __m256i s[TILE_MR][2];
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0xF);
    const uint8_t *c = blk + panel_head(type);
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(c + 32 * k));
        const __m256i w0 = _mm256_and_si256(v, low4), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        madd8_tokens(s, w0, w1, xq8, i, k, mr, k == 0);
    }
    for (int t = 0; t < mr; t++) s[t][0] = _mm256_madd_epi16(s[t][0], ones), s[t][1] = _mm256_madd_epi16(s[t][1], ones);
    const float *ds = ds8 + i * 2 * TILE_MR;
    head_into_lanes(type, blk, ds, ds + TILE_MR, 1, mr, lanes, i, first, s);
}

/* bytes: a PANELS8 panel against the activations' byte codes (xq8, scales ds8: the tile's
 * group in xbuf's byte order), else the 16-bit ones (xq, xd, xs); token t's TILE_NR results
 * at out + t ostride */
INLINE void ptile_mr(const int type, const int bytes, const uint8_t *panel, int64_t nb, int64_t cols,
                     const int16_t *xq, const int8_t *xq8, const float *xd, const float *xs, const float *ds8,
                     const int mr, float *lanes, float *out, int64_t ostride) {
    const int64_t pb = panel_block(type);
#ifdef BYTE_TILES_512
    if (bytes) {
        tile8_512(type, panel_head(type), pb, panel, NULL, nb, xq8, ds8, mr, lanes, out, ostride);
        return;
    }
#endif
#define PBLOCK(FIRST)                                                              \
    do {                                                                           \
        if (bytes)                                                                 \
            pblock8(type, panel + i * pb, xq8, ds8, mr, lanes, i, FIRST);          \
        else                                                                       \
            pblock(type, panel + i * pb, nb, cols, xq, xd, xs, mr, lanes, i, FIRST); \
    } while (0)
    int64_t i = 0;
    for (; i < nb && i < 8; i++) PBLOCK(1);  /* a lane's first block: it starts from zero */
    for (; i < nb; i++) PBLOCK(0);
#undef PBLOCK
    lanes_out(lanes, nb, mr, out, ostride);
}

static void ptile(int kind, const uint8_t *panel, int64_t nb, int64_t cols, const int16_t *xq, const int8_t *xq8,
                  const float *xd, const float *xs, const float *ds8, int mr, float *lanes, float *out,
                  int64_t ostride) {
#define PTILE(T, B, R) ptile_mr(T, B, panel, nb, cols, xq, xq8, xd, xs, ds8, R, lanes, out, ostride)
#define PTILE_Q40(R) PTILE(T_Q4_0, 0, R)
#define PTILE_Q41(R) PTILE(T_Q4_1, 0, R)
#define PTILE_Q80(R) PTILE(T_Q8_0, 0, R)
#define PTILE8_Q40(R) PTILE(T_Q4_0, 1, R)
#define PTILE8_Q41(R) PTILE(T_Q4_1, 1, R)
    switch (kind) {
    case T_Q8_0 | PANELS: WITH_CONSTANT_ROWS(mr, PTILE_Q80); break;
    case T_Q4_1 | PANELS: WITH_CONSTANT_ROWS(mr, PTILE_Q41); break;
    case T_Q4_0 | PANELS: WITH_CONSTANT_ROWS(mr, PTILE_Q40); break;
    case T_Q4_1 | PANELS8: WITH_CONSTANT_ROWS(mr, PTILE8_Q41); break;
    default: WITH_CONSTANT_ROWS(mr, PTILE8_Q40); break;
    }
#undef PTILE
#undef PTILE_Q40
#undef PTILE_Q41
#undef PTILE_Q80
#undef PTILE8_Q40
#undef PTILE8_Q41
}

/* panel c of y[n, rows] = W^T times the rounded activations xb for tokens [t0, t1) (W stored
 * as panels; the results where tile_dest puts them) */
INLINE void stored_panel(const qmat *m, int64_t t0, int64_t t1, float *y, const xbuf *xb, int64_t c, float *lanes,
                         float *out) {
    const int type = m->type & ~STORED;
    const int64_t cols = m->cols, nb = cols / 32, rows = m->rows, stride = nb * panel_block(type);
    const int64_t r0 = c * TILE_NR, nr = rows - r0 < TILE_NR ? rows - r0 : TILE_NR;
    const int bytes = xb->q8 != NULL;  /* each tile starts a group of xbuf's byte order: t0 is a multiple of TILE_MR */
    for (int64_t t = t0; t < t1; t += TILE_MR) {
        const int mr = t1 - t < TILE_MR ? (int)(t1 - t) : TILE_MR;
        int64_t ostride;
        float *to = tile_dest(y, rows, r0, nr, t, out, &ostride);
        ptile(m->type, m->w + c * stride, nb, cols, xb->q + t * cols, bytes ? xb->q8 + t * cols : NULL, xb->d + t * nb,
              xb->s + t * nb, bytes ? xb->ds8 + t * nb * 2 : NULL, mr, lanes, to, ostride);
        tile_tail(y, rows, r0, nr, t, mr, out);
    }
}

/* From this many tokens on a panel is a long job (tens of microseconds), and threads claim
 * panels one at a time as they come free */
#define CLAIM_FROM (8 * TILE_MR)
/* and then take the tokens TOKEN_SPAN at a time, every panel of a span before the next span:
 * the span's rounded activations (110 KiB at 576 columns) stay in each core's L2 while the
 * panels stream past, where a panel's sweep of a 2,048-token step (2.4 MB) would come from
 * L3 once per 16 rows */
#define TOKEN_SPAN (16 * TILE_MR)
#else
static void panel_row(int kind, const uint8_t *w, int64_t r, int64_t cols, float *y) {
    (void)kind, (void)w, (void)r, (void)cols, (void)y;  /* never called: radixkv_panel_bytes refuses every matrix */
}
#endif

/* y[n, rows] = W^T times the rounded activations xb, W stored as panels (m->type carries
 * PANELS, or PANELS8 with act_max 127), any n: called by every thread of a parallel region
 * (ends with a barrier). Few tokens (decode steps): each thread takes a fixed contiguous
 * range of panels (the same panels step after step). Many (prefill, extends): the threads
 * claim a panel's tiles of one TOKEN_SPAN at a time as they come free, since in a server
 * the OS gives a core to its other threads (HTTP, tokenizer, clients) now and then, and a
 * thread it interrupts then leaves its panels to the others instead of holding all of
 * them up at the barrier. */
static void stored_panels(const qmat *m, int64_t n, float *y, const xbuf *xb) {
#ifdef HAVE_PANELS
    const int64_t panels = (m->rows + TILE_NR - 1) / TILE_NR, nth = omp_get_num_threads(), me = omp_get_thread_num();
    float out[TILE_NR * TILE_MR] __attribute__((aligned(32)));
    float lanes[LANE_FLOATS * TILE_MR] __attribute__((aligned(64)));
    if (n >= CLAIM_FROM) {
        const int64_t spans = (n + TOKEN_SPAN - 1) / TOKEN_SPAN;
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t u = 0; u < spans * panels; u++) {
            const int64_t t0 = u / panels * TOKEN_SPAN, t1 = t0 + TOKEN_SPAN < n ? t0 + TOKEN_SPAN : n;
            stored_panel(m, t0, t1, y, xb, u % panels, lanes, out);
        }
    } else {
        for (int64_t c = panels * me / nth; c < panels * (me + 1) / nth; c++) stored_panel(m, 0, n, y, xb, c, lanes, out);
    }
#else
    (void)m, (void)n, (void)y, (void)xb;
#endif
#pragma omp barrier
}

/* ---- the dense products ----
 *
 * y[n, rows] = x[n, cols] . W^T for many tokens (prefill and extend rows), W in the kernels'
 * layout, x float32, rounded here as radixkv_qmatmul rounds it (act_max): the 32-value types on the
 * integer panels (split_panels: radixkv_qmatmul's bits), the K-quants on float32 panels of
 * the rounded activations (threads take contiguous ranges of panels). Returns 0; -1 for an
 * unknown type or a row length its blocks do not divide; -2 when a buffer cannot be
 * allocated. */
int radixkv_qgemm(int type, const uint8_t *w, int64_t rows, int64_t cols, const float *x, int64_t n, float *y,
                  int act_max, int threads) {
    if (type & STORED) return radixkv_qmatmul(type, w, rows, cols, x, n, y, act_max, threads);  /* any n: the tiles */
    const int64_t rb = row_bytes(type, cols);
    if (rb < 0) return -1;
    const qmat m = {type, act_max, rows, cols, w};
    const int64_t nb = cols / 32, panels = (rows + TILE_NR - 1) / TILE_NR;
    xbuf xb;
    if (xbuf_alloc(&xb, n, nb, act_max <= 127)) return -2;
    if (is_split(type)) {
#pragma omp parallel num_threads(threads)
        {
            quantize_rows(x, n, cols, act_max, &xb);
            split_panels(&m, n, y, &xb);
        }
        xbuf_free(&xb);
        return 0;
    }
    float *xr = malloc(sizeof(float) * (size_t)(n * cols)); /* the float panels' activations */
    if (xr == NULL) {
        xbuf_free(&xb);
        return -2;
    }
    int err = 0;
#pragma omp parallel num_threads(threads)
    {
        quantize_rows(x, n, cols, act_max, &xb);
#pragma omp for schedule(static)
        for (int64_t k = 0; k < n * cols; k++) xr[k] = xb.d[k / 32] * (float)xb.q[k];
        float *tmp = aligned_alloc(32, sizeof(float) * TILE_NR * (size_t)cols);  /* cols: a multiple of 32 */
        float *panel = aligned_alloc(32, sizeof(float) * TILE_NR * (size_t)cols);
        float *out = aligned_alloc(32, sizeof(float) * TILE_NR * TILE_MR);
        if (!tmp || !panel || !out) {
#pragma omp atomic write
            err = -2;
        } else {
            const int64_t nth = omp_get_num_threads(), me = omp_get_thread_num();
            for (int64_t c = panels * me / nth; c < panels * (me + 1) / nth; c++) {
                const int64_t r0 = c * TILE_NR, nr = rows - r0 < TILE_NR ? rows - r0 : TILE_NR;
                qg_panel(type, w, rb, r0, nr, cols, tmp, panel);
                for (int64_t t = 0; t < n; t += TILE_MR) {
                    const int mr = n - t < TILE_MR ? (int)(n - t) : TILE_MR;
                    int64_t ostride;
                    float *to = tile_dest(y, rows, r0, nr, t, out, &ostride);
                    tile(panel, cols, xr + t * cols, mr, to, ostride);
                    tile_tail(y, rows, r0, nr, t, mr, out);
                }
            }
        }
        free(tmp), free(panel), free(out);
    }
    free(xr);
    xbuf_free(&xb);
    return err;
}

/* ---- the steps between the products, for native models ----
 *
 * A decode step of a small model spends as long in its elementwise steps (norms, rotary
 * embedding, SwiGLU, residual adds) as in its products when each is a few torch calls;
 * these do each in one call, and radixkv_native_layer does a layer's whole stretch between
 * two attentions in one. Each row's arithmetic is one (noinline) function, the same code
 * whichever call runs it and whatever n. */

/* sum of x[j]^2 over j < d in double (each square exact): eight partial sums, x[j] into
 * sum j % 8, added as lanes8 adds (vectors where the CPU has them, the same order either way) */
static double sum_squares(const float *x, int64_t d) {
    double p[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    int64_t j = 0;
#ifdef USE_AVX2
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    for (; j + 8 <= d; j += 8) {
        const __m256d x0 = _mm256_cvtps_pd(_mm_loadu_ps(x + j)), x1 = _mm256_cvtps_pd(_mm_loadu_ps(x + j + 4));
        a0 = _mm256_add_pd(a0, _mm256_mul_pd(x0, x0)), a1 = _mm256_add_pd(a1, _mm256_mul_pd(x1, x1));
    }
    _mm256_storeu_pd(p, a0), _mm256_storeu_pd(p + 4, a1);
#endif
    for (; j < d; j++) p[j & 7] += (double)x[j] * x[j];
    return ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]));
}

/* With add: x += add first (the residual). Then out = w * x / sqrt(mean(x^2) + eps). */
static __attribute__((noinline)) void add_rms_norm_row(float *xr, const float *add, const float *w, float eps,
                                                       int64_t d, float *o) {
    if (add)
        for (int64_t j = 0; j < d; j++) xr[j] += add[j];
    const double ss = sum_squares(xr, d);
    float inv = 1.0f / sqrtf((float)(ss / (double)d) + eps);
    for (int64_t j = 0; j < d; j++) o[j] = w[j] * (xr[j] * inv);
}

/* silu(g) u = g sigmoid(g) u, the sigmoid from t = e^-|g| (never overflows): 1 / (1 + t)
 * for g >= 0, t / (1 + t) below. */
static __attribute__((noinline)) void silu_mul_row(const float *g, int64_t inter, float *o) {
    const float *u = g + inter;
    int64_t j = 0;
#ifdef USE_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (; j + 8 <= inter; j += 8) {
        __m256 gv = _mm256_loadu_ps(g + j), t = exp8_nonpositive(_mm256_or_ps(gv, sign));  /* e^-|g| */
        __m256 num = _mm256_blendv_ps(one, t, gv);  /* t where g's sign bit is set */
        _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_div_ps(_mm256_mul_ps(gv, num), _mm256_add_ps(one, t)),
                                              _mm256_loadu_ps(u + j)));
    }
#endif
    for (; j < inter; j++) {
        float t = exp_nonpositive(-fabsf(g[j]));
        o[j] = g[j] * (g[j] < 0.0f ? t : 1.0f) / (1.0f + t) * u[j];
    }
}

/* RoPE on the first rot dims of each of `heads` heads of d (half-split within them: dim j
 * pairs with j + rot / 2), c and s [rot]; rot < d: partial rotary (Phi-3), the rest kept. */
static __attribute__((noinline)) void rope_row(float *x, int64_t heads, int64_t d, int64_t rot, const float *c,
                                               const float *s) {
    int64_t half = rot / 2;
    for (int64_t h = 0; h < heads; h++) {
        float *x1 = x + h * d, *x2 = x1 + half;
        for (int64_t j = 0; j < half; j++) {
            float a = x1[j], b = x2[j];
            x1[j] = a * c[j] - b * s[j];
            x2[j] = b * c[j + half] + a * s[j + half];
        }
    }
}

/* q/k norms (Qwen3): each of the first hq heads normed with qn, each of the next hkv with
 * kn, in place: the RMSNorm of add_rms_norm_row per head of d values. */
static void qk_norm_row(float *x, int64_t hq, int64_t hkv, int64_t d, const float *qn, const float *kn, float eps) {
    for (int64_t h = 0; h < hq + hkv; h++) add_rms_norm_row(x + h * d, NULL, h < hq ? qn : kn, eps, d, x + h * d);
}

/* With add: x += add first (the residual). Then out = w * x / sqrt(mean(x^2) + eps), per row. */
void radixkv_add_rms_norm(float *x, const float *add, const float *w, float eps, int64_t n, int64_t d, float *out,
                          int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n > 1)
    for (int64_t r = 0; r < n; r++) add_rms_norm_row(x + r * d, add ? add + r * d : NULL, w, eps, d, out + r * d);
}

/* out[n, inter] = silu(gate) * up, gate_up [n, 2 * inter] (gate first). */
void radixkv_silu_mul(const float *gu, int64_t n, int64_t inter, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (n > 1)
    for (int64_t r = 0; r < n; r++) silu_mul_row(gu + r * 2 * inter, inter, out + r * inter);
}

/* q/k norms in place on the first hq + hkv heads of each of n rows (row_stride floats apart). */
void radixkv_qk_norm(float *x, int64_t n, int64_t row_stride, int64_t hq, int64_t hkv, int64_t d, const float *qn,
                     const float *kn, float eps, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < n; r++) qk_norm_row(x + r * row_stride, hq, hkv, d, qn, kn, eps);
}

/* Rotary embedding in place on the first rot dims of the first `heads` heads of each row
 * (q and k, half-split layout): x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin; cos/sin
 * [n, rot] (token r's row). */
void radixkv_rope(float *x, int64_t n, int64_t row_stride, int64_t heads, int64_t d, int64_t rot, const float *cos,
                  const float *sin) {
    for (int64_t r = 0; r < n; r++) rope_row(x + r * row_stride, heads, d, rot, cos + r * rot, sin + r * rot);
}

/* The floats of radixkv_native_layer's buffers for n rows (an MLP of inter, 0 for the
 * first layer's call): what a caller's scratch needs for the call to use it. */
int64_t radixkv_native_layer_floats(int64_t n, int64_t hidden, int64_t inter) { return n * (2 * hidden + 3 * inter); }

/* row r's RMSNorm (with add: the residual added into x first) into h, rounded at once for
 * the product m that takes it next (a stretch's norm rows) */
static void norm_row_for(const qmat *m, float *x, const float *add, const float *w, float eps, int64_t hidden,
                         int64_t r, float *h, const xbuf *xb) {
    add_rms_norm_row(x + r * hidden, add ? add + r * hidden : NULL, w, eps, hidden, h + r * hidden);
    quantize_row(h + r * hidden, r, hidden, m->act_max, xb);
}

/* A native layer's stretch between two attentions, for n tokens, in one parallel region:
 * with attn (layer i's attention output [n, o->cols]): x += o(attn); h = norm(x) * mlp_norm;
 * x += down(silu(gate) * up of gate_up(h)); then with next_norm (layer i + 1's attention
 * norm): h = norm(x) * next_norm and qkv_out = qkv(h) (+ qkv_bias), with q_norm the q/k
 * norms on its hq query and hkv key heads, RoPE on the first rot dims of those heads
 * (cos/sin [n, rot]). Without attn (before layer 0) only the second part. The same steps
 * as the separate calls (radixkv_qmatmul, radixkv_add_rms_norm, radixkv_silu_mul,
 * radixkv_qk_norm, radixkv_rope, a residual add), so the same bits. Returns 0, or -2 when
 * scratch cannot be allocated. */
int radixkv_native_layer(float *x, int64_t n, int64_t hidden, float eps, const float *attn, const qmat *o,
                         const float *mlp_norm, const qmat *gate_up, const qmat *down, const float *next_norm,
                         const qmat *qkv, const float *qkv_bias, const float *q_norm, const float *k_norm,
                         int64_t hq, int64_t hkv, int64_t head_dim, int64_t rot, const float *cos,
                         const float *sin, float *qkv_out, float *scratch, int64_t scratch_floats, int threads) {
    int64_t inter = gate_up ? gate_up->rows / 2 : 0, widest = hidden;
    if (attn && o->cols > widest) widest = o->cols;
    if (inter > widest) widest = inter;
    const int64_t floats = radixkv_native_layer_floats(n, hidden, inter);
    /* the caller's scratch where it is large enough: a prefill's buffers (tens of MB) would
     * otherwise be fresh mappings, every page faulted in again at every call */
    const int fits = scratch && scratch_floats >= floats;
    float *own = fits ? NULL : malloc(sizeof(float) * (size_t)floats), *h = fits ? scratch : own;
    float *tmp = h ? h + n * hidden : NULL, *gu = h ? tmp + n * hidden : NULL, *a = h ? gu + 2 * n * inter : NULL;
    const qmat *some = attn ? o : qkv;  /* the layer's matrices share their act_max (one model, one precision) */
    xbuf xb;
    if (!h || xbuf_alloc(&xb, n, widest / 32, some && some->act_max <= 127)) {
        free(own);
        return -2;
    }
#pragma omp parallel num_threads(threads)
    {
        /* each row's norm or SwiGLU is rounded for the next product as soon as it is
         * computed, in the same loop (one pass and one barrier fewer per product) */
        if (attn) {
            product(o, attn, n, tmp, &xb);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < n; r++) norm_row_for(gate_up, x, tmp, mlp_norm, eps, hidden, r, h, &xb);
            rounded_product(gate_up, n, gu, &xb);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < n; r++) {
                silu_mul_row(gu + r * 2 * inter, inter, a + r * inter);
                quantize_row(a + r * inter, r, inter, down->act_max, &xb);
            }
            rounded_product(down, n, tmp, &xb);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < n; r++) {
                if (next_norm)
                    norm_row_for(qkv, x, tmp, next_norm, eps, hidden, r, h, &xb);
                else
                    for (int64_t j = 0; j < hidden; j++) x[r * hidden + j] += tmp[r * hidden + j];
            }
        } else {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < n; r++) norm_row_for(qkv, x, NULL, next_norm, eps, hidden, r, h, &xb);
        }
        if (next_norm) {
            rounded_product(qkv, n, qkv_out, &xb);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < n; r++) {
                float *row = qkv_out + r * qkv->rows;
                if (qkv_bias)
                    for (int64_t j = 0; j < qkv->rows; j++) row[j] += qkv_bias[j];
                if (q_norm) qk_norm_row(row, hq, hkv, head_dim, q_norm, k_norm, eps);
                rope_row(row, hq + hkv, head_dim, rot, cos + r * rot, sin + r * rot);
            }
        }
    }
    free(own);
    xbuf_free(&xb);
    return 0;
}

/* ---- a step's layers in one call ----
 *
 * For a native model's batch over a float32, bfloat16 or half KV pool where every
 * sequence goes to a CPU attention kernel (decode rows to cpu_decode.c's
 * radixkv_paged_decode, prefills and extends to radixkv_paged_extend, passed in as function
 * pointers with the arguments CpuBackend.plan prepared, so the same kernels with the same
 * arguments): every layer in turn, its new K/V rows written into the pool (what the pool's
 * store does: copied, or rounded to bfloat16 or half as torch rounds), its attention, and
 * radixkv_native_layer between attentions. Where only each sequence's last row is read,
 * the last layer attends those rows alone (each kernel gives a row the same bits whatever
 * else it computes) and the stretch after it runs on them. The same computation, bit for
 * bit, as the layer loop in Python, without its per-layer calls and the waits of the
 * threads between them. */

typedef int (*attend_fn)(const float *, const void *, const void *, const void *, const void *, const float *,
                         const float *, const float *, const float *, const float *, const float *, const int64_t *,
                         const int64_t *, const int32_t *, const int32_t *, const int32_t *, float *, float *,
                         const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t, float, int64_t);
typedef int (*extend_fn)(const float *, const void *, const void *, const int64_t *, const int32_t *, const int32_t *,
                         const int32_t *, const int32_t *, float *, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                         int64_t, int64_t);

typedef struct {  /* one layer, as weights.py describes it */
    qmat qkv, o, gate_up, down;
    const float *attn_norm, *mlp_norm, *qkv_bias;
    const float *q_norm, *k_norm;  /* NULL: no q/k norms */
    void *k_cache, *v_cache;   /* the layer's pages: [pages * page_size, hkv, d] of the attention's kv_format */
    int64_t window;            /* sliding window in tokens, 0: none */
} qlayer;

typedef struct {  /* the attention kernels and this step's arguments to them (CpuBackend) */
    attend_fn decode;          /* decode rows: query rows rows[i] of the step, i < n_decode */
    const int64_t *rows;
    const int32_t *kv_starts, *seq_lens;
    int64_t n_decode;
    extend_fn extend;          /* prefills and extends: ext_n[i] query rows from ext_q[i], i < n_extend */
    const int64_t *ext_q;
    const int32_t *ext_n, *ext_starts, *ext_lens;
    int64_t n_extend;
    const int32_t *kv_indices; /* both kernels' page table */
    int64_t page_size;
    float scale, softcap;
    int64_t kv_format;         /* cpu_decode.c's: 0 float32 pages, 3 bfloat16, 4 half */
    const int64_t *last;       /* NULL: every row is read; else last[j], sequence j's last row, alone past the last layer */
    const int64_t *dec_seq, *ext_seq;  /* there: each decode row's and each extend's sequence (its row among last) */
    const int32_t *ones;       /* n_extend ones: an extend's one row there */
} attention;

/* x rounded to bfloat16 as torch rounds (to nearest, ties to even; NaN stays a quiet NaN) */
static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if (x != x) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

/* x rounded to an IEEE half as torch rounds (to nearest, ties to even; overflow to
 * infinity, underflow through the subnormals) */
static inline uint16_t to_fp16(float x) {
#if defined(__F16C__) && defined(USE_AVX2)
    return (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint32_t sign = (bits >> 16) & 0x8000u, ax = bits & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);      /* NaN */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);     /* rounds past 65504: infinity */
    if (ax < 0x38800000u) {                                        /* below 2^-14: a subnormal or zero */
        const float f = fabsf(x) * 16777216.0f;                    /* in units of 2^-24, exact */
        return (uint16_t)(sign | (uint32_t)nearbyintf(f));         /* the default mode: ties to even */
    }
    const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);           /* ties to even on the 13 dropped bits */
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
#endif
}

/* n values into a page row: copied (float32) or rounded (bfloat16, half) */
static void store_row(void *cache, int64_t at, const float *src, int64_t n, int64_t kv_format) {
    if (kv_format == 0) {
        memcpy((float *)cache + at, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + at;
    for (int64_t e = 0; e < n; e++) dst[e] = kv_format == 4 ? to_fp16(src[e]) : to_bf16(src[e]);
}

/* a layer's attention for the step's n query rows q (or, with att->last, for the n_last
 * rows q holds, sequence j's last row at j) into out */
static int attend(const attention *att, const qlayer *l, const float *q, float *out, int last, int64_t hq,
                  int64_t hkv, int64_t d) {
    int status = 0;
    if (att->n_extend)
        status = att->extend(q, l->k_cache, l->v_cache, last ? att->ext_seq : att->ext_q,
                             last ? att->ones : att->ext_n, att->ext_starts, att->kv_indices, att->ext_lens, out,
                             att->n_extend, hq, hkv, d, att->page_size, att->scale, l->window, att->kv_format);
    if (status == 0 && att->n_decode)
        status = att->decode(q, l->k_cache, l->v_cache, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                             last ? att->dec_seq : att->rows, att->kv_starts, att->kv_indices, att->seq_lens, out,
                             NULL, NULL, att->n_decode, hq, hkv, d, att->page_size, att->scale, l->window,
                             att->softcap, att->kv_format);
    return status;
}

/* floats of radixkv_native_forward's scratch for n rows (inter: the MLP's width, width:
 * the q/k/v rows, q_width: the query heads' floats) */
int64_t radixkv_native_forward_floats(int64_t n, int64_t hidden, int64_t inter, int64_t width, int64_t q_width) {
    return n * (width + 2 * q_width) + radixkv_native_layer_floats(n, hidden, inter);
}

/* x [n, hidden]: the embedded new tokens, updated in place to the last layer's residual
 * (with att->last: of the n_last rows read, in x's first rows); slots[r]: token r's pool
 * row; scratch: the caller's buffer of scratch_floats, used where it holds
 * radixkv_native_forward_floats (a prefill's tens of MB, allocated at every layer, would
 * be fresh mappings faulted in again every time). Returns 0; -2 when scratch cannot be
 * allocated; an attention kernel's own status otherwise. */
int radixkv_native_forward(float *x, int64_t n, int64_t hidden, float eps, const qlayer *layers, int64_t nlayers,
                           int64_t hq, int64_t hkv, int64_t d, int64_t rot, const float *cos, const float *sin,
                           const int64_t *slots, const attention *att, int64_t n_last, float *scratch,
                           int64_t scratch_floats, int threads) {
    const int64_t width = layers[0].qkv.rows, kv = hkv * d, qw = hq * d;
    const int64_t need = radixkv_native_forward_floats(n, hidden, layers[0].gate_up.rows / 2, width, qw);
    float *own = scratch && scratch_floats >= need ? NULL : malloc(sizeof(float) * (size_t)need);
    float *qkv = own ? own : scratch;
    if (!qkv) return -2;
    float *q = qkv + n * width, *out = q + n * qw, *rest = out + n * qw;
    const int64_t rest_floats = need - n * (width + 2 * qw);
    int status = radixkv_native_layer(x, n, hidden, eps, NULL, NULL, NULL, NULL, NULL, layers[0].attn_norm,
                                      &layers[0].qkv, layers[0].qkv_bias, layers[0].q_norm, layers[0].k_norm, hq,
                                      hkv, d, rot, cos, sin, qkv, rest, rest_floats, threads);
    for (int64_t i = 0; i < nlayers && status == 0; i++) {
        const qlayer *l = &layers[i], *next = i + 1 < nlayers ? &layers[i + 1] : NULL;
        const int last = att->last && !next;  /* past here only the rows read */
#pragma omp parallel for num_threads(threads) schedule(static) if (n >= 64)
        for (int64_t r = 0; r < n; r++) {
            const float *row = qkv + r * width;
            store_row(l->k_cache, slots[r] * kv, row + qw, kv, att->kv_format);
            store_row(l->v_cache, slots[r] * kv, row + qw + kv, kv, att->kv_format);
        }
        const int64_t m = last ? n_last : n;
        for (int64_t r = 0; r < m; r++) {
            const int64_t from = last ? att->last[r] : r;
            memcpy(q + r * qw, qkv + from * width, sizeof(float) * (size_t)qw);
            if (last && from != r) memcpy(x + r * hidden, x + from * hidden, sizeof(float) * (size_t)hidden);
        }
        status = attend(att, l, q, out, last, hq, hkv, d);
        if (status == 0)
            status = radixkv_native_layer(x, m, hidden, eps, out, &l->o, l->mlp_norm, &l->gate_up, &l->down,
                                          next ? next->attn_norm : NULL, next ? &next->qkv : NULL,
                                          next ? next->qkv_bias : NULL, next ? next->q_norm : NULL,
                                          next ? next->k_norm : NULL, hq, hkv, d, rot, cos, sin, qkv, rest,
                                          rest_floats, threads);
    }
    free(own);
    return status;
}
