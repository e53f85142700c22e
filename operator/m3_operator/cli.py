"""Command line of the operator: ``run`` it, print its ``crd``, or ``render`` a recipe's objects.

Shared by ``python -m m3_operator`` and ``sglang-m3 operator``. Building the parser imports
nothing heavy; kopf and the Kubernetes client load only when a command runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def configure(parser: argparse.ArgumentParser) -> None:
    """Add the ``run`` / ``crd`` / ``render`` subcommands to ``parser``."""
    commands = parser.add_subparsers(dest="operator_command", metavar="COMMAND", required=True)

    run = commands.add_parser(
        "run", help="run the operator against the current cluster",
        description="Watch M3Recipe objects and reconcile their Deployments / "
                    "LeaderWorkerSets, Services and PodDisruptionBudgets. Uses in-cluster "
                    "credentials, else ~/.kube/config. Settings come from M3_OPERATOR_* "
                    "environment variables (see m3_operator.options.OperatorConfig).")
    run.add_argument("-n", "--namespace", action="append", default=[], dest="namespaces",
                     help="watch only this namespace (repeatable; default: all namespaces)")
    run.add_argument("--metrics-port", type=int, default=None,
                     help="serve Prometheus metrics on this port")
    run.add_argument("--health-port", type=int, default=None,
                     help="serve the liveness endpoint /healthz on this port")
    run.add_argument("--webhook-port", type=int, default=None,
                     help="serve the validating admission webhook on this port (HTTPS)")
    run.add_argument("--webhook-cert", type=Path, default=None,
                     help="TLS certificate (PEM) of the webhook server")
    run.add_argument("--webhook-key", type=Path, default=None,
                     help="TLS private key (PEM) of the webhook server")
    run.set_defaults(handler=_run)

    crd = commands.add_parser(
        "crd", help="print the M3Recipe CustomResourceDefinition",
        description="Print the CRD generated from the recipe models, or write it into the "
                    "CRD chart with --write.")
    crd.add_argument("--write", type=Path, metavar="REPO_ROOT", default=None,
                     help="write charts/m3-crds/templates/... under REPO_ROOT instead")
    crd.set_defaults(handler=_crd)

    render = commands.add_parser(
        "render", help="print the objects the operator would apply for a recipe file",
        description="Run the operator's desired-state function on a recipe file and print "
                    "the resulting objects as YAML. Exits 1, listing every problem, when the "
                    "recipe is invalid.")
    render.add_argument("recipe", type=Path, help="recipe YAML file")
    render.add_argument("--namespace", default="default",
                        help="namespace the objects are rendered for (default: default)")
    render.set_defaults(handler=_render)


def _run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from m3_operator import runner, webhook
    from m3_operator.options import OperatorConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = OperatorConfig.from_env()
    hook = None
    if args.webhook_port is not None:
        hook = webhook.installer(args.webhook_port, args.webhook_cert, args.webhook_key, config)
    liveness = f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None
    asyncio.run(runner.run(config, namespaces=args.namespaces, metrics_port=args.metrics_port,
                           liveness_endpoint=liveness, registry_hook=hook))
    return 0


def _crd(args: argparse.Namespace) -> int:
    from m3_operator import crd

    if args.write is not None:
        print(crd.write_manifest(args.write))
    else:
        sys.stdout.write(crd.crd_yaml())
    return 0


def _render(args: argparse.Namespace) -> int:
    import yaml

    from m3_operator.desired import desired_state
    from m3_operator.options import OperatorConfig
    from m3_operator.recipe_api import RecipeLoadError, read_recipe_document, read_recipe_file

    # Read as `sglang-m3 recipe` reads it: a repeated key, an unreadable value or a second
    # document is refused here too, instead of the last key silently winning.
    try:
        body = read_recipe_document(read_recipe_file(args.recipe), source=str(args.recipe))
    except RecipeLoadError as error:
        print(error, file=sys.stderr)
        return 1
    if not isinstance(body, dict):
        print(f"{args.recipe}: expected one M3Recipe mapping", file=sys.stderr)
        return 1
    metadata = body.setdefault("metadata", {})
    if isinstance(metadata, dict):  # anything else is refused below, naming metadata
        metadata["namespace"] = args.namespace
    plan = desired_state(body, OperatorConfig.from_env())
    for warning in plan.warnings:
        print(warning, file=sys.stderr)
    if not plan.valid:
        print(f"{args.recipe}: {len(plan.problems)} problem(s):", file=sys.stderr)
        for problem in plan.problems:
            print(f"  {problem}", file=sys.stderr)
        return 1
    sys.stdout.write(yaml.safe_dump_all(plan.objects, sort_keys=False))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m m3_operator",
        description="Kubernetes operator for M3Recipe custom resources.")
    configure(parser)
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)
