/* Paged decode attention for the CPU: one new token per sequence, read straight from
 * the paged KV cache (no gather copy or dequantized copy), accumulating in float32.
 *
 * Built by cpu_backend.py with the system C compiler into a cached shared library and
 * called through ctypes. Threads come from OpenMP: torch ships the GNU runtime
 * (libgomp.so.1) and has it loaded before this library is, so both share one pool.
 *
 * Layouts (row-major, contiguous):
 *   q, out       [rows, hq, d]      sequence i's query is row rows[i]
 *   k/v cache    [pages * page_size, hkv, d]   (NHD pages, flattened; int4: d / 2 bytes, two codes each)
 *   k/v params   int8: [pages * page_size, hkv], a log-scale byte b per token and KV head;
 *                int4: K [pages, hkv, d, 2], V [pages * page_size, hkv, 2], fp16 (scale, offset)
 *   scales       [256]              int8 only: the scale each byte stands for (KVFormat.log_scales)
 *   basis        [d, d] or NULL     int8, int4: the map M of a format that stores rows in another basis
 *   k/v new      [rows, hkv, d]     int4 only: this step's new K/V rows (float32, the model's basis)
 *   stage k/v    [capacity * page_size, hkv, d]   int4 only: staged rows of partial pages (float32)
 *   stage_of     [pages]            int4 only: page -> staging slot (-1: none)
 *   kv_starts    [n]                sequence i's page table starts at kv_indices[kv_starts[i]]
 *   seq_lens     [n]                tokens in the cache for sequence i, the new one included
 *   mass         [...] or NULL      attention mass per position, added to (see radixkv_paged_decode)
 *   mass_at      [n]                sequence i's positions start at mass[mass_at[i]] (< 0: not observed)
 * Query head j uses KV head j / (hq / hkv), as GQA's repeat_interleave does.
 *
 * KV formats (kv_format): KV_FP32, elements as they are; KV_BF16 and KV_FP16, bfloat16 and
 * IEEE half elements, each row widened to float32 as it is read (exact: both are subsets
 * of float32), so the sums are fp32's on the values the cache holds (but bf16 rows of head
 * size 64 without a soft cap where the build has AVX512-BF16: bf16 products, see
 * attend_part_bf16); KV_INT8, codes c in [-127, 127]
 * standing for c * scale, scale = scales[b] with b the row's byte. The scales are folded
 * into the sums instead of dequantizing each element:
 *   q . k     = scale * sum_e q_e c_e
 *   sum_t p v = sum_t (p scale) c
 * so the codes go to float once per row (exact) and feed every query head of their group.
 * A format that stores rows rotated (a row x kept as y = x R, dequantized as y M with
 * M = R^T) is read in the stored basis: q . (y M) = (q M^T) . y, so each task turns the
 * queries into q M^T first, and sum p (y M) = (sum p y) M, so it turns its sums by M last.
 *
 * One task per sequence (or per range of its context when there are few sequences),
 * three passes over its positions: scores of every query head against each K row (a row
 * holds all KV heads, so it is read once), exponentials per head, then the weighted sum
 * of V rows; ranges are merged by their maxima and sums at the end. window > 0 keeps the
 * last `window` positions; softcap > 0 maps each score s to softcap * tanh(s / softcap).
 * Rows come from scattered pages, so each pass prefetches the row AHEAD tokens on.
 *
 * Attention mass (for KV eviction policies): with `mass`, each observed sequence's
 * probabilities per position, summed over its query heads, are added to its entries of
 * `mass`, taken from the exponentials the softmax pass leaves (every format has them
 * right after it, before V's pass), normalized by the head's final sum: at once when a
 * context is one range, after the ranges' merge when it is split (radixkv_paged_decode).
 *
 * int8 (attend_part_int8) keeps those passes and splits, with its own inner loops: K's
 * dot products 8 tokens at a time (their sums reduced together), V's weighted sums 16
 * tokens at a time with the sums in registers, the exponentials in vectors; an int8 row
 * is a quarter of an fp32 one, so it prefetches 4 * AHEAD tokens on. AVX2 + FMA when the
 * compiler targets them, portable loops otherwise.
 *
 * KV_INT4 (attend_part_int4): KIVI's layout, quantized on seal (radixkv.cache.sealing).
 * Elements are codes c in 0..15 standing for c * s + o, K's (s, o) per channel of a page,
 * V's per token; a byte holds channels 2b (low nibble) and 2b + 1. What a query at
 * position len - 1 reads (as torch_ref.attend_paged):
 *
 *     |== pages before its own page: sealed codes, stored basis ==|== own page: float32 ==|
 *                                                      own_start ^   staged rows   new ^
 *
 * the own page's earlier rows from the staging area (none staged: zeros, as gather_own),
 * the new token from this step's k/v (a page written whole, page size 1, is never staged).
 * Sealed rows are read in place, the parameters folded in:
 *   q . k     = sum_e (q_e s_e) c_e + sum_e q_e o_e   per page and KV head: q s (d products
 *                                                     per query head) and q . o, then the codes
 *   sum_t p v = sum_t (p s) c + (sum_t p o) 1          the second sum one number per head
 * with the codes centred (c - 8 against o + 8 s: sums of both signs, about the torch path's
 * rounding instead of 3-10x it). Channels are taken in split order, [even | odd] (see
 * unsplit): a byte's low nibbles then pair with the first half and its high nibbles with
 * the second, so 8 bytes unpack into two vectors with one mask and one shift, and no
 * shuffle per token; the queries are split once per task, a page's K parameters once per
 * page (a transpose), the sums unsplit at the end (natural order per token measured 11%
 * slower). Two bases: sealed rows are stored rotated (y = x R, int4; int4_norot: as they
 * are), staged and new rows are the model's. So sealed scores use q M^T and own-page
 * scores q itself, into one softmax; the sealed weighted sum, in the stored basis, is
 * turned by M (its offsets added first) and the own rows' sum is added after, in the
 * model's basis. A page's K codes and parameters are prefetched a KV head's share at a
 * time while the page before it is read (one burst stalled on the misses in flight:
 * 15-20% slower). AVX2 + FMA + F16C and d % 16 == 0 for the vector loops.
 */

#include <math.h>
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define AHEAD 4
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { KV_FP32 = 0, KV_INT8 = 1, KV_INT4 = 2, KV_BF16 = 3, KV_FP16 = 4 };
#define FLOAT_FORMAT(f) ((f) == KV_FP32 || (f) == KV_BF16 || (f) == KV_FP16) /* elements widened to floats */

#define INLINE static inline __attribute__((always_inline))

#include "vexp.h"  /* exp_nonpositive, exp8_nonpositive, half_to_float, WITH_CONSTANT_ROWS */

/* sum of a[e] * b[e] over e < d */
INLINE float dot(const float *a, const float *b, int64_t d) {
#if defined(__AVX512F__)
    if (d % 16 == 0) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t e = 0; e < d; e += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + e), _mm512_loadu_ps(b + e), acc);
        return _mm512_reduce_add_ps(acc);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (d % 8 == 0) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t e = 0; e < d; e += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + e), _mm256_loadu_ps(b + e), acc);
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
#endif
    float acc[16] = {0};
    int64_t e = 0;
    for (; e + 16 <= d; e += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[e + l] * b[e + l];
    for (int l = 0; e < d; e++, l++) acc[l] += a[e] * b[e];
    for (int w = 8; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

/* token t's row of `row` elements of `size` bytes */
INLINE const void *row_of(const void *cache, const int32_t *pages, int64_t t, int64_t page_size, int64_t row,
                          int64_t size) {
    return (const char *)cache + ((int64_t)pages[t / page_size] * page_size + t % page_size) * row * size;
}

/* ask for the cache lines of `bytes` bytes from p */
INLINE void prefetch_bytes(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o);
}

/* ask for the cache lines of token t's row before they are needed (none past `end`) */
INLINE void prefetch_row(const void *cache, const int32_t *pages, int64_t t, int64_t end, int64_t page_size, int64_t row,
                         int64_t size) {
    if (t < end) prefetch_bytes(row_of(cache, pages, t, page_size, row, size), row * size);
}

/* dst[0..n) = the bfloat16 values src[0..n) as floats (exact: a bfloat16 is a float's top half) */
INLINE void widen_bf16(const uint16_t *src, float *dst, int64_t n) {
    int64_t e = 0;
#if defined(__AVX2__)
    for (; e + 8 <= n; e += 8) {
        const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + e)));
        _mm256_storeu_ps(dst + e, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
#endif
    for (; e < n; e++) {
        const uint32_t bits = (uint32_t)src[e] << 16;
        memcpy(dst + e, &bits, sizeof bits);
    }
}

/* dst[0..n) = the IEEE half values src[0..n) as floats (exact) */
INLINE void widen_fp16(const uint16_t *src, float *dst, int64_t n) {
    int64_t e = 0;
#if defined(__F16C__)
    for (; e + 8 <= n; e += 8) _mm256_storeu_ps(dst + e, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + e))));
#endif
    for (; e < n; e++) dst[e] = half_to_float(src[e]);
}

/* n 16-bit elements of a KV_BF16 or KV_FP16 row widened into dst */
INLINE void widen_row(int fmt, const uint16_t *src, float *dst, int64_t n) {
    if (fmt == KV_FP16) widen_fp16(src, dst, n);
    else widen_bf16(src, dst, n);
}

/* token t's row as floats: in place for float32 pages, widened into buf for 16-bit ones */
INLINE const float *float_row(const void *cache, const int32_t *pages, int64_t t, int64_t page_size, int64_t row,
                              int fmt, float *buf) {
    if (fmt == KV_FP32) return row_of(cache, pages, t, page_size, row, sizeof(float));
    widen_row(fmt, row_of(cache, pages, t, page_size, row, sizeof(uint16_t)), buf, row);
    return buf;
}

/* Per head j of scores [hq][span]: m[j] = the largest score, each score replaced by
 * exp(score - m[j]), l[j] = their sum; acc [hq][d] zeroed for the weighted sum of V. */
INLINE void softmax_rows(float *scores, float *acc, float *m, float *l, int64_t hq, int64_t d, int64_t span) {
    for (int64_t j = 0; j < hq; j++) {
        float *sj = scores + j * span;
        float top = -INFINITY, total = 0.0f;
#pragma omp simd reduction(max : top)
        for (int64_t u = 0; u < span; u++) top = sj[u] > top ? sj[u] : top;
#pragma omp simd reduction(+ : total)
        for (int64_t u = 0; u < span; u++) {
            sj[u] = exp_nonpositive(sj[u] - top);
            total += sj[u];
        }
        m[j] = top;
        l[j] = total;
        for (int64_t e = 0; e < d; e++) acc[j * d + e] = 0.0f;
    }
}

/* mass[u] += sum over j < hq of w[j] * e[j * span + u], for u < span: a range's weights
 * e [hq][span] summed over the heads, 64 positions at a time (their sums stay in L1) */
INLINE void add_heads(float *mass, const float *e, const float *w, int64_t hq, int64_t span) {
    for (int64_t u0 = 0; u0 < span; u0 += 64) {
        const int64_t count = span - u0 < 64 ? span - u0 : 64;
        float sum[64];
        for (int64_t u = 0; u < count; u++) sum[u] = mass[u0 + u];
        for (int64_t j = 0; j < hq; j++) {
            const float wj = w[j], *ej = e + j * span + u0;
#pragma omp simd
            for (int64_t u = 0; u < count; u++) sum[u] += wj * ej[u];
        }
        for (int64_t u = 0; u < count; u++) mass[u0 + u] = sum[u];
    }
}

/* An observed row's range right after its softmax: e [hq][span] the weights exp(score -
 * m[j]), l [hq] their sums. When the range is the whole context (kept NULL), each
 * position's probability summed over the heads, sum_j e[j] / l[j], is added to mass
 * [span] now; else e is copied to kept [hq][span], to be weighted once the ranges are
 * merged (radixkv_paged_decode's last pass). */
INLINE void observe_range(const float *e, const float *l, int64_t hq, int64_t span, float *mass, float *kept) {
    if (kept != NULL) {
        memcpy(kept, e, sizeof(float) * (size_t)(hq * span));
        return;
    }
    float inv[hq];
    for (int64_t j = 0; j < hq; j++) inv[j] = 1.0f / l[j];
    add_heads(mass, e, inv, hq, span);
}

/* Float32 pages' weighted V sums with the sums in registers (AVX-512; a build with
 * -DRADIXKV_V_SUMS_IN_MEMORY keeps attend_part's loop, which the tests compare it with) */
#if defined(__AVX512F__) && !defined(RADIXKV_V_SUMS_IN_MEMORY)
#define V_SUMS_IN_REGISTERS 1

/* ask for float32 rows t .. the end of t's page (none from `end` on) */
INLINE void prefetch_page_rows(const float *cache, const int32_t *pages, int64_t t, int64_t end, int64_t page_size,
                               int64_t row) {
    const int64_t n = page_size - t % page_size < end - t ? page_size - t % page_size : end - t;
    prefetch_bytes(row_of(cache, pages, t, page_size, row, sizeof(float)), n * row * (int64_t)sizeof(float));
}

/* o[k d + e] += sum over positions t in [from, to) of w[k span + t - from] * V_t[voff + e]
 * for the NH <= 4 query heads k and 64 dims e of a tile: 4 NH sums in registers (named,
 * so that they stay there), per sum one fused multiply-add per position in position
 * order: the operations of attend_part's loop over the same sums, so the same bits.
 * ahead: this pass asks for each page's rows as it reaches the page (a page at once
 * measured better than the loop's row by row here). */
INLINE void weigh_v_tile(const float *w, int64_t span, const float *v_cache, const int32_t *pages, int64_t from,
                         int64_t to, int64_t page_size, int64_t row, int64_t voff, float *o, int64_t d, const int NH,
                         int ahead) {
    __m512 a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, e0, e1, e2, e3;
#define SUMS_IN(A, K)                                                                                           \
    if (NH > K)                                                                                                 \
        A##0 = _mm512_loadu_ps(o + K * d), A##1 = _mm512_loadu_ps(o + K * d + 16),                              \
        A##2 = _mm512_loadu_ps(o + K * d + 32), A##3 = _mm512_loadu_ps(o + K * d + 48);                          \
    else                                                                                                        \
        A##0 = A##1 = A##2 = A##3 = _mm512_setzero_ps();
#define SUMS_ADD(A, K)                                                                                          \
    if (NH > K) {                                                                                               \
        const __m512 p = _mm512_set1_ps(w[K * span + (t - from)]);                                              \
        A##0 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr), A##0), A##1 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 16), A##1); \
        A##2 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 32), A##2), A##3 = _mm512_fmadd_ps(p, _mm512_loadu_ps(vr + 48), A##3); \
    }
#define SUMS_OUT(A, K)                                                                                          \
    if (NH > K)                                                                                                 \
        _mm512_storeu_ps(o + K * d, A##0), _mm512_storeu_ps(o + K * d + 16, A##1),                              \
        _mm512_storeu_ps(o + K * d + 32, A##2), _mm512_storeu_ps(o + K * d + 48, A##3);
    SUMS_IN(a, 0) SUMS_IN(b, 1) SUMS_IN(c, 2) SUMS_IN(e, 3)
    if (ahead) prefetch_page_rows(v_cache, pages, from, to, page_size, row);
    for (int64_t t = from, pg = from / page_size, off = from % page_size; t < to; t++) {
        const float *vr = v_cache + ((int64_t)pages[pg] * page_size + off) * row + voff;
        if (++off == page_size) {
            off = 0, pg++;
            if (ahead && t + 1 < to) prefetch_page_rows(v_cache, pages, t + 1, to, page_size, row); /* as it is reached */
        }
        SUMS_ADD(a, 0) SUMS_ADD(b, 1) SUMS_ADD(c, 2) SUMS_ADD(e, 3)
    }
    SUMS_OUT(a, 0) SUMS_OUT(b, 1) SUMS_OUT(c, 2) SUMS_OUT(e, 3)
#undef SUMS_IN
#undef SUMS_ADD
#undef SUMS_OUT
}

/* attend_part's V sums (head sizes a multiple of 64) in tiles of up to 4 query heads of one
 * KV head by 64 dims, each tile a pass over the range's V rows (the first pass asks for
 * them ahead; the others find them in cache) */
INLINE void weigh_v_in_registers(const float *scores, int64_t span, const float *v_cache, const int32_t *pages,
                                 int64_t from, int64_t to, int64_t page_size, float *acc, int64_t hkv, int64_t group,
                                 int64_t d) {
    for (int64_t h = 0; h < hkv; h++)
        for (int64_t e = 0; e < d; e += 64)
            for (int64_t g = 0; g < group; g += 4) {
                const int64_t j = h * group + g, nh = group - g < 4 ? group - g : 4;
                const int ahead = h == 0 && e == 0 && g == 0;
#define TILE(NH) weigh_v_tile(scores + j * span, span, v_cache, pages, from, to, page_size, hkv * d, h * d + e, \
                              acc + j * d + e, d, NH, ahead)
                if (nh == 4) TILE(4);
                else if (nh == 3) TILE(3);
                else if (nh == 2) TILE(2);
                else TILE(1);
#undef TILE
            }
}
#else
#define V_SUMS_IN_REGISTERS 0
#endif

/* the slots of positions from..from+count-1 through the page table, found once (walking
 * it without a division per position) */
INLINE void range_slots(const int32_t *pages, int64_t from, int64_t count, int64_t page_size, int64_t *slots) {
    for (int64_t u = 0, p = from / page_size, o = from % page_size; u < count; u++) {
        slots[u] = (int64_t)pages[p] * page_size + o;
        if (++o == page_size) o = 0, p++;
    }
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512F__)
/* Decode rows on bf16 pages with bf16 products (vdpbf16ps), as the extend kernel computes
 * on them (see BF16_PRODUCTS below): each query head scaled and rounded to bf16 once, its
 * scores float32 sums of its pairs of dims against K's as the pages hold them; the softmax
 * in float32 (softmax_rows, the normaliser from the unrounded weights); the weights rounded
 * to bf16 for V's sums, two positions a lane against V's pairs. Widening every K and V row
 * to float32 and summing each score across a vector cost ~3x this. Head size 64. */
#define DECODE_BF16 1

/* lane u of the result = the sum of the 16 lanes of v[4 (u % 4) + u / 4]: a transposing
 * tree, 15 pairwise steps of two shuffles and an add where one reduction a vector takes 8 */
INLINE __m512 lane_sums16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int u = 0; u < 8; u++)  /* lanes 0-7: v[2u]'s halves added, 8-15: v[2u + 1]'s */
        a[u] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * u], v[2 * u + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * u], v[2 * u + 1], 0xEE));
    for (int u = 0; u < 4; u++)  /* quarter k: 4 partial sums of v[4u + k] */
        b[u] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * u], a[2 * u + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * u], a[2 * u + 1], 0xDD));
    for (int u = 0; u < 2; u++) {  /* quarter k: 2 of v[8u + k], 2 of v[8u + 4 + k] */
        const __m512d x = _mm512_castps_pd(b[2 * u]), y = _mm512_castps_pd(b[2 * u + 1]);
        c[u] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* quarter k: the sums of v[k], v[4 + k], v[8 + k], v[12 + k] */
    return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}

/* attend_part for bf16 pages, head size 64 and no soft cap (the same outputs: m, l, acc, mass) */
INLINE void attend_part_bf16(const float *qi, const void *k_cache, const void *v_cache, const int32_t *pages,
                             int64_t from, int64_t to, float *scores, float *acc, float *m, float *l, int64_t hq,
                             int64_t hkv, int64_t page_size, float scale, float *mass, float *kept) {
    const int64_t d = 64, group = hq / hkv, row = hkv * d, span = to - from, pairs = (span + 1) / 2;
    uint16_t qb[hq * d];  /* the scaled queries in bf16 */
    for (int64_t j = 0; j < hq; j++)
        for (int64_t e = 0; e < d; e += 16)
            _mm256_storeu_si256((__m256i *)(qb + j * d + e),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(qi + j * d + e),
                                                                          _mm512_set1_ps(scale))));
    int64_t slots[span];  /* the range's rows through the page table, for both passes */
    range_slots(pages, from, span, page_size, slots);
    const uint16_t *kc = k_cache, *vc = v_cache;
    for (int64_t t0 = 0; t0 < span; t0 += 16) {
        const int n = span - t0 < 16 ? (int)(span - t0) : 16;
        const uint16_t *kr[16];  /* slot 4 (u % 4) + u / 4 holds position t0 + u (lane_sums16's order); past n, t0's */
        for (int u = 0; u < 16; u++) kr[4 * (u % 4) + u / 4] = kc + slots[t0 + (u < n ? u : 0)] * row;
        for (int64_t h = 0, j = 0; h < hkv; h++)
            for (int64_t g = 0; g < group; g++, j++) {
                const __m512bh q0 = (__m512bh)_mm512_loadu_si512(qb + j * d),
                               q1 = (__m512bh)_mm512_loadu_si512(qb + j * d + 32);
                __m512 v[16];
                for (int u = 0; u < 16; u++) {
                    const uint16_t *k = kr[u] + h * d;
                    v[u] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q0, (__m512bh)_mm512_loadu_si512(k)),
                                            q1, (__m512bh)_mm512_loadu_si512(k + 32));
                }
                _mm512_mask_storeu_ps(scores + j * span + t0, (__mmask16)((1u << n) - 1), lane_sums16(v));
            }
    }
    softmax_rows(scores, acc, m, l, hq, d, span);
    if (mass != NULL) observe_range(scores, l, hq, span, mass, kept);
    /* each head's weights in bf16 pairs of positions (t, t + 1), the odd last one paired with 0 */
    uint32_t wp[hq * pairs + 16];
    for (int64_t j = 0; j < hq; j++)
        for (int64_t u = 0; u < span; u += 32) {
            const int64_t left = span - u;
            const __mmask16 lo = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1),
                            hi = left >= 32 ? 0xFFFF : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
            const __m512 w0 = _mm512_maskz_loadu_ps(lo, scores + j * span + u),
                         w1 = _mm512_maskz_loadu_ps(hi, scores + j * span + u + 16);
            _mm512_storeu_si512(wp + j * pairs + u / 2, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
        }
    /* V's sums: dims in unpack order (lane 4k + i of sum 0 is dim 8k + i, of sum 1 dim 8k + 4 + i,
     * sums 2 and 3 the same from dim 32), put back in order as they are stored */
    const __m512i lo_dims = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23),
                  hi_dims = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t h = 0; h < hkv; h++)
        for (int64_t g0 = 0; g0 < group; g0 += 4) {
            const int64_t j0 = h * group + g0, nh = group - g0 < 4 ? group - g0 : 4;
            __m512 a[4][4];
            for (int k = 0; k < 4; k++)
                for (int i = 0; i < 4; i++) a[k][i] = _mm512_setzero_ps();
            for (int64_t u = 0; u < pairs; u++) {
                const uint16_t *r0 = vc + slots[2 * u] * row + h * d,
                               *r1 = 2 * u + 1 < span ? vc + slots[2 * u + 1] * row + h * d : r0;
                const __m512i x0 = _mm512_loadu_si512(r0), x1 = _mm512_loadu_si512(r0 + 32),
                              y0 = _mm512_loadu_si512(r1), y1 = _mm512_loadu_si512(r1 + 32);
                const __m512bh p[4] = {(__m512bh)_mm512_unpacklo_epi16(x0, y0), (__m512bh)_mm512_unpackhi_epi16(x0, y0),
                                       (__m512bh)_mm512_unpacklo_epi16(x1, y1), (__m512bh)_mm512_unpackhi_epi16(x1, y1)};
                for (int k = 0; k < nh; k++) {
                    const __m512bh w = (__m512bh)_mm512_set1_epi32((int)wp[(j0 + k) * pairs + u]);
                    for (int i = 0; i < 4; i++) a[k][i] = _mm512_dpbf16_ps(a[k][i], w, p[i]);
                }
            }
            for (int k = 0; k < nh; k++) {
                float *o = acc + (j0 + k) * d;
                _mm512_storeu_ps(o, _mm512_permutex2var_ps(a[k][0], lo_dims, a[k][1]));
                _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(a[k][0], hi_dims, a[k][1]));
                _mm512_storeu_ps(o + 32, _mm512_permutex2var_ps(a[k][2], lo_dims, a[k][3]));
                _mm512_storeu_ps(o + 48, _mm512_permutex2var_ps(a[k][2], hi_dims, a[k][3]));
            }
        }
}
#else
#define DECODE_BF16 0
#endif

/* Sequence i's query heads against positions [from, to) of its context, unnormalized:
 * per head j, m[j] = the largest score, l[j] = sum of exp(score - m[j]) and
 * acc[j] = sum of exp(score - m[j]) * V row. scores is [hq][to - from] scratch. mass,
 * kept: observe_range's (mass NULL: the row is not observed), as in the other formats.
 * Float32 pages (fmt KV_FP32), or bfloat16 or half pages (KV_BF16, KV_FP16: each row widened
 * as it is read, then the same sums; bf16 pages go to attend_part_bf16 where it applies). in_registers: the V sums in registers where they can
 * be (the same bits; see weigh_v_in_registers). */
INLINE void attend_part(const float *qi, const void *k_cache, const void *v_cache, const int32_t *pages,
                        int64_t from, int64_t to, float *scores, float *acc, float *m, float *l, int64_t hq,
                        int64_t hkv, int64_t d, int64_t page_size, float scale, float softcap, float *mass,
                        float *kept, const int fmt, int in_registers) {
#if DECODE_BF16
    if (fmt == KV_BF16 && d == 64 && softcap <= 0.0f) {  /* soft-capped rows stay exact, as extends do */
        attend_part_bf16(qi, k_cache, v_cache, pages, from, to, scores, acc, m, l, hq, hkv, page_size, scale, mass,
                         kept);
        return;
    }
#endif
    const int64_t group = hq / hkv, row = hkv * d, span = to - from, size = fmt == KV_FP32 ? 4 : 2;
    float buf[fmt == KV_FP32 ? 1 : row];
    for (int64_t t = from; t < to; t++) {
        prefetch_row(k_cache, pages, t + AHEAD, to, page_size, row, size);
        const float *kr = float_row(k_cache, pages, t, page_size, row, fmt, buf);
        for (int64_t h = 0, j = 0; h < hkv; h++)
            for (int64_t g = 0; g < group; g++, j++) {
                float s = dot(qi + j * d, kr + h * d, d) * scale;
                if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
                scores[j * span + (t - from)] = s;
            }
    }
    softmax_rows(scores, acc, m, l, hq, d, span);
    if (mass != NULL) observe_range(scores, l, hq, span, mass, kept);
#if V_SUMS_IN_REGISTERS
    if (in_registers && fmt == KV_FP32 && d % 64 == 0) {
        weigh_v_in_registers(scores, span, v_cache, pages, from, to, page_size, acc, hkv, group, d);
        return;
    }
#endif
    for (int64_t t = from; t < to; t++) {
        prefetch_row(v_cache, pages, t + AHEAD, to, page_size, row, size);
        const float *vr = float_row(v_cache, pages, t, page_size, row, fmt, buf);
        for (int64_t h = 0, j = 0; h < hkv; h++)
            for (int64_t g = 0; g < group; g++, j++) {
                const float p = scores[j * span + (t - from)];
                const float *vh = vr + h * d;
                float *aj = acc + j * d;
                for (int64_t e = 0; e < d; e++) aj[e] += p * vh[e];
            }
    }
}


/* ---- int8 pages ---------------------------------------------------------------------- */

#if defined(__AVX2__)
/* 8 int8 codes as 8 floats */
INLINE __m256 codes8(const int8_t *c) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)c)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* a[g] = lane-wise partial sums of q_g . codes for g < n (n <= 4; the others 0), over d
 * (a multiple of 8): each 8 codes converted once for the n query heads */
INLINE void partial_dots_i8(const float *q, const int8_t *c, int64_t d, int n, __m256 a[4]) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t e = 0; e < d; e += 8) {
        const __m256 x = codes8(c + e);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + e), x, a0);
        if (n > 1) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + e), x, a1);
        if (n > 2) a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * d + e), x, a2);
        if (n > 3) a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 3 * d + e), x, a3);
    }
    a[0] = a0, a[1] = a1, a[2] = a2, a[3] = a3;
}
#endif

/* out[g] = sum_e q[g * d + e] * c[e] for g < n (n <= 4): n query heads of one group
 * against one KV head's codes, each code converted once for all n */
INLINE void dots_i8(const float *q, const int8_t *c, int64_t d, int n, float *out) {
#if defined(__AVX2__) && defined(__FMA__)
    if (d % 8 == 0) {
        __m256 a[4];
        partial_dots_i8(q, c, d, n, a);
        /* the four sums at once: pairwise adds leave [a0 a1 a2 a3] in each 128-bit half */
        const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
        return;
    }
#endif
    for (int g = 0; g < n; g++) {
        const float *qg = q + g * d;
        float acc[8] = {0};
        int64_t e = 0;
        for (; e + 8 <= d; e += 8)
            for (int u = 0; u < 8; u++) acc[u] += qg[e + u] * (float)c[e + u];
        for (int u = 0; e < d; e++, u++) acc[u] += qg[e] * (float)c[e];
        out[g] = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    }
}

/* acc[g * d + e] += w[g] * c[e] for g < n: the weighted sum of V codes where
 * weigh_tokens (below) does not apply */
INLINE void axpy_i8(float *acc, const float *w, const int8_t *c, int64_t d, int n) {
    for (int g = 0; g < n; g++) {
        const float wg = w[g];
        float *ag = acc + g * d;
        for (int64_t e = 0; e < d; e++) ag[e] += wg * (float)c[e];
    }
}

/* softmax_rows, its loops written in vectors (the compiler leaves softmax_rows' loop
 * over exp scalar: it will not if-convert the clamp without -fno-trapping-math) */
INLINE void softmax_rows_vec(float *scores, float *acc, float *m, float *l, int64_t hq, int64_t d, int64_t span) {
#if defined(__AVX2__) && defined(__FMA__)
    for (int64_t j = 0; j < hq; j++) {
        float *sj = scores + j * span;
        const int64_t whole = span - span % 8;
        __m256 vtop = _mm256_set1_ps(-INFINITY);
        for (int64_t u = 0; u < whole; u += 8) vtop = _mm256_max_ps(vtop, _mm256_loadu_ps(sj + u));
        __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(vtop), _mm256_extractf128_ps(vtop, 1));
        t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
        float top = _mm_cvtss_f32(_mm_max_ss(t4, _mm_movehdup_ps(t4)));
        for (int64_t u = whole; u < span; u++) top = sj[u] > top ? sj[u] : top;
        const __m256 vt = _mm256_set1_ps(top);
        __m256 vsum = _mm256_setzero_ps();
        for (int64_t u = 0; u < whole; u += 8) {
            const __m256 e = exp8_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sj + u), vt));
            _mm256_storeu_ps(sj + u, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(vsum), _mm256_extractf128_ps(vsum, 1));
        s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        float total = _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
        for (int64_t u = whole; u < span; u++) {
            sj[u] = exp_nonpositive(sj[u] - top);
            total += sj[u];
        }
        m[j] = top;
        l[j] = total;
        for (int64_t e = 0; e < d; e++) acc[j * d + e] = 0.0f;
    }
#else
    softmax_rows(scores, acc, m, l, hq, d, span);
#endif
}

/* f(..., n) with n a constant 1..4, so the n-way loops above keep their sums in registers */
#define BY_FOUR(n, call) \
    switch (n) {         \
    case 1: call(1); break; \
    case 2: call(2); break; \
    case 3: call(3); break; \
    default: call(4); break; \
    }

#if defined(__AVX2__) && defined(__FMA__)
/* [sum of r[0]'s lanes, ..., sum of r[7]'s lanes] */
INLINE __m256 sum8x8(const __m256 *r) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(r[0], r[1]), _mm256_hadd_ps(r[2], r[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(r[4], r[5]), _mm256_hadd_ps(r[6], r[7]));
    /* a: r0..r3's partial sums in each 128-bit half, b: r4..r7's */
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* Eight tokens (slots[0..7]) of KV head `head` against the n (<= 4) query heads q
 * [n][d]: out[g * span + t] = q_g . codes of token t. Each token's codes are converted once
 * for the n heads; the 8 tokens' sums of one head are reduced together into one vector. */
INLINE void dots_8_tokens(const float *q, const int8_t *k_cache, const int64_t *slots, const int64_t *ahead,
                          int64_t row, int64_t head, int64_t d, int n, float *out, int64_t span) {
    __m256 sums[4][8];
    for (int t = 0; t < 8; t++) {
        if (ahead != NULL) prefetch_bytes(k_cache + ahead[t] * row, row);
        __m256 a[4];
        partial_dots_i8(q, k_cache + slots[t] * row + head * d, d, n, a);
        for (int g = 0; g < n; g++) sums[g][t] = a[g];
    }
    for (int g = 0; g < n; g++) _mm256_storeu_ps(out + g * span, sum8x8(sums[g]));
}

/* acc[g * d + e0 + 8 v + lane] += sum over t < nt of w[g * span + t] * codes of token t
 * (slots[t], KV head `head`) at e0 + 8 v + lane, for g < n (<= 4), v < nv (<= 4): the
 * n x nv sums stay in registers across the nt tokens. */
INLINE void weigh_tokens(float *acc, const float *w, int64_t span, const int8_t *v_cache, const int64_t *slots,
                         int64_t nt, int64_t row, int64_t head, int64_t e0, int64_t d, int n, int nv) {
    __m256 a[4][4];
    for (int g = 0; g < n; g++)
        for (int v = 0; v < nv; v++) a[g][v] = _mm256_loadu_ps(acc + g * d + e0 + 8 * v);
    for (int64_t t = 0; t < nt; t++) {
        const int8_t *c = v_cache + slots[t] * row + head * d + e0;
        __m256 x[4];
        for (int v = 0; v < nv; v++) x[v] = codes8(c + 8 * v);
        for (int g = 0; g < n; g++) {
            const __m256 b = _mm256_broadcast_ss(w + g * span + t);
            for (int v = 0; v < nv; v++) a[g][v] = _mm256_fmadd_ps(b, x[v], a[g][v]);
        }
    }
    for (int g = 0; g < n; g++)
        for (int v = 0; v < nv; v++) _mm256_storeu_ps(acc + g * d + e0 + 8 * v, a[g][v]);
}
#endif

/* tokens u in [from, to)'s scales per KV head, times `by`: sc[h * span + u] */
INLINE void unpack_scales(const uint8_t *params, const float *scales, const int64_t *slots, int64_t from, int64_t to,
                          int64_t span, int64_t hkv, float by, float *sc) {
    for (int64_t u = from; u < to; u++) {
        if (u + 4 * AHEAD < span) __builtin_prefetch(params + slots[u + 4 * AHEAD] * hkv);
        const uint8_t *p = params + slots[u] * hkv;
        for (int64_t h = 0; h < hkv; h++) sc[h * span + u] = scales[p[h]] * by;
    }
}

#define TOKENS 16 /* tokens whose V sums stay in registers at once */

/* attend_part for int8 pages. Scratch: slots [span] (each token's slot, found once,
 * walking the page table without a division per token), sc [hkv][span] (the tokens'
 * scales, looked up once per pass), qb [hq][d] (with a basis: the turned queries, then
 * the turned sums). Scores are q . codes first, then scaled in one pass over each head;
 * softmax weights are multiplied by the V scales before the weighted sum of the codes. */
INLINE void attend_part_int8(const float *q, const int8_t *k_cache, const int8_t *v_cache, const uint8_t *k_params,
                             const uint8_t *v_params, const float *scales, const float *basis, const int32_t *pages,
                             int64_t from, int64_t to, float *scores, int64_t *slots, float *sc, float *qb, float *acc,
                             float *m, float *l, int64_t hq, int64_t hkv, int64_t d, int64_t page_size, float scale,
                             float softcap, float *mass, float *kept) {
    const int64_t group = hq / hkv, row = hkv * d, span = to - from;
    range_slots(pages, from, span, page_size, slots);
    const float *qi = q;
    if (basis != NULL) { /* q M^T: (q M^T)_e = q . M's row e */
        for (int64_t j = 0; j < hq; j++)
            for (int64_t e = 0; e < d; e++) qb[j * d + e] = dot(q + j * d, basis + e * d, d);
        qi = qb;
    }

    /* scores: q . codes, then scale * that. The scales are looked up a block at a time,
     * their misses beside the codes'; V's are fetched meanwhile. */
    int64_t done = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if (d % 8 == 0) {
        const int64_t lead = 4 * AHEAD; /* prefetch distance in tokens: int8 rows are short */
        for (; done + 8 <= span; done += 8) {
            const int64_t *ahead = done + 8 + lead <= span ? slots + done + lead : NULL;
            if (ahead != NULL)
                for (int t = 0; t < 8; t++) __builtin_prefetch(v_params + ahead[t] * hkv);
            unpack_scales(k_params, scales, slots, done, done + 8, span, hkv, scale, sc);
            for (int64_t h = 0; h < hkv; h++)
                for (int64_t g0 = 0; g0 < group; g0 += 4) {
                    const int64_t j0 = h * group + g0, n = group - g0 < 4 ? group - g0 : 4;
#define DOTS8(N) \
    dots_8_tokens(qi + j0 * d, k_cache, slots + done, h + g0 == 0 ? ahead : NULL, row, h, d, N, scores + j0 * span + done, span)
                    BY_FOUR(n, DOTS8)
#undef DOTS8
                }
        }
    }
#endif
    unpack_scales(k_params, scales, slots, done, span, span, hkv, scale, sc);
    float dots[4];
    for (int64_t u = done; u < span; u++) { /* the rest one token at a time */
        const int8_t *kr = k_cache + slots[u] * row;
        for (int64_t h = 0; h < hkv; h++)
            for (int64_t g0 = 0; g0 < group; g0 += 4) {
                const int64_t j0 = h * group + g0, n = group - g0 < 4 ? group - g0 : 4;
#define DOTS(N) dots_i8(qi + j0 * d, kr + h * d, d, N, dots)
                BY_FOUR(n, DOTS)
#undef DOTS
                for (int64_t g = 0; g < n; g++) scores[(j0 + g) * span + u] = dots[g];
            }
    }
    for (int64_t j = 0; j < hq; j++) {
        float *sj = scores + j * span;
        const float *scj = sc + (j / group) * span;
        for (int64_t u = 0; u < span; u++) sj[u] *= scj[u];
        if (softcap > 0.0f)
            for (int64_t u = 0; u < span; u++) sj[u] = softcap * tanhf(sj[u] / softcap);
    }

    softmax_rows_vec(scores, acc, m, l, hq, d, span);
    if (mass != NULL) observe_range(scores, l, hq, span, mass, kept);

    /* weights: p * scale per token */
    unpack_scales(v_params, scales, slots, 0, span, span, hkv, 1.0f, sc);
    for (int64_t j = 0; j < hq; j++) {
        float *sj = scores + j * span;
        const float *scj = sc + (j / group) * span;
        for (int64_t u = 0; u < span; u++) sj[u] *= scj[u];
    }
#if defined(__AVX2__) && defined(__FMA__)
    if (d % 8 == 0) {
        for (int64_t u0 = 0; u0 < span; u0 += TOKENS) {
            const int64_t nt = span - u0 < TOKENS ? span - u0 : TOKENS;
            for (int64_t u = u0 + TOKENS; u < u0 + 2 * TOKENS && u < span; u++)
                prefetch_bytes(v_cache + slots[u] * row, row);
            for (int64_t h = 0; h < hkv; h++)
                for (int64_t g0 = 0; g0 < group; g0 += 4) {
                    const int64_t j0 = h * group + g0, n = group - g0 < 4 ? group - g0 : 4;
                    float *aj = acc + j0 * d;
                    const float *wj = scores + j0 * span + u0;
                    int64_t e0 = 0;
#define WEIGH2(N) weigh_tokens(aj, wj, span, v_cache, slots + u0, nt, row, h, e0, d, N, 2)
#define WEIGH1(N) weigh_tokens(aj, wj, span, v_cache, slots + u0, nt, row, h, e0, d, N, 1)
                    for (; e0 + 16 <= d; e0 += 16) BY_FOUR(n, WEIGH2) /* 16 elements: n x 2 sums (measured best) */
                    for (; e0 < d; e0 += 8) BY_FOUR(n, WEIGH1)
#undef WEIGH2
#undef WEIGH1
                }
        }
    } else
#endif
    {
        float w[4];
        for (int64_t u = 0; u < span; u++) {
            if (u + 4 * AHEAD < span) prefetch_bytes(v_cache + slots[u + 4 * AHEAD] * row, row);
            const int8_t *vr = v_cache + slots[u] * row;
            for (int64_t h = 0; h < hkv; h++)
                for (int64_t g0 = 0; g0 < group; g0 += 4) {
                    const int64_t j0 = h * group + g0, n = group - g0 < 4 ? group - g0 : 4;
                    for (int64_t g = 0; g < n; g++) w[g] = scores[(j0 + g) * span + u];
#define AXPY(N) axpy_i8(acc + j0 * d, w, vr + h * d, d, N)
                    BY_FOUR(n, AXPY)
#undef AXPY
                }
        }
    }
    if (basis != NULL) /* (sum p y) M, each head's row through qb (the queries are done with) */
        for (int64_t j = 0; j < hq; j++) {
            float *aj = acc + j * d, *turned = qb + j * d;
            for (int64_t e = 0; e < d; e++) turned[e] = 0.0f;
            for (int64_t f = 0; f < d; f++) {
                const float x = aj[f], *mf = basis + f * d;
                for (int64_t e = 0; e < d; e++) turned[e] += x * mf[e];
            }
            for (int64_t e = 0; e < d; e++) aj[e] = turned[e];
        }
}

/* ---- int4 pages (KIVI's layout, quantized on seal) ----------------------------------- */

/* Rows of one KV head in "split order": its even channels, then its odd ones,
 *   split[b] = x[2b],  split[d/2 + b] = x[2b + 1]   (b < d/2),
 * which is the order a packed row's nibbles come in (byte b: channel 2b low, 2b + 1 high):
 * its low nibbles pair with the first half, its high nibbles with the second. */
INLINE int64_t unsplit(int64_t e, int64_t half) { return e < half ? 2 * e : 2 * (e - half) + 1; }

/* Codes are read centred, c - MID in [-8, 7], against offsets moved to o + MID * s: the
 * same values, but sums of terms of both signs, of half the size (the offsets, about
 * -range / 2, would otherwise mostly cancel the codes' sums: 3-10x the rounding error). */
#define MID 8

/* a (scale, offset) pair of fp16 */
INLINE void half_pair(const uint16_t *p, float *s, float *o) {
#if defined(__F16C__)
    int32_t pair;
    memcpy(&pair, p, sizeof pair);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(pair)); /* (scale, offset, 0, 0) */
    *s = _mm_cvtss_f32(f), *o = _mm_cvtss_f32(_mm_movehdup_ps(f));
#else
    *s = half_to_float(p[0]), *o = half_to_float(p[1]);
#endif
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define INT4_VECTORS 1 /* the vector loops below need all three (and d % 16 == 0) */
#endif

/* One sealed page's K parameters for one KV head (p: [d][2] fp16, (scale, offset) per
 * channel) in split order, for centred codes: s[d] the scales, o[d] offset + MID * scale,
 * float32. */
INLINE void k_params_split(const uint16_t *p, int64_t d, float *s, float *o) {
    const int64_t half = d / 2;
#if defined(INT4_VECTORS)
    if (half % 8 == 0) {
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        const __m256 mid = _mm256_set1_ps((float)MID);
        for (int64_t b = 0; b < half; b += 8) { /* channel pairs b .. b + 7: each 128-bit lane below holds one
                                                   pair's (s_even, o_even, s_odd, o_odd) */
            const uint16_t *pb = p + 4 * b;
            const __m256 f0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)pb));        /* pairs b, b+1 */
            const __m256 f1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pb + 8)));  /* b+2, b+3 */
            const __m256 f2 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pb + 16))); /* b+4, b+5 */
            const __m256 f3 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(pb + 24))); /* b+6, b+7 */
            /* a 4 x 8 transpose: each output holds its 8 pairs as [b, b+2, b+4, b+6 | b+1, b+3, b+5, b+7] */
            const __m256 lo01 = _mm256_unpacklo_ps(f0, f1), lo23 = _mm256_unpacklo_ps(f2, f3);
            const __m256 hi01 = _mm256_unpackhi_ps(f0, f1), hi23 = _mm256_unpackhi_ps(f2, f3);
            const __m256 se = _mm256_shuffle_ps(lo01, lo23, 0x44), oe = _mm256_shuffle_ps(lo01, lo23, 0xEE);
            const __m256 so = _mm256_shuffle_ps(hi01, hi23, 0x44), oo = _mm256_shuffle_ps(hi01, hi23, 0xEE);
            const __m256 ses = _mm256_permutevar8x32_ps(se, order), sos = _mm256_permutevar8x32_ps(so, order);
            _mm256_storeu_ps(s + b, ses);
            _mm256_storeu_ps(s + half + b, sos);
            _mm256_storeu_ps(o + b, _mm256_fmadd_ps(mid, ses, _mm256_permutevar8x32_ps(oe, order)));
            _mm256_storeu_ps(o + half + b, _mm256_fmadd_ps(mid, sos, _mm256_permutevar8x32_ps(oo, order)));
        }
        return;
    }
#endif
    for (int64_t b = 0; b < half; b++) {
        half_pair(p + 4 * b, s + b, o + b);
        half_pair(p + 4 * b + 2, s + half + b, o + half + b);
    }
    for (int64_t e = 0; e < d; e++) o[e] += (float)MID * s[e];
}

#if defined(INT4_VECTORS)
/* 8 packed bytes as their 8 low and 8 high nibbles, less MID, in floats */
INLINE void nibbles8(const uint8_t *c, __m256 *lo, __m256 *hi) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c));
    const __m256i mid = _mm256_set1_epi32(MID);
    *lo = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(x, _mm256_set1_epi32(15)), mid));
    *hi = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(x, 4), mid));
}

/* a[g] = lane-wise partial sums of kq_g . codes for g < n (n <= 4), kq [n][d] in split
 * order, codes d / 2 packed bytes (d a multiple of 16): each byte's nibbles converted once
 * for the n heads, low and high nibbles summed apart (two chains per head) */
INLINE void partial_dots_i4(const float *kq, const uint8_t *c, int64_t d, int n, __m256 a[4]) {
    const int64_t half = d / 2;
    __m256 l0 = _mm256_setzero_ps(), l1 = l0, l2 = l0, l3 = l0, h0 = l0, h1 = l0, h2 = l0, h3 = l0;
    for (int64_t b = 0; b < half; b += 8) {
        __m256 lo, hi;
        nibbles8(c + b, &lo, &hi);
        l0 = _mm256_fmadd_ps(_mm256_loadu_ps(kq + b), lo, l0);
        h0 = _mm256_fmadd_ps(_mm256_loadu_ps(kq + half + b), hi, h0);
        if (n > 1) {
            l1 = _mm256_fmadd_ps(_mm256_loadu_ps(kq + d + b), lo, l1);
            h1 = _mm256_fmadd_ps(_mm256_loadu_ps(kq + d + half + b), hi, h1);
        }
        if (n > 2) {
            l2 = _mm256_fmadd_ps(_mm256_loadu_ps(kq + 2 * d + b), lo, l2);
            h2 = _mm256_fmadd_ps(_mm256_loadu_ps(kq + 2 * d + half + b), hi, h2);
        }
        if (n > 3) {
            l3 = _mm256_fmadd_ps(_mm256_loadu_ps(kq + 3 * d + b), lo, l3);
            h3 = _mm256_fmadd_ps(_mm256_loadu_ps(kq + 3 * d + half + b), hi, h3);
        }
    }
    a[0] = _mm256_add_ps(l0, h0), a[1] = _mm256_add_ps(l1, h1), a[2] = _mm256_add_ps(l2, h2);
    a[3] = _mm256_add_ps(l3, h3);
}

/* `count` (<= 8) consecutive tokens of one page (codes c, `stride` bytes apart) against
 * n (<= 4) query heads: out[g * span + t] = kq_g . codes of token t + cst[g]. With 8
 * tokens their sums of one head are reduced together into one vector. */
INLINE void dots_tokens_i4(const float *kq, const float *cst, const uint8_t *c, int64_t stride, int64_t count,
                           int64_t d, int n, float *out, int64_t span) {
    if (count == 8) {
        __m256 sums[4][8];
        for (int t = 0; t < 8; t++) {
            __m256 a[4];
            partial_dots_i4(kq, c + t * stride, d, n, a);
            for (int g = 0; g < n; g++) sums[g][t] = a[g];
        }
        for (int g = 0; g < n; g++)
            _mm256_storeu_ps(out + g * span, _mm256_add_ps(sum8x8(sums[g]), _mm256_set1_ps(cst[g])));
        return;
    }
    for (int64_t t = 0; t < count; t++) {
        __m256 a[4];
        partial_dots_i4(kq, c + t * stride, d, n, a);
        const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        float four[4];
        _mm_storeu_ps(four, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
        for (int g = 0; g < n; g++) out[g * span + t] = four[g] + cst[g];
    }
}

/* acc[g * d + b + lane] += sum over t < nt of w[g * span + t] * low nibbles of token t's
 * bytes b .. b + 7 (KV head `head`), and acc[g * d + d / 2 + b + lane] likewise with the
 * high nibbles, for g < n (<= 4): acc in split order, the 2n sums in registers across the
 * nt tokens */
INLINE void weigh_tokens_i4(float *acc, const float *w, int64_t span, const uint8_t *v_cache, const int64_t *slots,
                            int64_t nt, int64_t row, int64_t head, int64_t b, int64_t d, int n) {
    const int64_t half = d / 2;
    __m256 al[4], ah[4];
    for (int g = 0; g < n; g++)
        al[g] = _mm256_loadu_ps(acc + g * d + b), ah[g] = _mm256_loadu_ps(acc + g * d + half + b);
    for (int64_t t = 0; t < nt; t++) {
        __m256 lo, hi;
        nibbles8(v_cache + slots[t] * row + head * half + b, &lo, &hi);
        for (int g = 0; g < n; g++) {
            const __m256 x = _mm256_broadcast_ss(w + g * span + t);
            al[g] = _mm256_fmadd_ps(x, lo, al[g]);
            ah[g] = _mm256_fmadd_ps(x, hi, ah[g]);
        }
    }
    for (int g = 0; g < n; g++)
        _mm256_storeu_ps(acc + g * d + b, al[g]), _mm256_storeu_ps(acc + g * d + half + b, ah[g]);
}
#endif

/* A page's queries for n (<= 4) query heads qs [n][d] against its K parameters s, o
 * [d]: kq[g] = qs[g] * s (elementwise) and cst[g] = qs[g] . o */
INLINE void page_queries(const float *qs, const float *s, const float *o, int64_t d, int n, float *kq, float *cst) {
#if defined(INT4_VECTORS)
    if (d % 8 == 0) {
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t e = 0; e < d; e += 8) {
            const __m256 se = _mm256_loadu_ps(s + e), oe = _mm256_loadu_ps(o + e);
            for (int g = 0; g < n; g++) {
                const __m256 x = _mm256_loadu_ps(qs + g * d + e);
                _mm256_storeu_ps(kq + g * d + e, _mm256_mul_ps(x, se));
                a[g] = _mm256_fmadd_ps(x, oe, a[g]);
            }
        }
        const __m256 r = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        float four[4];
        _mm_storeu_ps(four, _mm_add_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1)));
        for (int g = 0; g < n; g++) cst[g] = four[g];
        return;
    }
#endif
    for (int g = 0; g < n; g++) {
        for (int64_t e = 0; e < d; e++) kq[g * d + e] = qs[g * d + e] * s[e];
        cst[g] = dot(qs + g * d, o, d);
    }
}

/* portable: out[g] = kq_g . codes + cst[g] for g < n, kq in split order */
INLINE void dots_i4(const float *kq, const float *cst, const uint8_t *c, int64_t d, int n, float *out) {
    const int64_t half = d / 2;
    for (int g = 0; g < n; g++) {
        const float *lo = kq + g * d, *hi = lo + half;
        float acc[8] = {0};
        int64_t b = 0;
        for (; b + 4 <= half; b += 4)
            for (int u = 0; u < 4; u++) {
                acc[u] += lo[b + u] * (float)((c[b + u] & 15) - MID);
                acc[4 + u] += hi[b + u] * (float)((c[b + u] >> 4) - MID);
            }
        for (int u = 0; b < half; b++, u++)
            acc[u] += lo[b] * (float)((c[b] & 15) - MID) + hi[b] * (float)((c[b] >> 4) - MID);
        out[g] = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + cst[g];
    }
}

/* Where a paged format's own-page rows are: the new token's K and V rows ([hkv][d], from
 * the forward's k and v) and the staging area ([capacity * page_size][hkv][d]) with its
 * page -> staging slot map (-1: none). */
struct own_rows {
    const float *k_new, *v_new, *stage_k, *stage_v;
    const int64_t *stage_of;
};

/* position t's own-page row ([hkv][d]) of K (`v` 0) or V: the new token's, else its
 * staged one; NULL when its page has no staging rows (read as zeros, as the reference) */
INLINE const float *own_row(const struct own_rows *own, int v, const int32_t *pages, int64_t t, int64_t last,
                            int64_t page_size, int64_t row) {
    if (t == last) return v ? own->v_new : own->k_new;
    const int64_t slot = own->stage_of[pages[t / page_size]];
    if (slot < 0) return NULL;
    return (v ? own->stage_v : own->stage_k) + (slot * page_size + t % page_size) * row;
}

/* attend_part for int4 pages (see the top of this file), kept out of line (it runs once
 * per task; inlined into the one parallel function it only slowed the build): positions
 * [from, to) of a sequence of `len` tokens, those before the last one's page read sealed (codes and fp16
 * parameters, in the stored basis, split order), those in it in full precision from
 * `own` (model basis). Scratch: slots [span], scores [hq][span], sv, ov [hkv][span] (V's
 * scale and offset per sealed token), qs [hq][d] (the queries scaled by `scale`, turned
 * into the stored basis, split), sums [hq][d] (the sealed weighted sums, split), kq
 * [4][d] (queries times a page's K scales), ks, ko [d] (a page's K scales and offsets),
 * vo [hq] (the weighted sums of V's offsets). */
static __attribute__((noinline)) void
attend_part_int4(const float *q, const uint8_t *k_cache, const uint8_t *v_cache, const uint16_t *k_params,
                 const uint16_t *v_params, const float *basis, const struct own_rows *own, const int32_t *pages,
                 int64_t from, int64_t to, int64_t len, int64_t *slots, float *scores, float *sv, float *ov, float *qs,
                 float *sums, float *kq, float *ks, float *ko, float *vo, float *acc, float *m, float *l, int64_t hq,
                 int64_t hkv, int64_t d, int64_t page_size, float scale, float softcap, float *mass, float *kept) {
    const int64_t group = hq / hkv, half = d / 2, span = to - from, row = hkv * half /* bytes */;
    const int64_t own_start = (len - 1) / page_size * page_size;
    const int64_t sealed_end = to < own_start ? to : own_start, ns = sealed_end > from ? sealed_end - from : 0;
    const int64_t own_from = from > own_start ? from : own_start;
#if defined(INT4_VECTORS)
    const int vectors = half % 8 == 0;
#endif
    range_slots(pages, from, ns, page_size, slots);
    if (ns > 0) /* qs = split(q M^T) * scale, or split(q) * scale */
        for (int64_t j = 0; j < hq; j++)
            for (int64_t e = 0; e < d; e++) {
                const int64_t f = unsplit(e, half);
                qs[j * d + e] = scale * (basis != NULL ? dot(q + j * d, basis + f * d, d) : q[j * d + f]);
            }

    /* sealed scores, a page at a time: q . (s c + o) = (q s) . c + q . o, so per page and
     * KV head kq = qs * s (d products per query head) and q . o, then the codes' dots */
    for (int64_t t0 = from; t0 < sealed_end;) {
        const int64_t pi = t0 / page_size, o0 = t0 % page_size;
        const int64_t count = page_size - o0 < sealed_end - t0 ? page_size - o0 : sealed_end - t0;
        const int64_t page = pages[pi];
        const int64_t next = t0 + count < sealed_end ? pages[pi + 1] : -1;
        if (next >= 0) /* V's parameters of the next page; its K codes and parameters a head at a time below */
            prefetch_bytes(v_params + next * page_size * hkv * 2, page_size * hkv * 2 * (int64_t)sizeof(uint16_t));
        const uint8_t *codes = k_cache + (page * page_size + o0) * row;
        float *out = scores + (t0 - from);
        for (int64_t h = 0; h < hkv; h++) {
            if (next >= 0) {
                const int64_t share = (page_size * row + hkv - 1) / hkv;
                prefetch_bytes(k_cache + next * page_size * row + h * share, share);
                prefetch_bytes(k_params + (next * hkv + h) * d * 2, d * 2 * (int64_t)sizeof(uint16_t));
            }
            k_params_split(k_params + (page * hkv + h) * d * 2, d, ks, ko);
            for (int64_t g0 = 0; g0 < group; g0 += 4) {
                const int64_t j0 = h * group + g0, n = group - g0 < 4 ? group - g0 : 4;
                float cst[4];
                page_queries(qs + j0 * d, ks, ko, d, (int)n, kq, cst);
                const uint8_t *ch = codes + h * half;
                float *oj = out + j0 * span;
#if defined(INT4_VECTORS)
                if (vectors) {
                    for (int64_t t = 0; t < count; t += 8) {
                        const int64_t c8 = count - t < 8 ? count - t : 8;
#define DOTS4(N) dots_tokens_i4(kq, cst, ch + t * row, row, c8, d, N, oj + t, span)
                        BY_FOUR(n, DOTS4)
#undef DOTS4
                    }
                    continue;
                }
#endif
                for (int64_t t = 0; t < count; t++) {
                    float four[4];
                    dots_i4(kq, cst, ch + t * row, d, (int)n, four);
                    for (int64_t g = 0; g < n; g++) oj[g * span + t] = four[g];
                }
            }
        }
        t0 += count;
    }

    /* own-page scores: the model-basis rows against the queries as they came */
    for (int64_t t = own_from; t < to; t++) {
        const float *kr = own_row(own, 0, pages, t, len - 1, page_size, hkv * d);
        for (int64_t j = 0; j < hq; j++)
            scores[j * span + (t - from)] = kr == NULL ? 0.0f : dot(q + j * d, kr + (j / group) * d, d) * scale;
    }
    if (softcap > 0.0f)
        for (int64_t j = 0; j < hq; j++)
            for (int64_t u = 0; u < span; u++) scores[j * span + u] = softcap * tanhf(scores[j * span + u] / softcap);

    softmax_rows_vec(scores, sums, m, l, hq, d, span);
    if (mass != NULL) observe_range(scores, l, hq, span, mass, kept);

    /* sealed V: sum_t p (s c + o) = sum_t (p s) c + sum_t p o, the second one number per head */
    if (ns > 0) {
        for (int64_t u = 0; u < ns; u++) {
            if (u + 4 * AHEAD < ns) __builtin_prefetch(v_params + slots[u + 4 * AHEAD] * hkv * 2);
            for (int64_t h = 0; h < hkv; h++) {
                float *s = sv + h * span + u, *o = ov + h * span + u;
                half_pair(v_params + (slots[u] * hkv + h) * 2, s, o);
                *o += (float)MID * *s; /* for the centred codes */
            }
        }
        for (int64_t j = 0; j < hq; j++) {
            float *sj = scores + j * span, total = 0.0f;
            const float *svj = sv + (j / group) * span, *ovj = ov + (j / group) * span;
#pragma omp simd reduction(+ : total)
            for (int64_t u = 0; u < ns; u++) {
                total += sj[u] * ovj[u];
                sj[u] *= svj[u];
            }
            vo[j] = total;
        }
#if defined(INT4_VECTORS)
        if (vectors) {
            for (int64_t u0 = 0; u0 < ns; u0 += TOKENS) {
                const int64_t nt = ns - u0 < TOKENS ? ns - u0 : TOKENS;
                for (int64_t h = 0; h < hkv; h++) {
                    /* the next block's rows, a share per KV head (a burst of them all would stall) */
                    const int64_t ahead = u0 + TOKENS;
                    for (int64_t u = ahead + h * TOKENS / hkv; u < ahead + (h + 1) * TOKENS / hkv && u < ns; u++)
                        prefetch_bytes(v_cache + slots[u] * row, row);
                    for (int64_t g0 = 0; g0 < group; g0 += 4) {
                        const int64_t j0 = h * group + g0, n = group - g0 < 4 ? group - g0 : 4;
                        for (int64_t b = 0; b < half; b += 8) {
#define WEIGH4(N) \
    weigh_tokens_i4(sums + j0 * d, scores + j0 * span + u0, span, v_cache, slots + u0, nt, row, h, b, d, N)
                            BY_FOUR(n, WEIGH4)
#undef WEIGH4
                        }
                    }
                }
            }
        } else
#endif
        {
            for (int64_t u = 0; u < ns; u++) {
                if (u + 4 * AHEAD < ns) prefetch_bytes(v_cache + slots[u + 4 * AHEAD] * row, row);
                const uint8_t *vr = v_cache + slots[u] * row;
                for (int64_t j = 0; j < hq; j++) {
                    const float w = scores[j * span + u];
                    const uint8_t *c = vr + (j / group) * half;
                    float *sj = sums + j * d;
                    for (int64_t b = 0; b < half; b++) {
                        sj[b] += w * (float)((c[b] & 15) - MID);
                        sj[half + b] += w * (float)((c[b] >> 4) - MID);
                    }
                }
            }
        }
        /* + the offsets' sum on every element, then back to natural order (and the model's
         * basis: (sum p y) M, M's rows taken in split order) */
        for (int64_t j = 0; j < hq; j++) {
            const float *sj = sums + j * d;
            float *aj = acc + j * d;
            if (basis == NULL)
                for (int64_t e = 0; e < d; e++) aj[unsplit(e, half)] = sj[e] + vo[j];
            else {
                for (int64_t e = 0; e < d; e++) aj[e] = 0.0f;
                for (int64_t f = 0; f < d; f++) {
                    const float x = sj[f] + vo[j], *mf = basis + unsplit(f, half) * d;
                    for (int64_t e = 0; e < d; e++) aj[e] += x * mf[e];
                }
            }
        }
    } else
        for (int64_t e = 0; e < hq * d; e++) acc[e] = 0.0f;

    /* own-page V, in the model's basis, added to the turned sums */
    for (int64_t t = own_from; t < to; t++) {
        const float *vr = own_row(own, 1, pages, t, len - 1, page_size, hkv * d);
        if (vr == NULL) continue;
        for (int64_t j = 0; j < hq; j++) {
            const float p = scores[j * span + (t - from)], *vh = vr + (j / group) * d;
            float *aj = acc + j * d;
            for (int64_t e = 0; e < d; e++) aj[e] += p * vh[e];
        }
    }
}

/* positions [*from, *to) of a context of len tokens that range `part` of `parts` covers:
 * the last `window` positions (window > 0) or all, split evenly */
INLINE void range_of(int64_t len, int64_t window, int64_t part, int64_t parts, int64_t *from, int64_t *to) {
    const int64_t first = (window > 0 && len > window) ? len - window : 0;
    *from = first + (len - first) * part / parts, *to = first + (len - first) * (part + 1) / parts;
}

#define DCHUNK 128 /* positions per range of a decode row's context, about */

/* the ranges a context of len positions (its last `window`, window > 0) is split into */
INLINE int64_t parts_of(int64_t len, int64_t window) {
    const int64_t span = (window > 0 && len > window) ? window : len;
    const int64_t parts = (span + DCHUNK - 1) / DCHUNK;
    return parts < 1 ? 1 : parts;
}

static int compare_i32(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* whether two of the n sequences begin with the same page (a shared prefix the batch reads
 * from cache: where the V sums in registers gain, 1.33x over 30 layers; over distinct
 * contexts streamed from memory the loop's one pass is 3-4% faster) */
static int first_pages_shared(const int32_t *kv_indices, const int32_t *kv_starts, const int32_t *seq_lens, int64_t n) {
    if (n < 2) return 0;
    int32_t *first = malloc(sizeof(int32_t) * (size_t)n);
    if (first == NULL) return 0;
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++)
        if (seq_lens[i] > 0) first[k++] = kv_indices[kv_starts[i]];
    qsort(first, (size_t)k, sizeof(int32_t), compare_i32);
    int shared = 0;
    for (int64_t i = 1; i < k && !shared; i++) shared = first[i] == first[i - 1];
    free(first);
    return shared;
}

/* Decode attention of n sequences into out (see the top of this file). kv_format:
 * KV_FP32, KV_BF16 or KV_FP16 (k_params, v_params, scales, basis and the own-page rows
 * unused), KV_INT8 (basis
 * NULL: rows stored as they are; own-page rows unused) or KV_INT4 (scales unused; basis
 * NULL: rows stored as they are).
 *
 * Attention mass (mass non-NULL): for each sequence i with mass_at[i] >= 0, adds to
 * mass[mass_at[i] + t] the probability that position t gets, summed over the query heads
 * (0 outside the window), for every t < seq_lens[i]; mass_at[i] < 0: not observed. A
 * context in one range adds sum_j e_j / l_j as its task ends (observe_range); split into
 * ranges, each range keeps its weights e_j = exp(score - m_j) (hq floats per position),
 * the merge records each range's share exp(m_j - top_j) / total_j per head, and a last
 * parallel pass adds the kept weights times their shares.
 *
 * Returns 0, or -1 when scratch memory could not be had or the format is unknown. */
int radixkv_paged_decode(const float *q, const void *k_cache, const void *v_cache, const void *k_params,
                         const void *v_params, const float *scales, const float *basis, const float *k_new,
                         const float *v_new, const float *stage_k, const float *stage_v, const int64_t *stage_of,
                         const int64_t *rows, const int32_t *kv_starts, const int32_t *kv_indices,
                         const int32_t *seq_lens, float *out, float *mass, const int64_t *mass_at, int64_t n,
                         int64_t hq, int64_t hkv, int64_t d, int64_t page_size, float scale, int64_t window,
                         float softcap, int64_t kv_format) {
    if (!FLOAT_FORMAT(kv_format) && kv_format != KV_INT8 && kv_format != KV_INT4) return -1;
    /* Each context split into ranges of about DCHUNK positions, so that one long sequence
     * still keeps every thread reading (a thread streams its own contiguous range;
     * splitting by KV head instead measured slower). The ranges depend on the sequence
     * alone, never on the batch or the threads: a row's output is the same bits alone or
     * in any batch. part_at[i]: sequence i's first range (its ranges: part_at[i + 1] -
     * part_at[i]); seq_of[t]: range t's sequence. */
    int64_t *part_at = malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (part_at == NULL) return -1;
    part_at[0] = 0;
    for (int64_t i = 0; i < n; i++) part_at[i + 1] = part_at[i] + parts_of(seq_lens[i], window);
    const int64_t ntasks = part_at[n];
    int64_t *seq_of = malloc(sizeof(int64_t) * (size_t)(ntasks > 0 ? ntasks : 1));
    const int64_t stride = hq * (d + 2); /* one range's acc [hq][d], m [hq], l [hq] */
    float *partial = malloc(sizeof(float) * (size_t)((ntasks > 0 ? ntasks : 1) * stride));
    /* observed contexts split into ranges: each such row's offset into kept (hq floats per
     * position; -1: in one range, observed as its task ends), the kept weights, and each
     * range's share per head [ntasks][hq] */
    const int split_mass = mass != NULL && ntasks > n;
    int64_t *kept_at = NULL;
    float *kept = NULL, *shares = NULL;
    if (split_mass) {
        kept_at = malloc(sizeof(int64_t) * (size_t)n);
        int64_t size = 0;
        for (int64_t i = 0; kept_at != NULL && i < n; i++) {
            kept_at[i] = mass_at[i] >= 0 && part_at[i + 1] - part_at[i] > 1 ? size : -1;
            if (kept_at[i] >= 0) size += hq * seq_lens[i];
        }
        kept = malloc(sizeof(float) * (size_t)(size > 0 ? size : 1));
        shares = malloc(sizeof(float) * (size_t)(ntasks * hq));
    }
    if (seq_of == NULL || partial == NULL || (split_mass && (kept_at == NULL || kept == NULL || shares == NULL))) {
        free(part_at), free(seq_of), free(partial), free(kept_at), free(kept), free(shares);
        return -1;
    }
    for (int64_t i = 0; i < n; i++)
        for (int64_t t = part_at[i]; t < part_at[i + 1]; t++) seq_of[t] = i;
    const int shared = V_SUMS_IN_REGISTERS && kv_format == KV_FP32 && first_pages_shared(kv_indices, kv_starts, seq_lens, n);
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < ntasks; task++) {
        const int64_t i = seq_of[task], part = task - part_at[i], parts = part_at[i + 1] - part_at[i];
        const int64_t len = seq_lens[i];
        int64_t from, to;
        range_of(len, window, part, parts, &from, &to);
        float *acc = partial + task * stride, *m = acc + hq * d, *l = m + hq;
        if (from == to) { /* a range too short to split: contributes nothing */
            for (int64_t j = 0; j < hq; j++) l[j] = 0.0f;
            continue;
        }
        const int64_t span = to - from;
        /* this range's share of the row's mass, and where it keeps its weights when split */
        float *mass_i = mass != NULL && mass_at[i] >= 0 ? mass + mass_at[i] + from : NULL;
        float *kept_i = mass_i != NULL && kept != NULL && kept_at[i] >= 0 ? kept + kept_at[i] + hq * from : NULL;
        /* scratch: the scores [hq][span]; int8 also keeps the range's slots [span] (first,
         * for their alignment), a scale per token and KV head and a turned query [hq][d];
         * int4 the slots, two parameters per token and KV head, and attend_part_int4's rest */
        const size_t bytes = FLOAT_FORMAT(kv_format) ? sizeof(float) * (size_t)(hq * span)
                             : kv_format == KV_INT8 ? sizeof(int64_t) * (size_t)span
                                                          + sizeof(float) * (size_t)((hq + hkv) * span + hq * d)
                                                    : sizeof(int64_t) * (size_t)span
                                                          + sizeof(float) * (size_t)((hq + 2 * hkv) * span
                                                                                     + 2 * hq * d + 6 * d + hq);
        void *scratch = malloc(bytes);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        const float *qi = q + rows[i] * hq * d;
        const int32_t *pages = kv_indices + kv_starts[i];
        if (FLOAT_FORMAT(kv_format)) {
            float *scores = scratch;
            /* the common head sizes as constants, so the loops over d unroll into whole vectors */
#define FLOAT_PART(D, FMT)                                                                                            \
    attend_part(qi, k_cache, v_cache, pages, from, to, scores, acc, m, l, hq, hkv, D, page_size, scale, softcap, mass_i, \
                kept_i, FMT, shared)
            if (kv_format == KV_BF16 && d == 64)
                FLOAT_PART(64, KV_BF16);
            else if (kv_format == KV_BF16)
                FLOAT_PART(d, KV_BF16);
            else if (kv_format == KV_FP16 && d == 64)
                FLOAT_PART(64, KV_FP16);
            else if (kv_format == KV_FP16)
                FLOAT_PART(d, KV_FP16);
            else if (d == 64)
                FLOAT_PART(64, KV_FP32);
            else if (d == 128)
                FLOAT_PART(128, KV_FP32);
            else
                FLOAT_PART(d, KV_FP32);
#undef FLOAT_PART
        } else if (kv_format == KV_INT8) {
            const int8_t *kc = k_cache, *vc = v_cache;
            int64_t *slots = scratch;
            float *scores = (float *)(slots + span), *sc = scores + hq * span, *qb = sc + hkv * span;
#define INT8_PART(D)                                                                                             \
    attend_part_int8(qi, kc, vc, k_params, v_params, scales, basis, pages, from, to, scores, slots, sc, qb, acc, m, l, \
                     hq, hkv, D, page_size, scale, softcap, mass_i, kept_i)
            if (d == 64)
                INT8_PART(64);
            else if (d == 128)
                INT8_PART(128);
            else
                INT8_PART(d);
#undef INT8_PART
        } else {
            const struct own_rows own = {k_new + rows[i] * hkv * d, v_new + rows[i] * hkv * d, stage_k, stage_v,
                                         stage_of};
            int64_t *slots = scratch;
            float *scores = (float *)(slots + span), *sv = scores + hq * span, *ov = sv + hkv * span;
            float *qs = ov + hkv * span, *sums = qs + hq * d, *kq = sums + hq * d, *ks = kq + 4 * d, *ko = ks + d;
            float *vo = ko + d;
            /* one generic copy: head sizes as constants measured no faster, and cost build time */
            attend_part_int4(qi, k_cache, v_cache, k_params, v_params, basis, &own, pages, from, to, len, slots, scores,
                             sv, ov, qs, sums, kq, ks, ko, vo, acc, m, l, hq, hkv, d, page_size, scale, softcap,
                             mass_i, kept_i);
        }
        free(scratch);
    }
    /* each head's output: its parts rescaled to the largest max, summed, divided by the
     * total weight; an observed split row's shares (weight / total) recorded per part */
    for (int64_t i = 0; i < n && !failed; i++)
        for (int64_t j = 0; j < hq; j++) {
            const int64_t parts = part_at[i + 1] - part_at[i];
            const float *base = partial + part_at[i] * stride;
            float *share = kept != NULL && kept_at[i] >= 0 ? shares + part_at[i] * hq + j : NULL;
            float top = -INFINITY, total = 0.0f;
            for (int64_t p = 0; p < parts; p++) {
                const float *m = base + p * stride + hq * d, *l = m + hq;
                if (l[j] > 0.0f && m[j] > top) top = m[j];
            }
            float *oj = out + (rows[i] * hq + j) * d;
            for (int64_t e = 0; e < d; e++) oj[e] = 0.0f;
            for (int64_t p = 0; p < parts; p++) {
                const float *acc = base + p * stride, *m = acc + hq * d, *l = m + hq;
                if (l[j] == 0.0f) continue;
                const float w = parts == 1 ? 1.0f : expf(m[j] - top);
                total += w * l[j];
                for (int64_t e = 0; e < d; e++) oj[e] += w * acc[j * d + e];
                if (share != NULL) share[p * hq] = w;
            }
            const float inv = 1.0f / total;
            for (int64_t e = 0; e < d; e++) oj[e] *= inv;
            for (int64_t p = 0; share != NULL && p < parts; p++) share[p * hq] *= inv;
        }
    /* the split rows' mass: each range's kept weights times its shares */
    if (kept != NULL && !failed) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t task = 0; task < ntasks; task++) {
            const int64_t i = seq_of[task];
            int64_t from, to;
            range_of(seq_lens[i], window, task - part_at[i], part_at[i + 1] - part_at[i], &from, &to);
            if (kept_at[i] < 0 || from == to) continue;
            add_heads(mass + mass_at[i] + from, kept + kept_at[i] + hq * from, shares + task * hq, hq, to - from);
        }
    }
    free(part_at), free(seq_of), free(partial), free(kept_at), free(kept), free(shares);
    return failed ? -1 : 0;
}


/* ---- extends: a sequence's several new tokens against its pages (fp32, bf16, fp16) ----
 *
 * out rows of the n new tokens of each sequence, attending causally to its seq_lens[i]
 * positions (the new ones' K/V already in the pages; window > 0: the last `window`
 * positions up to each row), for float32 pages (kv_format KV_FP32), bfloat16 pages
 * (KV_BF16) or half pages (KV_FP16: each block's K/V rows widened to float32 once, for
 * all of the task's rows, then the float32 tiles). On bf16 pages, where the build has
 * AVX512-BF16, the products are bf16's (vdpbf16ps: two bf16 products added to a float32
 * sum per lane, twice FMA's multiply-adds per instruction), as GPU attention kernels
 * compute on a bf16 cache: the scaled queries rounded to bf16 once per task, K and V read
 * as the pages hold them, the softmax weights rounded to bf16 for V's sums while the
 * rows' normalisers add them unrounded, every sum in float32 (the score and V tiles
 * below, on pairs of dims and of positions). Without it bf16 rows are widened as half
 * ones are (exact). A sequence's query rows for one KV head
 * are its n tokens x G heads (G = hq / hkv share the KV head); one task takes up to
 * ECHUNK of them (so one long extend still spreads over the threads), scaled once and
 * transposed to [d][rows], against blocks of EK positions read in place from the pages:
 * - scores transposed, [EK][rows], in tiles of 16 rows by up to 6 positions (each
 *   position's K value broadcast against two vectors of rows; per score one chain of
 *   fused multiply-adds over the dims in order);
 * - the online softmax eight rows at a time, one lane a row: the block's maximum, the
 *   rescale alpha of the row's sums (exactly 1 where the maximum holds), the weights
 *   e^(s - max) in place of the scores (masked positions, where a block runs past a row's
 *   causal end, its window or the context, weigh exactly zero; blocks every row sees in
 *   full skip the masks);
 * - the weighted V sums, kept transposed ([d][rows]), in tiles of 6 dims by 16 rows (each
 *   V value broadcast against two vectors of the rows' weights: the score tile's shape).
 * Where the build has AVX-512, float32 (and widened) blocks take the same steps 16 rows a
 * vector: score tiles of 16 rows by 8 positions, V tiles of 8 dims by 16 rows, the softmax
 * on 16 lanes; every operation the AVX2 tiles' in the same order, so the same bits. bf16
 * products (AVX512-BF16) take those tiles' shapes on pairs: a lane multiplies two dims of
 * a row's query by two of a K row, or two positions' weights by those positions' V.
 * The rows share each block's K/V, where per-sequence SDPA calls paid their own setup and
 * the decode kernel would read the context once per row. Layouts as radixkv_paged_decode;
 * q_start[i]: sequence i's first query row, n_new[i] its new tokens. Returns 0; -1 when
 * the shapes are not the kernel's (d a multiple of 32, hq a multiple of hkv), the format
 * is neither, or there is no AVX2 + FMA (the caller takes the reference path); -2 when a
 * buffer cannot be had. */
#if defined(__AVX2__) && defined(__FMA__)
#define EK 16      /* positions per block */
#define ECHUNK 96  /* query rows per task at most (a multiple of 16) */

/* sT[j][r0 .. r0 + 8 nv) (row stride rs) = scores of np <= 6 positions (K rows kp[j]) for
 * 8 nv rows of qT ([d][rs], from column r0). */
INLINE void score_tile_nv(const float *qT, int64_t rs, const float *const *kp, int64_t d, const int nv, const int np,
                          float *sT) {
    __m256 a[6][2];
    for (int j = 0; j < np; j++) a[j][0] = a[j][1] = _mm256_setzero_ps();
    for (int64_t e = 0; e < d; e++) {
        __m256 q0 = _mm256_load_ps(qT + e * rs), q1 = nv > 1 ? _mm256_load_ps(qT + e * rs + 8) : q0;
        __asm__("" : "+x"(q0), "+x"(q1)); /* in registers: GCC would fold them into every FMA, a load each */
        for (int j = 0; j < np; j++) {
            const __m256 k = _mm256_broadcast_ss(kp[j] + e);
            a[j][0] = _mm256_fmadd_ps(q0, k, a[j][0]);
            if (nv > 1) a[j][1] = _mm256_fmadd_ps(q1, k, a[j][1]);
        }
    }
    for (int j = 0; j < np; j++) {
        _mm256_store_ps(sT + j * rs, a[j][0]);
        if (nv > 1) _mm256_store_ps(sT + j * rs + 8, a[j][1]);
    }
}

/* qT[e][r0 + i] = rows[i][e] * scale for 8 rows (a row NULL: zeros) and every dim e < d (a
 * multiple of 8), row stride rs: 8 x 8 transposes, the same products as one at a time */
INLINE void queries_t8(const float *const rows[8], int64_t d, float scale, float *qT, int64_t rs) {
    const __m256 sc = _mm256_set1_ps(scale);
    for (int64_t e = 0; e < d; e += 8) {
        __m256 r[8], t[8];
        for (int i = 0; i < 8; i++) r[i] = rows[i] ? _mm256_mul_ps(_mm256_loadu_ps(rows[i] + e), sc) : _mm256_setzero_ps();
        for (int i = 0; i < 8; i += 2)
            t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
        for (int i = 0; i < 8; i += 4) {
            r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44), r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
            r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44), r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
        }
        for (int i = 0; i < 4; i++) {  /* r[0..3]: dims (0, 1, 2, 3) of rows 0-3 | 4-7 in lanes, as do r[4..7] for rows 4-7 */
            _mm256_store_ps(qT + (e + i) * rs, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
            _mm256_store_ps(qT + (e + i + 4) * rs, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
        }
    }
}

/* the EK positions of a block against 8 nv rows: tiles of 6, 6 and 4 positions */
INLINE void score_block(const float *qT, int64_t rs, const float *const *kp, int64_t d, const int nv, float *sT) {
    score_tile_nv(qT, rs, kp, d, nv, 6, sT);
    score_tile_nv(qT, rs, kp + 6, d, nv, 6, sT + 6 * rs);
    score_tile_nv(qT, rs, kp + 12, d, nv, 4, sT + 12 * rs);
}

/* oT[i][0 .. 8 nv) (row stride rs) = alpha oT[i] + sum over the block's EK positions j of
 * pT[j][..] v_j[e + i], i < ne <= 6, for 8 nv rows (pT, alpha and oT from the tile's first
 * row): the V sums kept transposed, [d][rows] as the queries, so that a tile is the score
 * tile's shape: each V value broadcast against two vectors of the rows' weights, 12 sums in
 * registers. Per output one multiply by alpha, then fused multiply-adds over j in order
 * (zero weights add exactly zero). */
INLINE void pv_tile_t(const float *pT, int64_t rs, const float *const *vp, int64_t e, const int ne, const int nv,
                      const float *alpha, float *oT) {
    __m256 a[6][2];
    const __m256 al0 = _mm256_load_ps(alpha), al1 = nv > 1 ? _mm256_load_ps(alpha + 8) : al0;
    for (int i = 0; i < ne; i++) {
        a[i][0] = _mm256_mul_ps(_mm256_load_ps(oT + i * rs), al0);
        if (nv > 1) a[i][1] = _mm256_mul_ps(_mm256_load_ps(oT + i * rs + 8), al1);
    }
    for (int j = 0; j < EK; j++) {
        const __m256 p0 = _mm256_load_ps(pT + j * rs), p1 = nv > 1 ? _mm256_load_ps(pT + j * rs + 8) : p0;
        for (int i = 0; i < ne; i++) {
            const __m256 v = _mm256_broadcast_ss(vp[j] + e + i);
            a[i][0] = _mm256_fmadd_ps(p0, v, a[i][0]);
            if (nv > 1) a[i][1] = _mm256_fmadd_ps(p1, v, a[i][1]);
        }
    }
    for (int i = 0; i < ne; i++) {
        _mm256_store_ps(oT + i * rs, a[i][0]);
        if (nv > 1) _mm256_store_ps(oT + i * rs + 8, a[i][1]);
    }
}

/* a block's V sums for 8 nv rows, every dim (d a multiple of 32: tiles of 6 dims, then 4 or 2) */
INLINE void pv_block_t(const float *pT, int64_t rs, const float *const *vp, int64_t d, const int nv, const float *alpha,
                       float *oT) {
    int64_t e = 0;
    for (; e + 6 <= d; e += 6) pv_tile_t(pT, rs, vp, e, 6, nv, alpha, oT + e * rs);
    if (d - e == 4) pv_tile_t(pT, rs, vp, e, 4, nv, alpha, oT + e * rs);
    if (d - e == 2) pv_tile_t(pT, rs, vp, e, 2, nv, alpha, oT + e * rs);
}

/* The online softmax of one block for 8 rows (lanes): sT's EK vectors (row stride rs) become
 * the weights; m, l, alpha: the rows' running maximum and sum and this block's rescale.
 * last, first: the rows' last visible position and first (window) as int32 lanes; k0 the
 * block's first position, kn its positions in the context; full: every lane sees all EK. */
INLINE void softmax8(float *sT, int64_t rs, float *m, float *l, float *alpha, __m256i last, __m256i first,
                     int64_t k0, int64_t kn, int full) {
    __m256 s[EK], valid[EK];
    __m256 bm = _mm256_set1_ps(-INFINITY);
    for (int j = 0; j < EK; j++) {
        s[j] = _mm256_load_ps(sT + j * rs);
        if (!full) {
            const __m256i pos = _mm256_set1_epi32((int)(k0 + j));
            const __m256i ok = _mm256_andnot_si256(_mm256_or_si256(_mm256_cmpgt_epi32(pos, last), _mm256_cmpgt_epi32(first, pos)),
                                                   _mm256_set1_epi32(j < kn ? -1 : 0));
            valid[j] = _mm256_castsi256_ps(ok);
            s[j] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s[j], valid[j]);
        }
        bm = _mm256_max_ps(bm, s[j]);
    }
    const __m256 mo = _mm256_load_ps(m), mn = _mm256_max_ps(bm, mo);
    /* alpha: 1 where the maximum holds (a row with nothing seen yet and nothing here too), else e^(old - new) */
    const __m256 same = _mm256_cmp_ps(mn, mo, _CMP_EQ_OQ);
    const __m256 a = _mm256_blendv_ps(exp8_nonpositive(_mm256_sub_ps(mo, mn)), _mm256_set1_ps(1.0f), same);
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < EK; j++) {
        __m256 p = exp8_nonpositive(_mm256_sub_ps(s[j], mn));
        if (!full) p = _mm256_and_ps(p, valid[j]);  /* masked: exactly zero (the exp clamps, and -inf - -inf is NaN) */
        _mm256_store_ps(sT + j * rs, p);
        sum = _mm256_add_ps(sum, p);
    }
    _mm256_store_ps(l, _mm256_fmadd_ps(_mm256_load_ps(l), a, sum));
    _mm256_store_ps(m, mn);
    _mm256_store_ps(alpha, a);
}

#if defined(__AVX512F__)
/* AVX-512: the same tiles on 16 rows a vector (one zmm in place of two ymm), with 32
 * registers for wider tiles: every score, weight and V sum is computed by the same
 * operations in the same order as above, so the bits are the AVX2 path's. */
#define WIDE_ROWS 1

/* scores of 8 positions (K rows kp[j]) for the 16 rows of qT ([d][rs]) from its column 0 */
INLINE void score_tile16(const float *qT, int64_t rs, const float *const *kp, int64_t d, float *sT) {
    __m512 a[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_ps();
    for (int64_t e = 0; e < d; e++) {
        const __m512 q = _mm512_load_ps(qT + e * rs);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) a[j] = _mm512_fmadd_ps(q, _mm512_set1_ps(kp[j][e]), a[j]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) _mm512_store_ps(sT + j * rs, a[j]);
}

/* as softmax8, on 16 rows */
INLINE void softmax16(float *sT, int64_t rs, float *m, float *l, float *alpha, __m512i last, __m512i first, int64_t k0,
                      int64_t kn, int full) {
    __m512 s[EK];
    __mmask16 valid[EK];
    __m512 bm = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < EK; j++) {
        s[j] = _mm512_load_ps(sT + j * rs);
        if (!full) {
            const __m512i pos = _mm512_set1_epi32((int)(k0 + j));
            valid[j] = j < kn ? _mm512_cmple_epi32_mask(pos, last) & _mm512_cmple_epi32_mask(first, pos) : 0;
            s[j] = _mm512_mask_blend_ps(valid[j], _mm512_set1_ps(-INFINITY), s[j]);
        }
        bm = _mm512_max_ps(bm, s[j]);
    }
    const __m512 mo = _mm512_load_ps(m), mn = _mm512_max_ps(bm, mo);
    const __mmask16 same = _mm512_cmp_ps_mask(mn, mo, _CMP_EQ_OQ);
    const __m512 a = _mm512_mask_blend_ps(same, exp16_nonpositive(_mm512_sub_ps(mo, mn)), _mm512_set1_ps(1.0f));
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < EK; j++) {
        __m512 p = exp16_nonpositive(_mm512_sub_ps(s[j], mn));
        if (!full) p = _mm512_maskz_mov_ps(valid[j], p);
        _mm512_store_ps(sT + j * rs, p);
        sum = _mm512_add_ps(sum, p);
    }
    _mm512_store_ps(l, _mm512_fmadd_ps(_mm512_load_ps(l), a, sum));
    _mm512_store_ps(m, mn);
    _mm512_store_ps(alpha, a);
}

/* as pv_tile_t on 16 rows and 8 dims (e .. e + 8) */
INLINE void pv_tile16(const float *pT, int64_t rs, const float *const *vp, int64_t e, const float *alpha, float *oT) {
    __m512 a[8];
    const __m512 al = _mm512_load_ps(alpha);
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) a[i] = _mm512_mul_ps(_mm512_load_ps(oT + i * rs), al);
    for (int j = 0; j < EK; j++) {
        const __m512 p = _mm512_load_ps(pT + j * rs);
        const float *v = vp[j] + e;
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) a[i] = _mm512_fmadd_ps(p, _mm512_set1_ps(v[i]), a[i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) _mm512_store_ps(oT + i * rs, a[i]);
}
#else
#define WIDE_ROWS 0
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VL__) && WIDE_ROWS
/* bfloat16 products (AVX512-BF16's vdpbf16ps: a lane's two bf16 products added to its
 * float32 sum) for bf16 pages, in the float32 tiles' shapes on 16 rows a vector: the
 * queries and the softmax weights rounded to bf16, K and V as the pages hold them, every
 * sum in float32. A lane holds a row's pair (dims e, e + 1 of its query; positions j,
 * j + 1 of its weights), the broadcast the matching pair of K (dims) or of V (positions,
 * interleaved once a block by pair_values). */
#define BF16_PRODUCTS 1

/* as score_tile16: qP [d / 2][rs] holds each row's (q_e, q_e+1) pairs, kp[j] bf16 K rows */
INLINE void score_tile16_bf(const uint32_t *qP, int64_t rs, const uint16_t *const *kp, int64_t d, float *sT) {
    __m512 a[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_ps();
    for (int64_t e = 0; e < d; e += 2) {
        const __m512bh q = (__m512bh)_mm512_load_si512(qP + e / 2 * rs);
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            uint32_t k;
            memcpy(&k, kp[j] + e, sizeof k);
            a[j] = _mm512_dpbf16_ps(a[j], q, (__m512bh)_mm512_set1_epi32((int)k));
        }
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) _mm512_store_ps(sT + j * rs, a[j]);
}

/* (lo, hi) bf16 pairs of 16 lanes: lo in each 32-bit lane's low half */
INLINE __m512i bf16_pairs(__m256i lo, __m256i hi) {
    return _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
}

/* pP[j / 2][0 .. 16) = the 16 rows' weights of positions j and j + 1 (sT's), rounded to bf16 pairs */
INLINE void pair_weights16(const float *sT, int64_t rs, uint32_t *pP) {
    for (int j = 0; j < EK; j += 2)
        _mm512_store_si512(pP + j / 2 * rs, bf16_pairs((__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sT + j * rs)),
                                                       (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sT + (j + 1) * rs))));
}

/* vP[j / 2][e] = (dim e of V row j, of row j + 1) as a bf16 pair, for the block's EK rows vp */
INLINE void pair_values(const uint16_t *const *vp, int64_t d, uint32_t *vP) {
    for (int j = 0; j < EK; j += 2)
        for (int64_t e = 0; e < d; e += 16)
            _mm512_storeu_si512(vP + j / 2 * d + e, bf16_pairs(_mm256_loadu_si256((const __m256i *)(vp[j] + e)),
                                                               _mm256_loadu_si256((const __m256i *)(vp[j + 1] + e))));
}

/* as pv_tile16 on pairs: the 16 rows' weight pairs pP ([EK / 2][rs]) against the V pairs vP
 * ([EK / 2][d]), dims e .. e + 8 of the sums oT ([d][rs]) */
INLINE void pv_tile16_bf(const uint32_t *pP, int64_t rs, const uint32_t *vP, int64_t d, int64_t e, const float *alpha,
                         float *oT) {
    __m512 a[8];
    const __m512 al = _mm512_load_ps(alpha);
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) a[i] = _mm512_mul_ps(_mm512_load_ps(oT + i * rs), al);
    for (int j = 0; j < EK / 2; j++) {
        const __m512bh p = (__m512bh)_mm512_load_si512(pP + j * rs);
        const uint32_t *v = vP + j * d + e;
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) a[i] = _mm512_dpbf16_ps(a[i], p, (__m512bh)_mm512_set1_epi32((int)v[i]));
    }
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) _mm512_store_ps(oT + i * rs, a[i]);
}
#else
#define BF16_PRODUCTS 0
#endif

/* 1 when bf16 pages' extends multiply in bf16 (this build has AVX512-BF16), else 0 */
int radixkv_extend_bf16_products(void) { return BF16_PRODUCTS; }

/* 1 when bf16 pages' decode rows of head size 64 multiply in bf16 (attend_part_bf16), else 0 */
int radixkv_decode_bf16_products(void) { return DECODE_BF16; }

int radixkv_paged_extend(const float *q, const void *k_cache, const void *v_cache, const int64_t *q_start,
                         const int32_t *n_new, const int32_t *kv_starts, const int32_t *kv_indices,
                         const int32_t *seq_lens, float *out, int64_t nseq, int64_t hq, int64_t hkv, int64_t d,
                         int64_t page_size, float scale, int64_t window, int64_t kv_format) {
    if (d % 32 != 0 || hq % hkv != 0 || !FLOAT_FORMAT(kv_format)) return -1;
    if (nseq == 0) return 0;
    /* half: 16-bit elements; bfp: bf16 products, else those rows widened */
    const int64_t G = hq / hkv, half = kv_format != KV_FP32, bfp = kv_format == KV_BF16 && BF16_PRODUCTS;
    /* tasks: (sequence, KV head, a chunk of at most ECHUNK query rows), so that one long
     * extend still keeps every thread busy */
    int64_t ntasks = 0;
    for (int64_t i = 0; i < nseq; i++) ntasks += hkv * ((n_new[i] * G + ECHUNK - 1) / ECHUNK);
    int64_t *task_seq = malloc(sizeof(int64_t) * (size_t)ntasks), *task_row = malloc(sizeof(int64_t) * (size_t)ntasks);
    if (!task_seq || !task_row) {
        free(task_seq), free(task_row);
        return -2;
    }
    for (int64_t i = 0, t = 0; i < nseq; i++)
        for (int64_t h = 0; h < hkv; h++)
            for (int64_t r = 0; r < n_new[i] * G; r += ECHUNK, t++) task_seq[t] = i * hkv + h, task_row[t] = r;
    int err = 0;
#pragma omp parallel
    {
        float *qT = bfp ? NULL : aligned_alloc(64, sizeof(float) * (size_t)(ECHUNK * d));  /* bf16 products: qP */
        float *ob = aligned_alloc(64, sizeof(float) * (size_t)(ECHUNK * d));
        float *sT = aligned_alloc(64, sizeof(float) * ECHUNK * EK);
        float *zero = aligned_alloc(64, sizeof(float) * (size_t)d);
        float *m = aligned_alloc(64, sizeof(float) * ECHUNK), *l = aligned_alloc(64, sizeof(float) * ECHUNK);
        float *alpha = aligned_alloc(64, sizeof(float) * ECHUNK);
        int32_t *lastp = aligned_alloc(64, sizeof(int32_t) * ECHUNK), *firstp = aligned_alloc(64, sizeof(int32_t) * ECHUNK);
        /* bfloat16 pages, bf16 products: the queries and weights as bf16 pairs; else a
         * block's K and V rows (one KV head) widened */
        uint32_t *qP = bfp ? aligned_alloc(64, sizeof(uint32_t) * (size_t)(ECHUNK * d / 2)) : NULL;
        uint32_t *pP = bfp ? aligned_alloc(64, sizeof(uint32_t) * ECHUNK * EK / 2) : NULL;
        uint32_t *vP = bfp ? aligned_alloc(64, sizeof(uint32_t) * (size_t)(EK / 2 * d)) : NULL;
        float *kb = half && !bfp ? aligned_alloc(64, sizeof(float) * (size_t)(EK * d)) : NULL;
        float *vb = half && !bfp ? aligned_alloc(64, sizeof(float) * (size_t)(EK * d)) : NULL;
        if ((!bfp && !qT) || !ob || !sT || !zero || !m || !l || !alpha || !lastp || !firstp || (bfp && (!qP || !pP || !vP)) ||
            (half && !bfp && (!kb || !vb))) {
#pragma omp atomic write
            err = -2;
        } else {
            memset(zero, 0, sizeof(float) * (size_t)d);
#pragma omp for schedule(dynamic)
            for (int64_t task = 0; task < ntasks; task++) {
                const int64_t i = task_seq[task] / hkv, h = task_seq[task] % hkv, n = n_new[i], total = seq_lens[i];
                const int64_t c0 = task_row[task], R = n * G - c0 < ECHUNK ? n * G - c0 : ECHUNK;
                const int64_t RS = (R + 15) / 16 * 16; /* rows padded to whole score tiles: qT's and sT's row stride */
                /* local row r is row c0 + r of the sequence: token (c0 + r) / G, head h * G + (c0 + r) % G */
#define ROW_AT(base, r) ((base) + ((q_start[i] + (c0 + (r)) / G) * hq + h * G + (c0 + (r)) % G) * d)
                const int32_t *pages = kv_indices + kv_starts[i];
                if (!bfp)  /* the rows' queries, scaled, transposed 8 rows at a time (padding rows zero) */
                    for (int64_t r = 0; r < RS; r += 8) {
                        const float *rows[8];
                        for (int u = 0; u < 8; u++)
                            rows[u] = r + u < R ? ROW_AT(q, r + u) : NULL;
                        queries_t8(rows, d, scale, qT + r, RS);
                    }
                for (int64_t r = 0; r < RS; r++) {
                    if (r < R) {
#if BF16_PRODUCTS
                        const float *src = ROW_AT(q, r);
                        if (bfp)
                            for (int64_t e = 0; e < d; e += 16) {  /* (q_e, q_e+1) pairs, rounded */
                                const __m256i c = (__m256i)_mm512_cvtneps_pbh(
                                    _mm512_mul_ps(_mm512_loadu_ps(src + e), _mm512_set1_ps(scale)));
                                uint32_t pairs[8];
                                _mm256_storeu_si256((__m256i *)pairs, c);
                                for (int u = 0; u < 8; u++) qP[(e / 2 + u) * RS + r] = pairs[u];
                            }
#endif
                        lastp[r] = (int32_t)(total - n + (c0 + r) / G);
                        firstp[r] = window > 0 ? lastp[r] - (int32_t)window + 1 : 0;
                    } else {  /* padding: zero queries that see every position (their results are dropped) */
                        if (bfp)
                            for (int64_t e = 0; e < d; e += 2) qP[e / 2 * RS + r] = 0;
                        lastp[r] = INT32_MAX, firstp[r] = firstp[R - 1];  /* the groups' windows still rise */
                    }
                    m[r] = -INFINITY, l[r] = 0.0f;
                }
                memset(ob, 0, sizeof(float) * (size_t)(RS * d));
                const int64_t end = total - n + (c0 + R - 1) / G + 1; /* positions the chunk's last row sees */
                int64_t begin = 0; /* and its first row's window */
                if (window > 0 && firstp[0] > 0) begin = firstp[0] / EK * EK;
                for (int64_t k0 = begin; k0 < end; k0 += EK) {
                    const int64_t kn = end - k0 < EK ? end - k0 : EK;
                    const float *kp[EK], *vp[EK];
                    const uint16_t *kh[EK], *vh[EK]; /* bf16 products: the rows as the pages hold them */
                    (void)kh, (void)vh;
                    for (int64_t j = 0; j < EK; j++) {
                        if (j >= kn) {  /* past the end: zero K and V (weight zero, and 0 * V is 0) */
                            kp[j] = vp[j] = zero;
                            kh[j] = vh[j] = (const uint16_t *)zero;
                            continue;
                        }
                        const int64_t p = k0 + j, slot = (int64_t)pages[p / page_size] * page_size + p % page_size;
                        const int64_t at = (slot * hkv + h) * d; /* the position's row for KV head h */
                        if (bfp) {
                            kh[j] = (const uint16_t *)k_cache + at, vh[j] = (const uint16_t *)v_cache + at;
                        } else if (half) {
                            widen_row((int)kv_format, (const uint16_t *)k_cache + at, kb + j * d, d);
                            widen_row((int)kv_format, (const uint16_t *)v_cache + at, vb + j * d, d);
                            kp[j] = kb + j * d, vp[j] = vb + j * d;
                        } else {
                            kp[j] = (const float *)k_cache + at, vp[j] = (const float *)v_cache + at;
                        }
                    }
                    /* rows whose last visible position is before k0 see nothing here: token t sees up to total - n + t */
                    int64_t r0 = k0 - (total - n);
                    r0 = r0 <= 0 ? 0 : r0 * G - c0;
                    r0 = r0 < 0 ? 0 : r0 / 8 * 8;
#if WIDE_ROWS
                    r0 = r0 / 16 * 16;  /* 16 rows a vector (rows that see none of the block add zeros) */
                    for (int64_t r = r0; r < RS; r += 16) {
#if BF16_PRODUCTS
                        if (bfp) {
                            score_tile16_bf(qP + r, RS, kh, d, sT + r);
                            score_tile16_bf(qP + r, RS, kh + 8, d, sT + 8 * RS + r);
                            continue;
                        }
#endif
                        score_tile16(qT + r, RS, kp, d, sT + r);
                        score_tile16(qT + r, RS, kp + 8, d, sT + 8 * RS + r);
                    }
                    for (int64_t r = r0; r < RS; r += 16) {
                        const int full = kn == EK && k0 + EK - 1 <= lastp[r] && (window <= 0 || k0 >= firstp[r + 15]);
                        softmax16(sT + r, RS, m + r, l + r, alpha + r, _mm512_load_si512(lastp + r),
                                  _mm512_load_si512(firstp + r), k0, kn, full);
                    }
#if BF16_PRODUCTS
                    if (bfp) {
                        pair_values(vh, d, vP);  /* once a block, for every row tile */
                        for (int64_t r = r0; r < RS; r += 16) {
                            pair_weights16(sT + r, RS, pP + r);
                            for (int64_t e = 0; e < d; e += 8) pv_tile16_bf(pP + r, RS, vP, d, e, alpha + r, ob + e * RS + r);
                        }
                        continue;
                    }
#endif
                    for (int64_t r = r0; r < RS; r += 16)  /* ob [d][RS], padding rows too (dropped) */
                        for (int64_t e = 0; e < d; e += 8) pv_tile16(sT + r, RS, vp, e, alpha + r, ob + e * RS + r);
#else
                    for (int64_t r = r0; r < RS; r += 16) score_block(qT + r, RS, kp, d, RS - r >= 16 ? 2 : 1, sT + r);
                    for (int64_t r = r0; r < RS; r += 8) {
                        const int full = kn == EK && k0 + EK - 1 <= lastp[r] && (window <= 0 || k0 >= firstp[r + 7]);
                        softmax8(sT + r, RS, m + r, l + r, alpha + r, _mm256_load_si256((const __m256i *)(lastp + r)),
                                 _mm256_load_si256((const __m256i *)(firstp + r)), k0, kn, full);
                    }
                    for (int64_t r = r0; r < RS; r += 16) {  /* ob [d][RS], padding rows too (dropped) */
                        if (RS - r >= 16)
                            pv_block_t(sT + r, RS, vp, d, 2, alpha + r, ob + r);
                        else
                            pv_block_t(sT + r, RS, vp, d, 1, alpha + r, ob + r);
                    }
#endif
                }
                for (int64_t r = 0; r < R; r++) {
                    float *dst = ROW_AT(out, r);
                    const float inv = 1.0f / l[r];
                    for (int64_t e = 0; e < d; e++) dst[e] = ob[e * RS + r] * inv;
                }
#undef ROW_AT
            }
        }
        free(qT), free(ob), free(sT), free(zero), free(m), free(l), free(alpha), free(lastp), free(firstp), free(kb), free(vb);
        free(qP), free(pP), free(vP);
    }
    free(task_seq), free(task_row);
    return err;
}
#else
int radixkv_extend_bf16_products(void) { return 0; }
int radixkv_decode_bf16_products(void) { return 0; }

int radixkv_paged_extend(const float *q, const void *k_cache, const void *v_cache, const int64_t *q_start,
                         const int32_t *n_new, const int32_t *kv_starts, const int32_t *kv_indices,
                         const int32_t *seq_lens, float *out, int64_t nseq, int64_t hq, int64_t hkv, int64_t d,
                         int64_t page_size, float scale, int64_t window, int64_t kv_format) {
    return -1;
}
#endif
