/*
 * load_ct.c - the weights of two more quantized checkpoint formats in a
 * Hugging Face folder, read as they are stored:
 *
 *   compressed-tensors (quant_method "compressed-tensors", what
 *   llm-compressor writes): config_groups, each a scheme (weights'
 *   num_bits, type, symmetric, strategy, group_size, block_structure) over
 *   its targets ("Linear", module names, "re:" patterns matched from the
 *   start of the module's name as Python's re.match), minus `ignore`; the
 *   format (top level, or the group's own):
 *     pack-quantized   weight_packed, weight_scale, weight_shape and, when
 *                      asymmetric, weight_zero_point -> QT_CT_INT
 *     naive-quantized, int-quantized
 *                      weight int8 (or FP8 for type float), weight_scale,
 *                      weight_zero_point -> QT_CT_INT (or QT_FP8)
 *     float-quantized  weight F8_E4M3, weight_scale -> QT_FP8
 *   the scale's block from the strategy (group: 1 x group_size; channel:
 *   1 x cols; tensor: rows x cols; block: block_structure), the scales in
 *   their stored dtype (F32, BF16, F16).
 *
 *   fbgemm_fp8 (quant_method "fbgemm_fp8"): weight F8_E4M3 and weight_scale
 *   F32 [rows, 1] -> QT_FP8 with 1 x cols blocks; activation_scale_ub is
 *   read and not applied (activations stay float, README).
 *
 * A module is quantized when the checkpoint holds its scale; the config
 * must agree (a group targets it, ignore does not name it), else the
 * module is refused by name. Refused by the field's name: static or
 * output activation quantization, kv_cache_scheme, sparsity and transform
 * configs, a quantization_status other than compressed, strategies token,
 * tensor_group and attn_head, formats other than the four, actorder group
 * (weight_g_idx), asymmetric FP8, bits other than 4 and 8.
 *
 * It owns the copy of the config (model_ct_free); it calls loader.c
 * (model_find_st) and kernels/' constructors (qt_from_fp8,
 * qt_from_ct_int); it touches the folder's mapped shards only.
 */
#include "internal/model_internal.h"

#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Real checkpoints have one to three groups (Kimi: attention and experts). */
#define CT_MAX_SCHEMES 16

typedef enum { CT_PACKED, CT_NAIVE, CT_FLOAT } ct_format;

typedef struct ct_scheme {
    const char *name;     /* the config group's key (in cfg) */
    const cJSON *targets; /* its targets (in cfg) */
    ct_format format;
    int32_t bits;
    bool symmetric;
    int32_t block[2]; /* a scale's block; 0: the weight's whole dim */
} ct_scheme;

struct model_ct_config {
    cJSON *cfg;          /* the quantization_config, copied */
    const cJSON *ignore; /* its ignore list (in cfg), or NULL */
    bool fbgemm;         /* quant_method fbgemm_fp8: one scheme, every module with a scale */
    int32_t n_schemes;
    ct_scheme schemes[CT_MAX_SCHEMES];
};

/* A field that must be absent, null or empty, else refused by its name. */
static int refuse_present(const char *path, const cJSON *j, const char *key, const char *what,
                          char *msg, size_t msg_len)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    if (!v || cJSON_IsNull(v) || (cJSON_IsFalse(v)) ||
        ((cJSON_IsObject(v) || cJSON_IsArray(v)) && cJSON_GetArraySize(v) == 0))
        return QL_OK;
    return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                   "%s: quantization_config %s is not supported (%s)", path, key, what);
}

static int parse_format(const char *path, const char *where, const char *f, ct_format *out,
                        char *msg, size_t msg_len)
{
    if (f && strcmp(f, "pack-quantized") == 0)
        *out = CT_PACKED;
    else if (f && (strcmp(f, "naive-quantized") == 0 || strcmp(f, "int-quantized") == 0))
        *out = CT_NAIVE;
    else if (f && strcmp(f, "float-quantized") == 0)
        *out = CT_FLOAT;
    else
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: quantization_config %s format %s is not supported (pack-quantized, "
                       "naive-quantized, int-quantized and float-quantized are)",
                       path, where, f ? f : "(missing)");
    return QL_OK;
}

/* The scale's block from the weights' strategy (inferred from group_size
 * when null, as QuantizationArgs does). */
static int parse_strategy(const char *path, const char *g, const cJSON *w, ct_scheme *s, char *msg,
                          size_t msg_len)
{
    const char *st = mf_json_str(w, "strategy");
    const cJSON *gs = cJSON_GetObjectItemCaseSensitive(w, "group_size");
    int64_t group = 0;
    bool has_group = gs && !cJSON_IsNull(gs);
    if (has_group && (!mf_json_integer(gs, -1, 1 << 20, &group) || group == 0))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: config_groups %s weights group_size is not -1 or a positive integer",
                       path, g);
    if (!st)
        st = !has_group ? "tensor" : group > 0 ? "group" : "channel";
    s->block[0] = s->block[1] = 0;
    if (strcmp(st, "tensor") == 0)
        return QL_OK;
    if (strcmp(st, "channel") == 0) {
        s->block[0] = 1;
        return QL_OK;
    }
    if (strcmp(st, "group") == 0 && group > 0) {
        s->block[0] = 1;
        s->block[1] = (int32_t)group;
        return QL_OK;
    }
    const cJSON *bs = cJSON_GetObjectItemCaseSensitive(w, "block_structure");
    int64_t b[2];
    if (strcmp(st, "block") == 0 && cJSON_IsArray(bs) && cJSON_GetArraySize(bs) == 2 &&
        mf_json_integer(cJSON_GetArrayItem(bs, 0), 1, 1 << 20, &b[0]) &&
        mf_json_integer(cJSON_GetArrayItem(bs, 1), 1, 1 << 20, &b[1])) {
        s->block[0] = (int32_t)b[0];
        s->block[1] = (int32_t)b[1];
        return QL_OK;
    }
    return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                   "%s: config_groups %s weights strategy %s is not supported (tensor, channel, "
                   "group with a group_size and block with a block_structure are)",
                   path, g, st);
}

/* One config group's weights into s (format already set). */
static int parse_weights(const char *path, const char *g, const cJSON *w, ct_scheme *s, char *msg,
                         size_t msg_len)
{
    if (!cJSON_IsObject(w))
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: config_groups %s has no weights (activation-only quantization is not "
                       "supported)",
                       path, g);
    int64_t bits = 0;
    const char *type = mf_json_str(w, "type");
    bool is_float = type && strcmp(type, "float") == 0;
    if ((type && !is_float && strcmp(type, "int") != 0) ||
        !mf_json_integer(cJSON_GetObjectItemCaseSensitive(w, "num_bits"), 1, 64, &bits) ||
        (is_float ? bits != 8 : bits != 4 && bits != 8))
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: config_groups %s weights type %s with num_bits %lld is not supported "
                       "(int 4 and 8, float 8 are)",
                       path, g, type ? type : "int", (long long)bits);
    s->bits = (int32_t)bits;
    s->symmetric = mf_json_bool(w, "symmetric", true);
    if (is_float && s->format == CT_NAIVE)
        s->format = CT_FLOAT; /* naive-quantized stores the FP8 codes as they are */
    if ((s->format == CT_FLOAT) != is_float || (s->format == CT_NAIVE && bits != 8))
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: config_groups %s: %s %d-bit weights in this format are not supported",
                       path, g, is_float ? "float" : "int", s->bits);
    if (is_float && !s->symmetric)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: config_groups %s weights: asymmetric fp8 is not supported", path, g);
    const char *order = mf_json_str(w, "actorder");
    if (order && strcmp(order, "weight") != 0 && strcmp(order, "static") != 0)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: config_groups %s weights actorder %s is not supported (weight is: it "
                       "leaves the layout alone)",
                       path, g, order);
    int rc = refuse_present(path, w, "dynamic", "weights quantized on the fly", msg, msg_len);
    return rc == QL_OK ? parse_strategy(path, g, w, s, msg, msg_len) : rc;
}

/* A "re:" pattern compiled as POSIX extended; false when it does not compile. */
static bool compile_pattern(const char *target, regex_t *re)
{
    return regcomp(re, target + 3, REG_EXTENDED) == 0;
}

/* Every target of list is a string; a "re:" one compiles; a class name
 * other than Linear (capitalised, no dot) is refused. */
static int check_targets(const char *path, const char *where, const cJSON *list, bool required,
                         char *msg, size_t msg_len)
{
    if (!list || cJSON_IsNull(list)) {
        if (!required)
            return QL_OK;
    } else if (cJSON_IsArray(list)) {
        const cJSON *e;
        cJSON_ArrayForEach (e, list) {
            const char *t = cJSON_IsString(e) ? e->valuestring : NULL;
            regex_t re;
            if (t && strncmp(t, "re:", 3) == 0 && compile_pattern(t, &re)) {
                regfree(&re);
                continue;
            }
            if (t && strncmp(t, "re:", 3) != 0 &&
                (strcmp(t, "Linear") == 0 || !(t[0] >= 'A' && t[0] <= 'Z') || strchr(t, '.')))
                continue;
            return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                           "%s: quantization_config %s entry %s is not supported (Linear, module "
                           "names and re: patterns POSIX can compile are)",
                           path, where, t ? t : "(not a string)");
        }
        return QL_OK;
    }
    return ql_fail(msg, msg_len, QL_EFORMAT, "%s: quantization_config %s is not a list", path,
                   where);
}

/* One config group, named g, into s. */
static int parse_group(const char *path, const char *g, const cJSON *grp, const char *top_format,
                       ct_scheme *s, char *msg, size_t msg_len)
{
    char where[128];
    snprintf(where, sizeof where, "config_groups %s", g);
    const char *f = mf_json_str(grp, "format");
    int rc = parse_format(path, where, f ? f : top_format, &s->format, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    s->name = g;
    s->targets = cJSON_GetObjectItemCaseSensitive(grp, "targets");
    snprintf(where, sizeof where, "config_groups %s targets", g);
    if ((rc = check_targets(path, where, s->targets, true, msg, msg_len)) != QL_OK)
        return rc;
    const cJSON *in = cJSON_GetObjectItemCaseSensitive(grp, "input_activations");
    if (in && !cJSON_IsNull(in) && !mf_json_bool(in, "dynamic", false))
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: config_groups %s input_activations with static scales (input_scale) "
                       "are not supported (dynamic ones are: qlserve keeps activations in float)",
                       path, g);
    rc = refuse_present(path, grp, "output_activations", "output quantization", msg, msg_len);
    if (rc == QL_OK)
        rc = parse_weights(path, g, cJSON_GetObjectItemCaseSensitive(grp, "weights"), s, msg,
                           msg_len);
    return rc;
}

static int parse_compressed_tensors(struct model_ct_config *ct, const char *path, char *msg,
                                    size_t msg_len)
{
    const cJSON *qc = ct->cfg;
    const char *status = mf_json_str(qc, "quantization_status");
    if (status && strcmp(status, "compressed") != 0)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: quantization_config quantization_status %s is not supported "
                       "(compressed is)",
                       path, status);
    static const char *const refused[][2] = {
        {"kv_cache_scheme", "a quantized KV cache"},
        {"sparsity_config", "sparse weights"},
        {"transform_config", "rotated weights"},
    };
    for (size_t i = 0; i < sizeof refused / sizeof *refused; i++) {
        int rc = refuse_present(path, qc, refused[i][0], refused[i][1], msg, msg_len);
        if (rc != QL_OK)
            return rc;
    }
    const char *top = mf_json_str(qc, "format");
    ct_format unused;
    int rc = top && strcmp(top, "mixed-precision") != 0
                 ? parse_format(path, "top-level", top, &unused, msg, msg_len)
                 : QL_OK;
    if (rc != QL_OK)
        return rc;
    const cJSON *groups = cJSON_GetObjectItemCaseSensitive(qc, "config_groups");
    if (!cJSON_IsObject(groups) || cJSON_GetArraySize(groups) < 1 ||
        cJSON_GetArraySize(groups) > CT_MAX_SCHEMES)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: quantization_config config_groups must hold 1 to %d groups", path,
                       CT_MAX_SCHEMES);
    const cJSON *g;
    cJSON_ArrayForEach (g, groups) {
        rc = parse_group(path, g->string, g, top, &ct->schemes[ct->n_schemes++], msg, msg_len);
        if (rc != QL_OK)
            return rc;
    }
    ct->ignore = cJSON_GetObjectItemCaseSensitive(qc, "ignore");
    return check_targets(path, "ignore", ct->ignore, false, msg, msg_len);
}

static int parse_fbgemm(struct model_ct_config *ct, const char *path, char *msg, size_t msg_len)
{
    const cJSON *ub = cJSON_GetObjectItemCaseSensitive(ct->cfg, "activation_scale_ub");
    double v;
    if (ub && !cJSON_IsNull(ub) && (!mf_json_number(ub, &v) || !(v > 0)))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "%s: quantization_config activation_scale_ub is not a positive number",
                       path);
    ct->fbgemm = true;
    ct->n_schemes = 1;
    ct->schemes[0] = (ct_scheme){
        .name = "fbgemm_fp8", .format = CT_FLOAT, .bits = 8, .symmetric = true, .block = {1, 0}};
    return QL_OK;
}

int model_ct_config(model_loader *L, const char *path, const cJSON *qc, char *msg, size_t msg_len)
{
    struct model_ct_config *ct = calloc(1, sizeof *ct);
    if (!ct || !(ct->cfg = cJSON_Duplicate(qc, true))) {
        free(ct);
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory");
    }
    L->ct = ct;
    const char *qm = mf_json_str(qc, "quant_method");
    return qm && strcmp(qm, "fbgemm_fp8") == 0 ? parse_fbgemm(ct, path, msg, msg_len)
                                               : parse_compressed_tensors(ct, path, msg, msg_len);
}

void model_ct_free(model_loader *L)
{
    if (L->ct)
        cJSON_Delete(L->ct->cfg);
    free(L->ct);
    L->ct = NULL;
}

const char *model_ct_format(const model_loader *L)
{
    return L->ct && L->ct->fbgemm ? "fbgemm_fp8" : "compressed-tensors";
}

/* Whether one of list's targets names module (a linear when linear). */
static bool list_matches(const cJSON *list, const char *module, bool linear)
{
    const cJSON *e;
    cJSON_ArrayForEach (e, list) {
        const char *t = e->valuestring;
        regex_t re;
        regmatch_t m;
        if (strncmp(t, "re:", 3) == 0 && compile_pattern(t, &re)) {
            /* re.match: the match starts at the name's start */
            bool hit = regexec(&re, module, 1, &m, 0) == 0 && m.rm_so == 0;
            regfree(&re);
            if (hit)
                return true;
        } else if ((linear && strcmp(t, "Linear") == 0) || strcmp(t, module) == 0) {
            return true;
        }
    }
    return false;
}

/* The scheme quantizing module, NULL when none targets it or it is ignored. */
static const ct_scheme *scheme_for(const struct model_ct_config *ct, const char *module,
                                   bool linear)
{
    if (ct->fbgemm)
        return &ct->schemes[0];
    if (ct->ignore && list_matches(ct->ignore, module, linear))
        return NULL;
    for (int32_t i = 0; i < ct->n_schemes; i++)
        if (list_matches(ct->schemes[i].targets, module, linear))
            return &ct->schemes[i];
    return NULL;
}

/* `<module>.<part>` in the shards, or NULL. */
static const st_tensor *part_of(const model_loader *L, const char *module, const char *part,
                                const st_file **f)
{
    char buf[600];
    if ((size_t)snprintf(buf, sizeof buf, "%s.%s", module, part) >= sizeof buf)
        return NULL;
    return model_find_st(L, buf, f);
}

/* The module's weight_scale: dtype kept, numel the block grid's, a matrix
 * of that grid's shape when 2-D. */
static int check_scale(const char *module, const st_file *f, const st_tensor *s, int64_t grid_r,
                       int64_t grid_c, qt_scale_dtype *dt, char *msg, size_t msg_len)
{
    if (s->dtype != ST_F32 && s->dtype != ST_BF16 && s->dtype != ST_F16)
        return ql_fail(msg, msg_len, QL_EUNSUPPORTED,
                       "%s: '%s' is %s; a weight_scale must be F32, BF16 or F16", f->path, s->name,
                       st_dtype_name(s->dtype));
    *dt = s->dtype == ST_F32 ? QT_SCALE_F32 : s->dtype == ST_BF16 ? QT_SCALE_BF16 : QT_SCALE_F16;
    if (s->numel != grid_r * grid_c || s->ndim > 2 ||
        (s->ndim == 2 && (s->shape[0] != grid_r || s->shape[1] != grid_c)))
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: '%s' holds %lld scales; %s's scheme needs a [%lld, %lld] grid", f->path,
                       s->name, (long long)s->numel, module, (long long)grid_r, (long long)grid_c);
    return QL_OK;
}

/* A tensor's dtype and 2-D shape, else refused naming it (NULL: missing). */
static int check_matrix(const st_file *f, const st_tensor *t, st_dtype want, int64_t r, int64_t c,
                        char *msg, size_t msg_len)
{
    if (!t)
        return ql_fail(msg, msg_len, QL_EFORMAT, "a %s [%lld, %lld] weight is missing",
                       st_dtype_name(want), (long long)r, (long long)c);
    if (t->dtype == want && t->ndim == 2 && t->shape[0] == r && t->shape[1] == c)
        return QL_OK;
    return ql_fail(msg, msg_len, QL_EFORMAT,
                   "%s: '%s' is %s with %d dimensions; expected %s [%lld, %lld]", f->path, t->name,
                   st_dtype_name(t->dtype), t->ndim, st_dtype_name(want), (long long)r,
                   (long long)c);
}

/* pack-quantized's weight_shape: [rows, cols] as I64 or I32. */
static int check_weight_shape(const model_loader *L, const char *module, int64_t rows, int64_t cols,
                              char *msg, size_t msg_len)
{
    const st_file *f;
    const st_tensor *t = part_of(L, module, "weight_shape", &f);
    int64_t v[2] = {-1, -1};
    for (int i = 0; t && t->ndim == 1 && t->shape[0] == 2 && i < 2; i++) {
        if (t->dtype == ST_I64) {
            memcpy(&v[i], t->data + i * 8, 8);
        } else if (t->dtype == ST_I32) {
            int32_t w;
            memcpy(&w, t->data + i * 4, 4);
            v[i] = w;
        }
    }
    if (v[0] != rows || v[1] != cols)
        return ql_fail(msg, msg_len, QL_EFORMAT,
                       "%s: %s.weight_shape is missing or not [%lld, %lld] (an I64 or I32 pair)",
                       L->dir, module, (long long)rows, (long long)cols);
    return QL_OK;
}

/* The integer formats' codes and zeros into a QT_CT_INT. */
static int load_ct_int(const model_loader *L, const ct_scheme *sc, const char *module,
                       qt_ct_int_parts *p, qtensor *out, char *msg, size_t msg_len)
{
    const st_file *f = NULL, *zf;
    const st_tensor *w =
        part_of(L, module, sc->format == CT_PACKED ? "weight_packed" : "weight", &f);
    int rc = sc->format == CT_PACKED
                 ? check_matrix(f, w, ST_I32, p->rows, (p->cols * sc->bits + 31) / 32, msg, msg_len)
                 : check_matrix(f, w, ST_I8, p->rows, p->cols, msg, msg_len);
    if (rc == QL_OK && sc->format == CT_PACKED)
        rc = check_weight_shape(L, module, p->rows, p->cols, msg, msg_len);
    const st_tensor *z = part_of(L, module, "weight_zero_point", &zf);
    if (rc == QL_OK && !sc->symmetric && !z)
        rc = ql_fail(msg, msg_len, QL_EFORMAT, "%s is asymmetric but has no weight_zero_point",
                     module);
    if (rc == QL_OK && z && !sc->symmetric) {
        p->zeros = z->data;
        p->zeros_packed = z->dtype == ST_I32;
        if (p->zeros_packed)
            rc = check_matrix(zf, z, ST_I32, (p->scale_rows * sc->bits + 31) / 32, p->scale_cols,
                              msg, msg_len);
        else if (z->dtype != ST_I8 || z->numel != p->scale_rows * p->scale_cols)
            rc = ql_fail(msg, msg_len, QL_EFORMAT,
                         "%s: '%s' is %s of %lld; expected I8 zero points, one per scale", zf->path,
                         z->name, st_dtype_name(z->dtype), (long long)z->numel);
    }
    if (rc != QL_OK)
        return rc;
    p->bits = sc->bits;
    p->packed = sc->format == CT_PACKED;
    p->codes = w->data;
    p->borrow_codes = true; /* the shards stay mapped as long as the model */
    return qt_from_ct_int(out, p, msg, msg_len);
}

int model_ct_tensor(model_loader *L, const char *name, int64_t rows, int64_t cols, bool linear,
                    qtensor *out, bool *handled, char *msg, size_t msg_len)
{
    *handled = false;
    size_t n = strlen(name);
    char module[512];
    if (n < 7 || n - 7 >= sizeof module || strcmp(name + n - 7, ".weight") != 0)
        return QL_OK;
    snprintf(module, sizeof module, "%.*s", (int)(n - 7), name);
    const st_file *f, *sf;
    const st_tensor *s = part_of(L, module, "weight_scale", &sf);
    const ct_scheme *sc = scheme_for(L->ct, module, linear);
    if (!s && !part_of(L, module, "weight_packed", &f)) {
        if (sc && !L->ct->fbgemm)
            return ql_fail(msg, msg_len, QL_EFORMAT,
                           "%s: config group %s targets %s but the checkpoint holds it dense (no "
                           "weight_scale)",
                           L->dir, sc->name, module);
        return QL_OK; /* left dense: ignore, modules_to_not_convert */
    }
    *handled = true;
    if (!sc || !s)
        return ql_fail(
            msg, msg_len, QL_EFORMAT, "%s: %s is stored quantized but %s", L->dir, module,
            !s ? "has no weight_scale" : "no config group targets it (or ignore names it)");
    static const char *const refused[] = {"weight_g_idx", "input_scale", "weight_global_scale"};
    for (size_t i = 0; i < sizeof refused / sizeof *refused; i++)
        if (part_of(L, module, refused[i], &f))
            return ql_fail(msg, msg_len, QL_EUNSUPPORTED, "%s: %s.%s is not supported", f->path,
                           module, refused[i]);
    int32_t br = sc->block[0] ? sc->block[0] : (int32_t)rows;
    int32_t bc = sc->block[1] ? sc->block[1] : (int32_t)cols;
    int64_t gr = (rows + br - 1) / br, gc = (cols + bc - 1) / bc;
    qt_scale_dtype dt = QT_SCALE_F32;
    int rc = check_scale(module, sf, s, gr, gc, &dt, msg, msg_len);
    if (rc == QL_OK && L->ct->fbgemm && dt != QT_SCALE_F32)
        rc = ql_fail(msg, msg_len, QL_EFORMAT, "%s: fbgemm_fp8 '%s' is not F32", sf->path, s->name);
    if (rc != QL_OK)
        return rc;
    char why[256];
    if (sc->format == CT_FLOAT) {
        const st_tensor *w = part_of(L, module, "weight", &f);
        if ((rc = check_matrix(f, w, ST_F8_E4M3, rows, cols, why, sizeof why)) != QL_OK)
            return ql_fail(msg, msg_len, rc, "%s: %s: %s", L->dir, module, why);
        qt_fp8_parts p = {.rows = rows,
                          .cols = cols,
                          .block_rows = br,
                          .block_cols = bc,
                          .codes = w->data,
                          .borrow_codes = true,
                          .scale_dtype = dt,
                          .scales = s->data,
                          .scale_rows = gr,
                          .scale_cols = gc};
        rc = qt_from_fp8(out, &p, why, sizeof why);
    } else {
        qt_ct_int_parts p = {.rows = rows,
                             .cols = cols,
                             .block_rows = br,
                             .block_cols = bc,
                             .scale_dtype = dt,
                             .scales = s->data,
                             .scale_rows = gr,
                             .scale_cols = gc};
        rc = load_ct_int(L, sc, module, &p, out, why, sizeof why);
    }
    if (rc != QL_OK)
        return ql_fail(msg, msg_len, rc, "%s: %s: %s", L->dir, module, why);
    return QL_OK;
}
