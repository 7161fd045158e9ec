/*
 * test_kv_cache.c - the paged KV cache's sharing: reference counts, held
 * blocks, forks (and forks of forks), copy on write (eng_kv_prepare_write's
 * swaps and copy lists, eng_kv_copy_blocks in the host arena), and the
 * accounting that must stay exact whatever order sequences end in:
 * free + held + referenced blocks == total, a block's count is the number
 * of tables (or the one held list) that name it, and the shared count is
 * the blocks named more than once. Every refusal (ENOMEM, EINVAL) must
 * leave everything as it was.
 *
 * White-box: the checks read struct eng_kv_cache (kv_cache_internal.h) to
 * compare its counts with what the sequences' own lists say. No model is
 * loaded: a cache needs only the layer and head shapes.
 */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "kv_cache_internal.h"
#include "model.h"
#include "runtime.h"
#include "test_util.h"

TestSuite(kv_cache, .timeout = 60);

/* 2 layers, 2 kv heads of 8: 16 positions of K and V are 4 KiB. */
static const eng_config shape = {.n_layers = 2, .n_kv_heads = 2, .head_dim = 8};

enum { BT = 16 };

static eng_kv_cache *new_cache(int32_t blocks)
{
    size_t block_bytes = (size_t)BT * 2 * 2 * 8 * 2 * sizeof(float);
    eng_kv_cache *kv = NULL;
    char msg[256];
    cr_assert_eq(eng_kv_new(&kv, &shape, (size_t)blocks * block_bytes, BT, msg, sizeof msg), QL_OK,
                 "%s", msg);
    cr_assert_eq(eng_kv_total_blocks(kv), blocks);
    cr_assert_eq(eng_kv_block_floats(kv), block_bytes / sizeof(float));
    return kv;
}

/*
 * Everything the cache says against what the live sequences hold: each
 * block's count equals the tables naming it plus the held lists naming it,
 * a held block is in no table and one held list, the free queue (linked both
 * ways) holds the rest once each, and the shared count is the blocks named twice or more.
 */
static void assert_accounting(const eng_kv_cache *kv, eng_seq_kv *const *seqs, int n,
                              const char *when)
{
    int32_t total = eng_kv_total_blocks(kv);
    int32_t *in_tables = calloc((size_t)total, sizeof *in_tables);
    int32_t *in_held = calloc((size_t)total, sizeof *in_held);
    int32_t *on_free = calloc((size_t)total, sizeof *on_free);
    int64_t held = 0;
    for (int i = 0; i < n; i++) {
        const eng_seq_kv *s = seqs[i];
        for (int32_t j = 0; j < s->n_blocks; j++) {
            cr_assert(s->blocks[j] >= 0 && s->blocks[j] < total, "%s: block id %d", when,
                      s->blocks[j]);
            in_tables[s->blocks[j]]++;
        }
        for (int32_t j = 0; j < s->n_held; j++) {
            cr_assert(s->held[j] >= 0 && s->held[j] < total, "%s: held id %d", when, s->held[j]);
            in_held[s->held[j]]++;
        }
        held += s->n_held;
    }
    int32_t queued = 0, prev = -1;
    for (int32_t b = kv->free_head; b >= 0 && queued <= total; prev = b, b = kv->free_next[b]) {
        cr_assert_eq(kv->free_prev[b], prev, "%s: block %d's link back is %d, not %d", when, b,
                     kv->free_prev[b], prev);
        on_free[b]++;
        queued++;
    }
    cr_assert_eq(kv->free_tail, prev, "%s: the free queue ends at %d, its tail is %d", when, prev,
                 kv->free_tail);
    cr_assert_eq(queued, kv->n_free, "%s: %d blocks queued free, %d counted", when, queued,
                 kv->n_free);
    int32_t referenced = 0, shared = 0;
    for (int32_t b = 0; b < total; b++) {
        cr_assert_eq(kv->refs[b], in_tables[b] + in_held[b],
                     "%s: block %d counts %d, %d tables and %d held lists name it", when, b,
                     kv->refs[b], in_tables[b], in_held[b]);
        cr_assert(in_held[b] == 0 || (in_held[b] == 1 && in_tables[b] == 0),
                  "%s: held block %d is also named %d times elsewhere", when, b,
                  in_tables[b] + in_held[b] - 1);
        cr_assert_eq(on_free[b], kv->refs[b] == 0 ? 1 : 0, "%s: block %d (count %d) free %d times",
                     when, b, kv->refs[b], on_free[b]);
        referenced += in_tables[b] > 0;
        shared += in_tables[b] > 1;
    }
    cr_assert_eq(eng_kv_free_blocks(kv) + held + referenced, total,
                 "%s: free %d + held %lld + referenced %d != total %d", when,
                 eng_kv_free_blocks(kv), (long long)held, referenced, total);
    cr_assert_eq(eng_kv_shared_blocks(kv), shared, "%s: %d shared, %d named twice or more", when,
                 eng_kv_shared_blocks(kv), shared);
    free(in_tables);
    free(in_held);
    free(on_free);
}

/* A sequence that has written n positions (the forward pass's part, here
 * by hand). */
static void written(eng_kv_cache *kv, eng_seq_kv *s, int32_t reserve, int32_t n)
{
    cr_assert_eq(eng_kv_reserve(kv, s, reserve), QL_OK);
    s->n_tokens = n;
}

/* A deep copy of a sequence's lists, to show a refusal changed nothing. */
typedef struct seq_snapshot {
    int32_t blocks[64], held[64];
    int32_t n_blocks, n_held, n_tokens;
} seq_snapshot;

static seq_snapshot snap(const eng_seq_kv *s)
{
    seq_snapshot t = {.n_blocks = s->n_blocks, .n_held = s->n_held, .n_tokens = s->n_tokens};
    cr_assert(s->n_blocks <= 64 && s->n_held <= 64);
    if (s->n_blocks)
        memcpy(t.blocks, s->blocks, (size_t)s->n_blocks * sizeof *s->blocks);
    if (s->n_held)
        memcpy(t.held, s->held, (size_t)s->n_held * sizeof *s->held);
    return t;
}

static void assert_unchanged(const eng_seq_kv *s, const seq_snapshot *t, const char *what)
{
    cr_assert_eq(s->n_blocks, t->n_blocks, "%s: table length changed", what);
    cr_assert_eq(s->n_held, t->n_held, "%s: held count changed", what);
    cr_assert_eq(s->n_tokens, t->n_tokens, "%s: n_tokens changed", what);
    for (int32_t i = 0; i < s->n_blocks; i++)
        cr_assert_eq(s->blocks[i], t->blocks[i], "%s: table entry %d changed", what, i);
    for (int32_t i = 0; i < s->n_held; i++)
        cr_assert_eq(s->held[i], t->held[i], "%s: held entry %d changed", what, i);
}

Test(kv_cache, hold_takes_free_blocks_outside_the_table)
{
    eng_kv_cache *kv = new_cache(6);
    eng_seq_kv a = {0};
    eng_seq_kv *all[] = {&a};
    cr_assert_eq(eng_kv_hold(kv, &a, 2), QL_OK);
    cr_assert_eq(a.n_held, 2);
    cr_assert_eq(a.n_blocks, 0, "held blocks are not in the table");
    cr_assert_eq(eng_kv_free_blocks(kv), 4);
    cr_assert_eq(eng_kv_hold(kv, &a, 0), QL_OK, "holding none is nothing");
    written(kv, &a, 40, 0);
    cr_assert_eq(a.n_blocks, 3, "reserve takes from the free list, not the held ones");
    cr_assert_eq(a.n_held, 2);
    assert_accounting(kv, all, 1, "after hold and reserve");
    seq_snapshot before = snap(&a);
    cr_assert_eq(eng_kv_hold(kv, &a, 2), QL_ENOMEM, "one block is free");
    assert_unchanged(&a, &before, "a refused hold");
    cr_assert_eq(eng_kv_free_blocks(kv), 1);
    cr_assert_eq(eng_kv_hold(kv, &a, -1), QL_EINVAL);
    assert_accounting(kv, all, 1, "after refused holds");
    eng_kv_release(kv, &a);
    cr_assert_null(a.held, "release zeroes the held list too");
    cr_assert_eq(a.n_held, 0);
    cr_assert_eq(eng_kv_free_blocks(kv), 6, "held blocks come back with the table");
    cr_assert_eq(eng_kv_shared_blocks(kv), 0);
    eng_kv_free(kv);
}

Test(kv_cache, fork_blocks_counts_growth_and_the_copy_of_a_partial_block)
{
    eng_kv_cache *kv = new_cache(4);
    /* 21 written: 2 blocks, the second partly filled; growing to 40 needs a
     * third, and the partial one needs a block for its copy on write */
    cr_assert_eq(eng_kv_fork_blocks(kv, 21, 40), 2);
    cr_assert_eq(eng_kv_fork_blocks(kv, 21, 21), 1, "no growth, still the copy");
    cr_assert_eq(eng_kv_fork_blocks(kv, 21, 10), 1, "fewer than written is no growth");
    cr_assert_eq(eng_kv_fork_blocks(kv, 32, 32), 0, "full blocks are never copied");
    cr_assert_eq(eng_kv_fork_blocks(kv, 32, 33), 1);
    cr_assert_eq(eng_kv_fork_blocks(kv, 16, 64), 3);
    cr_assert_eq(eng_kv_fork_blocks(kv, 0, 17), 2, "a fork of nothing is a fresh sequence");
    cr_assert_eq(eng_kv_fork_blocks(kv, 0, 0), 0);
    eng_kv_free(kv);
}

Test(kv_cache, fork_shares_the_written_blocks_by_reference)
{
    eng_kv_cache *kv = new_cache(12);
    eng_seq_kv src = {0}, dst = {0};
    eng_seq_kv *all[] = {&src, &dst};
    written(kv, &src, 60, 21); /* 4 blocks reserved, 2 of them written */
    int32_t take = eng_kv_fork_blocks(kv, 21, 40);
    cr_assert_eq(eng_kv_hold(kv, &src, take), QL_OK);
    int32_t free_before = eng_kv_free_blocks(kv);
    cr_assert_eq(eng_kv_fork(kv, &dst, &src, 40), QL_OK);
    cr_assert_eq(eng_kv_free_blocks(kv), free_before, "a fork takes nothing off the free list");
    cr_assert_eq(dst.n_tokens, 21, "the fork has what its source wrote");
    cr_assert_eq(dst.n_blocks, 3, "grown to hold 40 positions");
    cr_assert_eq(dst.blocks[0], src.blocks[0]);
    cr_assert_eq(dst.blocks[1], src.blocks[1]);
    for (int i = 0; i < src.n_blocks; i++)
        cr_assert_neq(dst.blocks[2], src.blocks[i], "the growth is the fork's own");
    cr_assert_eq(dst.n_held, 1, "one block for the copy of the partial block");
    cr_assert_eq(src.n_held, 0, "the source gave what it held");
    cr_assert_eq(src.n_blocks, 4, "the source's table is its own still");
    cr_assert_eq(eng_kv_shared_blocks(kv), 2);
    cr_assert_eq(kv->refs[src.blocks[0]], 2);
    cr_assert_eq(kv->refs[src.blocks[2]], 1, "an unwritten block of the source is not shared");
    assert_accounting(kv, all, 2, "after the fork");
    eng_kv_release(kv, &src);
    cr_assert_eq(eng_kv_shared_blocks(kv), 0, "the fork is the last to name them");
    all[0] = &dst;
    assert_accounting(kv, all, 1, "after the source ended");
    eng_kv_release(kv, &dst);
    cr_assert_eq(eng_kv_free_blocks(kv), 12);
    eng_kv_free(kv);
}

Test(kv_cache, fork_refusals_change_nothing)
{
    eng_kv_cache *kv = new_cache(8);
    eng_seq_kv src = {0}, dst = {0}, other = {0};
    eng_seq_kv *all[] = {&src, &dst, &other};
    written(kv, &src, 21, 21);
    cr_assert_eq(eng_kv_hold(kv, &src, 1), QL_OK);
    seq_snapshot s0 = snap(&src), d0 = snap(&dst);
    cr_assert_eq(eng_kv_fork(kv, &dst, &src, 40), QL_ENOMEM, "two needed, one held");
    assert_unchanged(&src, &s0, "refused fork, source");
    assert_unchanged(&dst, &d0, "refused fork, destination");
    cr_assert_eq(eng_kv_shared_blocks(kv), 0);
    assert_accounting(kv, all, 3, "after a refused fork");
    cr_assert_eq(eng_kv_fork(kv, &src, &src, 21), QL_EINVAL, "a sequence is not its own fork");
    written(kv, &other, 5, 5);
    seq_snapshot o0 = snap(&other);
    cr_assert_eq(eng_kv_fork(kv, &other, &src, 21), QL_EINVAL, "the destination must be empty");
    assert_unchanged(&other, &o0, "refused fork into a used sequence");
    assert_unchanged(&src, &s0, "refused fork into a used sequence, source");
    assert_accounting(kv, all, 3, "after refused forks");
    cr_assert_eq(eng_kv_fork(kv, &dst, &src, 21), QL_OK, "one held is enough for the copy");
    assert_accounting(kv, all, 3, "after the fork");
    eng_kv_release(kv, &dst);
    eng_kv_release(kv, &src);
    eng_kv_release(kv, &other);
    cr_assert_eq(eng_kv_free_blocks(kv), 8);
    eng_kv_free(kv);
}

Test(kv_cache, prepare_write_copies_a_shared_block_once)
{
    eng_kv_cache *kv = new_cache(10);
    eng_seq_kv src = {0}, dst = {0};
    eng_seq_kv *all[] = {&src, &dst};
    written(kv, &src, 40, 21);
    cr_assert_eq(eng_kv_hold(kv, &src, eng_kv_fork_blocks(kv, 21, 40)), QL_OK);
    cr_assert_eq(eng_kv_fork(kv, &dst, &src, 40), QL_OK);
    int32_t partial = src.blocks[1], cow = dst.held[0];
    eng_kv_copy copies[4];
    int32_t n = 0;

    /* a step writing there now is refused by both backends' check */
    char msg[256] = "";
    int32_t t = 5;
    eng_step_seq step = {.kv = &dst, .tokens = &t, .n_tokens = 1, .pos = 21};
    cr_assert_eq(eng_kv_check_writes(kv, &step, 1, msg, sizeof msg), QL_EINVAL);
    cr_assert(strstr(msg, "shared"), "'%s'", msg);

    /* the fork writes position 21 first: its block 1 becomes its own copy */
    cr_assert_eq(eng_kv_prepare_write(kv, &dst, 21, 1, copies, 4, &n), QL_OK);
    cr_assert_eq(eng_kv_check_writes(kv, &step, 1, msg, sizeof msg), QL_OK);
    step.pos = 0; /* but block 0 is shared still */
    cr_assert_eq(eng_kv_check_writes(kv, &step, 1, msg, sizeof msg), QL_EINVAL);
    cr_assert_eq(n, 1);
    cr_assert_eq(copies[0].src, partial);
    cr_assert_eq(copies[0].dst, cow);
    cr_assert_eq(dst.blocks[1], cow);
    cr_assert_eq(dst.n_held, 0);
    cr_assert_eq(dst.blocks[0], src.blocks[0], "the full block stays shared");
    cr_assert_eq(kv->refs[partial], 1, "the source alone names the partial block now");
    cr_assert_eq(eng_kv_shared_blocks(kv), 1);
    assert_accounting(kv, all, 2, "after the fork's copy on write");

    /* writing again, or the source writing its own block, copies nothing */
    cr_assert_eq(eng_kv_prepare_write(kv, &dst, 22, 3, copies, 4, &n), QL_OK);
    cr_assert_eq(eng_kv_prepare_write(kv, &src, 21, 1, copies, 4, &n), QL_OK,
                 "the source holds nothing and needs nothing");
    cr_assert_eq(n, 1, "no copy listed for an unshared block");
    cr_assert_eq(src.blocks[1], partial);
    cr_assert_eq(eng_kv_prepare_write(kv, &src, 21, 0, copies, 4, &n), QL_OK, "nothing to write");
    cr_assert_eq(eng_kv_prepare_write(kv, &src, -1, 1, copies, 4, &n), QL_EINVAL);

    /* rewriting the shared block 0 (a second prefill): the fork has no held
     * block for it, then one; the list must have room */
    seq_snapshot d0 = snap(&dst);
    cr_assert_eq(eng_kv_prepare_write(kv, &dst, 0, 16, copies, 4, &n), QL_ENOMEM);
    assert_unchanged(&dst, &d0, "a copy without a held block");
    cr_assert_eq(n, 1);
    cr_assert_eq(eng_kv_hold(kv, &dst, 1), QL_OK);
    d0 = snap(&dst);
    cr_assert_eq(eng_kv_prepare_write(kv, &dst, 0, 16, copies, 1, &n), QL_EINVAL, "list full");
    assert_unchanged(&dst, &d0, "a full copy list");
    cr_assert_eq(n, 1);
    assert_accounting(kv, all, 2, "after refused writes");
    cr_assert_eq(eng_kv_prepare_write(kv, &dst, 5, 30, copies, 4, &n), QL_OK);
    cr_assert_eq(n, 2, "appended after the first copy");
    cr_assert_eq(copies[1].src, src.blocks[0]);
    cr_assert_eq(copies[1].dst, dst.blocks[0]);
    cr_assert_eq(eng_kv_shared_blocks(kv), 0);
    assert_accounting(kv, all, 2, "after the second copy");

    /* a write past the table is the step's to refuse, not a copy */
    cr_assert_eq(eng_kv_prepare_write(kv, &dst, 40, 20, copies, 4, &n), QL_OK);
    cr_assert_eq(n, 2);
    eng_kv_release(kv, &src);
    eng_kv_release(kv, &dst);
    cr_assert_eq(eng_kv_free_blocks(kv), 10);
    eng_kv_free(kv);
}

Test(kv_cache, the_source_writing_first_copies_and_the_fork_then_writes_in_place)
{
    eng_kv_cache *kv = new_cache(10);
    eng_seq_kv src = {0}, dst = {0};
    eng_seq_kv *all[] = {&src, &dst};
    written(kv, &src, 40, 21);
    /* the source holds one more for its own copy on write */
    cr_assert_eq(eng_kv_hold(kv, &src, eng_kv_fork_blocks(kv, 21, 40) + 1), QL_OK);
    cr_assert_eq(eng_kv_fork(kv, &dst, &src, 40), QL_OK);
    int32_t partial = src.blocks[1];
    eng_kv_copy copies[2];
    int32_t n = 0;
    cr_assert_eq(eng_kv_prepare_write(kv, &src, 21, 1, copies, 2, &n), QL_OK);
    cr_assert_eq(n, 1);
    cr_assert_eq(copies[0].src, partial);
    cr_assert_neq(src.blocks[1], partial);
    cr_assert_eq(eng_kv_prepare_write(kv, &dst, 21, 1, copies, 2, &n), QL_OK);
    cr_assert_eq(n, 1, "the fork is the last to name it: it writes in place");
    cr_assert_eq(dst.blocks[1], partial);
    cr_assert_eq(dst.n_held, 1, "its copy block is unused, and comes back at release");
    assert_accounting(kv, all, 2, "after both wrote");
    eng_kv_release(kv, &dst);
    eng_kv_release(kv, &src);
    cr_assert_eq(eng_kv_free_blocks(kv), 10);
    eng_kv_free(kv);
}

/* A source, its fork and the fork's fork, released in each of the six
 * orders: the shared count falls to 0 and every block comes back. */
Test(kv_cache, forks_of_forks_release_in_any_order)
{
    static const int orders[6][3] = {{0, 1, 2}, {0, 2, 1}, {1, 0, 2},
                                     {1, 2, 0}, {2, 0, 1}, {2, 1, 0}};
    for (int o = 0; o < 6; o++) {
        eng_kv_cache *kv = new_cache(16);
        eng_seq_kv s[3] = {{0}, {0}, {0}};
        eng_seq_kv *all[] = {&s[0], &s[1], &s[2]};
        written(kv, &s[0], 50, 37); /* 3 blocks written, the third partly */
        cr_assert_eq(eng_kv_hold(kv, &s[0], eng_kv_fork_blocks(kv, 37, 50)), QL_OK);
        cr_assert_eq(eng_kv_fork(kv, &s[1], &s[0], 50), QL_OK);
        cr_assert_eq(eng_kv_hold(kv, &s[1], eng_kv_fork_blocks(kv, 37, 60)), QL_OK);
        cr_assert_eq(eng_kv_fork(kv, &s[2], &s[1], 60), QL_OK);
        cr_assert_eq(s[2].n_tokens, 37);
        cr_assert_eq(s[2].n_blocks, 4);
        for (int i = 0; i < 3; i++)
            cr_assert_eq(kv->refs[s[0].blocks[i]], 3, "block %d named by all three", i);
        cr_assert_eq(eng_kv_shared_blocks(kv), 3);
        assert_accounting(kv, all, 3, "after two forks");
        /* the fork's fork writes: one copy; two still name the old block */
        eng_kv_copy copies[3];
        int32_t n = 0;
        cr_assert_eq(eng_kv_prepare_write(kv, &s[2], 37, 1, copies, 3, &n), QL_OK);
        cr_assert_eq(n, 1);
        cr_assert_eq(kv->refs[s[0].blocks[2]], 2);
        cr_assert_eq(eng_kv_shared_blocks(kv), 3);
        assert_accounting(kv, all, 3, "after a copy on write");
        eng_seq_kv *live[3];
        for (int k = 0; k < 3; k++) {
            eng_kv_release(kv, &s[orders[o][k]]);
            int n_live = 0;
            for (int j = k + 1; j < 3; j++)
                live[n_live++] = &s[orders[o][j]];
            assert_accounting(kv, live, n_live, "after a release");
        }
        cr_assert_eq(eng_kv_shared_blocks(kv), 0, "order %d", o);
        cr_assert_eq(eng_kv_free_blocks(kv), 16, "order %d", o);
        eng_kv_free(kv);
    }
}

Test(kv_cache, copy_blocks_copies_whole_blocks_in_the_host_arena)
{
    eng_kv_cache *kv = new_cache(5);
    size_t bf = eng_kv_block_floats(kv);
    float *data = (float *)(void *)kv->data; /* an f32 cache */
    for (size_t i = 0; i < 5 * bf; i++)
        data[i] = (float)i;
    /* 1 -> 3, then 3 -> 4: in order, so 4 gets what 1 held */
    eng_kv_copy copies[2] = {{.src = 1, .dst = 3}, {.src = 3, .dst = 4}};
    eng_kv_copy_blocks(kv, copies, 2);
    for (size_t i = 0; i < bf; i++) {
        cr_assert_eq(data[3 * bf + i], (float)(bf + i), "block 3 float %zu", i);
        cr_assert_eq(data[4 * bf + i], (float)(bf + i), "block 4 float %zu", i);
        for (int b = 0; b < 3; b++)
            cr_assert_eq(data[b * bf + i], (float)(b * bf + i), "block %d changed", b);
    }
    eng_kv_copy_blocks(kv, copies, 0);
    eng_kv_free(kv);

    /* a cache without a host arena has nothing to copy */
    eng_kv_cache *meta = NULL;
    char msg[256];
    cr_assert_eq(
        eng_kv_new_meta(&meta, &shape, (size_t)1 << 20, BT, ENG_KV_DEFAULT_STATES, msg, sizeof msg),
        QL_OK);
    eng_kv_copy_blocks(meta, copies, 2);
    eng_kv_free(meta);
}

/* Random reserves, holds, forks, writes and releases over a small cache,
 * the accounting checked after every one. */
/* Random reserves, holds, forks, writes and releases (and, with the
 * prefix cache on, keeping prompts and finding them again) must keep the
 * accounting exact and every refusal harmless. */
static void random_operations(bool prefix)
{
    enum { SEQS = 6, BLOCKS = 24, OPS = 4000 };
    eng_kv_cache *kv = new_cache(BLOCKS);
    char msg[256];
    if (prefix)
        cr_assert_eq(eng_kv_prefix_enable(kv, msg, sizeof msg), QL_OK, "%s", msg);
    /* two prompts that share their first block: tokens of prompt p at i */
    int32_t prompts[2][BLOCKS * BT];
    for (int p = 0; p < 2; p++)
        for (int i = 0; i < BLOCKS * BT; i++)
            prompts[p][i] = i < BT ? i : i * (p + 2);
    eng_prefix_chain chains[SEQS];
    int which[SEQS] = {0};
    memset(chains, 0, sizeof chains);
    int hits = 0;
    eng_seq_kv s[SEQS];
    memset(s, 0, sizeof s);
    eng_seq_kv *all[SEQS];
    for (int i = 0; i < SEQS; i++)
        all[i] = &s[i];
    uint64_t rng = 14;
    int refused = 0, copied = 0, forked = 0;
    for (int op = 0; op < OPS; op++) {
        eng_seq_kv *a = &s[test_rand(&rng) % SEQS], *b = &s[test_rand(&rng) % SEQS];
        seq_snapshot a0 = snap(a), b0 = snap(b);
        int32_t free0 = eng_kv_free_blocks(kv);
        int rc = QL_OK;
        int ai = (int)(a - s);
        switch (test_rand(&rng) % (prefix ? 7 : 5)) {
        case 0:
            rc = eng_kv_reserve(kv, a, a->n_blocks * BT + (int32_t)(test_rand(&rng) % 40));
            break;
        case 5: /* keep a's written whole blocks as its prompt's */
            eng_kv_prefix_insert(kv, 7, prompts[which[ai]], a->n_tokens, a, &chains[ai]);
            break;
        case 6: /* an empty sequence finds a prompt */
            if (a->n_blocks == 0 && a->n_held == 0 && a->n_tokens == 0) {
                which[ai] = (int)(test_rand(&rng) % 2);
                hits +=
                    eng_kv_prefix_match(kv, 7, prompts[which[ai]], BLOCKS * BT, a, &chains[ai]) > 0;
            }
            break;
        case 1: rc = eng_kv_hold(kv, a, (int32_t)(test_rand(&rng) % 4)); break;
        case 2:
            if (b->n_blocks == 0 && b->n_held == 0 && a != b) {
                int32_t to = a->n_tokens + (int32_t)(test_rand(&rng) % 40);
                rc = eng_kv_fork(kv, b, a, to);
                forked += rc == QL_OK;
            }
            break;
        case 3: {
            /* write a few positions at or before the written end */
            if (a->n_blocks == 0)
                break;
            int32_t cap = a->n_blocks * BT, pos = a->n_tokens;
            if (test_rand(&rng) % 4 == 0)
                pos = (int32_t)(test_rand(&rng) % (uint64_t)(pos + 1));
            if (pos >= cap)
                break;
            int32_t n = 1 + (int32_t)(test_rand(&rng) % (uint64_t)(cap - pos));
            eng_kv_copy copies[8];
            int32_t n_copies = 0;
            rc = eng_kv_prepare_write(kv, a, pos, n, copies, 8, &n_copies);
            if (rc == QL_OK) {
                copied += n_copies;
                for (int32_t k = 0; k < n_copies; k++)
                    cr_assert_eq(kv->refs[copies[k].dst], 1, "a copy's target is the writer's");
                if (pos + n > a->n_tokens)
                    a->n_tokens = pos + n;
            }
            break;
        }
        case 4:
            eng_kv_release(kv, a);
            chains[ai] = (eng_prefix_chain){0};
            break;
        default: break;
        }
        if (rc != QL_OK) {
            refused++;
            assert_unchanged(a, &a0, "a refused operation, first sequence");
            assert_unchanged(b, &b0, "a refused operation, second sequence");
            cr_assert_eq(eng_kv_free_blocks(kv), free0, "a refused operation took blocks");
        }
        assert_accounting(kv, all, SEQS, "after a random operation");
    }
    cr_assert_gt(refused, 0, "the cache never filled up: the test means it to");
    cr_assert_gt(forked, 10);
    cr_assert_gt(copied, 10);
    if (prefix)
        cr_assert_gt(hits, 10, "the prefix cache found %d prompts", hits);
    for (int i = SEQS - 1; i >= 0; i--)
        eng_kv_release(kv, &s[i]);
    cr_assert_eq(eng_kv_free_blocks(kv), BLOCKS);
    cr_assert_eq(eng_kv_shared_blocks(kv), 0);
    eng_kv_free(kv);
}

Test(kv_cache, random_operations_keep_the_accounting_exact)
{
    random_operations(false);
}

Test(kv_cache, random_operations_with_the_prefix_cache_keep_the_accounting_exact)
{
    random_operations(true);
}

/* A cache of `blocks` blocks with its prefix cache on. */
static eng_kv_cache *new_prefix_cache(int32_t blocks)
{
    eng_kv_cache *kv = new_cache(blocks);
    char msg[256];
    cr_assert_eq(eng_kv_prefix_enable(kv, msg, sizeof msg), QL_OK, "%s", msg);
    return kv;
}

/* n tokens of a prompt: token i is i * mul + add. */
static void prompt_of(int32_t *t, int32_t n, int32_t mul, int32_t add)
{
    for (int32_t i = 0; i < n; i++)
        t[i] = i * mul + add;
}

/* A sequence that wrote the n tokens of t and kept its whole blocks. */
static void kept(eng_kv_cache *kv, eng_seq_kv *s, uint64_t key, const int32_t *t, int32_t n)
{
    eng_prefix_chain c = {0};
    written(kv, s, n, n);
    eng_kv_prefix_insert(kv, key, t, n, s, &c);
    cr_assert_eq(c.n_blocks, n / BT);
}

Test(kv_cache, prefix_match_takes_the_kept_whole_blocks_of_the_same_prompt)
{
    eng_kv_cache *kv = new_prefix_cache(8);
    int32_t t[40], u[40];
    prompt_of(t, 40, 3, 1);
    eng_seq_kv a = {0}, b = {0}, c = {0};
    kept(kv, &a, 5, t, 40); /* 3 blocks; 2 whole */
    int32_t a0 = a.blocks[0], a1 = a.blocks[1];
    cr_assert_eq(eng_kv_prefix_blocks(kv), 2);
    eng_kv_release(kv, &a);
    cr_assert_eq(eng_kv_free_blocks(kv), 8, "kept blocks are free");
    cr_assert_eq(eng_kv_prefix_blocks(kv), 2);

    eng_prefix_chain ch;
    cr_assert_eq(eng_kv_prefix_match(kv, 5, t, 39, &b, &ch), 32);
    cr_assert(b.n_blocks == 2 && b.blocks[0] == a0 && b.blocks[1] == a1 && b.n_tokens == 32);
    cr_assert_eq(ch.n_blocks, 2);
    cr_assert_eq(eng_kv_free_blocks(kv), 6);
    /* at most max_tokens, in whole blocks */
    cr_assert_eq(eng_kv_prefix_match(kv, 5, t, 31, &c, &ch), 16);
    cr_assert_eq(c.blocks[0], a0);
    cr_assert_eq(eng_kv_shared_blocks(kv), 1, "a0 is in two tables");
    eng_seq_kv *all[] = {&b, &c};
    assert_accounting(kv, all, 2, "two hits");
    eng_kv_release(kv, &c);

    /* another key, or a token changed in a block, ends the match there */
    eng_seq_kv d = {0};
    cr_assert_eq(eng_kv_prefix_match(kv, 6, t, 39, &d, &ch), 0);
    cr_assert_eq(d.n_blocks, 0);
    memcpy(u, t, sizeof u);
    u[20]++;
    cr_assert_eq(eng_kv_prefix_match(kv, 5, u, 39, &d, &ch), 16);
    eng_kv_release(kv, &d);
    u[20]--;
    u[3]++;
    cr_assert_eq(eng_kv_prefix_match(kv, 5, u, 39, &d, &ch), 0);
    /* a match needs an empty sequence */
    cr_assert_eq(eng_kv_prefix_match(kv, 5, t, 39, &b, &ch), 0);
    eng_kv_release(kv, &d);
    eng_kv_release(kv, &b);
    eng_kv_free(kv);
}

Test(kv_cache, a_kept_block_going_on_from_the_match_gives_its_first_positions)
{
    eng_kv_cache *kv = new_prefix_cache(8);
    int32_t t[48], u[48];
    prompt_of(t, 48, 3, 1);
    memcpy(u, t, sizeof u);
    u[16 + 5] = 999; /* u leaves t five positions into t's second block */
    eng_seq_kv a = {0}, b = {0}, c = {0}, d = {0};
    kept(kv, &a, 5, t, 48);
    int32_t a1 = a.blocks[1];
    eng_kv_release(kv, &a);
    cr_assert_eq(eng_kv_prefix_blocks(kv), 3);

    eng_prefix_chain ch;
    cr_assert_eq(eng_kv_prefix_match(kv, 6, u, 47, &b, &ch), 0, "another key takes nothing");
    cr_assert_eq(eng_kv_prefix_match(kv, 5, u, 47, &b, &ch), 21);
    cr_assert(b.n_blocks == 2 && b.blocks[1] == a1, "t's second block is u's second");
    cr_assert_eq(ch.n_blocks, 1, "the chain ends at the whole blocks");
    cr_assert_eq(eng_kv_prefix_blocks(kv), 2, "the block u writes into left the cache");
    eng_seq_kv *all[] = {&b};
    assert_accounting(kv, all, 1, "a partial hit");
    /* the cache gave it up, so t's second block is found no more */
    cr_assert_eq(eng_kv_prefix_match(kv, 5, t, 47, &c, &ch), 16);
    cr_assert_eq(c.n_blocks, 1);
    eng_kv_release(kv, &c);
    /* never past max_tokens, and never a block a table holds */
    eng_kv_release(kv, &b);
    kept(kv, &a, 5, t, 48);
    eng_kv_release(kv, &a);
    cr_assert_eq(eng_kv_prefix_match(kv, 5, u, 19, &b, &ch), 19);
    cr_assert_eq(eng_kv_prefix_match(kv, 5, u, 47, &d, &ch), 16, "b holds the continuation");
    eng_seq_kv *both[] = {&b, &d};
    assert_accounting(kv, both, 2, "a held continuation");
    eng_kv_release(kv, &d);
    eng_kv_release(kv, &b);
    eng_kv_free(kv);
}

Test(kv_cache, kept_blocks_are_reused_last_and_a_chain_loses_its_end_first)
{
    eng_kv_cache *kv = new_prefix_cache(6);
    int32_t t[48];
    prompt_of(t, 48, 5, 2);
    eng_seq_kv a = {0}, b = {0}, c = {0};
    kept(kv, &a, 9, t, 48);
    cr_assert_eq(eng_kv_prefix_blocks(kv), 3);
    eng_kv_release(kv, &a);
    /* three blocks nothing keeps go first */
    cr_assert_eq(eng_kv_reserve(kv, &b, 3 * BT), QL_OK);
    cr_assert_eq(eng_kv_prefix_blocks(kv), 3);
    /* then the kept block released first: the chain's last */
    cr_assert_eq(eng_kv_reserve(kv, &b, 4 * BT), QL_OK);
    cr_assert_eq(eng_kv_prefix_blocks(kv), 2);
    eng_prefix_chain ch;
    cr_assert_eq(eng_kv_prefix_match(kv, 9, t, 48, &c, &ch), 32);
    eng_kv_release(kv, &c);
    cr_assert_eq(eng_kv_reserve(kv, &b, 6 * BT), QL_OK);
    cr_assert_eq(eng_kv_prefix_blocks(kv), 0);
    cr_assert_eq(eng_kv_prefix_match(kv, 9, t, 48, &c, &ch), 0);
    eng_kv_release(kv, &c);
    eng_kv_release(kv, &b);
    eng_kv_free(kv);
}

Test(kv_cache, a_block_reused_for_other_tokens_never_matches_its_old_chain)
{
    eng_kv_cache *kv = new_prefix_cache(2);
    int32_t t[32], u[32];
    prompt_of(t, 32, 7, 1);
    prompt_of(u, 32, 7, 1);
    u[0] = 99; /* a different first block, the same second */
    eng_seq_kv a = {0}, b = {0};
    kept(kv, &a, 1, t, 32);
    eng_kv_release(kv, &a); /* kept: t1 then t0 at the tail */
    /* u takes both blocks; its first is written where t's second was */
    kept(kv, &b, 1, u, 32);
    eng_kv_release(kv, &b);
    eng_prefix_chain ch;
    cr_assert_eq(eng_kv_prefix_match(kv, 1, t, 32, &a, &ch), 0, "t's blocks were overwritten");
    cr_assert_eq(eng_kv_prefix_match(kv, 1, u, 32, &a, &ch), 32);
    eng_kv_release(kv, &a);
    eng_kv_free(kv);
}

Test(kv_cache, the_same_prompt_computed_twice_is_kept_once)
{
    eng_kv_cache *kv = new_prefix_cache(8);
    int32_t t[48];
    prompt_of(t, 48, 11, 4);
    eng_seq_kv a = {0}, b = {0}, c = {0};
    kept(kv, &a, 3, t, 32);
    kept(kv, &b, 3, t, 48); /* its first two are a's content again */
    cr_assert_eq(eng_kv_prefix_blocks(kv), 3);
    eng_kv_release(kv, &a);
    eng_kv_release(kv, &b);
    eng_prefix_chain ch;
    cr_assert_eq(eng_kv_prefix_match(kv, 3, t, 48, &c, &ch), 48,
                 "b's third block goes on a's chain");
    eng_kv_release(kv, &c);
    eng_kv_free(kv);
}

/* Gemma 4's full layers with their own head size and kv heads: layer 0
 * slides (2 kv heads of 8: rows of 16 values), layer 1 is full (2 of 16:
 * rows of 32). A block holds each layer's K then V at its own row size,
 * one layer after the other; the bytes a position takes and the block's
 * values count both; rows of q8_0 are each layer's whole blocks of 32
 * (layer 0's 16 values are none, so q8_0 refuses it, naming the layer). */
Test(kv_cache, layers_with_their_own_row_size_lie_one_after_another)
{
    eng_config c = {
        .n_layers = 2, .n_kv_heads = 2, .head_dim = 8, .sliding_window = 4, .sliding_pattern = 2};
    c.g4.full_head_dim = 16;
    c.g4.full_kv_heads = 2;
    cr_assert(eng_layer_slides(&c, 0) && !eng_layer_slides(&c, 1));
    cr_assert_eq(eng_kv_token_bytes(&c, QT_F32), (2 * 16 + 2 * 32) * sizeof(float));
    cr_assert_eq(eng_kv_token_bytes(&c, QT_F16), (2 * 16 + 2 * 32) * 2);
    eng_kv_cache *kv = NULL;
    char msg[256];
    size_t block = (size_t)BT * eng_kv_token_bytes(&c, QT_F32);
    cr_assert_eq(eng_kv_new(&kv, &c, 3 * block, BT, msg, sizeof msg), QL_OK, "%s", msg);
    cr_assert_eq(eng_kv_total_blocks(kv), 3);
    cr_assert_eq(eng_kv_block_floats(kv), (size_t)BT * (2 * 16 + 2 * 32));
    int32_t blocks[2] = {2, 1};
    unsigned char *b1 = kv->data + block, *b2 = kv->data + 2 * block;
    size_t r0 = 16 * sizeof(float), r1 = 32 * sizeof(float);
    cr_assert_eq((unsigned char *)kv_row(kv, blocks, 0, 0, 3), b2 + 3 * r0);
    cr_assert_eq((unsigned char *)kv_row(kv, blocks, 0, 1, 3), b2 + (BT + 3) * r0);
    cr_assert_eq((unsigned char *)kv_row(kv, blocks, 1, 0, 3), b2 + 2 * BT * r0 + 3 * r1);
    cr_assert_eq((unsigned char *)kv_row(kv, blocks, 1, 1, BT + 5),
                 b1 + 2 * BT * r0 + (BT + 5) * r1);
    cr_assert_eq((unsigned char *)kv_row(kv, blocks, 1, 1, BT - 1) + r1, b2 + block,
                 "layer 1's last V row ends the block");
    eng_kv_free(kv);
    cr_assert_neq(eng_kv_new_dtype(&kv, &c, 3 * block, BT, QT_Q8_0, msg, sizeof msg), QL_OK);
    cr_assert(strstr(msg, "layer 0") && strstr(msg, "multiple of 32"), "%s", msg);
}
