/*
 * attend_ref.c - qt_attend_ref, the scalar attention inner loop over one
 * run of a paged cache: the arithmetic every fast path (qt_attend_avx2) is
 * tested against, and what qt_attend takes on a CPU without AVX2 or for a
 * head dimension the fast path does not cover.
 *
 * It owns no state and calls no other file of kernels/; it touches only
 * kernels/math/ops_math.h (the running softmax, om_online, shared with the
 * forward pass and CUDA).
 */
#include "kernels_internal.h"
#include "ops_math.h"

void qt_attend_ref(const float *q, const float *k, const float *v, int64_t stride, int32_t n,
                   int32_t d, float scale, float *max, float *sum, float *acc)
{
    om_online sm = {*max, *sum};
    for (int32_t i = 0; i < n; i++, k += stride, v += stride) {
        float a0 = 0, a1 = 0, a2 = 0, a3 = 0;
        int32_t t = 0;
        for (; t + 4 <= d; t += 4) {
            a0 += q[t] * k[t];
            a1 += q[t + 1] * k[t + 1];
            a2 += q[t + 2] * k[t + 2];
            a3 += q[t + 3] * k[t + 3];
        }
        for (; t < d; t++)
            a0 += q[t] * k[t];
        float score = ((a0 + a1) + (a2 + a3)) * scale, f;
        if (om_online_raise(&sm, score, &f)) /* rescale what was summed under the old max */
            for (int32_t u = 0; u < d; u++)
                acc[u] *= f;
        float w = om_online_weight(&sm, score);
        for (int32_t u = 0; u < d; u++)
            acc[u] = om_online_acc(acc[u], w, v[u]);
    }
    *max = sm.max;
    *sum = sm.sum;
}
