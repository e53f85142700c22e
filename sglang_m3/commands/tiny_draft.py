"""``sglang-m3 tiny-draft TARGET DIR``: write a tiny EAGLE3 draft for a tiny M3 checkpoint."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from sglang_m3.commands.arg_types import seed
from sglang_m3.commands.output_errors import describe_write_error
from sglang_m3.tiny.output_dir import prepare_output


def _layer_ids(text: str) -> list[int]:
    """Comma-separated layer numbers, at least one (an empty list would otherwise reach the
    builder, which then names the config field it writes rather than this flag)."""
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes comma-separated layer numbers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError(f"names no layer ({text!r}): an EAGLE3 draft reads at least one target layer")
    return ids


def _paragraphs(*texts: str) -> str:
    """Help text wrapped here, so that the raw formatter keeps the serving example's flags whole
    (argparse's own wrapping splits them at their hyphens)."""
    return "\n\n".join(textwrap.fill(" ".join(text.split()), 79, break_on_hyphens=False) for text in texts)


DESCRIPTION = _paragraphs(
    "Write an EAGLE3 draft in the format SGLang loads for --speculative-algorithm EAGLE3 "
    "(LlamaForCausalLMEagle3: one decoder layer fed with the target's aux hidden states, fc, norm, "
    "lm_head over a draft vocabulary, d2t/t2d maps). By default the weights are random (seeded) and "
    "most drafts are rejected; --copy-target-lm-head builds the draft whose logits equal the target's "
    "at the position it reads, which proposes the last token again.",
    "TARGET must be an M3 checkpoint directory: a config.json whose architectures is "
    "MiniMaxM3SparseForCausalLM or MiniMaxM3SparseForConditionalGeneration, and safetensors holding "
    "lm_head.weight, model.embed_tokens.weight and model.norm.weight (a VL checkpoint's "
    "language_model. names are accepted). The draft is written to a hidden directory next to DIR and "
    "moved into place whole; an existing DIR must be empty.",
)
EPILOG = (
    "serve the draft with its target:\n"
    "  python -m sglang.launch_server --model-path TARGET \\\n"
    "      --speculative-algorithm EAGLE3 --speculative-draft-model-path DIR \\\n"
    "      --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4\n\n"
    + _paragraphs(
        "On failure: exit status 1 when TARGET or DIR cannot be used (one line on stderr names which "
        "and why), 2 for a malformed option value."
    )
)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "tiny-draft",
        help="write a tiny EAGLE3 draft model for a tiny M3 checkpoint (speculative decoding tests)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", metavar="TARGET", help="the target M3 checkpoint directory (e.g. from sglang-m3 tiny-checkpoint)")
    parser.add_argument("directory", metavar="DIR", help="output directory (created; must be empty or absent)")
    parser.add_argument("--seed", type=seed, default=0, help="seed of the random weights, 0 to 2**63 - 1 (default 0)")
    parser.add_argument(
        "--draft-vocab-size",
        type=int,
        default=None,
        help="draft vocabulary size N: the draft proposes only the first N target token ids (d2t/t2d map them); default the full vocabulary",
    )
    parser.add_argument(
        "--copy-target-lm-head",
        action="store_true",
        help="full vocabulary, lm_head and final norm copied from the target, fc passing the last target layer through, midlayer adding nothing",
    )
    parser.add_argument(
        "--aux-layer-ids",
        type=_layer_ids,
        default=None,
        help=(
            "comma-separated target layers whose outputs the draft reads, written to "
            "eagle_config.eagle_aux_hidden_state_layer_ids (default: none written, so M3's default "
            "2,n//2,n-3 applies as for the published draft; with --copy-target-lm-head 2,n//2,n-1)"
        ),
    )
    parser.set_defaults(handler=run)


def _unreadable_tensor_file(target: str) -> str:
    """The first safetensors file in ``target`` whose header cannot be read, else ``target``:
    safetensors' error ("header too large") names no file."""
    from safetensors import SafetensorError, safe_open

    for name in sorted(os.listdir(target)):
        if name.endswith(".safetensors"):
            try:
                with safe_open(os.path.join(target, name), "pt") as handle:
                    handle.keys()
            except SafetensorError:
                return os.path.join(target, name)
    return target


def run(args: argparse.Namespace) -> int:
    from safetensors import SafetensorError

    try:
        prepare_output(args.directory)  # before the import below, which loads torch
        from sglang_m3.speculative.tiny_draft import build_tiny_draft

        path = build_tiny_draft(
            args.target,
            args.directory,
            seed=args.seed,
            draft_vocab_size=args.draft_vocab_size,
            copy_target_lm_head=args.copy_target_lm_head,
            aux_layer_ids=args.aux_layer_ids,
            progress=print,
        )
    except ValueError as error:
        print(f"sglang-m3 tiny-draft: {error}", file=sys.stderr)
        return 1
    except SafetensorError as error:  # a corrupt tensor file in TARGET
        print(f"sglang-m3 tiny-draft: {_unreadable_tensor_file(args.target)}: not a readable safetensors file ({error})", file=sys.stderr)
        return 1
    except OSError as error:  # a non-empty, unwritable or impossible output directory
        print(f"sglang-m3 tiny-draft: {describe_write_error(args.directory, error)}", file=sys.stderr)
        return 1
    kind = "lm-head-copy" if args.copy_target_lm_head else f"random (seed {args.seed})"
    print(f"wrote tiny EAGLE3 draft ({kind}) for {args.target} to {path}")
    return 0
