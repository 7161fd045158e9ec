/*
 * stages.h - where a CPU step's time goes: the wall time of each kind of
 * operation the forward pass runs (eng_forward on the CPU backend),
 * summed over the steps taken while a stage_times is attached. For
 * bench_decode --stages, which prints them per step beside the step's own
 * time (the rest is the walk itself and the operations not listed).
 * Timing costs two clock reads per operation, a few hundred a step, and
 * nothing when no stage_times is attached.
 */
#ifndef QLSERVE_ENGINE_STAGES_H
#define QLSERVE_ENGINE_STAGES_H

#include <stdint.h>

typedef enum {
    ENG_STAGE_MATMUL,    /* the layers' projections (adapters applied unmerged included) */
    ENG_STAGE_LM_HEAD,   /* the classifier */
    ENG_STAGE_ATTENTION, /* attention over the paged cache, conversions from f16 or q8_0 included */
    ENG_STAGE_ELEMENTWISE, /* norms, gated activations, rotations, residual adds, biases, scales */
    ENG_STAGE_KV_WRITE,    /* storing the step's K and V into the cache */
    ENG_STAGE_EMBED,       /* the token embeddings' rows */
    ENG_STAGE_COUNT
} eng_stage;

/* The stages' names as bench_decode prints them ("matmul", "lm_head", ...). */
extern const char *const eng_stage_names[ENG_STAGE_COUNT];

typedef struct eng_stage_times {
    int64_t ns[ENG_STAGE_COUNT];
    int64_t calls[ENG_STAGE_COUNT];
} eng_stage_times;

struct eng_forward_state;
/* Add each later step's stage times into times (borrowed until detached);
 * NULL detaches. */
void eng_forward_time_stages(struct eng_forward_state *st, eng_stage_times *times);

#endif
