"""``sglang-m3 tiny-checkpoint DIR``: write the deterministic tiny random-weight M3."""

from __future__ import annotations

import argparse
import sys


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "tiny-checkpoint",
        help="write a tiny random-weight MiniMax M3 checkpoint (tests, demos)",
        description=(
            "Write a deterministic random-weight MiniMax M3 in the original checkpoint layout: "
            "safetensors with the shipped tensor names, a small BPE tokenizer with M3's special "
            "tokens, the project's chat template, and (with --vision) the vision tower and the "
            "processor configs. 4 layers (1 dense, 3 MSA with block size 16 and top-4 blocks)."
        ),
    )
    parser.add_argument("directory", help="output directory (created; must be empty or absent)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument("--vision", action="store_true", help="include the vision tower (architecture MiniMaxM3SparseForConditionalGeneration)")
    parser.add_argument(
        "--sparse-config",
        choices=("flat", "nested"),
        default="flat",
        help="write the sparse settings as flat Hugging Face keys or as the nested sparse_attention_config (default flat)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from sglang_m3.tiny.checkpoint import build_tiny_checkpoint

    try:
        path = build_tiny_checkpoint(args.directory, seed=args.seed, vision=args.vision, sparse_form=args.sparse_config)
    except FileExistsError as error:
        print(f"sglang-m3 tiny-checkpoint: {error}", file=sys.stderr)
        return 1
    kind = "VL" if args.vision else "text-only"
    print(f"wrote tiny {kind} M3 checkpoint (seed {args.seed}, {args.sparse_config} sparse config) to {path}")
    return 0
