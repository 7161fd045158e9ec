/*
 * tokenizer.h - the public header of tokenizer/: text to token ids
 * and back.
 *
 * It offers tokenizers loaded from a Hugging Face tokenizer.json or from
 * GGUF metadata: byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM2, o200k
 * (GPT-OSS) pre-tokenizers, recognised by their exact patterns) and
 * SentencePiece-style BPE with byte fallback (Llama 2, Mistral,
 * TinyLlama); encoding with or without special tokens, whole and streamed
 * decoding. A tokenizer owns its vocabulary and merges (copied from the
 * file) and is immutable once loaded, so any thread may use it. It touches
 * the files it is given (through modelfile/) and nothing else.
 */
#ifndef QL_TOKENIZER_H
#define QL_TOKENIZER_H

#include "modelfile.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* --- tokenizers (tokenizer/) ------------------------------------- */

typedef struct tok_tokenizer tok_tokenizer;

/*
 * Load a tokenizer from a Hugging Face tokenizer.json (model type BPE:
 * byte-level as GPT-2, Llama 3, Qwen2, SmolLM2, GPT-OSS; or SentencePiece-style with
 * byte fallback as Llama 2, Mistral, TinyLlama). config_path, when not NULL,
 * is tokenizer_config.json (add_bos_token, bos/eos tokens). Free with
 * tok_free.
 */
int tok_from_hf(tok_tokenizer **out, const char *tokenizer_json, const char *config_path, char *msg,
                size_t msg_len);
/* The same from a tokenizer.json's text json[0..len) (borrowed, need not be
 * NUL-terminated) without a config; source names it in messages. The path
 * form reads the files and does this; the fuzzer drives it directly. */
int tok_from_hf_json(tok_tokenizer **out, const char *json, size_t len, const char *source,
                     char *msg, size_t msg_len);
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
/* Whether id is a special token (a control token, or the unknown one):
 * what tok_decode's skip_special drops. false for an id outside the
 * vocabulary. */
bool tok_is_special(const tok_tokenizer *t, int32_t id);
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
 * or QL_EINVAL with nothing changed when out_cap is too small (3 x (3 +
 * the longest piece) always fits; real vocabularies have pieces of 80 bytes
 * and more, so callers size for that or retry). tok_stream_flush emits what
 * is left (invalid UTF-8 as U+FFFD). */
long tok_stream_push(const tok_tokenizer *t, tok_stream *s, int32_t id, char *out, size_t out_cap);
long tok_stream_flush(const tok_tokenizer *t, tok_stream *s, char *out, size_t out_cap);

/* The bytes id adds to a stream in the middle of a text (no leading space
 * dropped, no UTF-8 completed: a byte token is its byte) into out: their
 * count, 0 for a special token (it adds no text), QL_EINVAL for an id out
 * of range or an out_cap too small. What a grammar walks (grammar). */
long tok_token_bytes(const tok_tokenizer *t, int32_t id, uint8_t *out, size_t out_cap);

int32_t tok_bos(const tok_tokenizer *t); /* -1 when none */
int32_t tok_eos(const tok_tokenizer *t);
bool tok_adds_bos(const tok_tokenizer *t);
size_t tok_vocab_size(const tok_tokenizer *t);
/* "byte-level BPE" or "sentencepiece BPE", with the pre-tokenizer's name. */
const char *tok_describe(const tok_tokenizer *t);

/* --- the tokenizer's contents, for writing it into a GGUF (tok_export.c) --- */

/* Token id's text (borrowed from t, *len bytes, not NUL-terminated) and its
 * GGUF tokenizer.ggml.token_type into *type (1 normal, 2 unknown, 3 control,
 * 4 user-defined, 6 byte); NULL for an id no entry names or out of range. */
const char *tok_token_text(const tok_tokenizer *t, int32_t id, size_t *len, int *type);
/* tokenizer.ggml.model as llama.cpp names the family: "gpt2" (byte-level
 * BPE), "llama" (SentencePiece-style, byte fallback) or "gemma4" (Gemma
 * 4's, read from a GGUF). */
const char *tok_gguf_model(const tok_tokenizer *t);
/* tokenizer.ggml.pre: the name llama.cpp's converter gives this
 * pre-tokenizer ("default" for the SentencePiece family), or NULL when no
 * name of llama.cpp's runs the same steps. */
const char *tok_gguf_pre(const tok_tokenizer *t);
/* The merges in rank order as (left, right, result) id triples: *merges
 * holds 3 * *n ids (the caller frees it; NULL when there are none).
 * QL_ENOMEM when out of memory. */
int tok_merges(const tok_tokenizer *t, int32_t **merges, size_t *n);
int32_t tok_unk(const tok_tokenizer *t); /* -1 when none */
/* The id whose text is s[0..n), or -1. */
int32_t tok_token_id(const tok_tokenizer *t, const char *s, size_t n);

#endif
