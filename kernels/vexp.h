/* What cpu_decode.c and qmatmul.c share: e^x for x <= 0, scalar and on eight AVX2 lanes
 * (softmax after subtracting the max; SwiGLU's sigmoid, from e^-|x|), the sum and the
 * maximum of eight lanes, and one float32 tile of outer products (the dequantized weight
 * product's and the extend attention's scores). Included by the C sources beside it;
 * radixkv.kernels.build keys a build by the text of such includes too. */

#ifndef RADIXKV_VEXP_H
#define RADIXKV_VEXP_H

#include <math.h>
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#ifndef INLINE
#define INLINE static inline __attribute__((always_inline))
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* the sum and the maximum of v's eight lanes, each in one fixed order */
INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

INLINE float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#endif

/* ---- a tile of outer products ----
 *
 * out[t][0..TILE_NR) = sum over k < depth of x[t * depth + k] * panel[k][0..TILE_NR), for
 * t < mr <= TILE_MR rows of x (row stride depth); panel [depth][TILE_NR] 32-byte aligned,
 * out [mr][TILE_NR] too. Per k: two vectors of the panel, each row's value broadcast,
 * 2 mr fused multiply-adds (12 accumulators at most: the 16 AVX2 registers' share). Each
 * output is one chain of fused multiply-adds over k in order, from zero, whatever mr (and
 * the portable loop takes the same steps, fmaf rounding once as the lanes do), so a row's
 * result does not depend on the rows beside it. */
#define TILE_NR 16 /* columns: two 8-lane vectors */
#define TILE_MR 6  /* rows at most */

INLINE void tile_mr(const float *panel, int64_t depth, const float *x, const int mr, float *out) {
#if defined(__AVX2__) && defined(__FMA__)
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
        _mm256_store_ps(out + t * TILE_NR, a[t][0]);
        _mm256_store_ps(out + t * TILE_NR + 8, a[t][1]);
    }
#else
    for (int t = 0; t < mr; t++)
        for (int r = 0; r < TILE_NR; r++) {
            float s = 0.0f;
            for (int64_t k = 0; k < depth; k++) s = fmaf(x[t * depth + k], panel[k * TILE_NR + r], s);
            out[t * TILE_NR + r] = s;
        }
#endif
}

/* tile_mr with mr a constant in each call (the loops unroll and the accumulators stay in
 * registers: both need it inlined where it is used) */
INLINE void tile(const float *panel, int64_t depth, const float *x, int mr, float *out) {
    switch (mr) {
    case 1: tile_mr(panel, depth, x, 1, out); break;
    case 2: tile_mr(panel, depth, x, 2, out); break;
    case 3: tile_mr(panel, depth, x, 3, out); break;
    case 4: tile_mr(panel, depth, x, 4, out); break;
    case 5: tile_mr(panel, depth, x, 5, out); break;
    default: tile_mr(panel, depth, x, 6, out); break;
    }
}

/* e^x for x <= 0, written so loops over it vectorize:
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

#endif
