"""``sglang-m3 tiny-checkpoint DIR``: write the deterministic tiny random-weight M3."""

from __future__ import annotations

import argparse
import sys

from sglang_m3.commands.arg_types import module_count, seed
from sglang_m3.commands.output_errors import describe_write_error
from sglang_m3.tiny.output_dir import prepare_output


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "tiny-checkpoint",
        help="write a tiny random-weight MiniMax M3 checkpoint (tests, demos)",
        description=(
            "Write a deterministic random-weight MiniMax M3 with the original tensor names: "
            "safetensors, a small BPE tokenizer with M3's special tokens, the project's chat "
            "template, and (with --vision) the vision tower and the processor configs. 4 layers "
            "(1 dense, 3 MSA with block size 16 and top-4 blocks); the vision tower's sizes all "
            "differ from the text model's."
        ),
    )
    parser.add_argument("directory", help="output directory (created; must be empty or absent)")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the random weights, 0 to 2**63 - 1 (default 0)")
    parser.add_argument("--vision", action="store_true", help="include the vision tower (architecture MiniMaxM3SparseForConditionalGeneration)")
    parser.add_argument(
        "--layout",
        choices=("shipped", "hf"),
        default="shipped",
        help=(
            "form of config.json: 'shipped' = the real checkpoint's (moe_layer_freq, nested "
            "sparse_attention_config, top-level rope_theta/rotary_dim/partial_rotary_factor, "
            "swigluoai); 'hf' = as transformers' save_pretrained writes it (layer_types, "
            "mlp_layer_types, index_*, rope_parameters). Same weights either way (default shipped)"
        ),
    )
    parser.add_argument(
        "--mtp-modules",
        type=module_count,
        default=0,
        help="add this many multi-token-prediction modules (model.mtp.layers.N.*; shipped layout only; servers skip them) (default 0)",
    )
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument(
        "--mxfp8",
        dest="quantization",
        action="store_const",
        const="mxfp8",
        help=(
            "write the linears in the published MXFP8 format (float8_e4m3fn weights + uint8 e8m0 "
            "weight_scale_inv per 32 inputs, quantization_config in config.json), quantized from "
            "the same BF16 weights"
        ),
    )
    weights.add_argument(
        "--mxfp8-dequantized",
        dest="quantization",
        action="store_const",
        const="mxfp8-dequantized",
        help="write the plain twin of --mxfp8: the same weights after quantize -> dequantize, unquantized",
    )
    parser.set_defaults(handler=run, quantization=None)


def run(args: argparse.Namespace) -> int:
    if args.mtp_modules and args.layout != "shipped":
        print(f"sglang-m3 tiny-checkpoint: --mtp-modules {args.mtp_modules} needs --layout shipped (got --layout "
              f"{args.layout}): MTP modules are part of the shipped layout only, transformers writes none", file=sys.stderr)
        return 2
    kind = "VL" if args.vision else "text-only"
    try:
        prepare_output(args.directory)  # before the imports below, which take tens of seconds
        print(f"sglang-m3 tiny-checkpoint: writing a tiny {kind} M3 checkpoint to {args.directory} ...", file=sys.stderr, flush=True)
        from sglang_m3.tiny.checkpoint import build_tiny_checkpoint

        path = build_tiny_checkpoint(
            args.directory, seed=args.seed, vision=args.vision, layout=args.layout, mtp_modules=args.mtp_modules,
            quantization=args.quantization,
        )
    except ValueError as error:
        print(f"sglang-m3 tiny-checkpoint: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # a non-empty, unwritable or impossible output directory
        print(f"sglang-m3 tiny-checkpoint: {describe_write_error(args.directory, error)}", file=sys.stderr)
        return 1
    mtp = f", {args.mtp_modules} MTP module(s)" if args.mtp_modules else ""
    weights = f", {args.quantization} weights" if args.quantization else ""
    print(f"wrote tiny {kind} M3 checkpoint (seed {args.seed}, {args.layout} layout{mtp}{weights}) to {path}")
    return 0
