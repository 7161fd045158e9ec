/*
 * qt_cuda_sample.h - a plain temperature draw on the device (no top-k,
 * top-p or penalty), the same token engine/scheduler/sampler.c draws from the same
 * logits and uniform: the arithmetic is kernels/math/sample_math.h's, which the
 * CPU sampler calls too. Plain C, conventions as qt_cuda_ops.h.
 */
#ifndef QL_QT_CUDA_SAMPLE_H
#define QL_QT_CUDA_SAMPLE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * For each row r < rows of logits ([rows][vocab], device) whose
 * inv_temperature[r] > 0: tokens[r] = the draw at temperature
 * 1 / inv_temperature[r] with uniform u[r] in [0, 1). Rows whose
 * inv_temperature is 0 are left alone (their greedy token is
 * qt_cuda_argmax's). inv_temperature, u and tokens are device arrays.
 * vocab up to 1.5M (the block sums live in shared memory). Enqueued on
 * stream; QL_OK or a negative qtensor.h code with msg.
 */
int qt_cuda_sample(const float *logits, int64_t rows, int64_t vocab, const float *inv_temperature,
                   const double *u, int32_t *tokens, void *stream, char *msg, size_t msg_len);

#ifdef __cplusplus
}
#endif

#endif
