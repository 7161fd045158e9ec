/*
 * delta_rule_avx2.c - qt_delta_rule_avx2, the gated delta rule's step
 * (delta_rule.c's qt_delta_rule_ref) eight value dims at a time: the state
 * walked row by row (key dim by key dim) as the scalar walks it, each
 * element a multiply and an add (no FMA: the scalar rounds twice), so the
 * bits are the scalar's. Dims past a multiple of eight take the scalar
 * loop. Compiled with -mavx2 (CMakeLists.txt); reached through
 * qt_delta_rule only on a CPU that has it.
 */
#include "kernels_internal.h"

#include <immintrin.h>

void qt_delta_rule_avx2(float *S, int32_t dk, int32_t dv, const float *q, const float *k,
                        const float *v, float decay, float beta, float *out, float *mem)
{
    int32_t d8 = dv - dv % 8;
    __m256 g = _mm256_set1_ps(decay);
    // decay, then what the state predicts for k: mem = (S decay)^T k
    for (int32_t e = 0; e < dv; e++)
        mem[e] = 0.0f;
    for (int32_t a = 0; a < dk; a++) {
        float *row = S + (int64_t)a * dv;
        __m256 ka = _mm256_set1_ps(k[a]);
        for (int32_t e = 0; e < d8; e += 8) {
            __m256 r = _mm256_mul_ps(_mm256_loadu_ps(row + e), g);
            _mm256_storeu_ps(row + e, r);
            _mm256_storeu_ps(mem + e,
                             _mm256_add_ps(_mm256_loadu_ps(mem + e), _mm256_mul_ps(r, ka)));
        }
        for (int32_t e = d8; e < dv; e++) {
            row[e] *= decay;
            mem[e] += row[e] * k[a];
        }
    }
    // the delta rule's correction, written into the state; the answer to q
    for (int32_t e = 0; e < dv; e++) {
        mem[e] = (v[e] - mem[e]) * beta;
        out[e] = 0.0f;
    }
    for (int32_t a = 0; a < dk; a++) {
        float *row = S + (int64_t)a * dv;
        __m256 ka = _mm256_set1_ps(k[a]), qa = _mm256_set1_ps(q[a]);
        for (int32_t e = 0; e < d8; e += 8) {
            __m256 r = _mm256_add_ps(_mm256_loadu_ps(row + e),
                                     _mm256_mul_ps(ka, _mm256_loadu_ps(mem + e)));
            _mm256_storeu_ps(row + e, r);
            _mm256_storeu_ps(out + e,
                             _mm256_add_ps(_mm256_loadu_ps(out + e), _mm256_mul_ps(r, qa)));
        }
        for (int32_t e = d8; e < dv; e++) {
            row[e] += k[a] * mem[e];
            out[e] += row[e] * q[a];
        }
    }
}
