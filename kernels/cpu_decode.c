/* Paged decode attention for the CPU: one new token per sequence, read straight from
 * the paged KV cache (no gather copy or dequantized copy), accumulating in float32.
 *
 * Built by cpu_backend.py with the system C compiler into a cached shared library and
 * called through ctypes. Threads come from OpenMP: torch ships the GNU runtime
 * (libgomp.so.1) and has it loaded before this library is, so both share one pool.
 *
 * Layouts (row-major, contiguous):
 *   q, out       [rows, hq, d]      sequence i's query is row rows[i]
 *   k/v cache    [pages * page_size, hkv, d]   (NHD pages, flattened)
 *   k/v params   [pages * page_size, hkv]   int8 only: a log-scale byte b per token and KV head
 *   scales       [256]              int8 only: the scale each byte stands for (KVFormat.log_scales)
 *   basis        [d, d] or NULL     int8 only: the map M of a format that stores rows in another basis
 *   kv_starts    [n]                sequence i's page table starts at kv_indices[kv_starts[i]]
 *   seq_lens     [n]                tokens in the cache for sequence i, the new one included
 * Query head j uses KV head j / (hq / hkv), as GQA's repeat_interleave does.
 *
 * KV formats (kv_format): KV_FP32, elements as they are; KV_INT8, codes c in [-127, 127]
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
 * int8 (attend_part_int8) keeps those passes and splits, with its own inner loops: K's
 * dot products 8 tokens at a time (their sums reduced together), V's weighted sums 16
 * tokens at a time with the sums in registers, the exponentials in vectors; an int8 row
 * is a quarter of an fp32 one, so it prefetches 4 * AHEAD tokens on. AVX2 + FMA when the
 * compiler targets them, portable loops otherwise.
 */

#include <math.h>
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#define AHEAD 4
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { KV_FP32 = 0, KV_INT8 = 1 };

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
    softmax_rows(scores, acc, m, l, hq, d, span);
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

#if defined(__AVX2__) && defined(__FMA__)
/* exp_nonpositive on 8 lanes */
INLINE __m256 exp8_nonpositive(__m256 x) {
    const __m256 round = _mm256_set1_ps(12582912.0f);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), round), round);
    const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

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

/* ask for the cache lines of `bytes` bytes from p */
INLINE void prefetch_bytes(const void *p, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch((const char *)p + o);
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
                             float softcap) {
    const int64_t group = hq / hkv, row = hkv * d, span = to - from;
    for (int64_t u = 0, p = from / page_size, o = from % page_size; u < span; u++) {
        slots[u] = (int64_t)pages[p] * page_size + o;
        if (++o == page_size) o = 0, p++;
    }
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

/* Decode attention of n sequences into out (see the top of this file). kv_format:
 * KV_FP32 (k_params, v_params, scales and basis unused) or KV_INT8 (basis NULL: rows stored as
 * they are). Returns 0, or -1 when scratch memory could not be had or the format is
 * unknown. */
int radixkv_paged_decode(const float *q, const void *k_cache, const void *v_cache, const uint8_t *k_params,
                         const uint8_t *v_params, const float *scales, const float *basis, const int64_t *rows, const int32_t *kv_starts,
                         const int32_t *kv_indices, const int32_t *seq_lens, float *out, int64_t n, int64_t hq,
                         int64_t hkv, int64_t d, int64_t page_size, float scale, int64_t window, float softcap,
                         int64_t kv_format) {
    if (kv_format != KV_FP32 && kv_format != KV_INT8) return -1;
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
        const int64_t span = to - from;
        /* scratch: the scores [hq][span]; int8 also keeps the range's slots [span] (first,
         * for their alignment), a scale per token and KV head and a turned query [hq][d] */
        const size_t bytes = kv_format == KV_FP32
                                 ? sizeof(float) * (size_t)(hq * span)
                                 : sizeof(int64_t) * (size_t)span + sizeof(float) * (size_t)((hq + hkv) * span + hq * d);
        void *scratch = malloc(bytes);
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        const float *qi = q + rows[i] * hq * d;
        const int32_t *pages = kv_indices + kv_starts[i];
        if (kv_format == KV_FP32) {
            const float *kc = k_cache, *vc = v_cache;
            float *scores = scratch;
            /* the common head sizes as constants, so the loops over d unroll into whole vectors */
            if (d == 64)
                attend_part(qi, kc, vc, pages, from, to, scores, acc, m, l, hq, hkv, 64, page_size, scale, softcap);
            else if (d == 128)
                attend_part(qi, kc, vc, pages, from, to, scores, acc, m, l, hq, hkv, 128, page_size, scale, softcap);
            else
                attend_part(qi, kc, vc, pages, from, to, scores, acc, m, l, hq, hkv, d, page_size, scale, softcap);
        } else {
            const int8_t *kc = k_cache, *vc = v_cache;
            int64_t *slots = scratch;
            float *scores = (float *)(slots + span), *sc = scores + hq * span, *qb = sc + hkv * span;
#define INT8_PART(D)                                                                                             \
    attend_part_int8(qi, kc, vc, k_params, v_params, scales, basis, pages, from, to, scores, slots, sc, qb, acc, m, l, \
                     hq, hkv, D, page_size, scale, softcap)
            if (d == 64)
                INT8_PART(64);
            else if (d == 128)
                INT8_PART(128);
            else
                INT8_PART(d);
#undef INT8_PART
        }
        free(scratch);
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
