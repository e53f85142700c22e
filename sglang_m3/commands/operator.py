"""``sglang-m3 operator``: run the Kubernetes operator, print its CRD, render a recipe's objects.

The subcommands live in ``m3_operator.cli`` (also reachable as ``python -m m3_operator``);
this module only mounts them under the project's command. kopf and the Kubernetes client load
when a subcommand runs, not when the parser is built.
"""

from __future__ import annotations


def register(subparsers) -> None:
    from m3_operator.cli import configure

    parser = subparsers.add_parser(
        "operator",
        help="Kubernetes operator for M3Recipe objects (run, crd, render)",
        description="Kubernetes operator for M3Recipe custom resources: `run` it against a "
                    "cluster, print its `crd`, or `render` the objects it would create for a "
                    "recipe file.",
    )
    configure(parser)
