/*
 * engine.h - the public header of engine/: model files in and out.
 *
 * For now it offers three things the loaders and the command line share:
 *   - a safetensors reader (mmap, validated before anything is trusted) and
 *     writer (header padded to 8 bytes, written to a temporary file and
 *     renamed, so a failed write never leaves half a file);
 *   - the bitsandbytes 4-bit serialization: one qtensor <-> the tensors
 *     transformers writes for a Linear4bit weight (`X`, `X.absmax`,
 *     `X.quant_map`, `X.nested_absmax`, `X.nested_quant_map`,
 *     `X.quant_state.bitsandbytes__nf4|fp4`);
 *   - the jobs behind `qlserve quantize` and `qlserve inspect`.
 *
 * Errors: functions return ENG_OK (0) or a negative ENG_E* code and write a
 * sentence naming the file, the tensor and the problem into msg.
 */
#ifndef QL_ENGINE_H
#define QL_ENGINE_H

#include "qtensor.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

enum {
    ENG_OK = 0,
    ENG_EIO = -100,       /* the file cannot be opened, read or written */
    ENG_EFORMAT = -101,   /* the file is not what it claims: bad header, offsets, dtypes */
    ENG_ENOTFOUND = -102, /* a tensor or key that must be there is not */
    ENG_EINVAL = -103,    /* a request that cannot be carried out as asked */
    ENG_ENOMEM = -104,
};

const char *eng_strerror(int err);

/* --- safetensors -------------------------------------------------------- */

typedef enum st_dtype {
    ST_BOOL,
    ST_U8,
    ST_I8,
    ST_U16,
    ST_I16,
    ST_F16,
    ST_BF16,
    ST_U32,
    ST_I32,
    ST_F32,
    ST_U64,
    ST_I64,
    ST_F64,
    ST_F8_E4M3,
    ST_F8_E5M2,
    ST_DTYPE_COUNT
} st_dtype;

#define ST_MAX_DIMS 8

/* The dtype's name in a safetensors header ("F32"), and its element size. */
const char *st_dtype_name(st_dtype dt);
size_t st_dtype_size(st_dtype dt);
/* The dtype named `name`, or -1. */
int st_dtype_from_name(const char *name);

typedef struct st_tensor {
    char *name;
    st_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    int64_t numel;
    size_t nbytes;
    const uint8_t *data; /* inside the file's mapping; lives until st_close */
} st_tensor;

typedef struct st_file {
    char *path;
    uint8_t *map; /* the whole file, read-only */
    size_t map_len;
    st_tensor *tensors; /* in the order of their data offsets */
    size_t n_tensors;
    char **meta_keys; /* __metadata__, string to string */
    char **meta_values;
    size_t n_meta;
} st_file;

/*
 * Map and validate a safetensors file: header length inside the file (and
 * under 100 MB, the format's own limit), JSON that parses to an object, each
 * tensor's dtype known, shape non-negative, data_offsets inside the data
 * area, byte length equal to numel * dtype size, no two tensors overlapping
 * and no duplicate names. On error nothing is left open.
 */
int st_open(st_file *f, const char *path, char *msg, size_t msg_len);
void st_close(st_file *f);
/* The tensor called name, or NULL. Borrowed; lives until st_close. */
const st_tensor *st_find(const st_file *f, const char *name);

typedef struct st_writer st_writer;

/* A writer collecting tensors in memory; free with st_writer_free. */
st_writer *st_writer_new(void);
void st_writer_free(st_writer *w);
/*
 * Add a tensor. data is copied when copy is true; otherwise it is borrowed
 * and must live until st_writer_write returns. Refuses a duplicate name or a
 * byte count that does not match shape and dtype.
 */
int st_writer_add(st_writer *w, const char *name, st_dtype dtype, int ndim, const int64_t *shape,
                  const void *data, size_t nbytes, bool copy, char *msg, size_t msg_len);
/* Add a __metadata__ entry (both strings copied). */
int st_writer_set_metadata(st_writer *w, const char *key, const char *value);
/* Write everything to path (through path.tmp and a rename). */
int st_writer_write(st_writer *w, const char *path, char *msg, size_t msg_len);

/* --- the bitsandbytes 4-bit serialization -------------------------------- */

/* True when the file holds `base`.quant_state.bitsandbytes__nf4 or __fp4. */
bool eng_bnb_is_quantized(const st_file *f, const char *base);

/*
 * Read the 4-bit weight serialized under `base` into *out (free with
 * qt_free). dtype_out (optional, 16 bytes) receives the quant state's
 * "dtype": the float dtype the weight dequantizes to. Every part is checked
 * against the quant state's shape and block sizes.
 */
int eng_bnb_read(const st_file *f, const char *base, qtensor *out, char *dtype_out, char *msg,
                 size_t msg_len);

/*
 * Add t (NF4 or FP4) to w under `base` as bitsandbytes serializes it, with
 * `dtype` ("float32", "float16", "bfloat16") as the quant state's dtype.
 * The parts are copied into the writer.
 */
int eng_bnb_write(st_writer *w, const char *base, const qtensor *t, const char *dtype, char *msg,
                  size_t msg_len);

/* --- the jobs behind the command line ------------------------------------ */

typedef struct eng_quantize_opts {
    const char *in_path;
    const char *out_path;
    const char *kind;  /* "nf4" or "fp4" */
    int32_t blocksize; /* 0: 64 */
    bool double_quant;
} eng_quantize_opts;

/*
 * Quantize every 2-D float tensor of a safetensors file to NF4/FP4 and
 * write the bitsandbytes serialization; copy every other tensor and the
 * metadata unchanged. A file that already holds bitsandbytes quant state is
 * refused. One line per tensor goes to log (may be NULL).
 */
int eng_quantize_file(const eng_quantize_opts *o, FILE *log, char *msg, size_t msg_len);

/*
 * Print what a safetensors file holds: each bitsandbytes-quantized weight
 * as one entry (kind, shape, blocksize, nesting, dtype, bytes), every other
 * tensor with its dtype and shape, and the metadata.
 */
int eng_inspect_file(const char *path, FILE *out, char *msg, size_t msg_len);

#endif
