"""What ``sglang-m3 serve RECIPE`` launches: a recipe's rendering, made to run on this machine.

A recipe renders the launch its pod runs, and some of its values only the pod has: Kubernetes
expands ``$(NAME)`` references from the container's environment (a multi-node recipe's leader
address is ``$(LWS_LEADER_ADDRESS):20000``). Served here, each reference is taken from this
environment or refused naming the recipe field that holds it, since SGLang would receive it
literally and a multi-node start would never rendezvous. ``--dist-init-addr`` and ``--node-rank``
given to ``serve`` go into the recipe's rendering (checked as ``recipe render`` checks them)
instead of following it beside the recipe's own. ``--dry-run`` keeps the references for the
shell the line is pasted into, and says which ones only the pod sets.
"""

from __future__ import annotations

import os
import re
import sys

#: A Kubernetes variable reference, ``$(NAME)``, as a multi-node recipe's ``--dist-init-addr``
#: holds it (``$(LWS_LEADER_ADDRESS):20000``); the pod expands it from its environment.
KUBERNETES_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def recipe_launch(path: str, sglang_args: list[str], local: bool) -> tuple[list[str], dict[str, str], list[str]]:
    """(SGLang arguments, extra environment, the user's SGLang options left to follow them) of
    recipe ``path``. Its multi-node launch takes ``--node-rank`` and ``--dist-init-addr`` from
    ``sglang_args``. ``local``: the launch is for this machine (not ``--dry-run``), so the
    values Kubernetes sets in the recipe's pod are taken from the environment, or refused."""
    from sglang_m3.commands.recipe import parse_dist_init_addr, parse_node_rank
    from sglang_m3.recipe import RecipeLoadError, has_errors, load_recipe, render_launch, validate_recipe
    from sglang_m3.recipe.render import LEADER_DIST_INIT_ADDR

    if os.path.isdir(path):  # most likely a model directory given without --model
        raise SystemExit(f"sglang-m3 serve: {path} is a directory, not a recipe file: to serve the model in it, give --model {path}")
    try:
        recipe = load_recipe(path)
    except RecipeLoadError as error:  # the file and the field at fault, without a traceback
        raise SystemExit(f"sglang-m3 serve: {error}") from None
    findings = validate_recipe(recipe)
    for finding in findings:
        print(f"{path}: {finding}", file=sys.stderr)
    if has_errors(findings):
        raise SystemExit(1)
    rest, node_rank, leader = _take_node_options(sglang_args)
    nodes = recipe.spec.hardware.nodes
    leader_flag = "--dist-init-addr"
    if local:
        node_rank = _local_value(path, "--node-rank", node_rank)
        if leader is not None:
            leader = _local_value(path, "--dist-init-addr", leader)
        elif nodes > 1:
            leader, leader_flag = _leader_from_environment(path, nodes), f"--dist-init-addr (from {LEADER_DIST_INIT_ADDR})"
    for flag, parse, value in (("--node-rank", parse_node_rank, node_rank), (leader_flag, parse_dist_init_addr, leader)):
        try:  # as `recipe render` checks them: a bad one reached SGLang, whose nodes never met
            parse(value, nodes)
        except ValueError as error:
            raise SystemExit(f"sglang-m3 serve: {path}: {flag}: {error}") from None
    launch = render_launch(recipe, node_rank=parse_node_rank(node_rank, nodes), dist_init_addr=leader)
    argv, env = list(launch.argv), dict(launch.env)
    if local:
        argv, env = _local_references(path, recipe, argv, env)
    return argv, env, rest


#: SGLang's names of a multi-node launch's leader address (``--nccl-init-addr`` is its alias) and
#: node rank, which a recipe renders itself: given to ``serve RECIPE`` they go into that rendering.
_LEADER_OPTIONS = frozenset({"--dist-init-addr", "--nccl-init-addr"})
_RANK_OPTIONS = frozenset({"--node-rank"})


def _take_node_options(sglang_args: list[str]) -> tuple[list[str], str, str | None]:
    """(the other options, node rank, leader address) of ``sglang_args``, the options named in
    any spelling SGLang reads as them (``--dist-init-addr=H:P``, ``--nccl-init-addr``, a prefix);
    the last of each counts, as in SGLang. Appended after the recipe's own, a leader address left
    the recipe's ``$(LWS_LEADER_ADDRESS)`` in the command line beside it."""
    from sglang_m3.recipe.sglang_options import is_option_token, resolve

    rest: list[str] = []
    node_rank, leader = "0", None
    i = 0
    while i < len(sglang_args):
        token = sglang_args[i]
        matches = set(resolve(token).matches) if is_option_token(token) else set()
        _, has_inline, inline = token.partition("=")
        if matches and (matches <= _LEADER_OPTIONS or matches <= _RANK_OPTIONS) and (has_inline or i + 1 < len(sglang_args)):
            value = inline if has_inline else sglang_args[i + 1]
            if matches <= _LEADER_OPTIONS:
                leader = value
            else:
                node_rank = value
            i += 1 if has_inline else 2
            continue
        rest.append(token)
        i += 1
    return rest, node_rank, leader


def _expand_references(text: str, environ) -> tuple[str, list[str]]:
    """``text`` with its Kubernetes references, ``$(NAME)``, replaced from ``environ`` (as the pod
    replaces them from its own), and the names ``environ`` lacks, left in place."""
    missing: list[str] = []

    def value(match: re.Match) -> str:
        name = match.group(1)
        if name in environ:
            return environ[name]
        missing.append(name)
        return match.group(0)

    return KUBERNETES_REFERENCE.sub(value, text), missing


def _pod_only(path: str, where: str, name: str, instead: str = "") -> SystemExit:
    """The refusal of a reference ``$(name)`` the environment here lacks, at ``where``."""
    return SystemExit(
        f"sglang-m3 serve: {path}: {where}: {name} is not set here (Kubernetes expands $({name}) in the "
        f"recipe's pod): set it{instead}"
    )


def _local_value(path: str, flag: str, text: str) -> str:
    """A ``--node-rank`` / ``--dist-init-addr`` given to ``serve RECIPE``, its references taken
    from the environment."""
    expanded, missing = _expand_references(text, os.environ)
    if missing:
        instead = " or give --node-rank N" if flag == "--node-rank" else " or give --dist-init-addr host:port"
        raise _pod_only(path, f"{flag} {text}", missing[0], instead)
    return expanded


def _leader_from_environment(path: str, nodes: int) -> str:
    """The leader address of a multi-node recipe served here with none given: the recipe's
    LeaderWorkerSet one, ``$(LWS_LEADER_ADDRESS):20000``, whose variable only the pod has. SGLang
    took it literally and could not rendezvous."""
    from sglang_m3.recipe.render import LEADER_DIST_INIT_ADDR

    address, missing = _expand_references(LEADER_DIST_INIT_ADDR, os.environ)
    if missing:
        raise SystemExit(
            f"sglang-m3 serve: {path}: spec.hardware.nodes is {nodes}: its leader address {LEADER_DIST_INIT_ADDR} "
            f"is set by Kubernetes in a LeaderWorkerSet pod, and {missing[0]} is not set here: give "
            "--dist-init-addr host:port (the address of node rank 0; each other node also --node-rank N)"
        )
    return address


def _local_references(path: str, recipe, argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """``argv`` and ``env`` with the recipe's other Kubernetes references (in ``spec.env``,
    ``serving.extraArgs``, a model path) taken from the environment, as the pod takes them from
    its own (container arguments may name its ``env`` too); one this environment lacks is refused
    with its field: SGLang would get it literally."""
    from sglang_m3.recipe.render import TYPED_FLAGS

    environ = dict(os.environ)
    local_env: dict[str, str] = {}
    for name, value in env.items():
        local_env[name], missing = _expand_references(value, environ)
        if missing:
            raise _pod_only(path, f"spec.env.{name} {value}", missing[0])
        environ[name] = local_env[name]
    local_argv: list[str] = []
    for i, word in enumerate(argv):
        expanded, missing = _expand_references(word, environ)
        if missing:
            if word in recipe.spec.serving.extra_args:
                field = "spec.serving.extraArgs"
            else:
                flag = word.partition("=")[0] if word.startswith("--") else (argv[i - 1] if i else "")
                field = TYPED_FLAGS.get(flag, "spec")
            raise _pod_only(path, f"{field} {word}", missing[0])
        local_argv.append(expanded)
    return local_argv, local_env


def note_pod_references(argv: list[str], env: dict[str, str]) -> None:
    """``--dry-run``: say which variables of the line only the recipe's pod sets, and what to give
    instead elsewhere (the line keeps them, written for a shell to expand)."""
    names: dict[str, bool] = {}  # name -> whether the leader address holds it
    words = [(value, None) for value in env.values()] + [(word, argv[i - 1] if i else None) for i, word in enumerate(argv)]
    for word, before in words:
        in_leader = before in _LEADER_OPTIONS or word.partition("=")[0] in _LEADER_OPTIONS
        for name in KUBERNETES_REFERENCE.findall(word):
            names[name] = names.get(name, False) or in_leader
    for name, leader in names.items():
        instead = ", or give serve --dist-init-addr host:port (the address of node rank 0)" if leader else ""
        print(
            f"sglang-m3 serve: note: $({name}) is set by Kubernetes in the recipe's pod; the line writes it "
            f"\"${{{name}}}\" for the shell to expand: elsewhere, set {name} first{instead}",
            file=sys.stderr,
        )
