#!/usr/bin/env python3
"""peer_peft_merge.py - the merge benchmark's peer: PEFT + bitsandbytes merging a LoRA adapter
into an NF4 model on the CPU, printing JSON. Python, because the peer is Python (PEFT and
bitsandbytes are the QLoRA stack users would merge with instead); qlserve never needs it, and it
is not part of the build or the tests.

Install (PyPI; the torch wheel is large):
    pip install torch transformers peft bitsandbytes accelerate gguf
Run (bench/merge_vs_peft.sh runs it beside bench_adapters --merge-nf4 and prints the ratio):
    python3 bench/peer_peft_merge.py --model ~/.cache/qlserve/models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --adapter DIR [--threads 2] [--repeat 3]

The model: a GGUF is read by transformers' GGUF loader (dequantized to f32, llama.cpp's q/k
row permutation undone), saved once as an HF folder next to the GGUF (--hf-dir, default
GGUF.hf/), and loaded from there with BitsAndBytesConfig(load_in_4bit, nf4, f32 compute, no
double quant): every projection NF4 in blocks of 64 on bitsandbytes' CPU backend, as
bench_adapters --merge-nf4 requantizes the same weights. An HF folder may be given as --model
instead. The adapter: a PEFT folder (bench_adapters --merge-nf4 N --adapter-dir DIR writes the
rank-16 one on all seven projections of every layer that qlserve merges).

What is timed: model.merge_adapter() (PEFT's LoraLayer.merge on each of the 210 bnb Linear4bit
modules: dequantize, add scale * B @ A, quantize again), --repeat times with an untimed
unmerge_adapter() between; the best and every time, wall and process CPU seconds, with torch
on --threads threads. merge_and_unload() does the same merge and then swaps the modules out,
which cannot be repeated on one model, so merge_adapter() is what is timed.
"""
import argparse
import json
import os
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file or an HF model folder")
    ap.add_argument("--adapter", required=True, help="a PEFT LoRA adapter folder")
    ap.add_argument("--hf-dir", help="where the GGUF's HF folder is written (default GGUF.hf)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    if a.repeat < 1:
        sys.exit("peer_peft_merge: --repeat must be at least 1")
    if not os.path.isdir(a.adapter) or not os.path.isfile(
        os.path.join(a.adapter, "adapter_config.json")
    ):
        sys.exit(f"peer_peft_merge: {a.adapter} is not a PEFT adapter folder (no adapter_config.json)")

    import torch
    import bitsandbytes
    import peft
    import transformers
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    torch.set_num_threads(a.threads)
    hf = a.model
    if os.path.isfile(a.model):
        hf = a.hf_dir or a.model + ".hf"
        if not os.path.isfile(os.path.join(hf, "config.json")):
            from safetensors.torch import save_model

            full = AutoModelForCausalLM.from_pretrained(
                os.path.dirname(os.path.abspath(a.model)),
                gguf_file=os.path.basename(a.model),
                dtype=torch.float32,
            )
            # save_pretrained refuses a GGUF-loaded model: the config without
            # its GGUF origin, and the f32 weights (tied ones once)
            os.makedirs(hf, exist_ok=True)
            if hasattr(full.config, "quantization_config"):
                del full.config.quantization_config
            full.config.save_pretrained(hf)
            save_model(full, os.path.join(hf, "model.safetensors"), metadata={"format": "pt"})
            del full

    bnb = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_use_double_quant=False,
    )
    model = AutoModelForCausalLM.from_pretrained(
        hf, quantization_config=bnb, dtype=torch.float32, device_map="cpu"
    )
    model = PeftModel.from_pretrained(model, a.adapter)
    n4 = sum(1 for m in model.modules() if isinstance(m, bitsandbytes.nn.Linear4bit))
    lora = sum(1 for m in model.modules() if isinstance(m, peft.tuners.lora.LoraLayer))

    wall, cpu = [], []
    for _ in range(a.repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        model.merge_adapter()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        model.unmerge_adapter()
    print(
        json.dumps(
            {
                "bench": "peer_peft_merge",
                "model": a.model,
                "adapter": a.adapter,
                "threads": a.threads,
                "linear4bit_modules": n4,
                "lora_modules": lora,
                "repeat": a.repeat,
                "merge_seconds": round(min(wall), 4),
                "merge_all": [round(t, 4) for t in wall],
                "merge_cpu_seconds": round(min(cpu), 4),
                "versions": {
                    "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "peft": peft.__version__,
                    "bitsandbytes": bitsandbytes.__version__,
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
