/*
 * model_internal.h - what engine/model/'s loader files share, and nothing
 * else includes: the loader's working state, what a tensor is to the
 * loader (its role), and the functions one loader file offers the others.
 *
 *   model.c      eng_model_load (picks the loader), the whole-model walks,
 *                eng_model_free;
 *   loader.c     --quant and --dtype: parsed once, applied to each weight;
 *                the shape-mismatch message and the model's name;
 *   layers.c     the decoder-layer table (each part's two names, shape and
 *                field) and the walks over it;
 *   experts.c    a mixture of experts' config fields and each MoE layer's
 *                router, experts and shared expert, per expert or fused;
 *   split.c      a fused weight's rows as tensors of their own;
 *   gemma4.c     Gemma 4's options and per-layer input embeddings;
 *   load_hf.c    a Hugging Face folder (config.json, safetensors shards,
 *                bitsandbytes 4-bit weights);
 *   load_ct.c    its compressed-tensors and fbgemm_fp8 configs and weights;
 *   load_gguf.c  a GGUF file;
 *   chat_template.c  the chat templates' source text (folder, GGUF, file).
 *
 * Calls go model.c -> load_*.c -> layers.c -> experts.c -> split.c,
 * loader.c, never back (load_hf.c -> load_ct.c -> loader.c).
 */
#ifndef QL_MODEL_INTERNAL_H
#define QL_MODEL_INTERNAL_H

#include "model.h"

#include <cjson/cJSON.h>
#include <math.h>

/* What the loader carries while it works. */
typedef struct model_loader {
    const eng_load_opts *o;
    eng_model *m;
    char dir[4096];             /* the folder (HF) */
    bool quantize;              /* a quant kind was asked for */
    qt_quant_params qp;         /* ... and its parameters */
    bool bnb_checkpoint;        /* config.json says bitsandbytes 4-bit */
    bool mxfp4_experts;         /* config.json says mxfp4: GPT-OSS's experts as _blocks / _scales */
    char bnb_type[8];           /* "nf4" / "fp4" from quantization_config */
    bool fp8_checkpoint;        /* config.json says transformers' finegrained fp8 */
    int32_t fp8_block[2];       /* its weight_block_size: rows, cols of a scale's block */
    bool gptq_checkpoint;       /* config.json says gptq (qweight, qzeros, scales, g_idx) */
    int32_t gptq_bits;          /* 4 or 8 */
    int32_t gptq_group;         /* group_size; -1: one group per input */
    bool gptq_v2;               /* checkpoint_format gptq_v2: zeros stored as they are */
    bool awq;                   /* ... or AWQ GEMM (quant_method awq: gptq_bits, gptq_group) */
    struct model_ct_config *ct; /* compressed-tensors or fbgemm_fp8 (load_ct.c), owned */
    qt_kind dtype;              /* target dense kind, or QT_KIND_COUNT to keep */
    /* the text model of a multimodal checkpoint (Gemma4ForConditionalGeneration,
     * Qwen3_5ForConditionalGeneration): its tensors' "model." is
     * "model.language_model." */
    bool text_model;
} model_loader;

/* What a tensor is to the loader: a dense parameter (norms, biases), a
 * linear layer (quantized on load when asked), lm_head (only with
 * --quantize-lm-head), or the embeddings (never quantized on load, but
 * taken as stored when a checkpoint quantized them, as `qlserve quantize`
 * does: a row of any kind dequantizes for the lookup), or a fused linear
 * (Phi-3's qkv_proj, gate_up_proj: taken as stored, then split by rows in
 * layers.c, each part finished as a linear). */
typedef enum { ROLE_DENSE, ROLE_LINEAR, ROLE_LM_HEAD, ROLE_EMBED, ROLE_FUSED } tensor_role;

/* One format's way to load tensor `name` of shape [rows, cols] (cols == 0:
 * a vector of rows) into *out, checked against that shape. */
typedef int (*model_tensor_loader)(model_loader *L, const char *name, int64_t rows, int64_t cols,
                                   tensor_role role, qtensor *out, char *msg, size_t msg_len);

/* --- loader.c ------------------------------------------------------------ */

/* Read L->o's --quant and --dtype into L->quantize, L->qp and L->dtype;
 * QL_EINVAL naming the option for a value we do not know. */
int model_parse_opts(model_loader *L, char *msg, size_t msg_len);
/* The last step for every weight loaded: quantize it as L->qp when the
 * role asks for it and --quant did, else give a dense one --dtype. On
 * error *t is freed. */
int model_finish_weight(const model_loader *L, const char *name, tensor_role role, qtensor *t,
                        char *msg, size_t msg_len);
/* mf_json_int_field into an int32_t field of eng_config (every bound the
 * loaders give fits one). */
int model_json_int32(const char *path, const cJSON *j, const char *key, int64_t def, bool required,
                     int64_t lo, int64_t hi, int32_t *out, char *msg, size_t msg_len);
/* QL_EFORMAT "<file>: tensor '<name>' is [r, c]; the config needs [wr, wc]". */
int model_shape_mismatch(const char *file, const char *name, int64_t rows, int64_t cols,
                         int64_t want_rows, int64_t want_cols, char *msg, size_t msg_len);
/* What the model calls itself (eng_model.name): the name its file gives
 * (own, not NUL-terminated, may be NULL), else the base name of its path,
 * so an adapter's base_model_name_or_path can be compared with it. */
void model_set_name(eng_model *m, const char *own, size_t own_len, const char *path);

/* The tensor `name` in the shards L->m has open, and its shard, or NULL. */
const st_tensor *model_find_st(const model_loader *L, const char *name, const st_file **file);

/* YaRN's mscale, 0.1 m ln(scale) + 1 (1 for scale <= 1): transformers'
 * yarn_get_mscale, llama.cpp's get_mscale; both loaders derive the
 * attention factor from it. */
static inline double model_yarn_mscale(double scale, double m)
{
    return scale <= 1.0 ? 1.0 : 0.1 * m * log(scale) + 1.0;
}

/* --- layers.c ------------------------------------------------------------ */

/* Load every decoder layer's tensors into L->m->layers (allocated by the
 * caller) through load, by their GGUF names (blk.N.attn_q.weight) or
 * Hugging Face ones (model.layers.N.self_attn.q_proj.weight). */
int model_layers_load(model_loader *L, model_tensor_loader load, bool gguf, char *msg,
                      size_t msg_len);
/* One full-attention layer (as config's layers past the decoder's would
 * be: no linear parts) into dst, each tensor named hf_prefix then its
 * Hugging Face name (mtp.layers.0.self_attn.q_proj.weight); fn on each of
 * its tensors, or qt_free them all. */
int model_layer_load_full(model_loader *L, model_tensor_loader load, const char *hf_prefix,
                          eng_layer *dst, char *msg, size_t msg_len);
/* The same from a GGUF, its tensors named blk.BLOCK. then their GGUF
 * names (llama.cpp's converter appends MTP layers as blocks past the
 * decoder's). */
int model_layer_load_full_gguf(model_loader *L, model_tensor_loader load, int32_t block,
                               eng_layer *dst, char *msg, size_t msg_len);
void model_layer_each(const eng_config *c, const eng_layer *ly,
                      void (*fn)(const qtensor *t, void *ctx), void *ctx);
void model_layer_free(eng_layer *ly);

/* --- mtp.c ------------------------------------------------------------ */

/* A Hugging Face checkpoint's MTP layers (mtp.h) into L->m->mtp when its
 * config declares them and mtp.fc.weight is there (else none: a converted
 * checkpoint may have dropped them); a mixture-of-experts model's are
 * refused by name. fn on each of their tensors; free them. */
int model_mtp_load_hf(model_loader *L, model_tensor_loader load, char *msg, size_t msg_len);
void model_mtp_each(const eng_model *m, void (*fn)(const qtensor *t, void *ctx), void *ctx);
void model_mtp_free(eng_model *m);

/* Call fn on each layer tensor m holds (rows != 0). */
void model_layers_each(const eng_model *m, void (*fn)(const qtensor *t, void *ctx), void *ctx);
/* qt_free every layer tensor (m->layers itself stays). */
void model_layers_free(eng_model *m);
/* Rows [r0, r0 + n) of a fused weight (Phi-3's qkv, an expert's slab of a
 * 3-D expert tensor) as a tensor of their own into *out, finished (--quant,
 * --dtype) as a linear of its own, so it is what a separate weight would
 * have been; name names the fused tensor in messages. */
int model_split_rows(const model_loader *L, const char *name, const qtensor *fused, int64_t r0,
                     int64_t n, qtensor *out, char *msg, size_t msg_len);
/* Expert e's [n_out, in] weight from a transposed 3-D dense tensor `all`
 * (experts as runs of `in` rows; output o is column first + step * o of
 * the run: GPT-OSS's gate_up_proj, down_proj), copied into a tensor *out
 * owns, finished as a linear. */
int model_split_transposed(const model_loader *L, const char *name, const qtensor *all, int64_t e,
                           int64_t in, int64_t first, int64_t step, int64_t n_out, qtensor *out,
                           char *msg, size_t msg_len);

/* --- experts.c ------------------------------------------------------------ */

/* A mixture-of-experts config.json's fields (num_experts or
 * num_local_experts, num_experts_per_tok, moe_intermediate_size,
 * shared_expert_intermediate_size, norm_topk_prob, decoder_sparse_step,
 * mlp_only_layers) into c, whose arch is set; path names the file. */
int model_moe_config_hf(const char *path, const cJSON *j, eng_config *c, char *msg, size_t msg_len);
/* What holds for every mixture once its fields are read (experts, chosen
 * per token, widths, layers), QL_E* naming path and the field; sets the
 * router. */
int model_moe_check(const char *path, eng_config *c, char *msg, size_t msg_len);
/* Mark layer l of a mixture a plain MLP. */
void model_moe_set_dense(eng_config *c, int32_t l);
/* Layer l's router, experts (per expert, or 3-D fused tensors split per
 * expert) and Qwen2-MoE's shared expert and its gate, through load. */
int model_experts_load(model_loader *L, model_tensor_loader load, bool gguf, int32_t l, char *msg,
                       size_t msg_len);
/* Call fn on layer l's router, experts and shared gate (rows != 0). */
void model_experts_each(const eng_model *m, int32_t l, void (*fn)(const qtensor *t, void *ctx),
                        void *ctx);
/* qt_free them, and the experts' array. */
void model_experts_free(eng_model *m, int32_t l);

/* --- gemma4.c ------------------------------------------------------------- */

/* Gemma 4's options in config.json beyond what load_hf.c reads
 * (hidden_size_per_layer_input, vocab_size_per_layer_input,
 * attention_k_eq_v, use_double_wide_mlp) into c->g4, a value qlserve
 * does not run refused by name. */
int model_gemma4_options(const char *path, const cJSON *j, eng_config *c, char *msg,
                         size_t msg_len);
/* Gemma 4's full layers' head size and kv heads into c->g4 (full_head_dim,
 * full_kv_heads) from per_layer_config, else global_head_dim and (with
 * attention_k_eq_v) num_global_key_value_heads, as Gemma4TextConfig
 * derives them; after the layer types and model_gemma4_options. A shape
 * qlserve does not run is refused by name. */
int model_gemma4_head_shapes(const char *path, const cJSON *j, eng_config *c, char *msg,
                             size_t msg_len);
/* A Gemma4ForConditionalGeneration config.json (j): its text_config as a
 * Gemma4ForCausalLM's into *text (the caller's, cJSON_Delete), with the
 * outer config's tie_word_embeddings, quantization_config and
 * _name_or_path where the text_config has none; *text NULL for any other
 * architecture. */
int model_gemma4_text_config(const char *path, const cJSON *j, cJSON **text, char *msg,
                             size_t msg_len);
/* The model-wide per-layer-input tensors (eng_gemma4_model) through load,
 * when the config has them; sets c->g4.ple_embed_scale. */
int model_gemma4_load(model_loader *L, model_tensor_loader load, char *msg, size_t msg_len);
/* Gemma's embedding scale sqrt(n) as an embedding table of kind `kind`
 * holds it (transformers casts it to the table's dtype: bf16, f16 or
 * f32). */
float model_gemma_embed_scale(int32_t n, qt_kind kind);

/* --- qwen35.c -------------------------------------------------------------- */

/* Qwen3.5's config.json fields (layer_types or full_attention_interval,
 * linear_*, the refused options) into c, whose arch and shapes are set. */
int model_qwen35_config_hf(const char *path, const cJSON *j, eng_config *c, char *msg,
                           size_t msg_len);
/* For a Qwen3_5ForConditionalGeneration config.json: its text model's
 * config as a Qwen3_5ForCausalLM one into *text (the caller's,
 * cJSON_Delete), with the outer tie_word_embeddings and
 * quantization_config, *multimodal true; the vision tower is not run. The
 * same for Qwen3.5-MoE's (Qwen3_5MoeForCausalLM and
 * Qwen3_5MoeForConditionalGeneration), its intermediate_size the
 * experts'. *text NULL for any other config. */
int model_qwen35_text_config(const char *path, const cJSON *j, cJSON **text, bool *multimodal,
                             char *msg, size_t msg_len);
/* A qwen35 or qwen35moe GGUF's fields (ARCH.ssm.*,
 * ARCH.attention.recurrent_layers or ARCH.full_attention_interval, arch
 * the file's general.architecture) into c, as llama.cpp's converter
 * writes them: norms with the 1 added, A as -exp(A_log), value heads
 * tiled. The mixture's keys are load_gguf.c's. */
int model_qwen35_config_gguf(const gguf_file *f, const char *arch, eng_config *c, char *msg,
                             size_t msg_len);
/* A qwen35 GGUF's MTP blocks (c->linear.mtp_layers of them, past the
 * decoder's) into L->m->mtp, as model_mtp_load_hf reads a folder's; none
 * for a file without them, and a qwen35moe file's stay unread (their layer
 * is a mixture). A file missing their fc, or whose MTP layers bring their
 * own embeddings or lm_head, is refused by name. */
int model_qwen35_mtp_load_gguf(model_loader *L, model_tensor_loader load, char *msg,
                               size_t msg_len);

/* --- load_hf.c, load_gguf.c ---------------------------------------------- */

/* Load the Hugging Face folder L->dir into L->m. On error L->m may hold a
 * part, which eng_model_free releases. */
int model_load_hf(model_loader *L, char *msg, size_t msg_len);
/* Load the GGUF file L->o->path into L->m; the same contract. */
int model_load_gguf(model_loader *L, char *msg, size_t msg_len);
/* A Hugging Face folder's tokenizer: dir/tokenizer.json, with
 * dir/tokenizer_config.json when there (load_hf.c; eng_tokenizer_load
 * reads it alone). *out is the caller's (tok_free). */
int model_folder_tokenizer(const char *dir, tok_tokenizer **out, char *msg, size_t msg_len);

/* --- load_ct.c ------------------------------------------------------------ */

/* quantization_config qc of path with quant_method "compressed-tensors" or
 * "fbgemm_fp8" into L->ct (a copy; model_ct_free releases it); what qlserve
 * does not read is refused by the field's name. */
int model_ct_config(model_loader *L, const char *path, const cJSON *qc, char *msg, size_t msg_len);
void model_ct_free(model_loader *L);
/* Linear `name` ([rows, cols], its `.weight` name) of such a checkpoint:
 * *handled false (QL_OK) when the checkpoint left it dense; else it is
 * loaded into *out as QT_FP8 or QT_CT_INT, the scales in their stored
 * dtype, or refused naming the tensor. */
int model_ct_tensor(model_loader *L, const char *name, int64_t rows, int64_t cols, bool linear,
                    qtensor *out, bool *handled, char *msg, size_t msg_len);
/* "compressed-tensors" or "fbgemm_fp8": the format L->ct read. */
const char *model_ct_format(const model_loader *L);

/* --- chat_template.c ------------------------------------------------------ */

/* f's tokenizer.chat_template and tokenizer.chat_template.tool_use (NULL
 * when absent; the caller's, free()); a key that is not a string, too
 * long, or not UTF-8 is refused by name. On error both are NULL. */
int model_chat_templates_from_gguf(const gguf_file *f, char **tmpl, char **tool_use, char *msg,
                                   size_t msg_len);

#endif
