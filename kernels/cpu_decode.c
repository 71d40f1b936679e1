/* Paged decode attention for the CPU: one new token per sequence, read straight from
 * the paged KV cache (no gather copy), float32 throughout.
 *
 * Built by cpu_backend.py with the system C compiler into a cached shared library and
 * called through ctypes. Threads come from OpenMP: torch ships the GNU runtime
 * (libgomp.so.1) and has it loaded before this library is, so both share one pool.
 *
 * Layouts (row-major, contiguous):
 *   q, out       [rows, hq, d]      sequence i's query is row rows[i]
 *   k/v cache    [pages * page_size, hkv, d]   (NHD pages, flattened)
 *   kv_starts    [n]                sequence i's page table starts at kv_indices[kv_starts[i]]
 *   seq_lens     [n]                tokens in the cache for sequence i, the new one included
 * Query head j uses KV head j / (hq / hkv), as GQA's repeat_interleave does.
 *
 * One task per sequence (or per range of its context when there are few sequences),
 * three passes over its positions: scores of every query head against each K row (a row
 * holds all KV heads, so it is read once), exponentials per head, then the weighted sum
 * of V rows; ranges are merged by their maxima and sums at the end. window > 0 keeps the
 * last `window` positions; softcap > 0 maps each score s to softcap * tanh(s / softcap).
 * Rows come from scattered pages, so each pass prefetches the row AHEAD tokens on.
 */

#include <math.h>
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>

#define AHEAD 4
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

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

/* e^x for x <= 0 (softmax after subtracting the max), written so loops over it vectorize:
 * x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial (Cephes' expf
 * coefficients), 2^n put into the exponent bits. Within 2 ulp of expf; 0 below -87. */
INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    __builtin_memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

INLINE const float *row_of(const float *cache, const int32_t *pages, int64_t t, int64_t page_size, int64_t row) {
    return cache + ((int64_t)pages[t / page_size] * page_size + t % page_size) * row;
}

/* ask for the cache lines of token t's row before they are needed (none past `end`) */
INLINE void prefetch_row(const float *cache, const int32_t *pages, int64_t t, int64_t end, int64_t page_size, int64_t row) {
    if (t >= end) return;
    const float *r = row_of(cache, pages, t, page_size, row);
    for (int64_t e = 0; e < row; e += 16) __builtin_prefetch(r + e);
}

/* Sequence i's query heads against positions [from, to) of its context, unnormalized:
 * per head j, m[j] = the largest score, l[j] = sum of exp(score - m[j]) and
 * acc[j] = sum of exp(score - m[j]) * V row. scores is [hq][to - from] scratch. */
INLINE void attend_part(const float *qi, const float *k_cache, const float *v_cache, const int32_t *pages,
                        int64_t from, int64_t to, float *scores, float *acc, float *m, float *l, int64_t hq,
                        int64_t hkv, int64_t d, int64_t page_size, float scale, float softcap) {
    const int64_t group = hq / hkv, row = hkv * d, span = to - from;
    for (int64_t t = from; t < to; t++) {
        prefetch_row(k_cache, pages, t + AHEAD, to, page_size, row);
        const float *kr = row_of(k_cache, pages, t, page_size, row);
        for (int64_t h = 0, j = 0; h < hkv; h++)
            for (int64_t g = 0; g < group; g++, j++) {
                float s = dot(qi + j * d, kr + h * d, d) * scale;
                if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
                scores[j * span + (t - from)] = s;
            }
    }
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
    for (int64_t t = from; t < to; t++) {
        prefetch_row(v_cache, pages, t + AHEAD, to, page_size, row);
        const float *vr = row_of(v_cache, pages, t, page_size, row);
        for (int64_t h = 0, j = 0; h < hkv; h++)
            for (int64_t g = 0; g < group; g++, j++) {
                const float p = scores[j * span + (t - from)];
                const float *vh = vr + h * d;
                float *aj = acc + j * d;
                for (int64_t e = 0; e < d; e++) aj[e] += p * vh[e];
            }
    }
}

int radixkv_paged_decode(const float *q, const float *k_cache, const float *v_cache,
                         const int64_t *rows, const int32_t *kv_starts, const int32_t *kv_indices,
                         const int32_t *seq_lens, float *out, int64_t n, int64_t hq, int64_t hkv,
                         int64_t d, int64_t page_size, float scale, int64_t window, float softcap) {
    /* Fewer sequences than twice the threads: split each context into `parts` ranges, so
     * that one long sequence still keeps every thread reading (a thread streams its own
     * contiguous range; splitting by KV head instead measured slower). */
    const int64_t threads = omp_get_max_threads();
    const int64_t parts = n >= 2 * threads ? 1 : (2 * threads + n - 1) / n;
    const int64_t stride = hq * (d + 2); /* one part's acc [hq][d], m [hq], l [hq] */
    float *partial = malloc(sizeof(float) * (size_t)(n * parts * stride));
    if (partial == NULL) return -1;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t task = 0; task < n * parts; task++) {
        const int64_t i = task / parts, part = task % parts;
        const int64_t len = seq_lens[i];
        const int64_t first = (window > 0 && len > window) ? len - window : 0;
        const int64_t from = first + (len - first) * part / parts, to = first + (len - first) * (part + 1) / parts;
        float *acc = partial + task * stride, *m = acc + hq * d, *l = m + hq;
        if (from == to) { /* a range too short to split: contributes nothing */
            for (int64_t j = 0; j < hq; j++) l[j] = 0.0f;
            continue;
        }
        float *scores = malloc(sizeof(float) * (size_t)(hq * (to - from)));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        const float *qi = q + rows[i] * hq * d;
        const int32_t *pages = kv_indices + kv_starts[i];
        /* the common head sizes as constants, so the loops over d unroll into whole vectors */
        if (d == 64)
            attend_part(qi, k_cache, v_cache, pages, from, to, scores, acc, m, l, hq, hkv, 64, page_size, scale, softcap);
        else if (d == 128)
            attend_part(qi, k_cache, v_cache, pages, from, to, scores, acc, m, l, hq, hkv, 128, page_size, scale, softcap);
        else
            attend_part(qi, k_cache, v_cache, pages, from, to, scores, acc, m, l, hq, hkv, d, page_size, scale, softcap);
        free(scores);
    }
    /* each head's output: its parts rescaled to the largest max, summed, divided by the total weight */
    for (int64_t i = 0; i < n && !failed; i++)
        for (int64_t j = 0; j < hq; j++) {
            const float *base = partial + i * parts * stride;
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
            }
            const float inv = 1.0f / total;
            for (int64_t e = 0; e < d; e++) oj[e] *= inv;
        }
    free(partial);
    return failed ? -1 : 0;
}
