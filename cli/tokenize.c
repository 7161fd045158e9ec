/*
 * tokenize.c - `qlserve tokenize`: its flags (cli_tokenize) and its job
 * (eng_tokenize), which loads a model's tokenizer alone (no weights: a
 * vocabulary-only GGUF works too) and prints the ids of a text, each with
 * its piece as a streaming client would see it, or as one JSON line. Owns
 * the tokenizer for the length of the call; writes only to the stream it
 * is given.
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

int eng_tokenize(const eng_tokenize_opts *o, FILE *out, char *msg, size_t msg_len)
{
    tok_tokenizer *tok;
    int rc = eng_tokenizer_load(&tok, o->model, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    int32_t *ids = NULL;
    size_t n = 0;
    rc = tok_encode(tok, o->text, strlen(o->text), o->add_bos, o->parse_special, &ids, &n, msg,
                    msg_len);
    if (rc == QL_OK && o->json) {
        fputs("{\"ids\": [", out);
        for (size_t i = 0; i < n; i++)
            fprintf(out, "%s%d", i ? ", " : "", ids[i]);
        fputs("]}\n", out);
    }
    /* each id's text as the streaming decoder gives it: what a client
     * receiving tokens one by one would see (an incomplete character shows
     * up with the token that completes it) */
    tok_stream st = {0};
    char piece[4096];
    for (size_t i = 0; rc == QL_OK && !o->json && i < n; i++) {
        long len = tok_stream_push(tok, &st, ids[i], piece, sizeof piece);
        fprintf(out, "%6d  '", ids[i]);
        print_piece(out, piece, len);
        fputs("'\n", out);
    }
    if (rc == QL_OK && !o->json)
        fprintf(out, "%zu tokens\n", n);
    free(ids);
    tok_free(tok);
    return rc;
}

int cli_tokenize(int argc, char **argv)
{
    char msg[1024];
    cfg_tokenize c;
    int rc = cfg_parse_tokenize(argc, argv, &c, msg, sizeof msg);
    if (rc != QL_OK)
        return cli_usage_failure("tokenize", rc, msg);
    eng_tokenize_opts o = {.model = c.model,
                           .text = c.text,
                           .add_bos = c.add_bos,
                           .parse_special = !c.no_special,
                           .json = c.json};
    rc = eng_tokenize(&o, stdout, msg, sizeof msg);
    if (rc != QL_OK) {
        fprintf(stderr, "qlserve tokenize: %s\n", msg);
        return 1;
    }
    return 0;
}
