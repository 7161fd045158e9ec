/*
 * tools.c - the jobs behind `qlserve quantize` and `qlserve inspect`: whole
 * safetensors files in, a quantized file or a description out. They live in
 * the engine because they are made of the loader's parts (the safetensors
 * reader, the bitsandbytes serialization); the command line only parses
 * flags and calls them.
 */
#include "cli.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define QS_MARK ".quant_state.bitsandbytes__"

/* A safetensors float dtype as the quant state names it, or NULL. */
static const char *torch_dtype_name(st_dtype dt)
{
    switch (dt) {
    case ST_F32: return "float32";
    case ST_F16: return "float16";
    case ST_BF16: return "bfloat16";
    default: return NULL;
    }
}

/* The tensor's values as f32 (caller frees), for F32, F16 and BF16. */
static float *to_f32(const st_tensor *t)
{
    float *v = malloc((size_t)(t->numel ? t->numel : 1) * sizeof *v);
    if (!v)
        return NULL;
    for (int64_t i = 0; i < t->numel; i++) {
        const uint8_t *p = t->data + (size_t)i * st_dtype_size(t->dtype);
        if (t->dtype == ST_F32) {
            memcpy(&v[i], p, 4);
        } else {
            uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
            v[i] = t->dtype == ST_F16 ? qt_f16_to_f32(h) : qt_bf16_to_f32(h);
        }
    }
    return v;
}

static int quantize_one(const eng_quantize_opts *o, const st_tensor *t, const qt_quant_params *p,
                        st_writer *w, FILE *log, char *msg, size_t msg_len)
{
    float *v = to_f32(t);
    if (!v)
        return ql_fail(msg, msg_len, QL_ENOMEM, "%s: tensor '%s': out of memory", o->in_path,
                       t->name);
    qtensor q;
    char why[256];
    int rc = qt_quantize(&q, v, t->shape[0], t->shape[1], p, why, sizeof why);
    free(v);
    if (rc != QL_OK)
        return ql_fail(msg, msg_len, QL_EINVAL, "%s: tensor '%s': %s", o->in_path, t->name, why);
    rc = bnb_write(w, t->name, &q, torch_dtype_name(t->dtype), msg, msg_len);
    if (rc == QL_OK && log)
        fprintf(log, "%s: %s [%" PRId64 ", %" PRId64 "] -> %s blocksize %d%s, %zu -> %zu bytes\n",
                t->name, st_dtype_name(t->dtype), t->shape[0], t->shape[1], o->kind, q.blocksize,
                q.nested ? " double-quant" : "", t->nbytes, qt_nbytes(&q));
    qt_free(&q);
    return rc;
}

int eng_quantize_file(const eng_quantize_opts *o, FILE *log, char *msg, size_t msg_len)
{
    int kind = qt_kind_from_name(o->kind);
    if (kind != QT_NF4 && kind != QT_FP4)
        return ql_fail(msg, msg_len, QL_EINVAL, "--kind %s: quantize writes nf4 or fp4",
                       o->kind ? o->kind : "(missing)");
    qt_quant_params p = {.kind = (qt_kind)kind,
                         .blocksize = o->blocksize ? o->blocksize : 64,
                         .double_quant = o->double_quant};
    int32_t bs = p.blocksize;
    if (bs < 32 || bs > 4096 || (bs & (bs - 1)))
        return ql_fail(msg, msg_len, QL_EINVAL, "--blocksize %d: a power of two from 32 to 4096",
                       (int)bs);
    st_file in;
    int rc = st_open(&in, o->in_path, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    for (size_t i = 0; i < in.n_tensors; i++) {
        if (strstr(in.tensors[i].name, QS_MARK)) {
            rc = ql_fail(msg, msg_len, QL_EINVAL,
                         "%s: tensor '%s' shows the file is already quantized by "
                         "bitsandbytes; quantizing it again would lose precision",
                         o->in_path, in.tensors[i].name);
            st_close(&in);
            return rc;
        }
    }
    st_writer *w = st_writer_new();
    if (!w) {
        st_close(&in);
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    }
    for (size_t i = 0; i < in.n_meta && rc == QL_OK; i++)
        rc = st_writer_set_metadata(w, in.meta_keys[i], in.meta_values[i]);
    size_t quantized = 0;
    for (size_t i = 0; i < in.n_tensors && rc == QL_OK; i++) {
        const st_tensor *t = &in.tensors[i];
        if (t->ndim == 2 && t->numel > 0 && torch_dtype_name(t->dtype)) {
            rc = quantize_one(o, t, &p, w, log, msg, msg_len);
            quantized++;
        } else {
            /* borrowed from the mapping, which outlives the write below */
            rc = st_writer_add(w, t->name, t->dtype, t->ndim, t->shape, t->data, t->nbytes, false,
                               msg, msg_len);
            if (rc == QL_OK && log)
                fprintf(log, "%s: %s, %d-D, copied unchanged\n", t->name, st_dtype_name(t->dtype),
                        t->ndim);
        }
    }
    if (rc == QL_OK)
        rc = st_writer_write(w, o->out_path, msg, msg_len);
    if (rc == QL_OK && log)
        fprintf(log, "wrote %s: %zu tensors quantized to %s, %zu copied\n", o->out_path, quantized,
                o->kind, in.n_tensors - quantized);
    st_writer_free(w);
    st_close(&in);
    return rc;
}

/* True when name is one of the parts serialized under a quantized base. */
static bool is_part_of_quantized(const st_file *f, const char *name)
{
    static const char *suffixes[] = {".absmax", ".quant_map", ".nested_absmax",
                                     ".nested_quant_map"};
    if (strstr(name, QS_MARK))
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
    snprintf(base, sizeof base, "%.*s", (int)(strstr(qs_name, QS_MARK) - qs_name), qs_name);
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
        if (strstr(t->name, QS_MARK)) {
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

static void count_kind(const qtensor *t, void *counts)
{
    ((int *)counts)[t->kind]++;
}

/* Count the kinds of the weights a model holds: "q4_1 x210, f32 x61". */
static void count_kinds(const eng_model *m, char *buf, size_t len)
{
    int counts[QT_KIND_COUNT] = {0};
    eng_model_each_tensor(m, count_kind, counts);
    size_t n = 0;
    buf[0] = '\0';
    for (int k = 0; k < QT_KIND_COUNT && n < len; k++)
        if (counts[k])
            n += (size_t)snprintf(buf + n, len - n, "%s%s x%d", n ? ", " : "",
                                  qt_kind_name((qt_kind)k), counts[k]);
}

static const char *rope_scaling_name(eng_rope_scaling r)
{
    return r == ENG_ROPE_LINEAR ? "linear" : r == ENG_ROPE_LLAMA3 ? "llama3" : "none";
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
    fprintf(out, "rope theta %g, scaling %s (factor %g), %s pairs; rms eps %g; %s embeddings%s\n",
            (double)c->rope_theta, rope_scaling_name(c->rope_scaling), (double)c->rope_factor,
            c->rope_interleaved ? "adjacent" : "half-split", (double)c->rms_norm_eps,
            c->tie_word_embeddings ? "tied" : "separate", c->attention_bias ? ", qkv bias" : "");
    fprintf(out, "linear layers %s; tensors %s; %.1f MiB of weights\n", m.quant, kinds,
            (double)eng_model_weight_bytes(&m) / (1024.0 * 1024.0));
    fprintf(out, "tokenizer %s, %zu tokens, bos %d, eos %d, adds bos: %s\n", tok_describe(m.tok),
            tok_vocab_size(m.tok), tok_bos(m.tok), tok_eos(m.tok),
            tok_adds_bos(m.tok) ? "yes" : "no");
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

int eng_tokenize(const eng_load_opts *load, const char *text, bool add_bos, FILE *out, char *msg,
                 size_t msg_len)
{
    eng_model m;
    int rc = eng_model_load(&m, load, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    int32_t *ids = NULL;
    size_t n = 0;
    rc = tok_encode(m.tok, text, strlen(text), add_bos, true, &ids, &n, msg, msg_len);
    /* each id's text as the streaming decoder gives it: what a client
     * receiving tokens one by one would see (an incomplete character shows
     * up with the token that completes it) */
    tok_stream st = {0};
    char piece[4096];
    for (size_t i = 0; rc == QL_OK && i < n; i++) {
        long len = tok_stream_push(m.tok, &st, ids[i], piece, sizeof piece);
        fprintf(out, "%6d  '", ids[i]);
        for (long k = 0; k < len; k++) {
            unsigned char ch = (unsigned char)piece[k];
            if (ch == '\n')
                fputs("\\n", out);
            else if (ch < 0x20)
                fprintf(out, "\\x%02x", ch);
            else
                fputc(ch, out);
        }
        fputs("'\n", out);
    }
    if (rc == QL_OK)
        fprintf(out, "%zu tokens\n", n);
    free(ids);
    eng_model_free(&m);
    return rc;
}

/* --- generate -------------------------------------------------------------------- */

typedef struct generation {
    FILE *out;
    pthread_mutex_t mu;
    pthread_cond_t done_cv;
    bool done;
    eng_finish why;
    eng_usage usage;
} generation;

static void gen_token(void *user, int32_t token, const char *text, size_t len)
{
    (void)token;
    generation *g = user;
    fwrite(text, 1, len, g->out);
    fflush(g->out);
}

static void gen_done(void *user, eng_finish why, const eng_usage *usage)
{
    generation *g = user;
    pthread_mutex_lock(&g->mu);
    g->done = true;
    g->why = why;
    g->usage = *usage;
    pthread_cond_signal(&g->done_cv);
    pthread_mutex_unlock(&g->mu);
}

int eng_generate_on(eng_engine *e, const eng_generate_opts *o, FILE *out, FILE *info, char *msg,
                    size_t msg_len)
{
    generation g = {.out = out};
    pthread_mutex_init(&g.mu, NULL);
    pthread_cond_init(&g.done_cv, NULL);
    const char *stops[1] = {o->stop};
    eng_request r = {.prompt = o->prompt,
                     .prompt_len = strlen(o->prompt),
                     .max_new_tokens = o->max_new_tokens,
                     .sampling = o->sampling,
                     .stop = stops,
                     .n_stop = o->stop ? 1 : 0,
                     .adapters = o->adapters,
                     .n_adapters = o->n_adapters,
                     .on_token = gen_token,
                     .on_done = gen_done,
                     .user = &g};
    uint64_t id;
    int rc = eng_engine_submit(e, &r, &id, msg, msg_len);
    if (rc == QL_OK) {
        pthread_mutex_lock(&g.mu);
        while (!g.done)
            pthread_cond_wait(&g.done_cv, &g.mu);
        pthread_mutex_unlock(&g.mu);
        const eng_usage *u = &g.usage;
        fputc('\n', out);
        fflush(out);
        fprintf(info,
                "prompt %d tokens, %.1f tok/s prefill; generated %d tokens, %.1f tok/s decode; "
                "finish %s; on %s\n",
                u->prompt_tokens, u->prefill_s > 0 ? u->prompt_tokens / u->prefill_s : 0.0,
                u->generated_tokens,
                u->decode_s > 0 && u->generated_tokens > 1 ? (u->generated_tokens - 1) / u->decode_s
                                                           : 0.0,
                eng_finish_name(g.why), eng_engine_backend(e));
        if (g.why == ENG_FINISH_ERROR)
            rc = ql_fail(msg, msg_len, QL_EINVAL, "generation failed in the engine");
    }
    pthread_mutex_destroy(&g.mu);
    pthread_cond_destroy(&g.done_cv);
    return rc;
}

int eng_generate(const eng_load_opts *load, const eng_generate_opts *o, FILE *out, FILE *info,
                 char *msg, size_t msg_len)
{
    eng_model m;
    int rc = eng_model_load(&m, load, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    eng_engine_opts eo = {
        .threads = o->threads, .device = o->device, .kv_bytes = o->kv_bytes, .max_running = 8};
    eng_engine *e;
    rc = eng_engine_start(&e, &m, &eo, msg, msg_len);
    if (rc == QL_OK) {
        rc = eng_generate_on(e, o, out, info, msg, msg_len);
        eng_engine_stop(e);
    }
    eng_model_free(&m);
    return rc;
}
