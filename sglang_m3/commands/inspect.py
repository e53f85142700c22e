"""``sglang-m3 inspect CONFIG [--tp N] [--ep N]``: the real size of an M3 config, without weights.

The project's model is built on the meta device for every rank of the layout (see
``sglang_m3.inspect``); this module only parses the flags and prints the report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from sglang_m3.commands.arg_types import token_count
from sglang_m3.commands.output_errors import describe_write_error
from sglang_m3.inspect.decode_floor import DEFAULT_FLOOR_CONTEXT
from sglang_m3.recipe.catalog import CATALOG

GB = 10**9


def write_geometry(path: str, record: dict) -> None:
    """Write ``record`` as JSON to ``path``. The text is made before the file is opened, so a
    failure while making it cannot leave the previous record (usually the committed one)
    truncated; errors opening ``path`` reach the caller as OSError."""
    text = json.dumps(record, indent=2) + "\n"
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)


def output_path(text: str) -> str:
    """A file path to write to. An empty one was taken for the option not given: the command
    exited 0 having written nothing and said nothing."""
    if not text:
        raise argparse.ArgumentTypeError("takes the path of the file to write, got an empty one")
    return text


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="parameter count, per-rank bytes and KV bytes per token of an M3 config (no weights)",
        description=(
            "Build the M3 model classes of a config on the meta device and report the total "
            "parameters (text, vision; MTP modules are not built and not counted), the bytes per "
            "rank under --tp/--ep with what is split and what is replicated, the KV-cache bytes per "
            "token (K/V plus MSA index keys), and the decode floor: the bytes the busiest rank must "
            "read for one token of a lone request at --context tokens, and the time that takes at "
            "the peak memory bandwidth of each GPU profile a recipe may name (h100 ... mi355x, from "
            "the vendors' data sheets), which no server can beat. Sizes are bf16 "
            "unless marked MXFP8; GB are 10^9 bytes."
        ),
    )
    parser.add_argument("config", help="a config.json file or a checkpoint directory")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size inside the TP group (default 1)")
    parser.add_argument(
        "--context", type=token_count, default=DEFAULT_FLOOR_CONTEXT, metavar="TOKENS",
        help=f"tokens in the request's context for the decode floor (default {DEFAULT_FLOOR_CONTEXT})",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--tensors", action="store_true", help="also list every expected checkpoint tensor with its full shape")
    parser.add_argument(
        "--write-geometry", type=output_path, metavar="PATH",
        help="also write the --tp/--ep independent part of the report to PATH (the recipe layer's m3_geometry.json)",
    )
    parser.set_defaults(handler=run)


class ConfigFileError(ValueError):
    """A config file ``inspect`` cannot measure; the message names the file."""


def config_file(path: str) -> str | None:
    """The config.json ``path`` names (itself, or the one in a checkpoint directory); None when
    there is none, which the build reports in its own words."""
    candidate = os.path.join(path, "config.json") if os.path.isdir(path) else path
    return candidate if os.path.isfile(candidate) else None


def check_config_file(path: str) -> None:
    """Refuse, naming the file, a config.json that is not UTF-8 JSON text holding an object, or
    that does not name an M3 architecture, before the build imports SGLang: the reader under
    the build met the first ones with a traceback."""
    file = config_file(path)
    if file is None:
        return
    try:
        with open(file, encoding="utf-8") as handle:
            config = json.load(handle)
    except UnicodeDecodeError as error:
        raise ConfigFileError(f"{file}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise ConfigFileError(f"{file}: not valid JSON ({error})") from None
    except OSError as error:
        raise ConfigFileError(f"{file}: cannot read it ({error.strerror})") from None
    if not isinstance(config, dict):
        raise ConfigFileError(f"{file}: must hold a JSON object, got {type(config).__name__}")
    _check_names_m3(file, config)


def _check_names_m3(file: str, config: dict) -> None:
    """M3 by ``architectures[0]``, which SGLang's model config needs to build the model: a config
    of another model met a missing-field message, one naming none a traceback in SGLang."""
    from sglang_m3.integration.hooks import M3_ARCHITECTURES, first_architecture

    if first_architecture(config) not in M3_ARCHITECTURES:
        raise ConfigFileError(
            f"{file}: not an M3 config (architectures {config.get('architectures')!r}, model_type "
            f"{config.get('model_type')!r}): architectures[0] must be {' or '.join(M3_ARCHITECTURES)}"
        )


def run(args: argparse.Namespace) -> int:
    try:
        check_config_file(args.config)
    except ConfigFileError as error:
        print(f"sglang-m3 inspect: {error}", file=sys.stderr)
        return 1
    from sglang_m3.config import M3ConfigError
    from sglang_m3.inspect.decode_floor import FloorContextError
    from sglang_m3.inspect.parallel_sizes import ParallelSizeError
    from sglang_m3.inspect.report import geometry_record, inspect_config

    try:
        report = inspect_config(args.config, args.tp, args.ep, tensors=args.tensors, context=args.context)
    except FloorContextError as error:
        print(f"sglang-m3 inspect: --context: {error}", file=sys.stderr)
        return 1
    except (M3ConfigError, ParallelSizeError) as error:
        print(f"sglang-m3 inspect: {error}", file=sys.stderr)
        return 1
    if args.write_geometry is not None:
        try:
            write_geometry(args.write_geometry, geometry_record(report))
        except OSError as error:  # a missing folder, a directory, no permission: no traceback
            print(f"sglang-m3 inspect: --write-geometry: {describe_write_error(args.write_geometry, error)}", file=sys.stderr)
            return 1
        print(f"wrote the geometry record to {args.write_geometry}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print("\n".join(text_lines(report)))
    return 0


def text_lines(report: dict) -> list[str]:
    params, size, kv, rank = report["parameters"], report["bytes"], report["kv_cache"], report["per_rank"]
    geometry = report["geometry"]
    lines = [
        f"{report['architecture']} from {report['config']}, built on the meta device ({report['dtype']})",
        f"parameters   {params['total']:,} ({params['total'] / 1e9:.2f} B)",
        f"  text       {params['text']:,}",
        f"  vision     {params['vision']:,}",
        f"  MTP        {params['mtp_modules']} module(s) in the checkpoint, not built or loaded by sglang-m3: not counted",
        f"weights      {size['bf16'] / GB:,.2f} GB at bf16 (2 bytes/param); {size['as_built'] / GB:,.2f} GB as "
        "built (router weight and correction bias in fp32)",
        f"  MXFP8      {size['mxfp8'] / GB:,.2f} GB as the MXFP8 checkpoint stores it (e4m3 linears + an e8m0 "
        "scale byte per 32; embeddings, lm_head, index projections, routers, norms, vision as built)",
        f"KV cache     {kv['total_bytes_per_token']:,} bytes/token ({kv['dtype']}): K+V {kv['kv_bytes_per_token']:,} "
        f"({geometry['num_layers']} layers) + index keys {kv['index_bytes_per_token']:,} "
        f"({geometry['sparse_layers']} sparse layers)",
        "",
    ]
    same = len(set(rank["bytes_by_rank"])) == 1
    lines += [
        f"per rank at --tp {rank['tp']} --ep {rank['ep']} "
        f"({'all ' + str(rank['tp']) + ' ranks hold the same' if same else 'largest rank shown'}):",
        f"  parameters {rank['parameters']:,}",
        f"  bytes      {rank['bytes'] / GB:,.2f} GB as built",
    ]
    rules = report["weights"]["rules"]
    for group, held in rank["groups"].items():
        ways = held["split_ways"]
        how = "replicated" if ways == 1 else f"1/{ways:g}" if ways else "-"
        lines.append(f"    {group:<13}{held['bytes'] / GB:>9.2f} GB  {how:<11}{rules[group]}")
    replication = rank["kv_head_replication"]
    heads = (
        f"{rank['kv_heads_per_rank']} KV head(s) per rank"
        + (f"; each of the {geometry['num_kv_heads']} KV heads replicated on {replication} ranks" if replication > 1 else "")
    )
    lines.append(
        f"  KV cache   {rank['total_kv_bytes_per_token']:,} bytes/token: K+V {rank['kv_bytes_per_token']:,} ({heads}) "
        f"+ index keys {rank['index_bytes_per_token']:,} (replicated on every rank)"
    )
    for problem in rank["uneven"]:
        lines.append(f"  UNEVEN     {problem}")
    lines += floor_lines(rank["decode_floor"])
    for name, shape in report.get("tensors", {}).items():
        lines.append(f"{name} {shape}")
    return lines


def floor_lines(floor: dict) -> list[str]:
    """The decode floor: the busiest rank's bytes per token by part, bf16 and MXFP8, then the time."""
    bf16, mxfp8 = floor["bf16"], floor["mxfp8"]
    lines = [
        f"  decode floor, one lone request at {floor['context']:,} tokens of context (busiest rank; "
        f"{floor['chosen_experts_per_moe_layer']} chosen expert(s) per MoE layer on it):",
        f"    {'part':<15}{'bf16 GB':>9}{'MXFP8 GB':>10}",
    ]
    for part, count in bf16.items():
        if part != "total":
            lines.append(f"    {part:<15}{count / GB:>9.3f}{mxfp8[part] / GB:>10.3f}")
    lines.append(f"    {'total':<15}{bf16['total'] / GB:>9.3f}{mxfp8['total'] / GB:>10.3f}")
    lines.append("    time per token at each hardware profile's peak memory bandwidth (data sheet):")
    for name, times in floor["ms_per_token"].items():
        lines.append(
            f"    {name:<7}{CATALOG[name].hbm_tbps:>5.2f} TB/s  >= {times['bf16']:.3f} ms per token at bf16, "
            f">= {times['mxfp8']:.3f} ms with MXFP8 weights"
        )
    return lines
