/*
 * delta_rule.c - qt_delta_rule_ref, the scalar step of the gated delta
 * rule (Gated DeltaNet's recurrent state, engine/model/hybrid.h): one
 * token through one value head's k x v state. The arithmetic the AVX2 path
 * (delta_rule_avx2.c) is tested against bit for bit: every output element
 * is its own chain of products and sums taken in the order of the key
 * dims, so eight lanes at a time give the same bits.
 *
 * It owns no state and calls nothing else of kernels/.
 */
#include "kernels_internal.h"

void qt_delta_rule_ref(float *S, int32_t dk, int32_t dv, const float *q, const float *k,
                       const float *v, float decay, float beta, float *out, float *mem)
{
    // decay, then what the state predicts for k: mem = (S decay)^T k
    for (int32_t e = 0; e < dv; e++)
        mem[e] = 0.0f;
    for (int32_t a = 0; a < dk; a++) {
        float *row = S + (int64_t)a * dv;
        for (int32_t e = 0; e < dv; e++) {
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
        for (int32_t e = 0; e < dv; e++) {
            row[e] += k[a] * mem[e];
            out[e] += row[e] * q[a];
        }
    }
}
