/*
 * gguf_writer.h - a GGUF writer for the tests: metadata and tensors in
 * memory, then one file, so tests build the tiny GGUF models they load.
 * Not part of the product (nothing in it writes GGUF).
 */
#ifndef QL_TEST_GGUF_WRITER_H
#define QL_TEST_GGUF_WRITER_H

#include "modelfile.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Free with gguf_writer_free. */
typedef struct gguf_writer gguf_writer;
gguf_writer *gguf_writer_new(void);
void gguf_writer_free(gguf_writer *w);
int gguf_writer_set_u32(gguf_writer *w, const char *key, uint32_t v);
int gguf_writer_set_i32(gguf_writer *w, const char *key, int32_t v);
int gguf_writer_set_f32(gguf_writer *w, const char *key, float v);
int gguf_writer_set_bool(gguf_writer *w, const char *key, bool v);
int gguf_writer_set_str(gguf_writer *w, const char *key, const char *v);
/* Arrays: numeric elements of type elem (n of them, packed), or strings. */
int gguf_writer_set_array(gguf_writer *w, const char *key, gguf_type elem, const void *data,
                          uint64_t n);
int gguf_writer_set_str_array(gguf_writer *w, const char *key, const char *const *strs, uint64_t n);
/* A tensor of GGML type ggml_type, ne[0..n_dims); data copied. */
int gguf_writer_add_tensor(gguf_writer *w, const char *name, uint32_t ggml_type, int n_dims,
                           const int64_t *ne, const void *data, size_t nbytes);
int gguf_writer_write(gguf_writer *w, const char *path, char *msg, size_t msg_len);

/* What gguf_writer_rewrite changes in a copy of a GGUF: edit_kv (may be
 * NULL) sees a copy of each metadata entry and may change it (its arrays'
 * data it points at must outlive the call), returning false to leave it
 * out; then the n_u32 keys u32_keys are set to u32_values; the tensor
 * rename_from (NULL: none) is called rename_to; n_extra tensors are added
 * at the end, extra_names[i] holding the type, shape and data of the
 * file's extra_sources[i]. */
typedef struct {
    bool (*edit_kv)(gguf_kv *kv, void *ctx);
    void *ctx;
    const char *const *u32_keys;
    const uint32_t *u32_values;
    size_t n_u32;
    const char *rename_from, *rename_to;
    const char *const *extra_names;
    const char *const *extra_sources;
    size_t n_extra;
} gguf_rewrite;

/* The GGUF at in rewritten to out with r, everything else as it was. */
int gguf_writer_rewrite(const char *in, const char *out, const gguf_rewrite *r, char *msg,
                        size_t msg_len);

#endif
