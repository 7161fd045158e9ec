/*
 * sampler.c - how the next token is chosen from a sequence's logits, and how
 * stop strings are cut out of the text a request streams back.
 *
 * Sampling follows Hugging Face transformers' generate() and TGI, which
 * apply the same processors in the same order, so a request that names
 * temperature, top_k, top_p and repetition_penalty gets the distribution it
 * would get there; the OpenAI and vLLM adjustments come first, in vLLM
 * v1's order (its Sampler applies the logit bias and min_tokens
 * processors, then apply_penalties: repetition, frequency, presence; all
 * before temperature), so that a request naming them gets vLLM's logits;
 * a grammar's mask comes before all of them (vLLM applies its structured
 * output bitmask to the logits before the sampler), so no bias or penalty
 * brings back a token the grammar refuses:
 *  -1. a constrained sampler (eng_sampler_constrain) sets the logit of
 *      every token its grammar does not allow next to -inf
 *      (grammar/'s matcher), and advances the grammar by the token
 *      chosen;
 *   0. logit_bias added to the logits (OpenAI); min_tokens sets the
 *      end-of-sequence token's logit to -inf while fewer tokens than it
 *      have been generated (vLLM's MinTokensLogitsProcessor);
 *   1. repetition penalty (CTRL, Keskar et al. 2019; HF's
 *      RepetitionPenaltyLogitsProcessor): every distinct token seen so far,
 *      prompt included, has its logit divided by the penalty when positive
 *      and multiplied by it otherwise, once however often it was seen;
 *      then OpenAI's presence and frequency penalties over the tokens
 *      generated (not the prompt): logit[t] -= frequency * c(t), then
 *      -= presence when c(t) > 0 (vLLM's apply_penalties, two roundings);
 *   2. temperature 0: greedy, the argmax with the lowest id on ties (as
 *      torch.argmax); top_k and top_p are ignored, as with do_sample=False,
 *      and no random number is drawn;
 *   3. otherwise logits / temperature, top-k, softmax, top-p (the smallest
 *      set of most probable tokens whose probability reaches top_p, never
 *      empty), typical_p, renormalise, and one draw. typical_p is locally
 *      typical sampling (Meister et al. 2023; transformers'
 *      TypicalLogitsWarper) on what top-k and top-p left, last as in TGI,
 *      which sends it (its HeterogeneousNextTokenChooser appends the
 *      warpers temperature, top_k, top_p, typical_p, as transformers'
 *      generate does): tokens ranked by how far their surprisal -log p is
 *      from the entropy, closest first, kept up to the first whose
 *      cumulative probability reaches typical_p (transformers counts the
 *      cumulative sums below typical_p: >=, not >), with every token
 *      exactly as far as that one (it removes only scores above the cut's).
 * Where HF leaves room, or where we differ on purpose:
 *   - top-k keeps exactly k tokens: ties at the k-th logit keep the lower
 *     ids (HF keeps every token tied with the k-th). top-p orders equal
 *     probabilities the same way.
 *   - NaN logits count as -inf (they are overwritten in place). When nothing
 *     is above -inf the token is the lowest id that is not NaN, or 0 when
 *     all are NaN; HF would fail in torch.multinomial. When some logits are
 *     +inf, those tokens share all the probability equally (the limit of the
 *     softmax) and every other token gets none.
 *   - The softmax weights are e^((logit - max) * (1 / temperature)) in
 *     float, with our own exp (Cephes' polynomial, relative error under
 *     1e-7), summed in double. Subtracting the max first keeps a tiny
 *     temperature from overflowing; multiplying by the reciprocal is one
 *     rounding away from HF's division. top-k compares the logits
 *     themselves (dividing by a temperature keeps their order).
 *   - typical_p needs no logarithm: with y = (max - logit) / T, the
 *     exponent of a weight, -log p = y + log Z and the entropy is
 *     sum p y + log Z, so the distance is |y - mean y| and log Z cancels.
 *     The mean is summed in double; the distances are rounded to float to
 *     rank them (transformers computes all of it in float). Between equal
 *     distances before the cut the lower id ranks first (their order
 *     changes nothing: the cut keeps every one of its distance).
 *   - top_p 1, typical_p 1 and repetition_penalty 1 are off, as 0 is (HF
 *     does not even add the processor then).
 *
 * Why it is shaped so:
 *   - Each sequence carries its own xoshiro256** stream (Blackman & Vigna),
 *     its state filled by splitmix64 from the request's seed alone, and
 *     takes exactly one uniform double in [0, 1) per sampled token, whatever
 *     path that token takes (greedy takes none). So a sequence's tokens
 *     depend on its seed and its logits only, never on what else is in the
 *     batch; and since every step is plain IEEE arithmetic in a fixed order
 *     (no libm, no contraction, the same bits from the SSE2 and AVX2 loops),
 *     on no machine either.
 *   - A vocabulary of 150k-256k tokens is never sorted. top-k is one pass
 *     that appends a logit only when it beats the running k-th best, and
 *     cuts the buffer back with a quickselect when it fills. top-p first
 *     drops the weights too small ever to be needed (one bound from the
 *     total), then runs a radix select on the weights' bits: a histogram of
 *     mass per bucket finds the bucket where the cut falls, the buckets above
 *     it are kept whole, and only that bucket is split again, by finer bits,
 *     until its weights are equal. The candidates live in the caller's
 *     scratch: nothing is allocated per token. The two loops over the whole
 *     vocabulary (the max, the weights) are written for the vectoriser and
 *     compiled twice, for SSE2 and AVX2, picked at run time.
 *     Measured for 150k logits (2-vCPU EPYC VM, shared with other builds;
 *     median of 300 calls): greedy 0.04 ms, temperature alone 0.3, top-k 50
 *     0.2-0.3, top-k 40 + top-p 0.95 0.2-0.3, top-p 0.9 0.4-0.5 (on normal
 *     logits, flatter than a model's). Near-flat distributions cost more,
 *     as the kept set is most of the vocabulary: top-p over equal logits or
 *     at temperature 100, top_p 0.999999, top_k 5000 or 100000: 0.8-2 ms.
 *     typical_p (same machine, under a load of 5): top-k 40 + top-p 0.95 +
 *     typical_p 0.9 0.2 ms, top-p 0.95 + typical_p 0.9 0.6, typical_p 0.9
 *     or 0.2 over the whole vocabulary 1.2-1.3, at temperature 100 1.5-1.8
 *     (top-p 0.9 alone measured 0.6 in the same runs).
 *   - The tokens seen are kept sorted and distinct, so a long prompt costs
 *     one sort and each new token a binary search. The generated tokens'
 *     counts likewise (one entry per distinct generated token, so never
 *     more than max_new_tokens), kept only when a presence or frequency
 *     penalty asks for them.
 *   - The backend's fast paths (eng_sampler_greedy, _plain_draw) are off
 *     exactly while some step above could change a logit: a nonzero bias,
 *     the EOS ban, the repetition penalty, or a presence or frequency
 *     penalty once a token has been generated. Otherwise they stay on;
 *     the plain draw is off too while top-k, top-p or typical_p filters
 *     (greedy never filters: temperature 0 ignores all three).
 *   - typical_p is four passes over what top-k and top-p left: the mean,
 *     a histogram of weight by distance (whose buckets order as the
 *     distances do) that finds the bucket where the cut falls, one that
 *     drops the buckets after it and one that moves the cut's bucket
 *     behind the closer ones; only the cut's bucket is ranked, by the
 *     quickselect, which weighs its candidates from their logits (the
 *     distances take the weights' place in the scratch).
 *
 * Stop strings: each one runs a Knuth-Morris-Pratt automaton over the text
 * byte by byte, across feeds. Its state is the longest prefix of the stop
 * string that ends the text so far, so the text to hold back is exactly the
 * longest such prefix over all stop strings, and nothing needs searching
 * again. A stop "occurs" where it is first completed; when several complete
 * on the same byte (one is a suffix of the other) the longest wins. That
 * makes the result independent of how the text was cut into feeds. Held
 * text always starts on a UTF-8 character: if the longest prefix begins
 * inside a character (a stop string that begins with a continuation byte),
 * the whole character is held. The text itself is not checked: the
 * tokenizer's stream already emits whole characters. With eng_stop_include
 * (vLLM's include_stop_str_in_output) the text is emitted up to the end of
 * the stop string instead of its start; what follows it is still dropped,
 * and held text is held as without it.
 *
 * It offers eng_sampling_check, eng_sample, eng_sampler_* and eng_stop_*
 * (scheduler.h) and owns each sampler's stream, seen-token set,
 * generated-token counts and logit-bias copy; it
 * calls nothing in scheduler.c or engine/runtime/, only the arithmetic of
 * kernels/internal/sample_math.h (which the CUDA sampling kernel runs too).
 */
#include "sample_math.h"
#include "scheduler.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* --- parameters ----------------------------------------------------------- */

int eng_sampling_check(const eng_sampling *p, char *msg, size_t msg_len)
{
    if (!p)
        return ql_fail(msg, msg_len, QL_EINVAL, "no sampling parameters");
    if (!(isfinite(p->temperature) && p->temperature >= 0))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "temperature %g is not a finite number >= 0 (0 is greedy)",
                       (double)p->temperature);
    if (p->top_k < 0)
        return ql_fail(msg, msg_len, QL_EINVAL, "top_k %d is negative (0 turns it off)",
                       (int)p->top_k);
    if (!(p->top_p == 0 || (p->top_p > 0 && p->top_p <= 1)))
        return ql_fail(msg, msg_len, QL_EINVAL, "top_p %g is not in (0, 1] (0 turns it off)",
                       (double)p->top_p);
    if (!(p->typical_p == 0 || (p->typical_p > 0 && p->typical_p <= 1)))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "typical_p %g is not in (0, 1] (0 or 1 turns it off)", (double)p->typical_p);
    if (!(p->repetition_penalty == 0 ||
          (p->repetition_penalty > 0 && isfinite(p->repetition_penalty))))
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "repetition_penalty %g is not a finite number > 0 (0 or 1 turns it off)",
                       (double)p->repetition_penalty);
    if (!(p->presence_penalty >= -2 && p->presence_penalty <= 2))
        return ql_fail(msg, msg_len, QL_EINVAL, "presence_penalty %g is not in [-2, 2]",
                       (double)p->presence_penalty);
    if (!(p->frequency_penalty >= -2 && p->frequency_penalty <= 2))
        return ql_fail(msg, msg_len, QL_EINVAL, "frequency_penalty %g is not in [-2, 2]",
                       (double)p->frequency_penalty);
    if (p->n_logit_bias > ENG_MAX_LOGIT_BIAS)
        return ql_fail(msg, msg_len, QL_EINVAL, "logit_bias has %zu entries; at most %d",
                       p->n_logit_bias, ENG_MAX_LOGIT_BIAS);
    if (p->n_logit_bias && !p->logit_bias)
        return ql_fail(msg, msg_len, QL_EINVAL, "%zu logit_bias entries but no array of them",
                       p->n_logit_bias);
    for (size_t i = 0; i < p->n_logit_bias; i++) {
        const eng_logit_bias *b = &p->logit_bias[i];
        if (b->token < 0)
            return ql_fail(msg, msg_len, QL_EINVAL, "logit_bias token %d is negative",
                           (int)b->token);
        if (!(b->bias >= -100 && b->bias <= 100))
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "logit_bias of token %d is %g; not in [-100, 100]", (int)b->token,
                           (double)b->bias);
    }
    if (p->min_tokens < 0)
        return ql_fail(msg, msg_len, QL_EINVAL, "min_tokens %d is negative", (int)p->min_tokens);
    return QL_OK;
}

/* --- the random stream ------------------------------------------------------ */

static uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

/* xoshiro256** 1.0, as in Blackman & Vigna's reference xoshiro256starstar.c */
static uint64_t xoshiro_next(uint64_t s[4])
{
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

/* A uniform double in [0, 1): the top 53 bits. */
static double uniform01(uint64_t s[4])
{
    return (double)(xoshiro_next(s) >> 11) * 0x1.0p-53;
}

/* --- the tokens seen ---------------------------------------------------------- */

/* Where id is, or would go, in the sorted seen list. */
static size_t seen_position(const eng_sampler *s, int32_t id)
{
    size_t lo = 0, hi = s->n_seen;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (s->seen[mid] < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static int seen_add(eng_sampler *s, int32_t id)
{
    size_t at = seen_position(s, id);
    if (at < s->n_seen && s->seen[at] == id)
        return QL_OK;
    if (s->n_seen == s->cap_seen) {
        size_t cap = s->cap_seen ? 2 * s->cap_seen : 64;
        int32_t *grown = realloc(s->seen, cap * sizeof *grown);
        if (!grown)
            return QL_ENOMEM;
        s->seen = grown;
        s->cap_seen = cap;
    }
    memmove(s->seen + at + 1, s->seen + at, (s->n_seen - at) * sizeof *s->seen);
    s->seen[at] = id;
    s->n_seen++;
    return QL_OK;
}

/* --- the tokens generated ----------------------------------------------------- */

/* Whether the presence or frequency penalty is on (they need the counts). */
static bool counting(const eng_sampling *p)
{
    return p->presence_penalty != 0 || p->frequency_penalty != 0;
}

/* One more generation of id: its count goes up, or it enters the sorted
 * list with count 1. */
static int count_add(eng_sampler *s, int32_t id)
{
    size_t lo = 0, hi = s->n_counts;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (s->counts[mid].token < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo < s->n_counts && s->counts[lo].token == id) {
        s->counts[lo].count++;
        return QL_OK;
    }
    if (s->n_counts == s->cap_counts) {
        size_t cap = s->cap_counts ? 2 * s->cap_counts : 64;
        eng_token_count *grown = realloc(s->counts, cap * sizeof *grown);
        if (!grown)
            return QL_ENOMEM;
        s->counts = grown;
        s->cap_counts = cap;
    }
    memmove(s->counts + lo + 1, s->counts + lo, (s->n_counts - lo) * sizeof *s->counts);
    s->counts[lo] = (eng_token_count){.token = id, .count = 1};
    s->n_counts++;
    return QL_OK;
}

/* A generated token: seen (repetition penalty), counted (presence and
 * frequency penalties), and one more toward min_tokens. When a list cannot
 * grow (out of memory) the token is only not recorded there. */
static void record_generated(eng_sampler *s, int32_t token)
{
    (void)seen_add(s, token);
    if (counting(&s->p) && token >= 0)
        (void)count_add(s, token);
    s->n_generated++;
}

static int compare_ids(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/*
 * p NULL means greedy. Refuses parameters eng_sampling_check refuses
 * (QL_EINVAL); QL_ENOMEM when the prompt cannot be copied. Negative
 * prompt ids are not recorded; ids past the vocabulary are recorded and
 * ignored by eng_sample. On error s holds nothing (eng_sampler_free is
 * still safe).
 */
int eng_sampler_init(eng_sampler *s, const eng_sampling *p, const int32_t *prompt, size_t n_prompt)
{
    memset(s, 0, sizeof *s);
    if (p) {
        int err = eng_sampling_check(p, NULL, 0);
        if (err)
            return err;
        s->p = *p;
    }
    s->n_eos = 0;
    s->p.logit_bias = NULL;
    s->p.n_logit_bias = 0;
    if (p && p->n_logit_bias) {
        s->bias = malloc(p->n_logit_bias * sizeof *s->bias);
        if (!s->bias)
            return QL_ENOMEM;
        memcpy(s->bias, p->logit_bias, p->n_logit_bias * sizeof *s->bias);
        s->p.logit_bias = s->bias;
        s->p.n_logit_bias = p->n_logit_bias;
    }
    uint64_t x = s->p.seed;
    for (int i = 0; i < 4; i++)
        s->rng[i] = ql_splitmix64(&x);
    if (n_prompt == 0 || !prompt)
        return QL_OK;
    s->cap_seen = n_prompt + 64;
    s->seen = malloc(s->cap_seen * sizeof *s->seen);
    if (!s->seen) {
        eng_sampler_free(s);
        return QL_ENOMEM;
    }
    for (size_t i = 0; i < n_prompt; i++)
        if (prompt[i] >= 0)
            s->seen[s->n_seen++] = prompt[i];
    if (s->n_seen == 0)
        return QL_OK;
    qsort(s->seen, s->n_seen, sizeof *s->seen, compare_ids);
    size_t distinct = 1;
    for (size_t i = 1; i < s->n_seen; i++)
        if (s->seen[i] != s->seen[distinct - 1])
            s->seen[distinct++] = s->seen[i];
    s->n_seen = distinct;
    return QL_OK;
}

void eng_sampler_free(eng_sampler *s)
{
    if (!s)
        return;
    free(s->seen);
    free(s->counts);
    free(s->bias);
    gr_matcher_free(s->grammar);
    memset(s, 0, sizeof *s);
    s->n_eos = 0;
}

void eng_sampler_set_eos(eng_sampler *s, const int32_t *eos, int32_t n)
{
    s->n_eos = 0;
    for (int32_t i = 0; i < n && s->n_eos < 8; i++)
        if (eos[i] >= 0)
            s->eos[s->n_eos++] = eos[i];
}

bool eng_sampler_may_end(const eng_sampler *s)
{
    return s->n_generated > s->p.min_tokens;
}

/* --- selecting the best candidates -------------------------------------------- */

/*
 * Candidates are two parallel arrays in the caller's scratch: key (a logit
 * or a probability weight) and id. "Better" is the larger key, and between
 * equal keys the lower id; ids are distinct, so the order is total.
 */
static inline bool ranks_before(const float *key, const int32_t *id, size_t i, size_t j)
{
    return key[i] > key[j] || (key[i] == key[j] && id[i] < id[j]);
}

static inline void swap_candidates(float *key, int32_t *id, size_t i, size_t j)
{
    float k = key[i];
    int32_t t = id[i];
    key[i] = key[j];
    id[i] = id[j];
    key[j] = k;
    id[j] = t;
}

static void insertion_sort(float *key, int32_t *id, size_t lo, size_t hi)
{
    for (size_t i = lo + 1; i < hi; i++) {
        float k = key[i];
        int32_t t = id[i];
        size_t j = i;
        while (j > lo && (key[j - 1] < k || (key[j - 1] == k && id[j - 1] > t))) {
            key[j] = key[j - 1];
            id[j] = id[j - 1];
            j--;
        }
        key[j] = k;
        id[j] = t;
    }
}

/* Heap of [base, base + n) with the worst candidate at the root. */
static void sift_down(float *key, int32_t *id, size_t base, size_t root, size_t n)
{
    for (;;) {
        size_t child = 2 * root + 1;
        if (child >= n)
            return;
        if (child + 1 < n && ranks_before(key, id, base + child, base + child + 1))
            child++;
        if (!ranks_before(key, id, base + root, base + child))
            return;
        swap_candidates(key, id, base + root, base + child);
        root = child;
    }
}

/* Best first; the quickselect's fallback, so that no input costs more than
 * n log n. */
static void heap_sort(float *key, int32_t *id, size_t lo, size_t hi)
{
    size_t n = hi - lo;
    for (size_t i = n / 2; i-- > 0;)
        sift_down(key, id, lo, i, n);
    for (size_t end = n; end-- > 1;) {
        swap_candidates(key, id, lo, lo + end);
        sift_down(key, id, lo, 0, end);
    }
}

/*
 * Lomuto partition of [lo, hi) (hi - lo >= 3) around the median of three:
 * returns the pivot's place; everything before it ranks before it. Without
 * a branch on the comparison (every candidate is swapped, the boundary
 * moves by the comparison's result): in a bucket of near-equal weights the
 * comparison is a coin toss, and a branch on it mispredicts half the time.
 */
static size_t partition(float *key, int32_t *id, size_t lo, size_t hi)
{
    size_t mid = lo + (hi - lo) / 2, last = hi - 1;
    if (ranks_before(key, id, mid, lo))
        swap_candidates(key, id, mid, lo);
    if (ranks_before(key, id, last, lo))
        swap_candidates(key, id, last, lo);
    if (ranks_before(key, id, mid, last))
        swap_candidates(key, id, mid, last);
    float pivot_key = key[last];
    int32_t pivot_id = id[last];
    size_t store = lo;
    for (size_t i = lo; i < last; i++) {
        float k = key[i];
        int32_t t = id[i];
        size_t before = (size_t)((k > pivot_key) | ((k == pivot_key) & (t < pivot_id)));
        key[i] = key[store];
        id[i] = id[store];
        key[store] = k;
        id[store] = t;
        store += before;
    }
    swap_candidates(key, id, store, last);
    return store;
}

/* Totals over many weights are sums of blocks of this many, each block
 * summed by block_sum. */
#define TOTAL_BLOCK 256

/* The sum of w[lo, hi) in double: four running sums, so that the additions
 * do not wait on each other; the same grouping every time. */
static double block_sum(const float *w, size_t lo, size_t hi)
{
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t i = lo;
    for (; i + 4 <= hi; i += 4) {
        s0 += w[i];
        s1 += w[i + 1];
        s2 += w[i + 2];
        s3 += w[i + 3];
    }
    for (; i < hi; i++)
        s0 += w[i];
    return (s0 + s1) + (s2 + s3);
}

/*
 * What a candidate weighs when select_best adds candidates up: 1 (top-k
 * counts them), its key (top-p's keys are the weights themselves), or the
 * softmax weight of its logit when the key ranks by something else
 * (typical sampling ranks by the distance from the entropy).
 */
typedef enum { WEIGH_ONE, WEIGH_KEY, WEIGH_LOGIT } weigh_by;

typedef struct candidate_weight {
    weigh_by by;
    /* WEIGH_LOGIT: the weight of token t is e^-((max - logits[t]) * inv_temperature) */
    const float *logits;
    float max, inv_temperature;
} candidate_weight;

static const candidate_weight weigh_one = {.by = WEIGH_ONE};
static const candidate_weight weigh_key = {.by = WEIGH_KEY};

/* The exponent of token t's softmax weight, e^-exponent: the same float
 * operations as weights_loop, so the same bits. */
static inline float weight_exponent(const candidate_weight *cw, int32_t t)
{
    return (cw->max - cw->logits[t]) * cw->inv_temperature;
}

static inline double weight_of(const float *key, const int32_t *id, size_t i,
                               const candidate_weight *cw)
{
    switch (cw->by) {
    case WEIGH_ONE: return 1.0;
    case WEIGH_KEY: return (double)key[i];
    default: return (double)qm_exp_minus(weight_exponent(cw, id[i]));
    }
}

/* The weight of candidates [lo, hi): for keys that are weights, block_sum. */
static double weight_of_range(const float *key, const int32_t *id, size_t lo, size_t hi,
                              const candidate_weight *cw)
{
    if (cw->by == WEIGH_ONE)
        return (double)(hi - lo);
    if (cw->by == WEIGH_KEY)
        return block_sum(key, lo, hi);
    double sum = 0;
    for (size_t i = lo; i < hi; i++)
        sum += weight_of(key, id, i, cw);
    return sum;
}

/*
 * The smallest m such that the m best candidates of [0, n) weigh at least
 * need (> 0), each weighing what cw says; those m are moved to the front,
 * in no particular order. When the weights never reach need (rounding),
 * all n. Expected O(n).
 */
static size_t select_best(float *key, int32_t *id, size_t n, double need,
                          const candidate_weight *cw)
{
    size_t lo = 0, hi = n; /* the answer lies in (lo, hi]; [0, lo) is in it */
    int depth = 8;
    for (size_t m = n; m > 1; m >>= 1)
        depth += 2;
    while (hi - lo > 16) {
        if (depth-- == 0) {
            heap_sort(key, id, lo, hi);
            break;
        }
        size_t p = partition(key, id, lo, hi);
        double upper = weight_of_range(key, id, lo, p, cw);
        if (upper >= need) {
            hi = p;
            continue;
        }
        need -= upper + weight_of(key, id, p, cw);
        if (need <= 0)
            return p + 1;
        lo = p + 1;
    }
    if (hi - lo <= 16)
        insertion_sort(key, id, lo, hi);
    for (size_t i = lo; i < hi; i++) {
        need -= weight_of(key, id, i, cw);
        if (need <= 0)
            return i + 1;
    }
    return hi;
}

/* --- the passes over the vocabulary ------------------------------------------ */

/*
 * These loops run over 150k-256k logits per token, so they are written for
 * the vectoriser: no float comparison decides anything inside them (GCC
 * keeps such a loop scalar unless math may not trap), only integer
 * operations on the floats' bits. For a float >= 0 its bits order as its
 * value does.
 */
#define F32_INF_BITS 0x7f800000u

static inline uint32_t f32_bits(float f)
{
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

static inline float f32_from_bits(uint32_t b)
{
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* An unsigned key in the order of the float (-inf lowest, +inf highest);
 * NaN gets 0, below everything. */
static inline uint32_t order_key(float f)
{
    uint32_t b = f32_bits(f);
    uint32_t negative = 0u - (b >> 31);
    uint32_t key = b ^ (negative | 0x80000000u);
    uint32_t is_nan = 0u - (uint32_t)((b & 0x7fffffffu) > F32_INF_BITS);
    return key & ~is_nan;
}

static inline float float_of_key(uint32_t key)
{
    return f32_from_bits(key & 0x80000000u ? key ^ 0x80000000u : ~key);
}

/* The largest order_key of logits[0, n); *nan_seen nonzero when some was
 * NaN. */
static inline uint32_t largest_key_loop(const float *logits, size_t n, uint32_t *nan_seen)
{
    uint32_t best_key = 0, nan = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t key = order_key(logits[i]);
        nan |= (uint32_t)(key == 0);
        best_key = key > best_key ? key : best_key;
    }
    *nan_seen = nan;
    return best_key;
}

/* e^-y for y >= 0 (NaN and y >= 87 give 0): Cephes' expf polynomial in
 * plain f32 operations, shared with the CUDA sampling kernel
 * (kernels/internal/sample_math.h) so a seed gives the same tokens there. */
static inline float exp_minus(float y)
{
    return qm_exp_minus(y);
}

/*
 * top-p buckets, a radix select on the bits of a weight in [0, 1] (the
 * largest is exactly 1), whose bits order as the weights do. Level 0 splits
 * by the bits above 19: 16 buckets per octave, weights under 2^-40 all in
 * the last one (together they weigh less than 1e-6 of the largest alone,
 * even in a 1M vocabulary). Levels 1-3 split the bucket where the cut fell
 * by the next 8, 8 and 3 bits, after which its weights are all equal.
 */
#define TOPP_ONE    0x3f800000u
#define TOPP_LEVELS 4
#define TOPP_TAIL   (40u * 16u)

static const uint32_t topp_shift[TOPP_LEVELS] = {19, 11, 3, 0};
static const uint32_t topp_buckets[TOPP_LEVELS] = {TOPP_TAIL + 1, 256, 256, 8};

static inline uint32_t topp_key(float w, int level)
{
    uint32_t b = f32_bits(w);
    uint32_t below_one = TOPP_ONE - (b < TOPP_ONE ? b : TOPP_ONE);
    uint32_t key = below_one >> topp_shift[level];
    if (level == 0)
        return key < TOPP_TAIL ? key : TOPP_TAIL;
    return key & (topp_buckets[level] - 1);
}

/* w[i] = e^((max - logit) * inv_temperature) for logits[0, n) */
static inline void weights_loop(const float *logits, size_t n, float max, float inv_temperature,
                                float *w)
{
    for (size_t i = 0; i < n; i++)
        w[i] = exp_minus((max - logits[i]) * inv_temperature);
}

/*
 * The two loops over the whole vocabulary exist twice on x86-64: as
 * compiled for the baseline (SSE2) and compiled for AVX2, picked at run
 * time; the AVX2 ones are 3x faster (measured: 150k weights in 0.12 ms
 * instead of 0.37). The same C without contraction, so both give the same
 * bits.
 */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SAMPLER_AVX2 1
__attribute__((target("avx2"))) static uint32_t largest_key_avx2(const float *logits, size_t n,
                                                                 uint32_t *nan_seen)
{
    return largest_key_loop(logits, n, nan_seen);
}

__attribute__((target("avx2"))) static void weights_avx2(const float *logits, size_t n, float max,
                                                         float inv_temperature, float *w)
{
    weights_loop(logits, n, max, inv_temperature, w);
}

#endif

static bool have_avx2(void)
{
#ifdef SAMPLER_AVX2
    return __builtin_cpu_supports("avx2");
#else
    return false;
#endif
}

static uint32_t largest_key(const float *logits, size_t n, uint32_t *nan_seen)
{
#ifdef SAMPLER_AVX2
    if (have_avx2())
        return largest_key_avx2(logits, n, nan_seen);
#endif
    return largest_key_loop(logits, n, nan_seen);
}

static void softmax_weights(const float *logits, size_t n, float max, float inv_temperature,
                            float *w)
{
#ifdef SAMPLER_AVX2
    if (have_avx2()) {
        weights_avx2(logits, n, max, inv_temperature, w);
        return;
    }
#endif
    weights_loop(logits, n, max, inv_temperature, w);
}

/*
 * The argmax ignoring NaN (lowest id on ties), or -1 when every logit is
 * NaN; *any_nan tells whether some was. Read-only: one wide pass for the
 * largest value, then the first id that holds it.
 */
static int32_t argmax_ignoring_nan(const float *logits, int32_t vocab, bool *any_nan)
{
    uint32_t nan_seen;
    uint32_t best_key = largest_key(logits, (size_t)vocab, &nan_seen);
    *any_nan = nan_seen != 0;
    if (best_key == 0)
        return -1;
    float best = float_of_key(best_key);
    for (int32_t i = 0; i < vocab; i++)
        if (logits[i] == best)
            return i;
    return -1; /* unreachable: best is one of the logits */
}

/* The worst key of key[0, n) (n >= 1). */
static float worst_key(const float *key, size_t n)
{
    float worst = key[0];
    for (size_t i = 1; i < n; i++)
        worst = key[i] < worst ? key[i] : worst;
    return worst;
}

/*
 * Gather the k (< vocab) best logits and their ids into key/id[0, k), in no
 * particular order, in one pass: a logit above the running threshold (the
 * k-th best so far) is appended, and whenever the buffer fills, a
 * quickselect cuts it back to k and raises the threshold. Ids arrive in
 * increasing order, so a later logit equal to the threshold ranks after it
 * and is rightly passed over. Linear for any order of the logits; for a
 * small k nearly every logit costs one comparison.
 */
static void keep_top_k(const float *logits, int32_t vocab, size_t k, float *key, int32_t *id)
{
    size_t cap = 2 * k + 4096, n = 0;
    if (cap > (size_t)vocab)
        cap = (size_t)vocab;
    int32_t i = 0;
    for (; (size_t)i < cap; i++) {
        key[n] = logits[i];
        id[n++] = i;
    }
    float threshold = -INFINITY;
    if (i < vocab) {
        n = select_best(key, id, n, (double)k, &weigh_one);
        threshold = worst_key(key, n);
    }
    for (; i < vocab; i++) {
        if (!(logits[i] > threshold))
            continue;
        if (n == cap) {
            n = select_best(key, id, n, (double)k, &weigh_one);
            threshold = worst_key(key, n);
            if (!(logits[i] > threshold))
                continue;
        }
        key[n] = logits[i];
        id[n++] = i;
    }
    select_best(key, id, n, (double)k, &weigh_one);
}

/* Whether every weight of w[lo, hi) has the same key at this level: their
 * lowest and highest bits do (one pass, no branch). */
static bool topp_all_one_key(const float *w, size_t lo, size_t hi, int level)
{
    uint32_t least = UINT32_MAX, most = 0;
    for (size_t i = lo; i < hi; i++) {
        uint32_t b = f32_bits(w[i]);
        least = b < least ? b : least;
        most = b > most ? b : most;
    }
    return lo == hi ||
           topp_key(f32_from_bits(least), level) == topp_key(f32_from_bits(most), level);
}

/*
 * Keep the candidates of w/id[lo, hi) whose level key is at most cut,
 * without a branch and in their order; then move those equal to cut to
 * the end, still in their order (a backward pass that swaps each one behind
 * the others). Returns the new end; *equal_from receives where those equal
 * to cut begin.
 */
static size_t topp_split(float *w, int32_t *id, size_t lo, size_t hi, int level, uint32_t cut,
                         size_t *equal_from)
{
    size_t m = lo;
    for (size_t i = lo; i < hi; i++) {
        uint32_t key = topp_key(w[i], level);
        w[m] = w[i];
        id[m] = id[i];
        m += key <= cut;
    }
    size_t e = m;
    for (size_t i = m; i-- > lo;)
        if (topp_key(w[i], level) == cut)
            swap_candidates(w, id, i, --e);
    *equal_from = e;
    return m;
}

/*
 * Keep the smallest set of best candidates of w/id[0, n) whose weight
 * reaches top_p of the total, moved to the front; returns its size (>= 1).
 * dense: the candidates are the whole vocabulary and id[] is not filled
 * yet (the token is the position).
 */
static size_t keep_top_p(float *w, int32_t *id, size_t n, float top_p, bool dense)
{
    double total = 0;
    for (size_t lo = 0; lo < n; lo += TOTAL_BLOCK)
        total += block_sum(w, lo, lo + TOTAL_BLOCK < n ? lo + TOTAL_BLOCK : n);
    double need = (double)top_p * total;

    /* a weight under (1 - top_p) * total / n is never needed: all of those
     * together weigh less than what top_p leaves out. Half of that bound, for
     * rounding; a language model's long tail goes here, without a branch,
     * keeping the candidates in their order */
    uint32_t floor_bits = f32_bits((float)(0.5 * (1.0 - (double)top_p) * total / (double)n));
    size_t hi = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t b = f32_bits(w[i]);
        w[hi] = w[i];
        id[hi] = dense ? (int32_t)i : id[i];
        hi += b >= floor_bits;
    }

    /* four interleaved histograms: neighbours often share a bucket, and
     * one histogram would make each addition wait for the last */
    double mass[4][TOPP_TAIL + 1];
    size_t lo = 0;
    for (int level = 0; level < TOPP_LEVELS; level++) {
        uint32_t buckets = topp_buckets[level];
        if (level > 0 && topp_all_one_key(w, lo, hi, level))
            continue; /* the split would change nothing (flat distributions) */
        for (int c = 0; c < 4; c++)
            memset(mass[c], 0, buckets * sizeof mass[c][0]);
        for (size_t i = lo; i < hi; i++)
            mass[i & 3][topp_key(w[i], level)] += w[i];
        uint32_t cut = 0;
        for (; cut < buckets - 1; cut++) {
            double here = (mass[0][cut] + mass[1][cut]) + (mass[2][cut] + mass[3][cut]);
            if (here >= need)
                break;
            need -= here;
        }
        size_t equal_from;
        hi = topp_split(w, id, lo, hi, level, cut, &equal_from);
        lo = equal_from;
        /* the tail bucket mixes octaves: its lower bits do not order it */
        if (level == 0 && cut == TOPP_TAIL)
            return lo + select_best(w + lo, id + lo, hi - lo, need, &weigh_key);
    }
    /* [lo, hi) now hold one weight: in id order (dense) the lowest ids are
     * the first; otherwise select them */
    size_t kept = dense ? 0 : select_best(w + lo, id + lo, hi - lo, need, &weigh_key);
    if (dense)
        while (lo + kept < hi && need > 0)
            need -= w[lo + kept++];
    return lo + kept ? lo + kept : 1;
}

/*
 * typical_p buckets of a distance d >= 0, whose bits order as the distances
 * do: its bits above 19, 16 buckets per octave from 2^-40 up to 2^8, with
 * everything below 2^-40 in the first and everything from 2^8 (inf
 * included: a -inf logit) in the last. A language model's distances span
 * a few octaves under 2^5, so the cut's bucket holds few candidates.
 */
#define TYPICAL_LOW_BITS 0x2b800000u /* 2^-40 */
#define TYPICAL_BUCKETS  (48u * 16u + 2u)

static inline uint32_t typical_bucket(float d)
{
    uint32_t b = f32_bits(d);
    uint32_t k = b < TYPICAL_LOW_BITS ? 0 : 1 + ((b - TYPICAL_LOW_BITS) >> 19);
    return k < TYPICAL_BUCKETS - 1 ? k : TYPICAL_BUCKETS - 1;
}

/* A candidate's distance from the mean exponent (below), in float. */
static inline float typical_distance(const candidate_weight *cw, int32_t t, double mean)
{
    return (float)fabs((double)weight_exponent(cw, t) - mean);
}

/*
 * Locally typical sampling over the candidates w/id[0, n) (softmax weights
 * of their logits as cw says, some > 0; dense: the whole vocabulary, id[]
 * not filled yet). A candidate's surprisal is -log p = y + log Z (y its
 * weight's exponent, Z the total weight) and the entropy is the mean
 * surprisal, sum p y + log Z: so the distance |surprisal - entropy| is
 * |y - mean y|, and log Z, which would need a logarithm, cancels. Keeps,
 * moved to the front, the closest candidates (lower id first between equal
 * distances) up to the first whose cumulative weight reaches typical_p of
 * the total, and every candidate as close as that one (transformers keeps
 * every score not above the cut's); returns how many (>= 1), their
 * weights in w. A histogram of weight by distance bucket finds the bucket
 * where the cut falls: the buckets before it are kept whole, and only the
 * cut's bucket is ranked, by a quickselect that weighs its candidates from
 * their logits (its keys are the distances).
 */
static size_t keep_typical(float *w, int32_t *id, size_t n, bool dense, const candidate_weight *cw,
                           float typical_p)
{
    // the mean exponent under the candidates' distribution, in double (four
    // running sums each, as block_sum; weight 0 is a -inf logit, whose y,
    // inf, would make 0 * inf)
    double total[4] = {0}, weighted[4] = {0};
    for (size_t i = 0; i < n; i++) {
        if (dense)
            id[i] = (int32_t)i;
        double y = (double)weight_exponent(cw, id[i]);
        total[i & 3] += w[i];
        weighted[i & 3] += w[i] > 0 ? (double)w[i] * y : 0.0;
    }
    double sum = (total[0] + total[1]) + (total[2] + total[3]);
    double mean = ((weighted[0] + weighted[1]) + (weighted[2] + weighted[3])) / sum;

    // the bucket where the cumulative weight, closest first, reaches
    // typical_p (four interleaved histograms, as top-p's)
    double mass[4][TYPICAL_BUCKETS];
    memset(mass, 0, sizeof mass);
    for (size_t i = 0; i < n; i++)
        mass[i & 3][typical_bucket(typical_distance(cw, id[i], mean))] += w[i];
    double need = (double)typical_p * sum;
    uint32_t cut = 0;
    for (; cut < TYPICAL_BUCKETS - 1; cut++) {
        double here = (mass[0][cut] + mass[1][cut]) + (mass[2][cut] + mass[3][cut]);
        if (here >= need)
            break;
        need -= here;
    }

    // drop the buckets after it without a branch, keeping the order; then
    // the cut's own bucket to the end (a backward pass, as topp_split's)
    size_t end = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t bucket = typical_bucket(typical_distance(cw, id[i], mean));
        w[end] = w[i];
        id[end] = id[i];
        end += bucket <= cut;
    }
    size_t closer = end;
    for (size_t i = end; i-- > 0;)
        if (typical_bucket(typical_distance(cw, id[i], mean)) == cut)
            swap_candidates(w, id, i, --closer);

    // the cut's bucket ranked (minus the distance: select_best ranks the
    // larger key first), up to need, and the ties at the cut
    float *key = w + closer;
    int32_t *key_id = id + closer;
    size_t in_bucket = end - closer;
    if (in_bucket == 0) /* the sums never reached need (rounding): all of them */
        return closer;
    for (size_t i = 0; i < in_bucket; i++)
        key[i] = -typical_distance(cw, key_id[i], mean);
    size_t kept = select_best(key, key_id, in_bucket, need, cw);
    float last = worst_key(key, kept);
    for (size_t i = kept; i < in_bucket; i++)
        if (key[i] == last)
            swap_candidates(key, key_id, i, kept++);

    // their weights again, the same bits as before
    for (size_t i = 0; i < kept; i++)
        key[i] = qm_exp_minus(weight_exponent(cw, key_id[i]));
    return closer + kept;
}

/*
 * One draw from positions [0, n) in proportion to w (some w > 0): the
 * token id[pos], or pos itself when id is NULL. The total is the sum of
 * block sums; the walk finds the block where u * total falls, then the
 * position inside it.
 */
static int32_t draw(const float *w, const int32_t *id, size_t n, double u)
{
    double total = 0;
    for (size_t lo = 0; lo < n; lo += TOTAL_BLOCK)
        total += block_sum(w, lo, lo + TOTAL_BLOCK < n ? lo + TOTAL_BLOCK : n);
    double target = u * total, cum = 0;
    size_t pick = n;
    for (size_t lo = 0; lo < n && pick == n; lo += TOTAL_BLOCK) {
        size_t hi = lo + TOTAL_BLOCK < n ? lo + TOTAL_BLOCK : n;
        double sum = block_sum(w, lo, hi);
        if (cum + sum <= target) {
            cum += sum;
            continue;
        }
        for (size_t i = lo; i < hi && pick == n; i++) {
            cum += w[i];
            if (cum > target)
                pick = i;
        }
        for (size_t i = hi; i-- > lo && pick == n;) /* rounding: the block's last with weight */
            if (w[i] > 0)
                pick = i;
    }
    for (size_t i = n; i-- > 0 && pick == n;) /* u * total rounded up to total */
        if (w[i] > 0)
            pick = i;
    if (pick == n)
        pick = 0;
    return id ? id[pick] : (int32_t)pick;
}

/* --- sampling -------------------------------------------------------------- */

/* Whether the repetition penalty applies (0 and 1 are off). */
static bool penalty_on(const eng_sampling *p)
{
    return p->repetition_penalty > 0 && isfinite(p->repetition_penalty) &&
           p->repetition_penalty != 1;
}

/* Whether typical sampling applies (0 and 1 are off). */
static bool typical_on(const eng_sampling *p)
{
    return p->typical_p > 0 && p->typical_p < 1;
}

/* Whether the token is drawn (temperature > 0) rather than the argmax. */
static bool tempered(const eng_sampling *p)
{
    return p->temperature > 0 && isfinite(p->temperature);
}

static void apply_repetition_penalty(const eng_sampler *s, float *logits, int32_t vocab,
                                     float penalty)
{
    for (size_t i = 0; i < s->n_seen; i++) {
        int32_t t = s->seen[i];
        if (t >= vocab)
            break; /* sorted: the rest are past the vocabulary too */
        float l = logits[t];
        logits[t] = l > 0 ? l / penalty : l * penalty;
    }
}

/* Whether min_tokens holds the end-of-sequence token back from the next
 * token. */
static bool eos_banned(const eng_sampler *s)
{
    return s->n_eos > 0 && s->n_generated < s->p.min_tokens;
}

/* Whether some logit bias is not 0. */
static bool biased(const eng_sampler *s)
{
    for (size_t i = 0; i < s->p.n_logit_bias; i++)
        if (s->p.logit_bias[i].bias != 0)
            return true;
    return false;
}

/* Whether any step before the choice could change a logit now: a bias,
 * the end-of-sequence ban, the repetition penalty, or a presence or
 * frequency penalty once something has been generated. */
static bool logits_adjusted(const eng_sampler *s)
{
    return s->grammar || penalty_on(&s->p) || biased(s) || eos_banned(s) ||
           (counting(&s->p) && s->n_counts);
}

/* vLLM's order (v1 sampler: logit bias and min_tokens, then
 * apply_penalties: repetition, frequency, presence), before temperature. */
static void adjust_logits(const eng_sampler *s, float *logits, int32_t vocab)
{
    // logit_bias: added as given (OpenAI)
    for (size_t i = 0; i < s->p.n_logit_bias; i++)
        if (s->p.logit_bias[i].token < vocab)
            logits[s->p.logit_bias[i].token] += s->p.logit_bias[i].bias;
    // min_tokens: the end-of-sequence token cannot be chosen yet
    for (int32_t i = 0; eos_banned(s) && i < s->n_eos; i++)
        if (s->eos[i] < vocab)
            logits[s->eos[i]] = -INFINITY;
    // repetition penalty over the prompt and what was generated
    if (penalty_on(&s->p))
        apply_repetition_penalty(s, logits, vocab, s->p.repetition_penalty);
    // frequency and presence penalties over what was generated
    if (counting(&s->p))
        for (size_t i = 0; i < s->n_counts; i++) {
            int32_t t = s->counts[i].token;
            if (t >= vocab)
                break; /* sorted */
            logits[t] -= s->p.frequency_penalty * (float)s->counts[i].count;
            logits[t] -= s->p.presence_penalty;
        }
}

static int32_t sample_tempered(eng_sampler *s, float *logits, int32_t vocab, int32_t best,
                               void *scratch)
{
    /* drawn first, so that every path takes exactly one */
    double u = uniform01(s->rng);
    if (best < 0)
        return 0;
    float max = logits[best];
    if (max == -INFINITY)
        return best;
    if (max == INFINITY) {
        for (int32_t i = 0; i < vocab; i++)
            logits[i] = logits[i] == INFINITY ? 0.0f : -INFINITY;
        max = 0;
    }
    /* multiplying by 1 / temperature rather than dividing: one rounding
     * apart, and far cheaper; capped so a denormal temperature stays finite */
    float inv_temperature = 1.0f / s->p.temperature;
    if (!(inv_temperature <= FLT_MAX))
        inv_temperature = FLT_MAX;
    float *w = scratch;
    int32_t *id = (int32_t *)(w + vocab);
    bool top_k = s->p.top_k > 0 && s->p.top_k < vocab;
    bool top_p = s->p.top_p > 0 && s->p.top_p < 1;
    bool typical = typical_on(&s->p);

    // no filter: the softmax of the whole vocabulary, ids implicit
    if (!top_k && !top_p && !typical) {
        softmax_weights(logits, (size_t)vocab, max, inv_temperature, w);
        return draw(w, NULL, (size_t)vocab, u);
    }

    // top-k on the logits (dividing by the temperature keeps their order)
    size_t n;
    if (top_k) {
        n = (size_t)s->p.top_k;
        keep_top_k(logits, vocab, n, w, id);
        softmax_weights(w, n, max, inv_temperature, w);
    } else {
        n = (size_t)vocab;
        softmax_weights(logits, n, max, inv_temperature, w);
    }

    // top-p on the softmax of what top-k kept
    if (top_p)
        n = keep_top_p(w, id, n, s->p.top_p, !top_k);

    // typical_p on the distribution top-k and top-p left (TGI's order)
    if (typical) {
        candidate_weight cw = {
            .by = WEIGH_LOGIT, .logits = logits, .max = max, .inv_temperature = inv_temperature};
        n = keep_typical(w, id, n, !top_k && !top_p, &cw, s->p.typical_p);
    }

    // renormalise and draw
    return draw(w, id, n, u);
}

/*
 * logits (vocab entries) are modified in place: penalised, NaN made -inf.
 * scratch (vocab floats then vocab int32s, float-aligned) is not touched
 * when greedy; NULL scratch means greedy. Returns -1 for vocab < 1. The
 * token is recorded for the penalty; when the seen list cannot grow (out
 * of memory) it is returned all the same, only not recorded.
 */
int32_t eng_sample(eng_sampler *s, float *logits, int32_t vocab, void *scratch)
{
    if (!s || !logits || vocab < 1)
        return -1;
    // the grammar's mask first: what it refuses no bias or penalty brings back
    if (s->grammar) {
        int64_t t0 = ql_now_ns();
        int rc = gr_matcher_mask(s->grammar, logits);
        s->grammar_ns = ql_now_ns() - t0;
        if (rc != QL_OK)
            return -1;
    }
    if (logits_adjusted(s))
        adjust_logits(s, logits, vocab);
    bool any_nan;
    int32_t best = argmax_ignoring_nan(logits, vocab, &any_nan);
    if (any_nan)
        for (int32_t i = 0; i < vocab; i++)
            if (isnan(logits[i]))
                logits[i] = -INFINITY;
    int32_t token;
    if (tempered(&s->p) && scratch)
        token = sample_tempered(s, logits, vocab, best, scratch);
    else
        token = best < 0 ? 0 : best;
    /* nothing the grammar allows was left (it refused every token the
     * vocabulary has there): the answer cannot go on */
    if (s->grammar && gr_matcher_accept(s->grammar, token) != QL_OK)
        return -1;
    record_generated(s, token);
    return token;
}

void eng_sampler_record(eng_sampler *s, int32_t token)
{
    if (s->grammar)
        (void)gr_matcher_accept(s->grammar, token); /* a backend never chooses for a grammar */
    record_generated(s, token);
}

int eng_sampler_constrain(eng_sampler *s, gr_grammar *g, const gr_vocab *v, char *msg,
                          size_t msg_len)
{
    gr_matcher_free(s->grammar);
    s->grammar = NULL;
    return gr_matcher_new(&s->grammar, g, v, msg, msg_len);
}

bool eng_sampler_grammar_done(const eng_sampler *s)
{
    return s->grammar && gr_matcher_done(s->grammar);
}

bool eng_sampler_greedy(const eng_sampler *s)
{
    return !tempered(&s->p) && !logits_adjusted(s);
}

bool eng_sampler_plain_draw(const eng_sampler *s, int32_t vocab, float *inv_temperature)
{
    const eng_sampling *p = &s->p;
    if (!tempered(p) || logits_adjusted(s) || (p->top_k > 0 && p->top_k < vocab) ||
        (p->top_p > 0 && p->top_p < 1) || typical_on(p))
        return false;
    float inv = 1.0f / p->temperature; /* as sample_tempered */
    *inv_temperature = inv <= FLT_MAX ? inv : FLT_MAX;
    return true;
}

double eng_sampler_uniform(eng_sampler *s)
{
    return uniform01(s->rng);
}

/* --- stop strings ------------------------------------------------------------ */

/*
 * A request's stop strings are compiled once into a stop_set that all its
 * choices share (n choices of one request hold one copy, not n); each
 * choice's eng_stop keeps only its own automaton states and held text.
 * Offsets and KMP entries are 32-bit: a stop string is bounded far below
 * 4 GiB (ENG_STOP_MAX_BYTES), and 4 bytes per byte of stop text is half
 * of what size_t entries cost.
 */
typedef struct stop_set {
    size_t refs; /* the matchers sharing it: one request's choices, made and
                  * freed on one thread together, so a plain count */
    size_t n;
    uint32_t *start; /* n + 1: string j is bytes[start[j], start[j + 1]) */
    char *bytes;     /* every string, one after another (no NULs) */
    uint32_t *fail;  /* KMP, per byte of bytes: the longest proper border
                      * of its string's prefix through that byte */
} stop_set;

struct eng_stop {
    stop_set *set;   /* shared, refcounted */
    uint32_t *state; /* set->n: bytes of string j that end what has been fed */
    char *buf;       /* [0, shown) went out with the last call, then `held` held back */
    size_t cap;
    size_t shown;
    size_t held;
    bool stopped;
    bool hold;    /* eng_stop_hold: completions do not stop yet */
    bool include; /* eng_stop_include: a completed stop string is emitted */
};

void eng_stop_hold(eng_stop *s, bool held)
{
    s->hold = held;
}

void eng_stop_include(eng_stop *s, bool include)
{
    s->include = include;
}

static void stop_set_unref(stop_set *set)
{
    if (!set || --set->refs > 0)
        return;
    free(set->start);
    free(set->bytes);
    free(set->fail);
    free(set);
}

void eng_stop_free(eng_stop *s)
{
    if (!s)
        return;
    stop_set_unref(s->set);
    free(s->state);
    free(s->buf);
    free(s);
}

/* The stop strings against the bounds: QL_OK, or QL_EINVAL with msg naming
 * the string and the bound; *total gets their bytes. */
static int check_stops(const char *const *stops, size_t n, size_t *total, char *msg, size_t msg_len)
{
    *total = 0;
    if (n > 0 && !stops)
        return ql_fail(msg, msg_len, QL_EINVAL, "%zu stop strings but no array of them", n);
    if (n > ENG_STOP_MAX_COUNT)
        return ql_fail(msg, msg_len, QL_EINVAL, "%zu stop strings; at most %d", n,
                       ENG_STOP_MAX_COUNT);
    for (size_t i = 0; i < n; i++) {
        if (!stops[i])
            return ql_fail(msg, msg_len, QL_EINVAL, "stop string %zu is NULL", i);
        size_t len = strnlen(stops[i], ENG_STOP_MAX_BYTES + 1);
        if (len == 0)
            return ql_fail(msg, msg_len, QL_EINVAL, "stop string %zu is empty", i);
        if (len > ENG_STOP_MAX_BYTES)
            return ql_fail(msg, msg_len, QL_EINVAL,
                           "stop string %zu is over %d bytes (the most one may have)", i,
                           ENG_STOP_MAX_BYTES);
        *total += len;
    }
    if (*total > ENG_STOP_MAX_TOTAL_BYTES)
        return ql_fail(msg, msg_len, QL_EINVAL,
                       "the stop strings have %zu bytes in all; at most %d", *total,
                       ENG_STOP_MAX_TOTAL_BYTES);
    return QL_OK;
}

/* The stop strings checked (check_stops), copied and their KMP tables
 * built into *out (one reference, the caller's); NULL on error. */
static int stop_set_new(const char *const *stops, size_t n, stop_set **out, char *msg,
                        size_t msg_len)
{
    *out = NULL;
    size_t total;
    int rc = check_stops(stops, n, &total, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    stop_set *set = calloc(1, sizeof *set);
    if (!set)
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for %zu stop strings", n);
    set->refs = 1;
    set->n = n;
    set->start = malloc((n + 1) * sizeof *set->start);
    set->bytes = malloc(total + 1);
    set->fail = malloc((total + 1) * sizeof *set->fail);
    if (!set->start || !set->bytes || !set->fail) {
        stop_set_unref(set);
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for %zu bytes of stop strings",
                       total);
    }
    uint32_t at = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t len = (uint32_t)strlen(stops[i]);
        const char *t = memcpy(set->bytes + at, stops[i], len);
        uint32_t *fail = set->fail + at;
        set->start[i] = at;
        fail[0] = 0;
        for (uint32_t j = 1, k = 0; j < len; j++) {
            while (k > 0 && t[j] != t[k])
                k = fail[k - 1];
            if (t[j] == t[k])
                k++;
            fail[j] = k;
        }
        at += len;
    }
    set->start[n] = at;
    *out = set;
    return QL_OK;
}

/* A matcher over set (taking a reference), its automata at the start. */
static int stop_matcher_new(stop_set *set, eng_stop **out, char *msg, size_t msg_len)
{
    *out = NULL;
    eng_stop *s = calloc(1, sizeof *s);
    uint32_t *state = set->n ? calloc(set->n, sizeof *state) : NULL;
    if (!s || (set->n && !state)) {
        free(s);
        free(state);
        return ql_fail(msg, msg_len, QL_ENOMEM, "out of memory for %zu stop strings", set->n);
    }
    set->refs++;
    s->set = set;
    s->state = state;
    *out = s;
    return QL_OK;
}

int eng_stop_new(eng_stop **out, const char *const *stops, size_t n, char *msg, size_t msg_len)
{
    *out = NULL;
    stop_set *set;
    int rc = stop_set_new(stops, n, &set, msg, msg_len);
    if (rc != QL_OK)
        return rc;
    rc = stop_matcher_new(set, out, msg, msg_len);
    stop_set_unref(set); /* the matcher's reference, or none */
    return rc;
}

int eng_stop_fork(const eng_stop *s, eng_stop **out, char *msg, size_t msg_len)
{
    return stop_matcher_new(s->set, out, msg, msg_len);
}

/* Feed one byte to stop string j's automaton; true when it completes. */
static bool stop_step(const stop_set *set, uint32_t *state, size_t j, char c)
{
    const char *t = set->bytes + set->start[j];
    const uint32_t *fail = set->fail + set->start[j];
    uint32_t q = *state, len = set->start[j + 1] - set->start[j];
    if (q == len) /* completed while held: go on from its border */
        q = fail[q - 1];
    while (q > 0 && t[q] != c)
        q = fail[q - 1];
    if (t[q] == c)
        q++;
    *state = q;
    return q == len;
}

static bool is_continuation_byte(char c)
{
    return ((unsigned char)c & 0xC0) == 0x80;
}

/* Where held text starts: `at`, or the start of the character at covers
 * when it lies inside one. */
static size_t character_start(const char *buf, size_t at)
{
    size_t i = at;
    while (i > 0 && at - i < 3 && is_continuation_byte(buf[i]))
        i--;
    return (unsigned char)buf[i] >= 0xC0 ? i : at;
}

/* Move the held text to the front, dropping what went out last time. */
static void drop_shown(eng_stop *s)
{
    if (s->shown && s->held)
        memmove(s->buf, s->buf + s->shown, s->held);
    s->shown = 0;
}

/*
 * When the buffer cannot grow (out of memory: held text plus len bytes),
 * generation is ended as a stop would end it: true, nothing emitted.
 */
bool eng_stop_feed(eng_stop *s, const char *text, size_t len, const char **emit, size_t *emit_len)
{
    *emit = "";
    *emit_len = 0;
    if (s->stopped)
        return true;
    drop_shown(s);
    size_t total = s->held + len;
    if (total > s->cap) {
        size_t cap = s->cap ? s->cap : 256;
        while (cap < total)
            cap *= 2;
        char *grown = realloc(s->buf, cap);
        if (!grown) {
            s->stopped = true;
            s->held = 0;
            return true;
        }
        s->buf = grown;
        s->cap = cap;
    }
    if (len)
        memcpy(s->buf + s->held, text, len);

    size_t longest_held = 0;
    const stop_set *set = s->set;
    for (size_t i = s->held; i < total && set->n; i++) {
        size_t completed = 0; /* the longest stop string completed by this byte */
        for (size_t j = 0; j < set->n; j++)
            if (stop_step(set, &s->state[j], j, s->buf[i])) {
                size_t done = s->state[j]; /* the string's length */
                if (s->hold)               /* not yet: match on, as if it had not completed */
                    s->state[j] = set->fail[set->start[j] + done - 1];
                else if (done > completed)
                    completed = done;
            }
        if (completed) {
            /* the text up to the stop string, or through it (vLLM's
             * include_stop_str_in_output); what follows it never */
            s->stopped = true;
            s->shown = s->include ? i + 1 : i + 1 - completed;
            s->held = 0;
            *emit = s->buf;
            *emit_len = s->shown;
            return true;
        }
    }
    for (size_t j = 0; j < set->n; j++)
        if (s->state[j] > longest_held)
            longest_held = s->state[j];

    size_t keep_from = total - longest_held;
    if (longest_held)
        keep_from = character_start(s->buf, keep_from);
    s->shown = keep_from;
    s->held = total - keep_from;
    *emit = s->buf ? s->buf : "";
    *emit_len = s->shown;
    return false;
}

/* Everything held is emitted and the automata start over; after a stop,
 * nothing. */
void eng_stop_flush(eng_stop *s, const char **emit, size_t *emit_len)
{
    *emit = "";
    *emit_len = 0;
    if (s->stopped)
        return;
    drop_shown(s);
    s->shown = s->held;
    s->held = 0;
    for (size_t j = 0; j < s->set->n; j++)
        s->state[j] = 0;
    if (s->buf)
        *emit = s->buf;
    *emit_len = s->shown;
}
