/*
 * st_qtensor.c - a dense safetensors tensor as a qtensor, the one way the
 * model loader and the LoRA loader turn F32, F16 and BF16 tensors into
 * what the kernels compute with.
 *
 * The data stays in the file's mapping wherever it can: safetensors puts
 * no alignment on a tensor's offset, so a tensor whose address is off its
 * element size (the kernels load whole elements) is copied instead. It
 * owns nothing beyond such a copy, which the qtensor it fills owns, and
 * touches only the st_file it is given.
 */
#include "modelfile.h"

#include <stdint.h>
#include <string.h>

int st_dtype_qt_kind(st_dtype dt)
{
    return dt == ST_F32 ? QT_F32 : dt == ST_F16 ? QT_F16 : dt == ST_BF16 ? QT_BF16 : -1;
}

int st_tensor_qtensor(const st_file *f, const st_tensor *t, qtensor *out, char *msg, size_t msg_len)
{
    memset(out, 0, sizeof *out);
    int kind = st_dtype_qt_kind(t->dtype);
    if (kind < 0)
        return ql_fail(msg, msg_len, QL_EFORMAT, "%s: tensor '%s' is %s; expected F32, F16 or BF16",
                       f->path, t->name, st_dtype_name(t->dtype));
    /* the tensor must be one of f's, as st_open checked it */
    uintptr_t at = (uintptr_t)t, first = (uintptr_t)f->tensors;
    if (!f->tensors || at < first || (at - first) / sizeof *t >= f->n_tensors)
        return ql_fail(msg, msg_len, QL_EINVAL, "%s: tensor '%s' does not lie in this file",
                       f->path, t->name);
    int64_t rows = 1, cols = t->ndim > 0 ? t->shape[t->ndim - 1] : 1;
    for (int d = 0; d + 1 < t->ndim; d++)
        rows *= t->shape[d];
    if ((uintptr_t)t->data % st_dtype_size(t->dtype) != 0) {
        char why[256];
        int rc = qt_from_dense(out, (qt_kind)kind, t->data, rows, cols, why, sizeof why);
        return rc == QL_OK
                   ? QL_OK
                   : ql_fail(msg, msg_len, QL_ENOMEM, "%s: tensor '%s': %s", f->path, t->name, why);
    }
    out->kind = (qt_kind)kind;
    out->rows = rows;
    out->cols = cols;
    /* read-only mapping: the kernels only read a qtensor's data */
    out->data = (uint8_t *)(uintptr_t)t->data;
    out->data_bytes = t->nbytes;
    out->data_borrowed = true;
    return QL_OK;
}
