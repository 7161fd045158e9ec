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
    ENG_EBUSY = -105,     /* the queue is full: try again later */
    ENG_ECONFLICT = -106, /* the state forbids it now (unloading a merged adapter) */
    ENG_EDEVICE = -107,   /* no usable device, or the device failed (a CUDA error) */
};

const char *eng_strerror(int err);

/*
 * Read and parse a JSON file into *root, which must be an object (free
 * with cJSON_Delete). max_bytes > 0 refuses a longer file. Errors name the
 * file and, for bad JSON, the byte where parsing stopped. The one JSON file
 * reader: model configs, shard indexes, tokenizers, adapter configs.
 */
struct cJSON;
int eng_read_json(const char *path, size_t max_bytes, struct cJSON **root, char *msg,
                  size_t msg_len);

/* The last component of path, trailing slashes ignored ("a/b/" -> "b"),
 * into out (truncated to fit): the name a model or adapter folder goes by. */
void eng_path_base(const char *path, char *out, size_t out_len);

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

/* --- GGUF (engine/gguf.c) ------------------------------------------------ */

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
    uint64_t alignment; /* general.alignment, default 32 */
    size_t data_offset; /* start of the tensor data section */
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

/*
 * The tensor as a qtensor of the matching kind (F32, F16, BF16, Q4_0, Q4_1,
 * Q8_0), its data borrowed from the mapping (no copy, no requantization);
 * rows = product of ne[1..], cols = ne[0]. Any other type is refused with
 * QT_EUNSUPPORTED naming the tensor and its GGML type; ENG_EFORMAT for dense
 * data off its element boundary, ENG_EINVAL for a tensor of another file.
 * The borrowed data lies in a read-only mapping: whoever wants to change
 * the weight (a merge) works on a copy.
 */
int gguf_tensor_qtensor(const gguf_file *f, const gguf_tensor *t, qtensor *out, char *msg,
                        size_t msg_len);

/* A GGUF writer for tests and tools: metadata and tensors in memory, then
 * one file. Free with gguf_writer_free. */
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

/* GGML tensor type numbers this project reads (ggml.h's enum ggml_type). */
enum {
    GGML_TYPE_F32 = 0,
    GGML_TYPE_F16 = 1,
    GGML_TYPE_Q4_0 = 2,
    GGML_TYPE_Q4_1 = 3,
    GGML_TYPE_Q8_0 = 8,
    GGML_TYPE_BF16 = 30,
};

/* --- tokenizers (engine/tokenizer.c) ------------------------------------- */

typedef struct tok_tokenizer tok_tokenizer;

/*
 * Load a tokenizer from a Hugging Face tokenizer.json (model type BPE:
 * byte-level as GPT-2, Llama 3, Qwen2, SmolLM2; or SentencePiece-style with
 * byte fallback as Llama 2, Mistral, TinyLlama). config_path, when not NULL,
 * is tokenizer_config.json (add_bos_token, bos/eos tokens). Free with
 * tok_free.
 */
int tok_from_hf(tok_tokenizer **out, const char *tokenizer_json, const char *config_path, char *msg,
                size_t msg_len);
/* The same from GGUF metadata (tokenizer.ggml.*: model "gpt2" or "llama"). */
int tok_from_gguf(tok_tokenizer **out, const gguf_file *f, char *msg, size_t msg_len);
void tok_free(tok_tokenizer *t);

/*
 * Text to ids. add_bos: prepend BOS when the tokenizer's own metadata says
 * the model wants it; parse_special: special and added tokens written in the
 * text become their ids (otherwise they are plain text). *ids is allocated
 * (free()); returns 0 or a negative code.
 */
int tok_encode(const tok_tokenizer *t, const char *text, size_t len, bool add_bos,
               bool parse_special, int32_t **ids, size_t *n_ids, char *msg, size_t msg_len);
/* Ids to text (allocated, NUL-terminated); skip_special drops control
 * tokens. Invalid ids are refused. */
int tok_decode(const tok_tokenizer *t, const int32_t *ids, size_t n, bool skip_special, char **text,
               size_t *len, char *msg, size_t msg_len);

/* Streaming decode: push ids one at a time; out receives only whole UTF-8
 * characters (a partial one waits for the next token). Zero-initialise. */
typedef struct tok_stream {
    uint8_t pending[8]; /* the start of a character still incomplete */
    size_t n_pending;
    size_t n_pushed; /* bytes produced so far: a SentencePiece decoder drops
                        the prefix space only as the very first byte */
} tok_stream;
/* Returns the bytes written to out, or a negative code: for an invalid id,
 * or ENG_EINVAL with nothing changed when out_cap is too small (3 x (3 +
 * the longest piece) always fits; real vocabularies have pieces of 80 bytes
 * and more, so callers size for that or retry). tok_stream_flush emits what
 * is left (invalid UTF-8 as U+FFFD). */
long tok_stream_push(const tok_tokenizer *t, tok_stream *s, int32_t id, char *out, size_t out_cap);
long tok_stream_flush(const tok_tokenizer *t, tok_stream *s, char *out, size_t out_cap);

int32_t tok_bos(const tok_tokenizer *t); /* -1 when none */
int32_t tok_eos(const tok_tokenizer *t);
bool tok_adds_bos(const tok_tokenizer *t);
size_t tok_vocab_size(const tok_tokenizer *t);
/* "byte-level BPE" or "sentencepiece BPE", with the pre-tokenizer's name. */
const char *tok_describe(const tok_tokenizer *t);

/* --- models (engine/model.c) ------------------------------------------------ */

typedef enum eng_arch { ENG_ARCH_LLAMA, ENG_ARCH_MISTRAL, ENG_ARCH_QWEN2 } eng_arch;

typedef enum eng_rope_scaling {
    ENG_ROPE_NONE,
    ENG_ROPE_LINEAR, /* positions divided by factor */
    ENG_ROPE_LLAMA3, /* Llama 3.1's frequency-dependent scaling */
} eng_rope_scaling;

/* What a model is, from config.json or GGUF metadata. */
typedef struct eng_config {
    eng_arch arch;
    int32_t vocab_size;
    int32_t hidden_size;
    int32_t intermediate_size;
    int32_t n_layers;
    int32_t n_heads;
    int32_t n_kv_heads; /* grouped-query attention: n_heads % n_kv_heads == 0 */
    int32_t head_dim;
    int32_t max_position_embeddings;
    float rope_theta;
    eng_rope_scaling rope_scaling;
    float rope_factor;
    float rope_low_freq_factor, rope_high_freq_factor; /* llama3 */
    int32_t rope_original_max_position;                /* llama3 */
    /* rotary pairs: false = (i, i + head_dim/2) as Hugging Face computes
     * them; true = (2i, 2i + 1), the layout llama.cpp's converter leaves in
     * a llama GGUF after permuting the q/k rows */
    bool rope_interleaved;
    float rms_norm_eps;
    bool tie_word_embeddings;
    bool attention_bias;                /* Qwen2: q, k, v projections have biases */
    int32_t sliding_window;             /* Mistral; 0 when none */
    int32_t bos_token_id, eos_token_id; /* -1 when the config names none */
} eng_config;

/* One decoder layer's weights. Norms and biases are dense [1, n]; a bias
 * that does not exist has rows == 0. */
typedef struct eng_layer {
    qtensor attn_norm, ffn_norm;
    qtensor wq, wk, wv, wo;
    qtensor bq, bk, bv;
    qtensor w_gate, w_up, w_down;
} eng_layer;

/*
 * A model in memory: immutable config and weights (no run state), the
 * tokenizer, and the mapped files that borrowed tensors point into. Owned
 * by whoever called eng_model_load; eng_model_free releases everything.
 */
typedef struct eng_model {
    eng_config cfg;
    qtensor embed; /* [vocab, hidden] */
    eng_layer *layers;
    qtensor norm;
    qtensor lm_head; /* rows == 0 when tied to embed */
    tok_tokenizer *tok;
    char format[32]; /* "safetensors", "bitsandbytes-4bit", "gguf" */
    char quant[32];  /* what the linear layers hold: "nf4", "q4_1", "bf16", ... */
    /* what the model calls itself: config.json's _name_or_path or the
     * folder's name; a GGUF's general.name or the file's name */
    char name[256];
    st_file *shards; /* safetensors files kept mapped */
    size_t n_shards;
    gguf_file *gguf; /* or the GGUF file kept mapped */
} eng_model;

typedef struct eng_load_opts {
    const char *path; /* a Hugging Face folder or a .gguf file */
    /* quantize on load: "none" (default), "nf4", "nf4-dq", "fp4", "int4",
     * "int8"; weights that are already quantized are never quantized again */
    const char *quant;
    int32_t blocksize;     /* nf4/fp4 absmax block, default 64 */
    int32_t group_size;    /* int4/int8 group, default 128 for int4, per channel for int8 */
    bool quantize_lm_head; /* lm_head stays dense unless asked */
    /* the float dtype of dense parameters: "f32", "bf16", "f16", or NULL to
     * keep the file's; quant state keeps its own dtype either way */
    const char *dtype;
} eng_load_opts;

/*
 * Load a model: config, weights (mapped, borrowed where the file's layout is
 * the kind's layout; quantized on load when asked), tokenizer. Every tensor
 * is checked against the config's shapes; an architecture or tensor kind we
 * do not run is refused by name. On error *m holds nothing.
 */
int eng_model_load(eng_model *m, const eng_load_opts *o, char *msg, size_t msg_len);
void eng_model_free(eng_model *m);
/* Call fn on every tensor the model holds (embeddings, norms, lm_head
 * when untied, each layer's weights and biases when present). */
void eng_model_each_tensor(const eng_model *m, void (*fn)(const qtensor *t, void *ctx), void *ctx);
/* Bytes of weights the model holds (codes and quant state). */
size_t eng_model_weight_bytes(const eng_model *m);
const char *eng_arch_name(eng_arch a);

/* --- adapters as the engine sees them: low-rank deltas and weight versions
 *     (engine/weights.c) ------------------------------------------------------ */

/* The projections of a decoder layer an adapter may target, in PEFT's
 * module names. */
typedef enum eng_proj {
    ENG_PROJ_Q,
    ENG_PROJ_K,
    ENG_PROJ_V,
    ENG_PROJ_O,
    ENG_PROJ_GATE,
    ENG_PROJ_UP,
    ENG_PROJ_DOWN,
    ENG_N_PROJ
} eng_proj;

/* "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj" */
const char *eng_proj_name(eng_proj p);
/* The parent module in a Hugging Face model: "self_attn" or "mlp". */
const char *eng_proj_parent(eng_proj p);
/* The model's own (pristine) weight of layer l's projection p. */
const qtensor *eng_model_proj(const eng_model *m, int32_t layer, eng_proj p);

/* One module of a LoRA adapter: y += scale * (x @ A^T) @ B^T. */
typedef struct eng_lora_module {
    qtensor a;   /* [rank, in_features], F32, F16 or BF16; rows == 0: not targeted */
    qtensor b;   /* [out_features, rank], rows already in the model's layout (a
                    llama GGUF's permuted q/k rows) */
    float scale; /* lora_alpha / r, or / sqrt(r) with rslora, per module */
} eng_lora_module;

/*
 * A loaded adapter, immutable once built and shared by reference: the
 * registry, every weight version that has it merged and every sequence
 * that applies it hold one reference each. Whoever builds it sets refs to
 * 1 and destroy (called once, by the last eng_lora_unref, on any thread).
 */
typedef struct eng_lora {
    char name[128];
    int32_t n_layers;
    eng_lora_module *modules; /* [n_layers * ENG_N_PROJ] */
    size_t bytes;             /* memory it holds (tensors mapped or copied) */
    int refs;                 /* atomic */
    uint64_t requests;        /* atomic: sequences admitted that asked for it */
    void (*destroy)(struct eng_lora *l);
} eng_lora;

void eng_lora_ref(eng_lora *l);
void eng_lora_unref(eng_lora *l);
/* Layer l's module p, or NULL when the adapter does not target it. */
const eng_lora_module *eng_lora_module_at(const eng_lora *lora, int32_t layer, eng_proj p);

/* An adapter with the user's scale (which multiplies the module scale). */
typedef struct eng_lora_term {
    eng_lora *lora;
    float scale;
} eng_lora_term;

/*
 * A version of the serving weights: for every layer's projection, the
 * tensor it computes with (the model's pristine one, or a merged one the
 * version owns), and the adapter configuration merged into them. Immutable
 * once published, shared by reference: the engine holds the current one
 * and every sequence holds the one it started on, so a merge never changes
 * a running answer. Freed (merged tensors included) by the last unref.
 */
typedef struct eng_weights {
    uint64_t version;
    const eng_model *m;
    const qtensor **proj;  /* [n_layers * ENG_N_PROJ] */
    qtensor *owned;        /* [n_layers * ENG_N_PROJ]: merged tensors (rows == 0: none) */
    eng_lora_term *merged; /* the merged configuration (a reference on each) */
    size_t n_merged;
    int refs; /* atomic */
} eng_weights;

/* A version serving the model's pristine weights with nothing merged
 * (refs 1). */
int eng_weights_new(eng_weights **out, const eng_model *m, uint64_t version, char *msg,
                    size_t msg_len);
/* Serve layer l's projection p with *t: the version takes t over (t is
 * zeroed). Only before the version is published. */
void eng_weights_set(eng_weights *w, int32_t layer, eng_proj p, qtensor *t);
/* Record the merged configuration (references are taken). */
int eng_weights_set_merged(eng_weights *w, const eng_lora_term *terms, size_t n, char *msg,
                           size_t msg_len);
const qtensor *eng_weights_proj(const eng_weights *w, int32_t layer, eng_proj p);
void eng_weights_ref(eng_weights *w);
void eng_weights_unref(eng_weights *w);
/*
 * A 64-bit digest of every weight byte a version serves: embeddings,
 * norms, lm_head and each projection (codes and quant state), in a fixed
 * order. Equal digests mean the same bits (up to a 2^-64 accident).
 * w NULL: the model's own weights.
 */
uint64_t eng_weights_digest(const eng_model *m, const eng_weights *w);

/*
 * The signed difference between a wanted configuration and a merged one:
 * for each wanted adapter, its scale minus the merged scale (dropped when
 * zero); for each merged adapter not wanted, minus its merged scale. *out
 * is allocated (free()); references are NOT taken.
 */
int eng_lora_difference(const eng_lora_term *want, size_t n_want, const eng_lora_term *merged,
                        size_t n_merged, eng_lora_term **out, size_t *n_out);

/* --- inference: KV cache, forward pass, sampling (engine/kv_cache.c,
 *     forward.c, sampler.c) ------------------------------------------------- */

/*
 * The paged KV cache: fixed blocks of `block_tokens` positions, each
 * holding K and V for every layer and kv head (f32), in one arena whose
 * size is set in bytes. A sequence owns a block table; blocks are handed
 * out and taken back whole, so a finished sequence frees its memory at once
 * and a long one never needs a contiguous run.
 */
typedef struct eng_kv_cache eng_kv_cache;

typedef struct eng_seq_kv {
    int32_t *blocks; /* block table, n_blocks entries (owned, realloc'd) */
    int32_t n_blocks;
    int32_t n_tokens; /* positions written so far */
} eng_seq_kv;

/* An arena of `bytes` for cfg's layers and kv heads (block_tokens 0: 16).
 * Refuses a size too small for one block. Free with eng_kv_free. */
int eng_kv_new(eng_kv_cache **out, const eng_config *cfg, size_t bytes, int32_t block_tokens,
               char *msg, size_t msg_len);
/* The same block bookkeeping without the host arena (the positions live
 * elsewhere, e.g. in device memory: see the CUDA backend). */
int eng_kv_new_meta(eng_kv_cache **out, const eng_config *cfg, size_t bytes, int32_t block_tokens,
                    char *msg, size_t msg_len);
void eng_kv_free(eng_kv_cache *kv);
/* Floats one block holds (every layer's K and V for its positions). */
size_t eng_kv_block_floats(const eng_kv_cache *kv);
int32_t eng_kv_block_tokens(const eng_kv_cache *kv);
int32_t eng_kv_total_blocks(const eng_kv_cache *kv);
int32_t eng_kv_free_blocks(const eng_kv_cache *kv);
/* Blocks needed for a sequence to hold n_tokens positions in all. */
int32_t eng_kv_blocks_for(const eng_kv_cache *kv, int32_t n_tokens);
/* Grow s to hold n_tokens positions; ENG_ENOMEM (nothing taken) when the
 * free blocks do not suffice. */
int eng_kv_reserve(eng_kv_cache *kv, eng_seq_kv *s, int32_t n_tokens);
/* Give back all of s's blocks and zero it. */
void eng_kv_release(eng_kv_cache *kv, eng_seq_kv *s);

/* A worker pool for the CPU kernels (engine/pool.c): n threads (0: the
 * machine's cores), the caller's thread included. */
typedef struct eng_pool eng_pool;
int eng_pool_new(eng_pool **out, int n_threads, char *msg, size_t msg_len);
void eng_pool_free(eng_pool *p);
int eng_pool_threads(const eng_pool *p);
/* Run fn(ctx, i, n) for i in [0, n) split over the threads; returns when
 * all are done. */
void eng_pool_run(eng_pool *p, void (*fn)(void *ctx, int64_t begin, int64_t end), void *ctx,
                  int64_t n, int64_t grain);

/* One sequence's part of a forward step: its new tokens, written at
 * positions [pos, pos + n_tokens) of its KV (already reserved to hold
 * them), attending to everything before them. */
typedef struct eng_step_seq {
    eng_seq_kv *kv;
    const int32_t *tokens;
    int32_t n_tokens;
    int32_t pos;
    /* the weight version the sequence runs on (NULL: the model's own) and
     * the adapters it applies unmerged on top of it, in order (the signed
     * difference between what it wants and what the version has merged) */
    const struct eng_weights *weights;
    const struct eng_lora_term *delta;
    int32_t n_delta;
    /* the caller only needs the greedy token (eng_sample's at temperature 0
     * without a penalty): a backend that can choose it where the logits are
     * (eng_backend_forward's tokens) need not return this row's logits */
    bool greedy;
    /* or the caller wants a plain temperature draw (eng_sampler_plain_draw)
     * with this 1 / T and this uniform, already taken from the sequence's
     * stream: only for a backend that draws (eng_backend_draws), which then
     * must put the token in tokens */
    bool draw;
    float inv_temperature;
    double u;
} eng_step_seq;

/* Scratch of the forward pass, sized for up to max_tokens new tokens per
 * step (a step's prefill chunks plus decodes). */
typedef struct eng_forward_state eng_forward_state;
int eng_forward_state_new(eng_forward_state **out, const eng_model *m, int32_t max_tokens,
                          char *msg, size_t msg_len);
void eng_forward_state_free(eng_forward_state *st);

/*
 * One batched step over n_seqs sequences: every weight is read once for all
 * their new tokens together. logits (n_seqs x vocab) receives the logits of
 * each sequence's last new token. A sequence's result does not depend on
 * what else is in the step (bit for bit). Refuses, changing nothing: token
 * ids outside the vocabulary, positions past the context or the reserved
 * KV, a position that leaves a gap after the cached ones, and more than the
 * state's max_tokens new tokens in one step.
 */
int eng_forward(eng_forward_state *st, const eng_model *m, eng_kv_cache *kv, eng_pool *pool,
                const eng_step_seq *seqs, int32_t n_seqs, float *logits, char *msg, size_t msg_len);

/*
 * The unmerged LoRA product, added after a base product: y[b] += scale *
 * (x[b] @ A^T) @ B^T for the batch rows of x (in_features wide) and y
 * (out_features wide), both products over the pool. t (batch * rank) and u
 * (batch * out_features) are scratch. Each row's arithmetic is the same
 * whatever the batch, so grouping rows never changes a bit.
 */
void eng_lora_apply(eng_pool *pool, const eng_lora_module *mod, float scale, const float *x,
                    int64_t batch, float *y, float *t, float *u);

/* --- backends: where a forward step runs (engine/backend.c; the CUDA one in
 *     engine/backend_cuda.c when built with CUDA) ------------------------------ */

/* Which backend: cpu (always built, the reference; the zero value, so
 * options built by hand stay on the CPU), cuda (an NVIDIA GPU), or auto
 * (cuda when this build has it and a device is present, else cpu: what the
 * command line defaults to). */
typedef enum eng_device {
    ENG_DEVICE_CPU = 0,
    ENG_DEVICE_CUDA,
    ENG_DEVICE_AUTO,
} eng_device;

/* "auto", "cpu", "cuda" -> *out; ENG_EINVAL naming the value otherwise. */
int eng_device_parse(const char *name, eng_device *out, char *msg, size_t msg_len);
const char *eng_device_name(eng_device d);
/* Whether this build has the CUDA backend. */
bool eng_cuda_built(void);

/*
 * A backend: the model's weights where it computes, its KV cache, and the
 * scratch of a step. The CPU backend borrows the model's tensors and runs
 * eng_forward over a worker pool; the CUDA backend uploads every weight
 * once at creation (in its quantized layout), keeps the KV cache in device
 * memory, and runs the step there. Both take the same eng_step_seq lists
 * and must give the same greedy tokens. Owned by one thread at a time.
 */
typedef struct eng_backend eng_backend;

typedef struct eng_backend_opts {
    eng_device device;
    int threads;          /* CPU kernel threads; 0: the machine's cores */
    int32_t max_tokens;   /* new tokens one step may carry */
    int32_t max_seqs;     /* sequences one step may carry */
    size_t kv_bytes;      /* KV cache size (host or device memory) */
    int32_t block_tokens; /* KV block, positions */
} eng_backend_opts;

/* Make the backend o->device names for model m (borrowed: it must outlive
 * the backend). cuda without a device, or in a build without CUDA, is an
 * error naming why; out of device memory names what did not fit. */
int eng_backend_new(eng_backend **out, const eng_model *m, const eng_backend_opts *o, char *msg,
                    size_t msg_len);
void eng_backend_free(eng_backend *b);
/* "cpu (2 threads)", "cuda (NVIDIA H200, sm_90, 5.1 GiB of weights)": for
 * logs and /info. */
const char *eng_backend_describe(const eng_backend *b);
/* Which device it is (never ENG_DEVICE_AUTO). */
eng_device eng_backend_device(const eng_backend *b);
/* Whether the backend chooses greedy tokens and makes plain temperature
 * draws itself (eng_step_seq.greedy, .draw): the CUDA one does. */
bool eng_backend_draws(const eng_backend *b);
/* The backend's KV cache bookkeeping (block tables are handed out here). */
eng_kv_cache *eng_backend_kv(eng_backend *b);
/*
 * One step, as eng_forward: logits (n_seqs x vocab, host memory) gets each
 * sequence's last-token logits; where tokens is not NULL and seqs[k].greedy,
 * the backend may instead put the greedy token in tokens[k] and leave row k
 * of logits unwritten; tokens[k] = -1 where it did not.
 */
int eng_backend_forward(eng_backend *b, const eng_step_seq *seqs, int32_t n_seqs, float *logits,
                        int32_t *tokens, char *msg, size_t msg_len);
/*
 * eng_weights_digest of what the backend computes with for version w (NULL:
 * the model's own weights): the CPU backend's are the host tensors
 * themselves; the CUDA backend copies its device tensors back (building
 * the version's device copy, merges included, if no step has yet), so a
 * merge and an unmerge on the device can be checked bit for bit.
 */
int eng_backend_digest(eng_backend *b, const eng_weights *w, uint64_t *digest, char *msg,
                       size_t msg_len);

/* How a request samples (engine/sampler.c). Zero-initialised: greedy. */
typedef struct eng_sampling {
    float temperature;        /* 0: greedy; > 0 */
    int32_t top_k;            /* 0: off */
    float top_p;              /* 0 or 1: off; else in (0, 1) */
    float repetition_penalty; /* 0 or 1: off; else > 0 (CTRL / HF semantics) */
    uint64_t seed;            /* the same seed and inputs give the same tokens */
} eng_sampling;

/* Check the fields, naming the first bad one and its value. */
int eng_sampling_check(const eng_sampling *p, char *msg, size_t msg_len);

/* A sequence's sampler: its parameters, its own random stream (so what
 * else is in the batch never changes its tokens), and the tokens seen (for
 * the repetition penalty). */
typedef struct eng_sampler {
    eng_sampling p;
    uint64_t rng[4];
    int32_t *seen; /* distinct token ids seen, for the penalty (owned) */
    size_t n_seen, cap_seen;
} eng_sampler;

int eng_sampler_init(eng_sampler *s, const eng_sampling *p, const int32_t *prompt, size_t n_prompt);
void eng_sampler_free(eng_sampler *s);
/* Pick the next token from logits (vocab entries, modified in place);
 * scratch holds at least vocab floats + vocab int32s. Records the token. */
int32_t eng_sample(eng_sampler *s, float *logits, int32_t vocab, void *scratch);
/* Record a token chosen elsewhere (a backend's greedy choice) as eng_sample
 * records its own. */
void eng_sampler_record(eng_sampler *s, int32_t token);
/* Whether s's next token is the plain argmax of its logits (temperature 0,
 * no penalty), which a backend can choose where the logits are. */
bool eng_sampler_greedy(const eng_sampler *s);
/* Whether s's next token is a plain temperature draw over the whole
 * vocabulary (no top-k, top-p or penalty), which a backend can make where
 * the logits are (kernels/sample_math.h); *inv_temperature receives the
 * 1 / T eng_sample would use. */
bool eng_sampler_plain_draw(const eng_sampler *s, int32_t vocab, float *inv_temperature);
/* The uniform in [0, 1) eng_sample would draw next (taken from s's stream:
 * a backend's draw then stands for eng_sample's). */
double eng_sampler_uniform(eng_sampler *s);

/* Stop strings, matched on the decoded text across token boundaries and
 * never emitted: text that could still be the start of a stop string is
 * held back until it cannot. */
typedef struct eng_stop eng_stop;
/* Copies the strings (empty ones are refused). */
int eng_stop_new(eng_stop **out, const char *const *stops, size_t n, char *msg, size_t msg_len);
void eng_stop_free(eng_stop *s);
/*
 * Feed decoded text. *emit (borrowed until the next call) and *emit_len
 * receive what is safe to show now. Returns true when a stop string has
 * completed: the text before it has been emitted, the rest is dropped, and
 * generation should end.
 */
bool eng_stop_feed(eng_stop *s, const char *text, size_t len, const char **emit, size_t *emit_len);
/* At the end of generation (EOS, length): what was held back. */
void eng_stop_flush(eng_stop *s, const char **emit, size_t *emit_len);

/* --- the engine: continuous batching on one thread (engine/scheduler.c) --- */

typedef enum eng_finish {
    ENG_FINISH_EOS,       /* the model ended its answer */
    ENG_FINISH_LENGTH,    /* max_new_tokens, or the context is full */
    ENG_FINISH_STOP,      /* a stop string (not emitted) */
    ENG_FINISH_CANCELLED, /* eng_engine_cancel, or the engine stopped */
    ENG_FINISH_ERROR,     /* the step failed (out of memory); the engine goes on */
} eng_finish;

/* "eos", "length", "stop", "cancelled", "error" */
const char *eng_finish_name(eng_finish f);

typedef struct eng_usage {
    int32_t prompt_tokens;
    int32_t generated_tokens;
    double queued_s;  /* submitted to admitted */
    double prefill_s; /* admitted to first token */
    double decode_s;  /* first token to the last */
} eng_usage;

/* A generation request. The engine copies what it needs at submit. The
 * callbacks run on the engine thread between steps: they must be quick
 * and must not call back into the engine (the server hands them to its
 * loop through uv_async). */
typedef struct eng_request {
    const char *prompt;
    size_t prompt_len;
    int32_t max_new_tokens; /* >= 1 */
    eng_sampling sampling;
    const char *const *stop; /* stop strings, n_stop of them */
    size_t n_stop;
    /* the adapter configuration wanted (none: the base model); the engine
     * takes its own references at submit */
    const eng_lora_term *adapters;
    size_t n_adapters;
    /* text (UTF-8, whole characters, stop strings held back) and the token
     * that completed it; text may be empty */
    void (*on_token)(void *user, int32_t token, const char *text, size_t len);
    /* exactly once per admitted request */
    void (*on_done)(void *user, eng_finish reason, const eng_usage *usage);
    void *user;
} eng_request;

typedef struct eng_engine_opts {
    size_t kv_bytes;        /* KV cache size; 0: 256 MiB */
    int32_t block_tokens;   /* KV block; 0: 16 */
    int32_t step_tokens;    /* token budget of one step; 0: 256 */
    int32_t prefill_chunk;  /* most prompt tokens of one sequence per step; 0: 128 */
    int32_t max_running;    /* sequences decoding together; 0: 64 */
    int32_t max_queued;     /* waiting requests before submit refuses; 0: 256 */
    int32_t max_new_tokens; /* the largest max_new_tokens accepted; 0: 4096 */
    /* prompt plus max_new_tokens may not pass it; 0: the model's context */
    int32_t max_context;
    int threads; /* kernel threads; 0: the machine's cores */
    eng_device device;
} eng_engine_opts;

typedef struct eng_engine eng_engine;

/* Start the engine thread over a loaded model (borrowed: it must outlive
 * the engine). */
int eng_engine_start(eng_engine **out, const eng_model *m, const eng_engine_opts *o, char *msg,
                     size_t msg_len);
/*
 * Check and queue a request: an empty prompt, invalid UTF-8, a prompt
 * longer than the context or the whole KV cache, prompt plus
 * max_new_tokens past max_context (when set), max_new_tokens out of range,
 * bad sampling parameters or a full queue are refused here with the reason
 * (nothing is queued). *id names it for eng_engine_cancel.
 */
int eng_engine_submit(eng_engine *e, const eng_request *r, uint64_t *id, char *msg, size_t msg_len);
/*
 * Publish a new weight version (the engine takes the caller's reference):
 * the engine switches to it between two steps; sequences admitted after
 * run on it, those already running finish on the version they started on.
 * Returns at once; eng_engine_weights tells what serves.
 */
void eng_engine_publish(eng_engine *e, eng_weights *w);
/* The version new sequences get (the last published), with a reference
 * for the caller. */
eng_weights *eng_engine_weights(eng_engine *e);
/* Block until every version but the current one has been released (no
 * sequence still runs on an older one) or timeout_s passes; true when so. */
bool eng_engine_wait_versions(eng_engine *e, double timeout_s);

/* Cancel a request (waiting or running); its on_done says cancelled. */
void eng_engine_cancel(eng_engine *e, uint64_t id);
/* Cancel everything, join the engine thread, free. */
void eng_engine_stop(eng_engine *e);

typedef struct eng_engine_stats {
    int32_t waiting, running;
    int32_t kv_blocks_used, kv_blocks_total;
    uint64_t steps, tokens_generated, prompt_tokens;
    uint64_t weights_version;  /* the version new sequences get */
    int32_t weights_versions;  /* versions alive (the current one and older ones still running) */
    uint64_t adapter_requests; /* admitted sequences that applied an adapter unmerged */
} eng_engine_stats;
/* A snapshot, safe from any thread. */
void eng_engine_stats_get(eng_engine *e, eng_engine_stats *out);
/* The backend the engine runs on, described (eng_backend_describe); lives
 * as long as the engine. */
const char *eng_engine_backend(const eng_engine *e);

/* What requantizing cost one module of a merge, as adapters' lora_cost
 * sums it (dot = <Q - W, d>, delta_sq = |d|^2, err_sq = |Q - (W + d)|^2). */
typedef struct eng_merge_cost {
    double dot, delta_sq, err_sq;
    bool merged; /* false: the module had nothing merged into it */
} eng_merge_cost;

/* Whether the engine's backend merges adapters itself (CUDA): a version
 * then needs only its merged configuration (eng_weights_set_merged), not
 * host copies of the merged tensors. */
bool eng_engine_merges_on_device(const eng_engine *e);
/*
 * Have the backend build its copy of version w now (merging on the device
 * what w's configuration merges), on the engine thread between two steps,
 * and wait for it: costs (n_layers * ENG_N_PROJ entries, or NULL) receives
 * each module's merge figures and *digest eng_backend_digest's digest of
 * what the device will serve. Call before publishing w, so the first step
 * on it does not stall. ENG_EINVAL when the backend does not merge.
 */
int eng_engine_prepare(eng_engine *e, const eng_weights *w, eng_merge_cost *costs, uint64_t *digest,
                       char *msg, size_t msg_len);

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
 * Print what a file or folder holds. A .safetensors file: each
 * bitsandbytes-quantized weight as one entry (kind, shape, blocksize,
 * nesting, dtype, bytes), every other tensor with its dtype and shape, and
 * the metadata. A model (a Hugging Face folder or a GGUF file): it is
 * loaded with `load` (path taken from `path`) and its architecture, sizes,
 * tensor kinds, bytes and tokenizer are printed.
 */
int eng_inspect(const char *path, const eng_load_opts *load, FILE *out, char *msg, size_t msg_len);

/* What `qlserve generate` asks for. */
typedef struct eng_generate_opts {
    const char *prompt;
    int32_t max_new_tokens;
    eng_sampling sampling;
    const char *stop;              /* one stop string, or NULL */
    int threads;                   /* 0: all cores */
    eng_device device;             /* where to run (auto: CUDA when present) */
    size_t kv_bytes;               /* 0: the engine's default */
    const eng_lora_term *adapters; /* the configuration wanted (eng_request) */
    size_t n_adapters;
} eng_generate_opts;

/*
 * Load the model, run the prompt through the engine, stream the completion
 * to out as it comes, then write one line to info: prompt tokens,
 * generated tokens, prefill and decode tokens per second, finish reason.
 */
int eng_generate(const eng_load_opts *load, const eng_generate_opts *g, FILE *out, FILE *info,
                 char *msg, size_t msg_len);
/* The same on an engine already running (threads and kv_bytes unused). */
int eng_generate_on(eng_engine *e, const eng_generate_opts *g, FILE *out, FILE *info, char *msg,
                    size_t msg_len);

/* Load the model's tokenizer and print the ids (and pieces) of text. */
int eng_tokenize(const eng_load_opts *load, const char *text, bool add_bos, FILE *out, char *msg,
                 size_t msg_len);

#endif
