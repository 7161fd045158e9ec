/*
 * fused_experts.h - internal to adapters/: PEFT's LoRA on a mixture of
 * experts' fused parameters (target_parameters, PEFT's ParamWrapper) as
 * the engine's per-expert modules (fused_experts.c), for peft.c's loader.
 */
#ifndef QL_ADAPTERS_FUSED_EXPERTS_H
#define QL_ADAPTERS_FUSED_EXPERTS_H

#include "model.h"
#include "modelfile.h"

/* The fused expert parameters an adapter may target, in the order
 * transformers registers them on the experts module (the order PEFT wraps
 * them in: the first is innermost, under the most "base_layer."). */
typedef enum { LORA_FUSED_GATE_UP, LORA_FUSED_DOWN, LORA_FUSED_N } lora_fused_param;

/* Which one a target_parameters entry names ("mlp.experts.gate_up_proj",
 * or any name ending in "experts.down_proj"), or -1. */
int lora_fused_param_of(const char *target);

/*
 * Whether key is a LoRA factor of a fused expert parameter:
 * [base_model.model.]model.layers.L.mlp.experts.(base_layer.)*lora_<A|B>
 * .weight (or .default.weight); *layer, *depth (how many "base_layer.")
 * and *is_b are set when it is.
 */
bool lora_fused_key(const char *key, int64_t *layer, int *depth, bool *is_b);

/*
 * Layer `layer`'s expert modules from one fused parameter's factors, as
 * PEFT's ParamWrapper lays them out: lora_A [r * experts, in] (expert e's
 * rows e*r .. e*r + r - 1), lora_B [out, r * experts] (expert e's column k
 * at k * experts + e), expert e's delta B_e @ A_e in the [out, in]
 * orientation of our projections; gate_up's out rows are the gate's then
 * the up's. row is the adapter's modules of that layer (eng_n_proj of
 * them); each module gets copies of its A and B it owns (their bytes added
 * to *copied) and scale. Shapes are checked against the model's experts
 * and refused naming the tensor, path the adapter file.
 */
int lora_fused_build(const eng_model *m, int32_t layer, lora_fused_param which, const st_tensor *a,
                     const st_tensor *b, int32_t rank, float scale, eng_lora_module *row,
                     size_t *copied, const char *path, char *msg, size_t msg_len);

#endif
