/*
 * split.c - a fused weight's rows as tensors of their own: Phi-3's qkv_proj
 * and gate_up_proj (layers.c), an expert's slab of a 3-D expert tensor
 * (experts.c), and GPT-OSS's transposed, interleaved expert tensors
 * (model_split_transposed). Each part is finished (quantized on load, --dtype) as a
 * linear of its own, so it is what a separate weight would have been.
 *
 * It owns nothing: a part is a view of the fused tensor where the kind
 * stores rows back to back (borrowed when the fused one is borrowed from
 * the mapping), else a copy the caller's tensor owns; a transposed part is
 * always a copy.
 */
#include "internal/model_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/*
 * Rows [r0, r0 + n) of a bitsandbytes 4-bit fused weight (a Phi-3 saved
 * with load_in_4bit): its blocks run over the flattened rows, so the part
 * starts on a block boundary or is refused by name. The part copies its
 * codes and takes each block's absmax as the fused tensor dequantizes it
 * (double quantization undone, so the part is single-quantized with the
 * same values, bit for bit).
 */
static int split_bnb4_rows(const char *name, const qtensor *fused, int64_t r0, int64_t n,
                           qtensor *out, char *msg, size_t msg_len)
{
    int64_t e0 = r0 * fused->cols, count = n * fused->cols, bs = fused->blocksize;
    if (e0 % bs != 0 || e0 % 2 != 0)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "tensor '%s': its part at row %lld does not start on a %lld-element "
                       "block, so it cannot be split",
                       name, (long long)r0, (long long)bs);
    int64_t nb = (count + bs - 1) / bs;
    float *absmax = malloc((size_t)nb * sizeof *absmax);
    if (!absmax)
        return ql_fail(msg, msg_len, QL_ENOMEM, "tensor '%s': out of memory", name);
    for (int64_t b = 0; b < nb; b++)
        absmax[b] = qt_block_absmax(fused, e0 / bs + b);
    qt_bnb4_parts parts = {.kind = fused->kind,
                           .rows = n,
                           .cols = fused->cols,
                           .blocksize = fused->blocksize,
                           .codes = fused->data + e0 / 2,
                           .codes_bytes = (size_t)((count + 1) / 2),
                           .codebook = fused->codebook,
                           .n_blocks = nb,
                           .absmax = absmax};
    char why[256];
    int rc = qt_from_bnb4(out, &parts, why, sizeof why);
    free(absmax);
    if (rc != QL_OK)
        return ql_fail(msg, msg_len, rc, "tensor '%s': %s", name, why);
    return QL_OK;
}

/* Rows [r0, r0 + n) of an FP8 tensor (fused experts, transformers'
 * FP8Experts): the part starts and ends on a block row boundary (or at the
 * last row), so it owns whole rows of the scale grid; its codes stay
 * borrowed where the fused tensor's are, its scales are copied in their
 * stored dtype. A part inside a block row is refused by name. */
static int split_fp8_rows(const char *name, const qtensor *fused, int64_t r0, int64_t n,
                          qtensor *out, char *msg, size_t msg_len)
{
    int64_t br = fused->block_rows;
    if (r0 % br != 0 || (n % br != 0 && r0 + n != fused->rows))
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "tensor '%s': rows %lld..%lld do not start and end on its fp8 blocks of "
                       "%lld rows, so it cannot be split",
                       name, (long long)r0, (long long)(r0 + n), (long long)br);
    size_t ssize = qt_scale_dtype_size(fused->scale_dtype);
    qt_fp8_parts parts = {
        .rows = n,
        .cols = fused->cols,
        .block_rows = fused->block_rows,
        .block_cols = fused->block_cols,
        .codes = fused->data + (size_t)(r0 * fused->cols),
        .borrow_codes = fused->data_borrowed,
        .scale_dtype = fused->scale_dtype,
        .scales =
            (const uint8_t *)fused->block_scales + (size_t)(r0 / br * fused->scale_cols) * ssize,
        .scale_rows = (n + br - 1) / br,
        .scale_cols = fused->scale_cols,
    };
    char why[256];
    int rc = qt_from_fp8(out, &parts, why, sizeof why);
    if (rc != QL_OK)
        return ql_fail(msg, msg_len, rc, "tensor '%s': %s", name, why);
    return QL_OK;
}

/* Dense and GGUF-block kinds store rows whole and back to back, so a part
 * is a view (borrowed, when the fused tensor is borrowed from the mapping;
 * else a copy). bitsandbytes 4-bit and FP8 parts are copies of their
 * scales (split_bnb4_rows, split_fp8_rows). */
int model_split_rows(const model_loader *L, const char *name, const qtensor *fused, int64_t r0,
                     int64_t n, qtensor *out, char *msg, size_t msg_len)
{
    const qt_traits *tr = &qt_traits_table[fused->kind];
    if (fused->kind == QT_NF4 || fused->kind == QT_FP4 || fused->kind == QT_FP8) {
        int rc = fused->kind == QT_FP8 ? split_fp8_rows(name, fused, r0, n, out, msg, msg_len)
                                       : split_bnb4_rows(name, fused, r0, n, out, msg, msg_len);
        return rc == QL_OK ? model_finish_weight(L, name, ROLE_LINEAR, out, msg, msg_len) : rc;
    }
    if (!tr->is_dense && !tr->is_gguf)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "tensor '%s' is %s; qlserve splits fused projections of dense, GGUF "
                       "block, bitsandbytes 4-bit and fp8 kinds",
                       name, tr->name);
    size_t row_bytes = fused->data_bytes / (size_t)fused->rows;
    qtensor view = *fused;
    view.rows = n;
    view.data = fused->data + (size_t)r0 * row_bytes;
    view.data_bytes = (size_t)n * row_bytes;
    view.data_borrowed = true;
    int rc = QL_OK;
    if (fused->data_borrowed)
        *out = view;
    else if ((rc = qt_clone(out, &view)) != QL_OK)
        return ql_fail(msg, msg_len, QL_ENOMEM, "tensor '%s': out of memory", name);
    return model_finish_weight(L, name, ROLE_LINEAR, out, msg, msg_len);
}

/*
 * A part of a transposed 3-D expert tensor as an [out, in] weight of its
 * own: `all` holds the experts as runs of `in` rows of `width` values
 * (GPT-OSS's gate_up_proj [experts, hidden, 2 * ff], down_proj [experts,
 * ff, hidden]: y = x @ W[e], the transpose of a linear's layout), and
 * output o of expert e is column first + step * o of expert e's run
 * (gate_up's gate is columns 0, 2, 4, ..., its up 1, 3, 5, ...). A copy,
 * element by element, in the tensor's own dense kind (F32, F16 or BF16);
 * then finished as a linear of its own.
 */
int model_split_transposed(const model_loader *L, const char *name, const qtensor *all, int64_t e,
                           int64_t in, int64_t first, int64_t step, int64_t n_out, qtensor *out,
                           char *msg, size_t msg_len)
{
    const qt_traits *tr = &qt_traits_table[all->kind];
    if (!tr->is_dense)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "tensor '%s' is %s; qlserve reads transposed expert tensors (GPT-OSS's "
                       "fused gate_up_proj, down_proj) of dense kinds (f32, f16, bf16)",
                       name, tr->name);
    size_t es = all->kind == QT_F32 ? 4 : 2, width = (size_t)all->cols;
    unsigned char *buf = malloc((size_t)n_out * (size_t)in * es);
    if (!buf)
        return ql_fail(msg, msg_len, QL_ENOMEM, "tensor '%s': out of memory", name);
    const unsigned char *src = all->data + (size_t)(e * in) * width * es;
    for (int64_t o = 0; o < n_out; o++)
        for (int64_t i = 0; i < in; i++)
            memcpy(buf + ((size_t)o * (size_t)in + (size_t)i) * es,
                   src + ((size_t)i * width + (size_t)(first + step * o)) * es, es);
    int rc = qt_from_dense(out, all->kind, buf, n_out, in, msg, msg_len);
    free(buf);
    return rc == QL_OK ? model_finish_weight(L, name, ROLE_LINEAR, out, msg, msg_len) : rc;
}
