/*
 * config.h - the public header of config/: command-line flags for each
 * `qlserve` subcommand, parsed and checked for form (a number is a number, a
 * required flag is present, an unknown flag is an error naming it). What a
 * value means (a quant kind, a path that must exist) is checked by the
 * module that uses it.
 *
 * Strings in the parsed structs point into argv and live as long as it;
 * cfg_serve also holds copies of strings from its config file and the
 * environment, which live until cfg_serve_free.
 */
#ifndef QL_CONFIG_H
#define QL_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "ql_base.h"

/* The longest API key or admin token accepted: the server compares a
 * secret over this many bytes whatever its length (server.h,
 * srv_secret_equal), and a request's Authorization header must hold
 * "Bearer " and it (server.h's srv_request.authorization is sized from
 * it). 256 bytes is four times `openssl rand -hex 32`. */
#define CFG_SECRET_MAX 256

/* Under the server's state directory (--state-dir): the journal's name
 * when --state-file is unset, and the admin token generated at start when
 * --host is not loopback and no token is given. "none" as --state-file
 * turns the journal off. */
#define CFG_STATE_FILE_NAME  "state.json"
#define CFG_STATE_FILE_NONE  "none"
#define CFG_ADMIN_TOKEN_NAME "admin-token"

typedef struct cfg_quantize {
    const char *in_path;   /* --in, required */
    const char *out_path;  /* --out, required */
    const char *kind;      /* --kind, required: nf4, fp4, a GGUF kind or fp8 */
    int32_t blocksize;     /* --blocksize, default 64 */
    bool double_quant;     /* --double-quant */
    const char *block;     /* --block RxC (fp8) */
    const char *scale_fmt; /* --scale-fmt float|ue8m0 (fp8) */
    bool allow_requantize; /* --allow-requantize (a GGUF file in, a GGUF kind) */
} cfg_quantize;

/* How to load a model: shared by every subcommand that loads one. */
typedef struct cfg_model {
    const char *path;      /* --model (inspect takes it as its argument) */
    const char *quant;     /* --quant none|nf4|nf4-dq|fp4|int4|int8 */
    int32_t blocksize;     /* --blocksize for nf4/fp4 (0: 64) */
    int32_t group_size;    /* --group-size for int4/int8 (0: kind's default) */
    bool quantize_lm_head; /* --quantize-lm-head */
    const char *dtype;     /* --dtype f32|bf16|f16 for dense parameters */
    /* --chat-template FILE (serve, generate): its text replaces the model's
     * chat templates; NULL: the model's own */
    const char *chat_template;
} cfg_model;

/* Speculative decoding (serve, generate): --speculative off|ngram|draft|mtp
 * (mtp: the model's own MTP layers, refused at start without them), --draft-model,
 * --draft-kv-mib, --draft-max, --draft-fixed, --ngram-min, --ngram-max, --ngram-memory,
 * --spec-max-batch (0: the engine's defaults, eng_spec_opts). */
typedef struct cfg_spec {
    const char *speculative; /* default "off" */
    int32_t draft_max, ngram_min, ngram_max, max_batch;
    int32_t ngram_memory;    /* tokens of earlier answers (0: the engine's; -1: none) */
    bool draft_fixed;        /* --draft-fixed: draft-max tokens every step, no cost rule */
    const char *draft_model; /* --draft-model PATH (speculative draft) */
    int32_t draft_kv_mib;    /* its KV cache (0: as many positions as the model's) */
} cfg_spec;

typedef struct cfg_inspect {
    const char *path; /* the one positional argument */
    cfg_model model;  /* used when path is a model */
} cfg_inspect;

typedef struct cfg_tokenize {
    const char *model; /* --model, required: only its tokenizer is read */
    const char *text;  /* the one positional argument */
    bool add_bos;      /* --add-bos: prepend BOS when the model wants it */
    bool no_special;   /* --no-special: special-token strings are plain text */
    bool json;         /* --json: {"ids": [...]} instead of the table */
} cfg_tokenize;

typedef struct cfg_generate {
    cfg_model model;          /* --model is required */
    const char *prompt;       /* --prompt, required */
    int32_t max_new_tokens;   /* --max-new-tokens, default 128 */
    float temperature;        /* --temperature, default 0: greedy */
    int32_t top_k;            /* --top-k, default 0: off */
    float top_p;              /* --top-p, default 1: off */
    float repetition_penalty; /* --repetition-penalty, default 1: off */
    uint64_t seed;            /* --seed, default 0 */
    const char *stop;         /* --stop STRING */
    int32_t threads;          /* --threads, default 0: all cores */
    const char *device;       /* --device cpu|cuda|auto, default auto */
    int32_t kv_mib;           /* --kv-mib, default 0: the engine's default */
    const char *kv_dtype;     /* --kv-dtype f32|f16|q8_0; NULL: f32 (eng_kv_dtype_resolve) */
    const char *activations;  /* --activations f32|q8 (ql_activations_names), default f32 */
    const char *adapter;      /* --adapter DIR: a PEFT LoRA adapter folder */
    float adapter_scale;      /* --adapter-scale, default 1 */
    bool merge;               /* --merge: merge it into the weights (else unmerged) */
    const char *into;         /* --into int8|bf16: what merged modules are stored in */
    /* --adapter-dtype bf16|f32 (lora_dtype), default bf16 */
    const char *adapter_dtype;
    cfg_spec spec;
} cfg_generate;

/* `qlserve serve`: see cfg_parse_serve for where each value comes from. */
typedef struct cfg_serve {
    /* --model (required), --quant, --blocksize, --group-size,
     * --quantize-lm-head, --dtype: MODEL_OPTS; --chat-template */
    cfg_model model;
    const char *host; /* --host, default "127.0.0.1" */
    int32_t port;     /* --port, default 8080; 0: pick a free port (tests) */
    /* --adapter-dir DIR: the only place adapters load from (NULL: adapter
     * loading off) */
    const char *adapter_dir;
    /* --no-lazy-adapters: a request naming an adapter that is not loaded
     * is refused, not loaded from adapter_dir's folder of that name */
    bool no_lazy_adapters;
    /* --no-prefix-cache: keep no prompt's KV blocks for later requests */
    bool no_prefix_cache;
    /* --state-dir DIR: the server's own files (the journal, a generated
     * admin token), never the adapter folder, which uploaders may write.
     * NULL: $XDG_STATE_HOME/qlserve, else ~/.local/state/qlserve (the
     * server makes it, mode 0700; an unusable default only warns, unless
     * a token must be generated there). */
    const char *state_dir;
    /* --state-file FILE: where the adapter registry journals its state
     * (loaded adapters, the merged configuration) and what is replayed at
     * start; "none": no journal. NULL: CFG_STATE_FILE_NAME under the state
     * directory when it can be written (else the server warns and runs
     * without), no journal without adapter_dir. */
    const char *state_file;
    /* The first line of --admin-token-file FILE (trailing newline and
     * whitespace stripped; the file must exist and not be empty; at most
     * CFG_SECRET_MAX bytes), or env QLSERVE_ADMIN_TOKEN. NULL: on a
     * loopback --host the admin routes answer loopback clients whose
     * request a browser page cannot have made (server/admin.c); on any
     * other the server generates one into the state directory. */
    const char *admin_token;
    /* --allowed-hosts HOST[:PORT],...: Host header values accepted besides
     * the loopback names (localhost, 127.x.x.x, [::1], with the server's
     * port or none), or "*": any. Checked on every request while --host is
     * loopback, no admin token is configured, or this is set (DNS
     * rebinding); NULL: the loopback names only. */
    const char *allowed_hosts;
    /* The first line of --api-key-file FILE (stripped as the admin token
     * is), or env QLSERVE_API_KEY: every route but /health and GET / then
     * wants "Authorization: Bearer KEY". At most CFG_SECRET_MAX bytes. NULL:
     * no key asked. Never equal to admin_token (refused). */
    const char *api_key;
    /* --cors-allow-origin ORIGIN,...: the browser origins answered with CORS
     * headers, comma separated, each "*" (any) or scheme://host[:port].
     * NULL: no CORS headers, no preflight. */
    const char *cors_allow_origin;
    const char *config_path; /* --config FILE (or env QLSERVE_CONFIG) */
    /* --served-model-name NAME: the model's id in /v1/models and /info; NULL:
     * derived by the server */
    const char *served_model_name;
    int32_t threads; /* --threads, 0: all cores */
    /* --device cpu|cuda|auto, default auto: CUDA when this build has it and
     * a device is present */
    const char *device;
    int32_t kv_mib;       /* --kv-mib, default QL_KV_MIB_DEFAULT */
    const char *kv_dtype; /* --kv-dtype f32|f16|q8_0; NULL: f32 (eng_kv_dtype_resolve) */
    /* --activations f32|q8 (ql_activations_names), default f32; NULL (a
     * struct built by hand): f32 */
    const char *activations;
    int32_t max_running;          /* --max-running (sequences decoding together), default 64 */
    cfg_spec spec;                /* speculative decoding */
    int32_t max_queued;           /* --max-queued (waiting requests before 503), default 256 */
    int32_t max_new_tokens;       /* --max-new-tokens (largest accepted), default 4096 */
    int64_t max_held_bytes;       /* --max-held-bytes (unanswered requests, 503 past), 1 GiB */
    int32_t max_context;          /* --max-context (prompt + new tokens), 0: the model's */
    int32_t max_connections;      /* --max-connections, default 256 */
    int64_t max_body_bytes;       /* --max-body-bytes, default 1 MiB */
    int32_t max_header_bytes;     /* --max-header-bytes, default 16 KiB */
    int32_t request_timeout_ms;   /* --request-timeout-ms: to receive a request (408), 30000 */
    int32_t keepalive_timeout_ms; /* --keepalive-timeout-ms: idle keep-alive, default 60000 */
    /* --first-byte-timeout-ms: a new connection's time to begin its first
     * request before it is closed, default 10000 */
    int32_t first_byte_timeout_ms;
    /* --max-connections-per-peer: connections open at once from one IP
     * address (more get 503), default 64; 0: no cap */
    int32_t max_connections_per_peer;
    /* the step budget (eng_engine_opts): --step-budget-ms (0: automatic), --max-prefill-per-step
     * (0: from the time), --min-prefill-per-step (default 16) */
    int32_t step_budget_ms, max_prefill_per_step, min_prefill_per_step;
    int32_t grace_ms;           /* --grace-ms: SIGTERM drain period, 30000; 0: cancel at once */
    int64_t adapter_budget_mib; /* --adapter-budget-mib, 0: no limit */
    int32_t merge_threads;      /* --merge-threads, default 1 */
    /* --adapter-dtype bf16|f32 (lora_dtype), default bf16; NULL (a struct
     * built by hand): f32 */
    const char *adapter_dtype;
    /* private: the strings this struct owns (copies from the config file and
     * the environment), freed by cfg_serve_free. NULL in a struct built by
     * hand, which cfg_serve_free then leaves alone. */
    void *owned_;
} cfg_serve;

/* argv[0] is the subcommand's name. On QL_EUSAGE msg says what is wrong. */
int cfg_parse_quantize(int argc, char **argv, cfg_quantize *out, char *msg, size_t msg_len);
int cfg_parse_inspect(int argc, char **argv, cfg_inspect *out, char *msg, size_t msg_len);
int cfg_parse_tokenize(int argc, char **argv, cfg_tokenize *out, char *msg, size_t msg_len);
int cfg_parse_generate(int argc, char **argv, cfg_generate *out, char *msg, size_t msg_len);

/* Defaults, then the JSON config file (--config, or env QLSERVE_CONFIG), then
 * command-line flags, then environment variables (QLSERVE_<FLAG> with dashes
 * as underscores, upper case, e.g. QLSERVE_PORT, QLSERVE_MAX_BODY_BYTES), in
 * that order of precedence (later wins; QLSERVE_CONFIG too wins over
 * --config). The config file is a JSON object whose keys are the flag names
 * ("max-body-bytes" or "max_body_bytes"). Validated at the end: every range
 * checked; a message names the flag, file key or env var and the value (never
 * the admin token or API key). The admin token comes from QLSERVE_ADMIN_TOKEN,
 * else the first line of the admin token file; the API key likewise from
 * QLSERVE_API_KEY or --api-key-file; a config file holding "admin_token" or
 * "api_key" is refused. QL_EHELP when --help is on the command line, whatever the file
 * holds. On QL_OK the caller calls cfg_serve_free; on any other return *out
 * is zeroed and owns nothing. */
int cfg_parse_serve(int argc, char **argv, cfg_serve *out, char *msg, size_t msg_len);
void cfg_serve_free(cfg_serve *c);

/* The usage text of the whole command, or of one subcommand. */
void cfg_print_usage(FILE *out, const char *subcommand);

#endif
