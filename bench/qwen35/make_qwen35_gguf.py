#!/usr/bin/env python3
"""make_qwen35_gguf.py - issue 33's benchmark model: random weights in the layer shapes of
transformers' Qwen3_5TextConfig defaults, a handful of layers, saved as a Hugging Face folder by
transformers and converted to an f16 GGUF by llama.cpp's own convert_hf_to_gguf.py (--no-mtp),
so both engines read the file llama.cpp's converter writes (bench/qwen35.sh then has
llama-quantize make the Q4_K_M file).

Python because this is a benchmark fixture, made once and cached outside git; qlserve's build and
tests never run it.

Shapes (Qwen3_5TextConfig's defaults in transformers 5): hidden_size 4096, intermediate_size
12288, 16 query heads / 4 kv heads of head_dim 256 on the full-attention layers (output gate,
partial rotary 0.25), Gated DeltaNet linear layers with 16 key heads / 32 value heads of 128,
conv kernel 4; three linear layers to each full one, as the released models. Only --layers of
its 32 layers (default 4: three linear, one full). The vocabulary is a stand-in (a byte-level
BPE of --vocab tokens, tests/fixtures/llama_cpp_convert.py's): the benchmark feeds token ids,
and the embeddings and lm_head are --vocab x 4096 rather than 248320 x 4096.
Weights are transformers' own initialization (normal, std initializer_range 0.02).
"""
import argparse
import os
import shutil
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "fixtures"))
from llama_cpp_convert import convert  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--out", required=True, help="the f16 GGUF to write")
    a = ap.parse_args()
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    base = Qwen3_5TextConfig()
    types = [base.layer_types[i] for i in range(a.layers)]
    if "full_attention" not in types:
        types[-1] = "full_attention"
    cfg = Qwen3_5TextConfig(vocab_size=a.vocab, num_hidden_layers=a.layers, layer_types=types,
                            tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg).to(torch.float16)
    tmp = tempfile.mkdtemp()
    folder = os.path.join(tmp, "qwen35-shapes-L%d" % a.layers)
    try:
        model.save_pretrained(folder, safe_serialization=True)
        del model
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        convert(folder, a.out, "f16", ["--no-mtp"])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(a.out)


if __name__ == "__main__":
    main()
