"""Command line of the operator: ``run`` it, print its ``crd``, or ``render`` a recipe's objects.

Shared by ``python -m m3_operator`` and ``sglang-m3 operator``. Building the parser imports
nothing heavy; kopf and the Kubernetes client load only when a command runs.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

#: A namespace name: an RFC 1123 label (``metadata.namespace`` of every object the operator writes).
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def namespace_name(text: str) -> str:
    """A namespace the API server accepts. ``render --namespace Bad_NS!`` put that name in every
    object it printed, none of which could then be applied, and ``run -n`` would watch a
    namespace that cannot exist."""
    if not _DNS_LABEL.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a namespace name: 1 to 63 lowercase letters, digits and '-', "
            "starting and ending with a letter or digit (RFC 1123 label)")
    return text


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
                     type=namespace_name,
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
    render.add_argument("--namespace", type=namespace_name, default="default",
                        help="namespace the objects are rendered for (default: default)")
    render.set_defaults(handler=_render)


def _run(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    from m3_operator import runner, webhook
    from m3_operator.options import OperatorConfig

    problem = _credentials_problem()
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = OperatorConfig.from_env()
    hook = None
    if args.webhook_port is not None:
        hook = webhook.installer(args.webhook_port, args.webhook_cert, args.webhook_key, config)
    liveness = f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None
    asyncio.run(runner.run(config, namespaces=args.namespaces, metrics_port=args.metrics_port,
                           liveness_endpoint=liveness, registry_hook=hook))
    return 0


def _credentials_problem() -> str | None:
    """Why the operator has no cluster to talk to, in one line, or None. The credentials are
    loaded as the operator loads them, before kopf starts: without any (the most common first
    run) the client raised ConfigException, or a YAMLError for a malformed kubeconfig, with a
    traceback from inside the event loop."""
    import yaml
    from kubernetes.config import KUBE_CONFIG_DEFAULT_LOCATION, ConfigException

    from m3_operator.kube import api_client_for

    try:
        api_client_for().close()
    except (ConfigException, yaml.YAMLError, OSError) as error:
        reason = " ".join(str(error).split())  # a YAML error spans lines
        return (f"no cluster credentials: not running inside a cluster, and the kubeconfig "
                f"{KUBE_CONFIG_DEFAULT_LOCATION} (KUBECONFIG, else ~/.kube/config) gives none: {reason}")
    return None


def _crd(args: argparse.Namespace) -> int:
    from m3_operator import crd

    if args.write is None:
        sys.stdout.write(crd.crd_yaml())
        return 0
    problem = _repo_root_problem(args.write, crd.MANIFEST_PATH.parents[1])
    if problem is not None:
        print(f"--write {args.write}: {problem}", file=sys.stderr)
        return 1
    try:
        print(crd.write_manifest(args.write))
    except OSError as error:  # no permission, a directory where the manifest goes
        print(f"--write {args.write}: cannot write {error.filename}: {error.strerror}",
              file=sys.stderr)
        return 1
    return 0


def _repo_root_problem(root: Path, chart: Path) -> str | None:
    """Why ``root`` is not a checkout whose CRD chart the manifest belongs in, or None. A plain
    file met a NotADirectoryError traceback, and any other path got a
    ``charts/m3-crds/templates`` tree created under it."""
    if not root.exists():
        return "no such directory"
    if not root.is_dir():
        return "not a directory"
    if not (root / chart).is_dir():
        return f"no {chart} there (REPO_ROOT is the top folder of the sglang-m3 repository)"
    return None


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
