"""tiny_model.py - writes the conformance test's model: the same tiny
Llama-family model the C tests build (tests/tiny_model.h: 260 tokens,
hidden 64, 2 layers, 4 heads, 2 KV heads, random weights) as a Hugging Face
folder: config.json, model.safetensors (F32) and tokenizer.json (GPT-2's
byte-level BPE over 256 byte tokens, merges for "Ġt", "he", "Ġthe", and
<|endoftext|> as 259, both BOS and EOS). One difference from the C tests'
model: its output leans to printable ASCII (see ascii_bias), so checks can
compare texts and pick stop strings from them. Pure Python, no dependency: the
safetensors layout is an 8-byte header length, a JSON header, then the
raw little-endian tensors.

    python3 tiny_model.py DIR
"""

import json
import os
import random
import struct
import sys

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 260, 64, 96, 2, 4, 2
MERGES = [("\u0120", "t"), ("h", "e"), ("\u0120t", "he")]


def byte_symbols():
    """GPT-2's byte-to-unicode map: printable bytes stand for themselves,
    the rest shift to U+0100 upward, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, shift = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + shift)
            shift += 1
    return out


def tokenizer():
    sym = byte_symbols()
    vocab = {sym[b]: b for b in range(256)}
    for i, (a, b) in enumerate(MERGES):
        vocab[a + b] = 256 + i
    return {
        "model": {"type": "BPE", "vocab": vocab, "merges": [a + " " + b for a, b in MERGES]},
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "decoder": {"type": "ByteLevel"},
        "added_tokens": [{"id": 259, "content": "<|endoftext|>", "special": True}],
    }


def tensors(seed):
    rng = random.Random(seed)
    head_dim = HIDDEN // HEADS
    q, kv = HEADS * head_dim, KV_HEADS * head_dim

    def t(name, shape, norm, column0=None, scale=0.02):
        n = shape[0] * (shape[1] if len(shape) > 1 else 1)
        vals = [1.0 + 0.01 * rng.gauss(0, 1) if norm else scale * rng.gauss(0, 1) for _ in range(n)]
        if column0:  # row r's first element is column0(r)
            for r in range(shape[0]):
                vals[r * shape[1]] = column0(r)
        return name, shape, struct.pack("<%df" % n, *vals)

    # the hidden state's first dimension carries a constant 8 from every
    # embedding (the others are N(0, 1), so the last token moves the
    # logits), and lm_head's first column turns it into a bias: 0 for the
    # tokens spelling printable ASCII, -4 (some -20 in the logits) for the
    # rest, EOS included. So the text is readable, never cut by an
    # incomplete UTF-8 tail or a control byte, and EOS comes only when a
    # request forces it (logit_bias), never by chance in a sampled answer.
    def ascii_bias(r):
        return 0.0 if 32 <= r < 127 or 256 <= r < 259 else -4.0

    out = [t("model.embed_tokens.weight", [VOCAB, HIDDEN], False, lambda r: 8.0, 1.0),
           t("model.norm.weight", [HIDDEN], True),
           t("lm_head.weight", [VOCAB, HIDDEN], False, ascii_bias)]
    for l in range(LAYERS):
        p = "model.layers.%d." % l
        out += [t(p + "input_layernorm.weight", [HIDDEN], True),
                t(p + "post_attention_layernorm.weight", [HIDDEN], True),
                t(p + "self_attn.q_proj.weight", [q, HIDDEN], False),
                t(p + "self_attn.k_proj.weight", [kv, HIDDEN], False),
                t(p + "self_attn.v_proj.weight", [kv, HIDDEN], False),
                t(p + "self_attn.o_proj.weight", [HIDDEN, q], False),
                t(p + "mlp.gate_proj.weight", [INTER, HIDDEN], False),
                t(p + "mlp.up_proj.weight", [INTER, HIDDEN], False),
                t(p + "mlp.down_proj.weight", [HIDDEN, INTER], False)]
    return out


def write_safetensors(path, items):
    header, offset = {}, 0
    for name, shape, data in items:
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, data in items:
            f.write(data)


def main(folder):
    os.makedirs(folder, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": HIDDEN,
              "intermediate_size": INTER, "num_hidden_layers": LAYERS,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "max_position_embeddings": 512, "rope_theta": 10000.0, "rms_norm_eps": 1e-05,
              "tie_word_embeddings": False, "bos_token_id": 259, "eos_token_id": 259,
              "torch_dtype": "float32"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer(), f, ensure_ascii=False, indent=1)
    write_safetensors(os.path.join(folder, "model.safetensors"), tensors(1))


if __name__ == "__main__":
    main(sys.argv[1])
