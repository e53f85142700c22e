"""``sglang-m3 recipe``: check, size, render and describe M3 deployment recipes.

Needs only the recipe layer (pydantic + pyyaml), so it runs in CI and in the operator's
container without torch or SGLang. Every subcommand computes its whole answer before printing,
so a failure never leaves half an output behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

import yaml

from sglang_m3.recipe import (
    CATALOG,
    TINY_MODEL_PATH,
    RecipeLoadError,
    crd_openapi_schema,
    estimate_fit,
    fit_applies,
    has_errors,
    load_recipe,
    recipe_json_schema,
    render_launch,
    validate_recipe,
)

RECIPE_SUFFIXES = (".yaml", ".yml")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "recipe",
        help="validate, size, render and describe deployment recipes",
        description="Work with M3Recipe files (recipes/*.yaml): the same YAML is the CLI's "
                    "input and a Kubernetes custom resource.",
    )
    commands = parser.add_subparsers(dest="recipe_command", metavar="SUBCOMMAND", required=True)

    validate = commands.add_parser(
        "validate", help="check recipes against the schema and the deployment rules",
        description="Check recipe files (folders are searched for *.yaml / *.yml). Prints every "
                    "error and warning with the field at fault and the fix. Exits 1 if any "
                    "file has an error; warnings do not fail.")
    validate.add_argument("paths", nargs="+", metavar="PATH", help="recipe file or folder")
    validate.add_argument("--output", choices=("text", "json"), default="text",
                          help="text for people, json for tools (default: text)")
    validate.set_defaults(handler=run_validate)

    fit = commands.add_parser(
        "fit", help="show the memory fit of a recipe as a table",
        description="Per-GPU memory budget: weights, KV bytes per token (main KV + index keys), "
                    "KV pool, runtime reserve, the largest context at the requested concurrency "
                    "and the largest concurrency at the requested context. Exits 1 when the "
                    "recipe cannot fit.")
    fit.add_argument("file", metavar="FILE", help="recipe file")
    fit.add_argument("--output", choices=("text", "json"), default="text",
                     help="text: the table and its findings; json: {fit, table, findings} "
                          "(default: text)")
    fit.set_defaults(handler=run_fit)

    render = commands.add_parser(
        "render", help="print the SGLang launch command a recipe stands for",
        description="Print the environment and `python -m sglang.launch_server` command of a "
                    "recipe. Refuses recipes with errors (see `recipe validate`).")
    render.add_argument("file", metavar="FILE", help="recipe file")
    render.add_argument("--output", choices=("shell", "json"), default="shell",
                        help="shell: one command line to paste; json: {argv, env}")
    render.add_argument("--node-rank", default="0",
                        help="node rank for multi-node recipes: 0 .. nodes-1, or a variable "
                             "reference such as $(LWS_WORKER_INDEX) left for Kubernetes to "
                             "expand (default 0, the leader)")
    render.add_argument("--dist-init-addr", default=None,
                        help="leader host:port for multi-node recipes (default: the "
                             "LeaderWorkerSet leader address, expanded by Kubernetes)")
    render.set_defaults(handler=run_render)

    schema = commands.add_parser(
        "schema", help="print the recipe JSON Schema or the Kubernetes CRD schema",
        description="Print the JSON Schema of recipe files, or with --crd the structural "
                    "openAPIV3Schema of the M3Recipe CRD (the operator adds names and status; "
                    "`sglang-m3 operator crd` prints the whole CRD). Both are generated from the "
                    "pydantic models the validator uses.")
    schema.add_argument("--crd", action="store_true", help="the CRD openAPIV3Schema")
    schema.add_argument("--format", choices=("json", "yaml"), default="json",
                        help="output format of the schema (default: json)")
    schema.set_defaults(handler=run_schema)

    catalog = commands.add_parser(
        "catalog", help="list the hardware profiles a recipe can name",
        description="The hardware catalog: memory, GPUs per node, architecture, weight "
                    "variants, attention backend and Kubernetes scheduling keys per profile.")
    catalog.add_argument("--output", choices=("text", "json"), default="text",
                         help="text: one row per profile; json: every field of every profile "
                              "(default: text)")
    catalog.set_defaults(handler=run_catalog)


# --- validate ---------------------------------------------------------------------------------

def recipe_files(paths: list[str]) -> list[Path]:
    """Files named directly, plus every recipe file below each folder, in a stable order."""
    files: list[Path] = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix in RECIPE_SUFFIXES)
        else:
            files.append(path)
    return files


def check_file(path: Path) -> dict:
    """Load and validate one file: {file, ok, problems, findings} (problems = load errors)."""
    try:
        recipe = load_recipe(path)
    except RecipeLoadError as error:
        problems = [{"field": p.field, "message": p.message} for p in error.problems]
        return {"file": str(path), "ok": False, "problems": problems, "findings": []}
    findings = validate_recipe(recipe)
    return {
        "file": str(path),
        "ok": not has_errors(findings),
        "problems": [],
        "findings": [finding.as_dict() for finding in findings],
    }


def run_validate(args: argparse.Namespace) -> int:
    files = recipe_files(args.paths)
    if not files:
        print(f"no recipe files (*.yaml, *.yml) under {' '.join(args.paths)}", file=sys.stderr)
        return 1
    results = [check_file(path) for path in files]
    if args.output == "json":
        print(json.dumps(results, indent=2))
    else:
        print(_validate_text(results))
    return 0 if all(result["ok"] for result in results) else 1


def _validate_text(results: list[dict]) -> str:
    lines = []
    for result in results:
        warnings = sum(f["severity"] == "warning" for f in result["findings"])
        status = "ok" if result["ok"] else "FAIL"
        suffix = f" ({warnings} warning{'s' * (warnings != 1)})" if warnings else ""
        lines.append(f"{status:4} {result['file']}{suffix}")
        for problem in result["problems"]:
            lines.append(f"     error: {problem['field']}: {problem['message']}")
        for finding in result["findings"]:
            lines.append(f"     {finding['severity']}: {finding['field']}: "
                         f"{finding['message']} [{finding['rule']}]")
    failed = sum(not result["ok"] for result in results)
    lines.append(f"{len(results)} recipe(s), {failed} with errors")
    return "\n".join(lines)


# --- fit ------------------------------------------------------------------------------------

def run_fit(args: argparse.Namespace) -> int:
    recipe = _load_or_report(args.file)
    if recipe is None:
        return 1
    if not fit_applies(recipe):
        print(f"{args.file}: the memory fit models M3's weights on GPUs; profile "
              f"{recipe.spec.hardware.profile} serves the tiny model (maxTotalTokens "
              f"{recipe.spec.serving.max_total_tokens})")
        return 0
    report = estimate_fit(recipe)
    findings = report.findings()
    if args.output == "json":
        numbers = {**dataclasses.asdict(report),
                   "static_budget_bytes": report.static_budget_bytes,
                   "reserve_budget_bytes": report.reserve_budget_bytes}
        print(json.dumps({"fit": numbers, "table": dict(report.rows()),
                          "findings": [f.as_dict() for f in findings]}, indent=2))
    else:
        print(_table(report.rows()))
        for finding in findings:
            print(finding)
    return 1 if has_errors(findings) else 0


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


# --- render ---------------------------------------------------------------------------------

def parse_node_rank(text: str, nodes: int) -> int | str:
    """The rank as a number in ``0 .. nodes - 1``, or unchanged when it is a variable reference
    (``$(LWS_WORKER_INDEX)``, ``$RANK``) that Kubernetes or the shell expands later. Anything else
    (``5`` for a 2-node recipe, ``-1``, ``abc``) used to go into the command as it was and only
    failed when SGLang's nodes could not rendezvous."""
    if "$" in text:
        return text
    try:
        rank = int(text)
    except ValueError:
        raise ValueError(f"takes a number or a variable reference such as "
                         f"$(LWS_WORKER_INDEX), got {text!r}") from None
    if not 0 <= rank < nodes:
        raise ValueError(f"{rank} is outside 0 .. {nodes - 1} (spec.hardware.nodes is {nodes})")
    return rank


def parse_dist_init_addr(text: str | None, nodes: int) -> str | None:
    """``host:port`` of the leader for a multi-node recipe (None: the LeaderWorkerSet leader's
    address), or a variable reference left for Kubernetes or the shell to expand. A single-node
    recipe has no leader to meet, and an address without a port reached SGLang, which cannot
    rendezvous on it."""
    if text is None:
        return None
    if nodes == 1:
        raise ValueError("applies to multi-node recipes only (spec.hardware.nodes is 1)")
    if "$" in text:
        return text
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"takes host:port (port 1 .. 65535) or a variable reference, got {text!r}")
    return text


def run_render(args: argparse.Namespace) -> int:
    recipe = _load_or_report(args.file)
    if recipe is None:
        return 1
    findings = validate_recipe(recipe)
    if has_errors(findings):
        print(f"{args.file}: not rendered, the recipe has errors:", file=sys.stderr)
        for finding in findings:
            print(f"  {finding}", file=sys.stderr)
        return 1
    nodes = recipe.spec.hardware.nodes
    for flag, parse, value in (("--node-rank", parse_node_rank, args.node_rank),
                               ("--dist-init-addr", parse_dist_init_addr, args.dist_init_addr)):
        try:
            parse(value, nodes)
        except ValueError as error:
            print(f"{args.file}: not rendered: {flag}: {error}", file=sys.stderr)
            return 1
    launch = render_launch(recipe, node_rank=parse_node_rank(args.node_rank, nodes), dist_init_addr=args.dist_init_addr)
    if args.output == "json":
        print(json.dumps({"argv": launch.argv, "env": launch.env}, indent=2))
    else:
        assignments = [f"{key}={shlex.quote(value)}" for key, value in launch.env.items()]
        print(" ".join(assignments + [shlex.join(launch.command())]))
    if recipe.spec.model.path == TINY_MODEL_PATH:
        print(f"note: --model-path {TINY_MODEL_PATH} is the embedded tiny model, which `sglang-m3 serve "
              f"{args.file}` builds and serves; to run this command yourself, put a directory made by "
              "`sglang-m3 tiny-checkpoint DIR` in its place", file=sys.stderr)
    return 0


# --- schema, catalog --------------------------------------------------------------------------

def run_schema(args: argparse.Namespace) -> int:
    if args.crd:
        document = crd_openapi_schema()
    else:
        document = recipe_json_schema()
    if args.format == "yaml":
        print(yaml.safe_dump(document, sort_keys=False), end="")
    else:
        print(json.dumps(document, indent=2))
    return 0


def run_catalog(args: argparse.Namespace) -> int:
    if args.output == "json":
        print(json.dumps({name: p.model_dump() for name, p in CATALOG.items()}, indent=2))
        return 0
    header = ("profile", "memory", "bandwidth", "per node", "arch", "variants", "attention", "node label")
    rows = [header] + [
        (p.name, f"{p.memory_gb:g} GB", f"{p.hbm_tbps:g} TB/s" if p.hbm_tbps else "-", str(p.gpus_per_node), p.architecture,
         ",".join(p.variants), p.attention_backend, "=".join(p.node_label))
        for p in CATALOG.values()
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


def _load_or_report(path: str):
    try:
        return load_recipe(path)
    except RecipeLoadError as error:
        print(str(error), file=sys.stderr)
        return None
