#!/usr/bin/env python3
"""make_moe_gguf.py - the MoE benchmark's model: random weights in Qwen3-30B-A3B's layer shapes,
a handful of layers, written as a GGUF of architecture qwen3moe in f16 (then bench/moe.sh has
llama.cpp's llama-quantize make the Q4_K_M file both engines run).

Python because this is a benchmark fixture, made once and cached outside git: gguf-py writes the
file exactly as llama.cpp's convert_hf_to_gguf.py does (same writer, same keys), which a C writer
would have to restate. qlserve's build and tests never run it.

The shapes are Qwen3-30B-A3B's config.json: hidden_size 2048, num_attention_heads 32,
num_key_value_heads 4, head_dim 128 (so q is 4096 wide, wider than hidden), num_experts 128,
num_experts_per_tok 8, moe_intermediate_size 768, norm_topk_prob true, q/k RMS norms per head,
rope_theta 1e6, rms_norm_eps 1e-6, untied lm_head. Only --layers of its 48 layers (default 4).
The vocabulary is not Qwen3's (151936 tokens): the default model's (SmolLM2-135M-Instruct,
49152 tokens, GPT-2 BPE) is copied with its tokenizer.* keys, since a speed benchmark needs a
real tokenizer both servers accept and nothing here is meant to be read; the lm_head and the
embeddings are therefore 49152 x 2048 rather than 151936 x 2048 (a smaller share of each step).

Tensor names, shapes and kinds follow the converter for Qwen3MoeForCausalLM (conversion/qwen.py's
Qwen2MoeModel, base.py's f16 rules) and llama.cpp's src/models/qwen3moe.cpp:
  token_embd.weight, output.weight                [vocab, 2048]            f16
  output_norm.weight, blk.N.attn_norm/ffn_norm    [2048]                   f32
  blk.N.attn_q.weight [4096, 2048], attn_k / attn_v [512, 2048], attn_output [2048, 4096]  f16
  blk.N.attn_q_norm.weight, attn_k_norm.weight    [128]                    f32
  blk.N.ffn_gate_inp.weight                       [128, 2048]              f32 (kept f32, as the
                                                                           converter and
                                                                           llama-quantize do)
  blk.N.ffn_gate_exps / ffn_up_exps.weight        [128, 768, 2048]         f16
  blk.N.ffn_down_exps.weight                      [128, 2048, 768]         f16
(shapes as numpy writes them: GGML's ne is the reverse.) Weights are normal with std --std
(0.02, as the Hugging Face initializer), norms 1, so the logits are finite and the router's
choice differs from token to token.

  python3 bench/moe/make_moe_gguf.py [--out PATH] [--layers 4] [--vocab-from GGUF] [--seed 0]
Prints the path written. Tensors are generated and written one at a time (the largest, one
layer's gate_exps, is 400 MB in f16).
"""
import argparse
import os
import sys

import numpy as np

import gguf

ARCH = "qwen3moe"
HIDDEN = 2048
HEADS, KV_HEADS, HEAD_DIM = 32, 4, 128
EXPERTS, EXPERTS_USED, EXPERT_FF = 128, 8, 768
FF_DENSE = 6144  # Qwen3-30B-A3B's intermediate_size: written as the converter does, unused
CONTEXT = 40960
ROPE_THETA = 1e6
RMS_EPS = 1e-6


def cache_dir():
    return os.path.join(os.environ.get("QLSERVE_CACHE") or os.path.expanduser("~/.cache/qlserve"),
                        "bench")


def default_vocab():
    return os.path.join(os.environ.get("QLSERVE_CACHE") or os.path.expanduser("~/.cache/qlserve"),
                        "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def copy_tokenizer(writer, path):
    """Every tokenizer.* key of the GGUF at path, with its own value types; the vocabulary size."""
    reader = gguf.GGUFReader(path)
    n_vocab = None
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        main = field.types[0]
        if main == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), main, sub_type=field.types[-1])
            if key == "tokenizer.ggml.tokens":
                n_vocab = len(field.data)
        else:
            writer.add_key_value(key, field.contents(), main)
    if not n_vocab:
        sys.exit("make_moe_gguf: %s has no tokenizer.ggml.tokens" % path)
    return n_vocab


def tensor_table(layers, n_vocab):
    """(name, numpy shape, dtype, kind) in file order; kind: 'normal' or 'ones'."""
    f16, f32 = np.float16, np.float32
    t = [("token_embd.weight", (n_vocab, HIDDEN), f16, "normal")]
    for i in range(layers):
        b = "blk.%d." % i
        t += [
            (b + "attn_norm.weight", (HIDDEN,), f32, "ones"),
            (b + "attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), f16, "normal"),
            (b + "attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), f16, "normal"),
            (b + "attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), f16, "normal"),
            (b + "attn_output.weight", (HIDDEN, HEADS * HEAD_DIM), f16, "normal"),
            (b + "attn_q_norm.weight", (HEAD_DIM,), f32, "ones"),
            (b + "attn_k_norm.weight", (HEAD_DIM,), f32, "ones"),
            (b + "ffn_norm.weight", (HIDDEN,), f32, "ones"),
            (b + "ffn_gate_inp.weight", (EXPERTS, HIDDEN), f32, "normal"),
            (b + "ffn_gate_exps.weight", (EXPERTS, EXPERT_FF, HIDDEN), f16, "normal"),
            (b + "ffn_up_exps.weight", (EXPERTS, EXPERT_FF, HIDDEN), f16, "normal"),
            (b + "ffn_down_exps.weight", (EXPERTS, HIDDEN, EXPERT_FF), f16, "normal"),
        ]
    t += [("output_norm.weight", (HIDDEN,), f32, "ones"),
          ("output.weight", (n_vocab, HIDDEN), f16, "normal")]
    return t


def make_tensor(rng, shape, dtype, kind, std):
    if kind == "ones":
        return np.ones(shape, dtype=dtype)
    out = np.empty(shape, dtype=dtype)
    # row blocks of the first axis, so no float32 copy of a whole expert tensor is held
    for k in range(shape[0]):
        out[k] = rng.standard_normal(shape[1:], dtype=np.float32) * np.float32(std)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab-from", default=default_vocab(),
                    help="a GGUF whose tokenizer.* keys are copied (default: the default model)")
    ap.add_argument("--std", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None,
                    help="default: $QLSERVE_CACHE/bench/qwen3moe-a3b-shapes-L{layers}.f16.gguf")
    a = ap.parse_args()
    if a.layers < 1:
        sys.exit("make_moe_gguf: --layers must be at least 1")
    out = a.out or os.path.join(cache_dir(), "qwen3moe-a3b-shapes-L%d.f16.gguf" % a.layers)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

    tmp = out + ".tmp"
    w = gguf.GGUFWriter(tmp, ARCH)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name("random qwen3moe, Qwen3-30B-A3B layer shapes, %d layers" % a.layers)
    w.add_block_count(a.layers)
    w.add_context_length(CONTEXT)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FF_DENSE)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(EXPERTS_USED)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_expert_feed_forward_length(EXPERT_FF)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    n_vocab = copy_tokenizer(w, a.vocab_from)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)

    table = tensor_table(a.layers, n_vocab)
    for name, shape, dtype, _ in table:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(a.seed)
    for name, shape, dtype, kind in table:
        w.write_tensor_data(make_tensor(rng, shape, dtype, kind, a.std))
    w.close()
    os.replace(tmp, out)
    print(out)


if __name__ == "__main__":
    main()
