/*
 * inspect.c - `qlserve inspect`: its flags (cli_inspect) and its job
 * (eng_inspect), which prints what a file or model holds: a .safetensors
 * file tensor by tensor (bitsandbytes weights read back with their quant
 * state), a GGUF file's header and tensor-type census, a model as loaded
 * (architecture, sizes, tensor kinds, tokenizer). Owns what it opens or
 * loads for the length of the call; writes only to the stream it is given.
 */
#include "cli.h"
#include "model.h"
#include "modelfile.h"
#include "tokenizer.h"

#include <inttypes.h>
#include <string.h>

/* --- safetensors files -------------------------------------------------------- */

/* True when name is one of the parts serialized under a quantized base. */
static bool is_part_of_quantized(const st_file *f, const char *name)
{
    static const char *suffixes[] = {".absmax", ".quant_map", ".nested_absmax",
                                     ".nested_quant_map"};
    if (strstr(name, CLI_BNB_QUANT_STATE))
        return true;
    if (bnb_is_quantized(f, name))
        return true;
    for (size_t i = 0; i < sizeof suffixes / sizeof *suffixes; i++) {
        size_t n = strlen(name), s = strlen(suffixes[i]);
        if (n > s && strcmp(name + n - s, suffixes[i]) == 0) {
            char base[1024];
            snprintf(base, sizeof base, "%.*s", (int)(n - s), name);
            if (bnb_is_quantized(f, base))
                return true;
        }
    }
    return false;
}

static void print_shape(FILE *out, const st_tensor *t)
{
    fputc('[', out);
    for (int d = 0; d < t->ndim; d++)
        fprintf(out, "%s%" PRId64, d ? ", " : "", t->shape[d]);
    fputc(']', out);
}

static int inspect_quantized(const st_file *f, const char *qs_name, FILE *out, char *msg,
                             size_t msg_len)
{
    char base[1024];
    snprintf(base, sizeof base, "%.*s", (int)(strstr(qs_name, CLI_BNB_QUANT_STATE) - qs_name),
             qs_name);
    qtensor q;
    char dtype[16];
    int rc = bnb_read(f, base, &q, dtype, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    float lo = 0, hi = 0;
    for (int64_t b = 0; b < q.n_blocks; b++) {
        float a = qt_block_absmax(&q, b);
        lo = b ? (a < lo ? a : lo) : a;
        hi = b ? (a > hi ? a : hi) : a;
    }
    fprintf(out, "%s: %s [%" PRId64 ", %" PRId64 "] blocksize %d, dtype %s", base,
            qt_kind_name(q.kind), q.rows, q.cols, q.blocksize, dtype);
    if (q.nested)
        fprintf(out, ", double-quant (nested blocksize %d, offset %.9g)", q.nested_blocksize,
                (double)q.nested_offset);
    fprintf(out, ", %" PRId64 " blocks, absmax in [%.6g, %.6g], %zu bytes\n", q.n_blocks,
            (double)lo, (double)hi, qt_nbytes(&q));
    qt_free(&q);
    return QL_OK;
}

static int inspect_safetensors(const char *path, FILE *out, char *msg, size_t msg_len)
{
    st_file f;
    int rc = st_open(&f, path, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    size_t bytes = 0;
    for (size_t i = 0; i < f.n_tensors; i++)
        bytes += f.tensors[i].nbytes;
    fprintf(out, "%s: safetensors, %zu tensors, %zu bytes of data\n", path, f.n_tensors, bytes);
    for (size_t i = 0; i < f.n_meta; i++)
        fprintf(out, "metadata %s = %s\n", f.meta_keys[i], f.meta_values[i]);
    for (size_t i = 0; i < f.n_tensors && rc == QL_OK; i++) {
        const st_tensor *t = &f.tensors[i];
        if (strstr(t->name, CLI_BNB_QUANT_STATE)) {
            rc = inspect_quantized(&f, t->name, out, msg, msg_len);
        } else if (!is_part_of_quantized(&f, t->name)) {
            fprintf(out, "%s: %s ", t->name, st_dtype_name(t->dtype));
            print_shape(out, t);
            fprintf(out, ", %zu bytes\n", t->nbytes);
        }
    }
    st_close(&f);
    return rc;
}

/* --- models ------------------------------------------------------------------ */

/* The kinds whose scales have a dtype of their own (qt_scale_dtype) are
 * counted per scale dtype, after every kind: slot QT_KIND_COUNT + 4 * i + d
 * for the i-th of these kinds and scale dtype d. */
static const qt_kind scaled_kinds[] = {QT_FP8, QT_CT_INT};
#define N_SCALED (sizeof scaled_kinds / sizeof *scaled_kinds)
#define N_COUNTS (QT_KIND_COUNT + 4 * N_SCALED)

static void count_kind(const qtensor *t, void *counts)
{
    int slot = (int)t->kind;
    for (size_t i = 0; i < N_SCALED; i++)
        if (t->kind == scaled_kinds[i])
            slot = QT_KIND_COUNT + 4 * (int)i + (int)t->scale_dtype;
    ((int *)counts)[slot]++;
}

/* Count the kinds of the weights a model holds: "q4_1 x210, f32 x61";
 * FP8, GPTQ, AWQ and CT_INT with their scales' dtype: "fp8 (e8m0 scales)
 * x14". */
static void count_kinds(const eng_model *m, char *buf, size_t len)
{
    int counts[N_COUNTS] = {0};
    eng_model_each_tensor(m, count_kind, counts);
    size_t n = 0;
    buf[0] = '\0';
    for (int k = 0; k < (int)N_COUNTS && n < len; k++) {
        char name[64];
        if (k >= QT_KIND_COUNT)
            snprintf(name, sizeof name, "%s (%s scales)",
                     qt_kind_name(scaled_kinds[(k - QT_KIND_COUNT) / 4]),
                     qt_scale_dtype_name((qt_scale_dtype)((k - QT_KIND_COUNT) % 4)));
        else
            snprintf(name, sizeof name, "%s%s", qt_kind_name((qt_kind)k),
                     k == QT_GPTQ || k == QT_AWQ ? " (f16 scales)" : "");
        if (counts[k])
            n += (size_t)snprintf(buf + n, len - n, "%s%s x%d", n ? ", " : "", name, counts[k]);
    }
}

static const char *rope_scaling_name(eng_rope_scaling r)
{
    switch (r) {
    case ENG_ROPE_LINEAR: return "linear";
    case ENG_ROPE_LLAMA3: return "llama3";
    case ENG_ROPE_LONGROPE: return "longrope";
    case ENG_ROPE_YARN: return "yarn";
    case ENG_ROPE_PROPORTIONAL: return "proportional";
    default: return "none";
    }
}

/* Where the per-pair frequency factors came from. */
static const char *rope_factors_note(const eng_config *c)
{
    if (!c->n_rope_freq_factors)
        return "";
    if (c->rope_scaling == ENG_ROPE_LONGROPE)
        return ", short and long factors, one set per sequence";
    return ", frequency factors (rope_freqs.weight)";
}

/* Gemma 4's options beyond the lines every model has (nothing for others). */
static void print_gemma4(const eng_config *c, FILE *out)
{
    if (c->arch != ENG_ARCH_GEMMA4)
        return;
    fprintf(out, "gemma 4: %d sliding window, %d kv-shared layers%s", c->sliding_window,
            c->kv_shared_layers, c->g4.double_wide ? " (double-wide MLP)" : "");
    if (c->g4.ple_dim > 0)
        fprintf(out, "; per-layer inputs %d a layer", c->g4.ple_dim);
    if (eng_heads_vary(c))
        fprintf(out, "; full layers: head_dim %d, %d kv heads", c->g4.full_head_dim,
                c->g4.full_kv_heads);
    if (c->g4.k_eq_v)
        fputs("; keys as values on full layers", out);
    if (c->g4.moe_block)
        fprintf(out, "; MoE block: %d experts of %d, %d a token", c->n_experts, c->expert_ff,
                c->n_experts_used);
    fprintf(out, "%s\n",
            c->g4.language_model ? "; the text model of a Gemma4ForConditionalGeneration" : "");
}

static int inspect_model(const eng_load_opts *load, FILE *out, char *msg, size_t msg_len)
{
    eng_model m;
    int rc = eng_model_load(&m, load, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    const eng_config *c = &m.cfg;
    char kinds[512];
    count_kinds(&m, kinds, sizeof kinds);
    fprintf(out, "%s: %s model, architecture %s\n", load->path, m.format, eng_arch_name(c->arch));
    fprintf(out,
            "layers %d, hidden %d, heads %d (kv %d, head dim %d), ffn %d, vocab %d, context %d\n",
            c->n_layers, c->hidden_size, c->n_heads, c->n_kv_heads, c->head_dim,
            c->intermediate_size, c->vocab_size, c->max_position_embeddings);
    fprintf(out, "rope theta %g, scaling %s (factor %g)%s, %s pairs; rms eps %g; %s embeddings%s\n",
            (double)c->rope_theta, rope_scaling_name(c->rope_scaling), (double)c->rope_factor,
            rope_factors_note(c), c->rope_interleaved ? "adjacent" : "half-split",
            (double)c->rms_norm_eps, c->tie_word_embeddings ? "tied" : "separate",
            c->attention_bias ? ", qkv bias" : "");
    print_gemma4(c, out);
    fprintf(out, "linear layers %s; tensors %s; %.1f MiB of weights\n", m.quant, kinds,
            (double)eng_model_weight_bytes(&m) / (1024.0 * 1024.0));
    fprintf(out, "tokenizer %s, %zu tokens, bos %d, eos %d, adds bos: %s\n", tok_describe(m.tok),
            tok_vocab_size(m.tok), tok_bos(m.tok), tok_eos(m.tok),
            tok_adds_bos(m.tok) ? "yes" : "no");
    if (m.chat_template)
        fprintf(out, "chat template: yes, %zu bytes%s\n", strlen(m.chat_template),
                m.chat_template_tool_use ? "; a tool_use template too" : "");
    else
        fputs("chat template: none (chat requests are refused)\n", out);
    eng_model_free(&m);
    return QL_OK;
}

/* A GGUF file as a file: version, metadata, the census of tensor types
 * (types qlserve cannot run included), before it is loaded as a model. */
static int inspect_gguf_file(const char *path, FILE *out, char *msg, size_t msg_len)
{
    gguf_file f;
    int rc = gguf_open(&f, path, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    uint64_t counts[64] = {0}, other = 0;
    size_t bytes = 0;
    for (uint64_t i = 0; i < f.n_tensors; i++) {
        if (f.tensors[i].ggml_type < 64)
            counts[f.tensors[i].ggml_type]++;
        else
            other++;
        bytes += f.tensors[i].nbytes;
    }
    const gguf_kv *name = gguf_find_kv(&f, "general.name");
    fprintf(out, "%s: GGUF v%u, %" PRIu64 " metadata keys, %" PRIu64 " tensors, %zu bytes", path,
            f.version, f.n_kv, f.n_tensors, bytes);
    if (name && name->type == GGUF_STRING)
        fprintf(out, ", name \"%.*s\"", (int)name->str.len, name->str.ptr);
    fputs("\ntensor types:", out);
    for (uint32_t t = 0; t < 64; t++)
        if (counts[t])
            fprintf(out, " %s x%" PRIu64, gguf_ggml_type_name(t), counts[t]);
    if (other)
        fprintf(out, " other x%" PRIu64, other);
    fputc('\n', out);
    gguf_close(&f);
    return QL_OK;
}

static bool ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), k = strlen(suffix);
    return n > k && strcmp(s + n - k, suffix) == 0;
}

/* A .safetensors file (by its ending) is described tensor by tensor;
 * anything else is a model (a GGUF file described as a file first). */
int eng_inspect(const char *path, const eng_load_opts *load, FILE *out, char *msg, size_t msg_len)
{
    if (ends_with(path, ".safetensors"))
        return inspect_safetensors(path, out, msg, msg_len);
    if (ends_with(path, ".gguf")) {
        int rc = inspect_gguf_file(path, out, msg, msg_len);
        if (rc != QL_OK)
            return rc;
    }
    eng_load_opts o = *load;
    o.path = path;
    return inspect_model(&o, out, msg, msg_len);
}

int cli_inspect(int argc, char **argv)
{
    char msg[1024];
    cfg_inspect c;
    int rc = cfg_parse_inspect(argc, argv, &c, msg, sizeof msg);
    if (rc != QL_OK)
        return cli_usage_failure("inspect", rc, msg);
    eng_load_opts load = cli_load_opts(&c.model);
    rc = eng_inspect(c.path, &load, stdout, msg, sizeof msg);
    if (rc != QL_OK) {
        fprintf(stderr, "qlserve inspect: %s\n", msg);
        return 1;
    }
    return 0;
}
