/* What cpu_decode.c and qmatmul.c share: e^x for x <= 0, scalar and on the lanes of an AVX2 or
 * AVX-512 vector (softmax after subtracting the max; SwiGLU's sigmoid, from e^-|x|), an IEEE half's
 * value, and the call of a tile function with its row count as a constant. Included by
 * the C sources beside it; radixkv.kernels.build keys a build by the text of such
 * includes too. */

#ifndef RADIXKV_VEXP_H
#define RADIXKV_VEXP_H

#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#ifndef INLINE
#define INLINE static inline __attribute__((always_inline))
#endif

/* The value of the IEEE half with bits h (exact: every half is a float). */
INLINE float half_to_float(uint16_t h) {
#if defined(__F16C__) && defined(__AVX2__) && defined(__FMA__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {  /* zero or subnormal: m * 2^-24 */
        const float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    const uint32_t bits = e == 31 ? sign | 0x7f800000u | (m << 13) : sign | ((e + 112) << 23) | (m << 13);
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* CALL(R) with R the constant 1 .. 6 equal to rows (6 for more): a tile function inlined
 * with a constant row count unrolls its loops and keeps its sums in registers. */
#define WITH_CONSTANT_ROWS(rows, CALL) \
    do {                               \
        switch (rows) {                \
        case 1: CALL(1); break;        \
        case 2: CALL(2); break;        \
        case 3: CALL(3); break;        \
        case 4: CALL(4); break;        \
        case 5: CALL(5); break;        \
        default: CALL(6); break;       \
        }                              \
    } while (0)

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

/* exp_nonpositive on the lanes of a vector: P the intrinsics' prefix (_mm256, _mm512),
 * V and VI the float and integer vector types, CAST the integer-to-float cast. One body
 * for both widths, so a lane's result is the same bits at either. */
#define EXP_NONPOSITIVE_LANES(NAME, P, V, VI, CAST)                                                                 \
    INLINE V NAME(V x) {                                                                                             \
        const V round = P##_set1_ps(12582912.0f);                                                                    \
        x = P##_max_ps(x, P##_set1_ps(-87.0f));                                                                      \
        const V n = P##_sub_ps(P##_fmadd_ps(x, P##_set1_ps(1.44269504088896341f), round), round);                    \
        const V r = P##_fmadd_ps(n, P##_set1_ps(2.12194440e-4f), P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), x));    \
        V p = P##_set1_ps(1.9875691500e-4f);                                                                         \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.3981999507e-3f));                                                       \
        p = P##_fmadd_ps(p, r, P##_set1_ps(8.3334519073e-3f));                                                       \
        p = P##_fmadd_ps(p, r, P##_set1_ps(4.1665795894e-2f));                                                       \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.6666665459e-1f));                                                       \
        p = P##_fmadd_ps(p, r, P##_set1_ps(5.0000001201e-1f));                                                       \
        p = P##_fmadd_ps(P##_mul_ps(p, r), r, P##_add_ps(r, P##_set1_ps(1.0f)));                                     \
        const VI bits = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23);                 \
        return P##_mul_ps(p, CAST(bits));                                                                            \
    }

#if defined(__AVX2__) && defined(__FMA__)
EXP_NONPOSITIVE_LANES(exp8_nonpositive, _mm256, __m256, __m256i, _mm256_castsi256_ps) /* on 8 lanes */
#endif
#if defined(__AVX512F__)
EXP_NONPOSITIVE_LANES(exp16_nonpositive, _mm512, __m512, __m512i, _mm512_castsi512_ps) /* on 16 lanes */
#endif

#endif
