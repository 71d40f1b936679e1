/* The ceiling of the integer tiles' inner work on this CPU (bench_cpu_kernels.py).
 *
 * One block of a tile of radixkv_qgemm (kernels/qmatmul.c: 6 tokens x 16 rows, 32 columns)
 * is 16 steps of 12 integer multiply-adds on 16-bit pairs (vpdpwssd with AVX512-VNNI,
 * else pmaddwd + paddd), each token's pair broadcast from memory, then per token and 8
 * rows the float steps of the bit contract: y = fma(m, sx, fma(float(sum), d * dx, y)),
 * one multiply and two fused multiply-adds, the sums y in memory. On CPUs whose multiply
 * pipes run both the integer and the float multiplies (AMD Zen 4: vpdpwssd, vdpbf16ps,
 * vmulps and vfmadd share two pipes) those 36 float steps cost as much as 36 of the 192
 * integer ones. tile_ops times `iters` such blocks (float_steps 0: the integer steps
 * alone) on `threads` threads, with the weights' loads and decode left out and the
 * weights in registers: what the tiles could reach with those free. Returns seconds
 * (wall), or -1 on a CPU without AVX2 and FMA. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <time.h>

#if defined(__AVX2__) && defined(__FMA__)
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static inline __m256i madd(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, w, x);
#else
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
    __asm__("" : "+x"(acc));  /* as qmatmul.c's madd_acc: no regrouping of the sums (spills) */
    return acc;
#endif
}

volatile float tile_sink;

double tile_ops(long iters, int float_steps, int threads) {
    double t0 = now();
#pragma omp parallel num_threads(threads)
    {
        __m256i a[12], w0 = _mm256_set1_epi16(3), w1 = _mm256_set1_epi16(4);
        int32_t codes[16 * 6];  /* each step's token codes, broadcast from memory as the tiles do */
        float dx[6], dm[3 * 8] __attribute__((aligned(32))), lanes[12 * 8] __attribute__((aligned(32)));
        /* the tokens' scales, the rows' (d of the two halves, m) and the sums, in memory as the tiles keep them */
        for (int j = 0; j < 16 * 6; j++) codes[j] = 0x00050003 + j;
        for (int t = 0; t < 6; t++) dx[t] = 1.0f + (float)t;
        for (int j = 0; j < 12 * 8; j++) lanes[j] = 0.0f;
        for (int j = 0; j < 3 * 8; j++) dm[j] = 0.5f / (float)(1 + j / 8);
        for (int i = 0; i < 12; i++) a[i] = _mm256_setzero_si256();
        __asm__ volatile("" : : "r"(codes), "r"(dx), "r"(dm), "r"(lanes) : "memory");  /* unknown to the compiler */
        for (long k = 0; k < iters; k++) {
#pragma GCC unroll 16
            for (int s = 0; s < 16; s++) {
#pragma GCC unroll 6
                for (int t = 0; t < 6; t++) {
                    const __m256i x = _mm256_set1_epi32(codes[6 * s + t]);
                    a[2 * t] = madd(a[2 * t], w0, x), a[2 * t + 1] = madd(a[2 * t + 1], w1, x);
                }
                __asm__ volatile("" : "+x"(w0), "+x"(w1));  /* a new step's weights: no folding across steps */
            }
            if (float_steps) {
                const __m256 d0 = _mm256_load_ps(dm), d1 = _mm256_load_ps(dm + 8), m = _mm256_load_ps(dm + 16);
#pragma GCC unroll 6
                for (int t = 0; t < 6; t++) {
                    const __m256 s = _mm256_broadcast_ss(dx + t);
                    float *o = lanes + 16 * t;
                    _mm256_store_ps(o, _mm256_fmadd_ps(m, s, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[2 * t]), _mm256_mul_ps(d0, s), _mm256_load_ps(o))));
                    _mm256_store_ps(o + 8, _mm256_fmadd_ps(m, s, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[2 * t + 1]), _mm256_mul_ps(d1, s), _mm256_load_ps(o + 8))));
                }
            }
            __asm__ volatile("" : : : "memory");  /* the next block's codes, scales and sums: loaded again */
        }
        float sum = 0.0f;
        for (int i = 0; i < 12; i++) sum += (float)_mm256_extract_epi32(a[i], 0) + lanes[8 * i];
        tile_sink = sum;
    }
    return now() - t0;
}
#else
double tile_ops(long iters, int float_steps, int threads) {
    (void)iters, (void)float_steps, (void)threads;
    return -1.0; /* no AVX2 and FMA: the tiles run their portable loops */
}
#endif
