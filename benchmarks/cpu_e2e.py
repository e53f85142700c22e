"""End-to-end CPU benchmark: the tiny M3 against a tiny Llama of the same width, served the same way.

Both models are served by the real SGLang server on the project's CPU platform, in one run, with
the same tokenizer and workload (a fixed set of prompts, greedy, fixed output length). Reported as
ratios M3 / Llama: time to first token (streamed) and output tokens per second, so the overhead
of the MSA path shows independent of how fast the machine is. Report only; no target yet.

    .venv/bin/python benchmarks/cpu_e2e.py [--out benchmarks/results/cpu_e2e.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import requests

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from server_harness import launch_cpu_server  # noqa: E402
from transformers_oracle import random_prompt  # noqa: E402

PROMPT_LENGTHS = (128, 256, 512, 1024)
OUTPUT_TOKENS = 64


def build_llama_twin(m3_dir: str, out_dir: str) -> str:
    """A random Llama with the tiny M3's width, depth, heads and tokenizer."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sglang_m3.tiny.checkpoint import TinyGeometry

    g = TinyGeometry()
    config = LlamaConfig(
        vocab_size=g.vocab_size, hidden_size=g.hidden_size, intermediate_size=g.dense_intermediate,
        num_hidden_layers=g.num_layers, num_attention_heads=g.num_heads, num_key_value_heads=g.num_kv_heads,
        head_dim=g.head_dim, max_position_embeddings=4096, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(m3_dir, name), out_dir)
    return out_dir


def measure(server, prompts) -> dict:
    ttfts, rates = [], []
    for prompt in prompts:
        start = time.perf_counter()
        first = None
        tokens = 0
        with requests.post(
            f"{server.base_url}/generate",
            json={"input_ids": prompt, "stream": True,
                  "sampling_params": {"temperature": 0, "max_new_tokens": OUTPUT_TOKENS, "ignore_eos": True}},
            stream=True, timeout=600,
        ) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                if first is None:
                    first = time.perf_counter()
                tokens = json.loads(line[5:])["meta_info"]["completion_tokens"]
        end = time.perf_counter()
        ttfts.append(first - start)
        rates.append((tokens - 1) / (end - first))
    return {"ttft_s": statistics.median(ttfts), "output_tok_per_s": statistics.median(rates), "per_prompt_ttft_s": ttfts, "per_prompt_tok_per_s": rates}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu_e2e.json"))
    args = parser.parse_args()
    from sglang_m3.tiny.checkpoint import build_tiny_checkpoint

    work = tempfile.mkdtemp(prefix="cpu-e2e-")
    m3_dir = build_tiny_checkpoint(os.path.join(work, "m3"))
    llama_dir = build_llama_twin(m3_dir, os.path.join(work, "llama"))
    prompts = [random_prompt(100 + i, n) for i, n in enumerate(PROMPT_LENGTHS)]
    results = {}
    for name, path in (("tiny_m3", m3_dir), ("tiny_llama", llama_dir)):
        print(f"serving {name} ...", flush=True)
        with launch_cpu_server(path, work, "--disable-radix-cache") as server:
            measure(server, prompts[:1])  # warm-up
            results[name] = measure(server, prompts)
        print(f"{name}: TTFT {results[name]['ttft_s'] * 1000:.1f} ms, {results[name]['output_tok_per_s']:.1f} tok/s", flush=True)
    report = {
        "workload": {"prompt_lengths": PROMPT_LENGTHS, "output_tokens": OUTPUT_TOKENS, "greedy": True, "radix_cache": False},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "results": results,
        "ratio_m3_over_llama": {
            "ttft": results["tiny_m3"]["ttft_s"] / results["tiny_llama"]["ttft_s"],
            "output_tok_per_s": results["tiny_m3"]["output_tok_per_s"] / results["tiny_llama"]["output_tok_per_s"],
        },
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump(report, handle, indent=2)
    ratio = report["ratio_m3_over_llama"]
    print(f"M3 / Llama: TTFT x{ratio['ttft']:.2f}, output tokens/s x{ratio['output_tok_per_s']:.2f}  -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
