/*
 * split.c - a fused weight's rows as tensors of their own: Phi-3's qkv_proj
 * and gate_up_proj (layers.c), an expert's slab of a 3-D expert tensor
 * (experts.c). Each part is finished (quantized on load, --dtype) as a
 * linear of its own, so it is what a separate weight would have been.
 *
 * It owns nothing: a part is a view of the fused tensor where the kind
 * stores rows back to back (borrowed when the fused one is borrowed from
 * the mapping), else a copy the caller's tensor owns.
 */
#include "internal/model_internal.h"

#include <stdio.h>
#include <stdlib.h>

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

/* Dense and GGUF-block kinds store rows whole and back to back, so a part
 * is a view (borrowed, when the fused tensor is borrowed from the mapping;
 * else a copy). bitsandbytes 4-bit parts are copies (split_bnb4_rows). */
int model_split_rows(const model_loader *L, const char *name, const qtensor *fused, int64_t r0,
                     int64_t n, qtensor *out, char *msg, size_t msg_len)
{
    const qt_traits *tr = &qt_traits_table[fused->kind];
    if (fused->kind == QT_NF4 || fused->kind == QT_FP4) {
        int rc = split_bnb4_rows(name, fused, r0, n, out, msg, msg_len);
        return rc == QL_OK ? model_finish_weight(L, name, ROLE_LINEAR, out, msg, msg_len) : rc;
    }
    if (!tr->is_dense && !tr->is_gguf)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "tensor '%s' is %s; qlserve splits fused projections of dense, GGUF "
                       "block and bitsandbytes 4-bit kinds",
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
