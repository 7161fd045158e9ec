/*
 * modelfile.h - the public header of modelfile/: the files models
 * and adapters come in, read and validated before anything is trusted.
 *
 * It offers:
 *   - mf_: mapping a file read-only (guarded, in a server, against the
 *     file being rewritten in place), reading a file, or one beneath an
 *     open folder with no symlink followed (mf_open_in), a JSON file, the
 *     JSON field readers every loader shares (strings, bools, finite
 *     numbers, bounded integers, positive numbers, token ids), a folder's
 *     base name;
 *   - st_: the safetensors reader (mmap, every offset checked), a dense
 *     tensor as a qtensor (st_tensor_qtensor), and the writer
 *     (header padded to 8 bytes, written to a temporary file and renamed,
 *     so a failed write never leaves half a file);
 *   - bnb_: the bitsandbytes 4-bit serialization, one qtensor <-> the
 *     tensors transformers writes for a Linear4bit weight (`X`, `X.absmax`,
 *     `X.quant_map`, `X.nested_absmax`, `X.nested_quant_map`,
 *     `X.quant_state.bitsandbytes__nf4|fp4`);
 *   - gguf_: the GGUF v2/v3 reader, tensors as qtensors read in place;
 *     gguf_out_: the GGUF v3 writer (gguf_write.c), tensor data streamed.
 *
 * It owns the mappings it makes (freed by st_close, gguf_close) and their
 * guard (mf_guard_start); tensors it hands out borrow from them
 * (st_tensor_qtensor copies one whose address is off its element size;
 * the qtensor then owns the copy). It touches nothing but the files it is
 * given, kernels/' qtensor type and, once the guard runs, one real-time
 * signal's handler. Errors: QL_OK or a negative QL_E* code
 * (base/ql_base.h), with a sentence naming the file, the tensor and the
 * problem in msg.
 */
#ifndef QL_MODELFILE_H
#define QL_MODELFILE_H

#include "qtensor.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Map a whole file read-only (mapped_file.c). Refuses what is not a regular
 * file, and a file shorter than min_len with "too short for a <format>
 * header (truncated?)". On success *map and *len describe the mapping
 * (release it with mf_unmap_file); on error nothing is mapped. While the
 * guard runs the mapping is guarded: see mf_guard_start. */
int mf_map_file(const char *path, size_t min_len, const char *format, uint8_t **map, size_t *len,
                char *msg, size_t msg_len);
/* Unmap what mf_map_file mapped (NULL: nothing), releasing its guard. */
void mf_unmap_file(uint8_t *map, size_t len);
/*
 * The guard of mapped model files, for a server: from mf_guard_start on,
 * each mapping holds a read lease on its file, and when another process
 * opens it to rewrite or truncate it, the guard's thread first copies the
 * bytes into memory at the mapping's own address, so the weights stay as
 * loaded and nothing faults (mapped_file.c says how). Without a lease: a
 * warning naming the file on stderr, and the file mapped unguarded. Takes
 * one real-time signal (SIGRTMIN + 4) for the process's life. mf_guard_stop
 * ends the thread and releases the leases (mappings stay). Idempotent;
 * QL_EIO or QL_ENOMEM when the guard cannot start.
 */
int mf_guard_start(char *msg, size_t msg_len);
void mf_guard_stop(void);

/* Read a whole file into *out (malloc'd and NUL-terminated: free()), its
 * length in *out_len; max_bytes > 0 refuses a longer one (QL_EFORMAT
 * "<path>: larger than N bytes") having read one byte past it. QL_EIO when
 * it cannot be opened or read, QL_ENOMEM; each names the file. */
int mf_read_file(const char *path, size_t max_bytes, char **out, size_t *out_len, char *msg,
                 size_t msg_len);

/* Files of a folder opened once (mapped_file.c): open rel (a name, or
 * "a/b") beneath the open folder dirfd, which messages call dir. Without
 * MF_NO_LINKS symlinks are followed. With it, rel may not be absolute or
 * hold "..", and no component may be a symlink, even one that stays
 * inside: a folder whose files may not lead out of it (an adapter's). No
 * path is resolved twice (openat2 RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS,
 * else openat O_NOFOLLOW a component at a time), so a link made meanwhile
 * is refused too. MF_FOLDER wants a folder (O_DIRECTORY), else a regular
 * file (fstat; a FIFO never blocks the open). *fd is the caller's to
 * close. QL_ENOTFOUND: it is not there; QL_EINVAL: a symlink, not a
 * regular file (a folder), absolute or ".."; QL_EIO; each names dir/rel. */
enum { MF_FOLDER = 1, MF_NO_LINKS = 2 };
int mf_open_in(int dirfd, const char *dir, const char *rel, int how, int *fd, char *msg,
               size_t msg_len);
/* mf_read_file for the file rel beneath dirfd, opened by mf_open_in(how). */
int mf_read_in(int dirfd, const char *dir, const char *rel, int how, size_t max_bytes, char **out,
               size_t *out_len, char *msg, size_t msg_len);

/* Read and parse a JSON file into *root, which must be an object (free
 * with cJSON_Delete). max_bytes > 0 refuses a longer file. Errors name the
 * file and, for bad JSON, the byte where parsing stopped. The one JSON file
 * reader: model configs, shard indexes, tokenizers, adapter configs. */
struct cJSON;
int mf_read_json(const char *path, size_t max_bytes, struct cJSON **root, char *msg,
                 size_t msg_len);
/* The same for JSON already in memory: text[0..len) (borrowed, need not be
 * NUL-terminated), source naming it in messages. What mf_read_json does
 * after reading, and the seam the fuzzers drive a JSON loader through. */
int mf_parse_json(const char *text, size_t len, const char *source, struct cJSON **root, char *msg,
                  size_t msg_len);

/* --- JSON fields: the readers every loader shares ----------------------- */

/* The string at key, or NULL when absent or not a string (borrowed from j). */
const char *mf_json_str(const struct cJSON *j, const char *key);
/* The bool at key, or def when it is absent or not a bool. */
bool mf_json_bool(const struct cJSON *j, const char *key, bool def);
/* Whether v is a finite number; *out receives it. */
bool mf_json_number(const struct cJSON *v, double *out);
/* Whether v is a number with no fraction in [lo, hi]; *out receives it. */
bool mf_json_integer(const struct cJSON *v, int64_t lo, int64_t hi, int64_t *out);
/* The integer at key, in [lo, hi], into *out. Absent or null: def, or with
 * `required` QL_EFORMAT "<path>: "<key>" is missing"; anything else that is
 * not such an integer: QL_EFORMAT "<path>: "<key>" must be an integer in
 * [lo, hi]". */
int mf_json_int_field(const char *path, const struct cJSON *j, const char *key, int64_t def,
                      bool required, int64_t lo, int64_t hi, int64_t *out, char *msg,
                      size_t msg_len);
/* The number at key, which must be finite and > 0, into *out. Absent or
 * null: def; anything else: QL_EFORMAT "<path>: "<key>" must be a positive
 * number". */
int mf_json_positive_field(const char *path, const struct cJSON *j, const char *key, double def,
                           double *out, char *msg, size_t msg_len);
/* A token id at key (bos_token_id, eos_token_id): a number in [0, 1e9), or
 * a list whose first element is one (its fraction dropped); -1 otherwise. */
int32_t mf_json_token_id(const struct cJSON *j, const char *key);

/* The last component of path, trailing slashes ignored ("a/b/" -> "b"),
 * into out (truncated to fit): the name a model or adapter folder goes by. */
void mf_path_base(const char *path, char *out, size_t out_len);

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
    ST_F8_E8M0, /* torch.float8_e8m0fnu: a power of two, 2^(e - 127) */
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
    bool owned;         /* map is a copy in memory (st_open_copy), not a mapping */
    st_tensor *tensors; /* in the order of their data offsets */
    size_t n_tensors;
    st_tensor **by_name; /* the same tensors sorted by name (st_find's binary search) */
    char **meta_keys;    /* __metadata__, string to string */
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
/* The same over bytes already read (malloc'd; f owns them from the call
 * on, also on error, and st_close frees them), path naming them: what is
 * read stays as read whatever later happens to the file on disk, where a
 * mapping would change or fault (SIGBUS). For small files a server keeps
 * while it runs (an adapter's weights, read with mf_read_in). */
int st_open_copy(st_file *f, char *bytes, size_t len, const char *path, char *msg, size_t msg_len);
void st_close(st_file *f);
/* The tensor called name, or NULL (O(log n)). Borrowed; lives until
 * st_close. */
const st_tensor *st_find(const st_file *f, const char *name);

/* The dense qtensor kind of a float dtype (QT_F32, QT_F16, QT_BF16), or -1
 * for any other dtype. */
int st_dtype_qt_kind(st_dtype dt);
/*
 * The tensor (F32, F16 or BF16) as a dense qtensor (st_qtensor.c); rows =
 * product of shape[0..ndim-1), cols = shape[ndim-1] (a vector is [1, n]).
 * Its data is borrowed from the mapping (data_borrowed, no copy) when its
 * address suits its element size, else copied into memory the qtensor owns;
 * qt_free is right either way. Errors name the file and the tensor: another
 * dtype is QL_EFORMAT naming it, a tensor of another file QL_EINVAL, a
 * failed copy QL_ENOMEM. The borrowed data lies in a read-only mapping:
 * whoever wants to change the weight (a merge) works on a copy.
 */
int st_tensor_qtensor(const st_file *f, const st_tensor *t, qtensor *out, char *msg,
                      size_t msg_len);

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
bool bnb_is_quantized(const st_file *f, const char *base);

/*
 * Read the 4-bit weight serialized under `base` into *out (free with
 * qt_free). dtype_out (optional, 16 bytes) receives the quant state's
 * "dtype": the float dtype the weight dequantizes to. Every part is checked
 * against the quant state's shape and block sizes.
 */
int bnb_read(const st_file *f, const char *base, qtensor *out, char *dtype_out, char *msg,
             size_t msg_len);

/*
 * Add t (NF4 or FP4) to w under `base` as bitsandbytes serializes it, with
 * `dtype` ("float32", "float16", "bfloat16") as the quant state's dtype.
 * The parts are copied into the writer.
 */
int bnb_write(st_writer *w, const char *base, const qtensor *t, const char *dtype, char *msg,
              size_t msg_len);

/* --- GGUF (gguf.c) ----------------------------------------------------- */

/* GGUF metadata value types, numbered as the format numbers them. */
typedef enum gguf_type {
    GGUF_UINT8 = 0,
    GGUF_INT8 = 1,
    GGUF_UINT16 = 2,
    GGUF_INT16 = 3,
    GGUF_UINT32 = 4,
    GGUF_INT32 = 5,
    GGUF_FLOAT32 = 6,
    GGUF_BOOL = 7,
    GGUF_STRING = 8,
    GGUF_ARRAY = 9,
    GGUF_UINT64 = 10,
    GGUF_INT64 = 11,
    GGUF_FLOAT64 = 12,
    GGUF_TYPE_COUNT
} gguf_type;

/* A string inside the mapped file: not NUL-terminated. */
typedef struct gguf_str {
    const char *ptr;
    uint64_t len;
} gguf_str;

typedef struct gguf_kv {
    char *key;      /* NUL-terminated copy */
    gguf_type type; /* GGUF_ARRAY for arrays */
    gguf_type elem; /* for arrays: the element type; else == type */
    uint64_t n;     /* array length; 1 for a scalar */
    /* scalars, converted: integers in i/u (both set when representable),
     * floats in f, bools in u (0/1), a string in str */
    int64_t i;
    uint64_t u;
    double f;
    gguf_str str;
    /* arrays: numeric elements packed little-endian at `data` (n * size,
     * not aligned: memcpy them out); string elements in strs[0..n)
     * (pointers into the mapping), data NULL */
    const uint8_t *data;
    gguf_str *strs;
} gguf_kv;

typedef struct gguf_tensor {
    char *name;
    uint32_t ggml_type; /* GGML_TYPE_* number as stored */
    int n_dims;
    int64_t ne[4];   /* ne[0] is the fastest-varying (columns) */
    uint64_t offset; /* from the start of the data section */
    size_t nbytes;
    const uint8_t *data; /* inside the mapping; lives until gguf_close */
} gguf_tensor;

typedef struct gguf_file {
    char *path;
    uint8_t *map;
    size_t map_len;
    uint32_t version; /* 2 or 3 */
    gguf_kv *kvs;
    uint64_t n_kv;
    gguf_tensor *tensors;
    uint64_t n_tensors;
    gguf_tensor **by_name; /* the tensors sorted by name, for gguf_find_tensor (NULL: < 2) */
    uint64_t alignment;    /* general.alignment, default 32 */
    size_t data_offset;    /* start of the tensor data section */
} gguf_file;

/*
 * Map and validate a GGUF v2/v3 file: magic, version, counts that fit the
 * file, every string and array inside it, metadata types known, alignment
 * a power of two, tensor dims positive, each tensor's bytes (from its type's
 * block geometry) inside the data section and aligned, no duplicate names.
 * A tensor of a type we cannot compute the size of is refused by its GGML
 * type name. On error nothing is left open.
 */
int gguf_open(gguf_file *f, const char *path, char *msg, size_t msg_len);
void gguf_close(gguf_file *f);
const gguf_kv *gguf_find_kv(const gguf_file *f, const char *key);
const gguf_tensor *gguf_find_tensor(const gguf_file *f, const char *name);
/* The GGML name of a tensor type ("q4_k", "iq2_xs", ...), or "type N". */
const char *gguf_ggml_type_name(uint32_t ggml_type);
/* A GGML type's block geometry (elements per block, bytes per block), as
 * ggml's type traits give it; false for a number ggml does not (or no
 * longer) defines. */
bool gguf_ggml_type_geometry(uint32_t ggml_type, uint32_t *block_size, uint32_t *type_size);
/* Bytes of one metadata value of a fixed-size type; 0 for string and array. */
size_t gguf_value_size(gguf_type t);

/*
 * The tensor as a qtensor of the matching kind (F32, F16, BF16, Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4), its data borrowed
 * from the mapping (no copy, no requantization); rows = product of ne[1..], cols = ne[0]. Any other
 * type is refused with QL_EUNSUPPORTED naming the tensor and its GGML type; QL_EFORMAT for dense
 * data off its element boundary, QL_EINVAL for a tensor of another file.
 * The borrowed data lies in a read-only mapping: whoever wants to change
 * the weight (a merge) works on a copy.
 */
int gguf_tensor_qtensor(const gguf_file *f, const gguf_tensor *t, qtensor *out, char *msg,
                        size_t msg_len);

/*
 * The GGUF v3 writer (gguf_write.c). Declare the metadata (copied from a
 * reader's kv, or set) and every tensor (name, GGML type, dims, ne[0]
 * fastest), then gguf_out_begin writes the head to PATH.tmp, gguf_out_write
 * streams the tensors' data in declaration order (any chunking), and
 * gguf_out_finish renames PATH.tmp over PATH once every byte is there.
 * gguf_out_free closes and removes an unfinished PATH.tmp. alignment 0 is
 * GGUF's default, 32. The caller keeps keys unique.
 */
typedef struct gguf_out gguf_out;
gguf_out *gguf_out_new(uint64_t alignment);
void gguf_out_free(gguf_out *o);
int gguf_out_copy_kv(gguf_out *o, const gguf_kv *kv, char *msg, size_t msg_len);
int gguf_out_set_u32(gguf_out *o, const char *key, uint32_t v, char *msg, size_t msg_len);
int gguf_out_add_tensor(gguf_out *o, const char *name, uint32_t ggml_type, int n_dims,
                        const int64_t *ne, char *msg, size_t msg_len);
int gguf_out_begin(gguf_out *o, const char *path, char *msg, size_t msg_len);
int gguf_out_write(gguf_out *o, const void *data, size_t n, char *msg, size_t msg_len);
int gguf_out_finish(gguf_out *o, char *msg, size_t msg_len);

/* GGML tensor type numbers this project reads (ggml.h's enum ggml_type). */
enum {
    GGML_TYPE_F32 = 0,
    GGML_TYPE_F16 = 1,
    GGML_TYPE_Q4_0 = 2,
    GGML_TYPE_Q4_1 = 3,
    GGML_TYPE_Q5_0 = 6,
    GGML_TYPE_Q5_1 = 7,
    GGML_TYPE_Q8_0 = 8,
    GGML_TYPE_Q2_K = 10,
    GGML_TYPE_Q3_K = 11,
    GGML_TYPE_Q4_K = 12,
    GGML_TYPE_Q5_K = 13,
    GGML_TYPE_Q6_K = 14,
    GGML_TYPE_IQ4_NL = 20,
    GGML_TYPE_IQ4_XS = 23,
    GGML_TYPE_BF16 = 30,
    GGML_TYPE_MXFP4 = 39,
};

#endif
