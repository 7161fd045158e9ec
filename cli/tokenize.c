/*
 * tokenize.c - `qlserve tokenize`: its flags (cli_tokenize) and its job
 * (eng_tokenize), which loads a model for its tokenizer and prints the ids
 * of a text with each id's piece as a streaming client would see it. Owns
 * the model for the length of the call; writes only to the stream it is
 * given.
 */
#include "cli.h"
#include "model.h"
#include "tokenizer.h"

#include <stdlib.h>
#include <string.h>

/* One piece as it goes between the quotes: newline as \n, other control
 * bytes as \xNN, everything else (UTF-8 included) as it is. */
static void print_piece(FILE *out, const char *piece, long len)
{
    for (long k = 0; k < len; k++) {
        unsigned char ch = (unsigned char)piece[k];
        if (ch == '\n')
            fputs("\\n", out);
        else if (ch < 0x20)
            fprintf(out, "\\x%02x", ch);
        else
            fputc(ch, out);
    }
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
        print_piece(out, piece, len);
        fputs("'\n", out);
    }
    if (rc == QL_OK)
        fprintf(out, "%zu tokens\n", n);
    free(ids);
    eng_model_free(&m);
    return rc;
}

int cli_tokenize(int argc, char **argv)
{
    char msg[1024];
    cfg_tokenize c;
    int rc = cfg_parse_tokenize(argc, argv, &c, msg, sizeof msg);
    if (rc != QL_OK)
        return cli_usage_failure("tokenize", rc, msg);
    eng_load_opts load = cli_load_opts(&c.model);
    rc = eng_tokenize(&load, c.text, c.add_bos, stdout, msg, sizeof msg);
    if (rc != QL_OK) {
        fprintf(stderr, "qlserve tokenize: %s\n", msg);
        return 1;
    }
    return 0;
}
