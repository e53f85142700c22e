"""``sglang-m3 serve``: the embedded tiny M3 on CPU, a recipe, or any model passed through to SGLang."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from sglang_m3.commands.output_errors import describe_write_error
from sglang_m3.commands.recipe_launch import KUBERNETES_REFERENCE, note_pod_references, recipe_launch
from sglang_m3.integration.hooks import M3_ARCHITECTURES, first_architecture
from sglang_m3.parsers.serving_hooks import PARSER_NAME
from sglang_m3.serve_support import (
    CPU_MAX_TOTAL_TOKENS,
    CPU_PLATFORM_ENV,
    KV_SIZE_OPTIONS,
    TINY_CPU_ARGS,
    TINY_MODEL_PATH,
    ServeInputError,
    check_listen_address,
    check_model,
    ensure_tiny_checkpoint,
    is_local_model,
    launch_command,
    m3_context_length,
    read_model_config,
    serves_on_cpu_platform,
    tiny_checkpoint_path,
)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve M3 with SGLang (default: the embedded tiny model on CPU)",
        usage="sglang-m3 serve [-h] [--model MODEL] [--host HOST] [--port PORT] [--dry-run] [recipe] [SGLang option ...]",
        # laid out by hand: argparse's wrapping breaks option names at their hyphens
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # split_command_line reads only whole option names (an abbreviation goes to SGLang)
        allow_abbrev=False,
        description=(
            "Start sglang.launch_server. With no model and no recipe, build (once, cached in\n"
            "$SGLANG_M3_CACHE or ~/.cache/sglang-m3) and serve the tiny random-weight M3 on the CPU\n"
            "platform, then print how to query it. With --model, serve that model with the SGLang\n"
            "options given (a local M3 checkpoint also gets M3's reasoning and tool-call parsers).\n"
            "With a recipe file, serve what the recipe renders."
        ),
        epilog=(
            "SGLang options: every other option goes to SGLang unchanged, wherever it stands\n"
            "(python -m sglang.launch_server --help lists them), e.g. --tp-size 8. It follows the\n"
            "tiny model's CPU defaults (--dtype float32 --max-total-tokens 8192 ...) and a recipe's\n"
            "flags, so it overrides them. SGLang's --model-path is read as --model: give the model once.\n"
            "A recipe file (kind M3Recipe) is the recipe wherever it stands; --dist-init-addr\n"
            "host:port and --node-rank N (checked as `recipe render` checks them) go into its\n"
            "multi-node launch.\n"
            "\n"
            "On the CPU platform (no GPU here, or SGLANG_PLATFORM=sglang_m3_cpu) --model gets\n"
            f"--max-total-tokens {CPU_MAX_TOTAL_TOKENS} unless --max-total-tokens or --mem-fraction-static is\n"
            "given: SGLang would size the KV cache to most of the machine's memory. A local M3\n"
            "checkpoint declaring a longer context (M3's is 1M) also gets --context-length 8192 unless\n"
            "one is given: no longer request fits, and SGLang's request-slot table for 1M took 8.6 GB.\n"
            "\n"
            "Checks: before SGLang starts, a local --model directory (or a recipe's spec.model.path)\n"
            "must hold a readable config.json (an M3 one is checked field by field) and the listen\n"
            "port must be free, and a recipe's Kubernetes references, $(NAME), are taken from the\n"
            "environment (one not set is refused: for $(LWS_LEADER_ADDRESS), the leader address of a\n"
            "multi-node recipe, give --dist-init-addr host:port). --dry-run checks neither, nor adds\n"
            "the CPU platform's bound (its line may be meant for another machine: it is quoted for a\n"
            "POSIX shell, and $(NAME) becomes \"${NAME}\", expanded where the line is pasted, as\n"
            "Kubernetes expands it in the pod)."
        ),
    )
    parser.add_argument("recipe", nargs="?", help="a recipe YAML file (see recipes/)")
    parser.add_argument("--model", help="model directory or hub id to serve instead of the tiny model")
    parser.add_argument("--host", default=None, help="listen address (default 127.0.0.1 for the tiny model)")
    parser.add_argument("--port", type=listen_port, default=None, help="listen port, 1-65535 (default 30000)")
    parser.add_argument("--dry-run", action="store_true", help="print the SGLang command line and exit")
    parser.set_defaults(handler=run, accepts_extra_args=True)


#: serve's own options -> their field; SGLang's ``--model-path`` (its other name for ``--model``)
#: is read as ``--model``, so that it names the model to serve instead of following the tiny
#: model's CPU settings, or a recipe's model, to be overridden by SGLang
_OWN_OPTIONS = {"--model": "model", "--model-path": "model", "--host": "host", "--port": "port"}


def split_command_line(argv: list[str]) -> argparse.Namespace:
    """Separate serve's own options from the SGLang flags that follow them, keeping their order.

    argparse cannot do this with a positional recipe: in ``serve --model M --tp-size 8`` it would
    take ``8`` (a value of an SGLang flag it does not know) for the recipe.
    """
    tokens = argv[argv.index("serve") + 1 :] if "serve" in argv else list(argv)
    own = argparse.Namespace(recipe=None, model=None, model_flag="--model", host=None, port=None, dry_run=False, extra_args=[])
    i = 0
    while i < len(tokens):
        token = tokens[i]
        flag, has_inline, inline = token.partition("=")
        if flag in _OWN_OPTIONS:
            value = inline if has_inline else (tokens[i + 1] if i + 1 < len(tokens) else None)
            if value is None:
                raise SystemExit(f"sglang-m3 serve: {flag} needs a value")
            if _OWN_OPTIONS[flag] == "model":
                _set_model(own, flag, value)
            else:
                setattr(own, _OWN_OPTIONS[flag], value)
            i += 1 if has_inline else 2
        elif token == "--dry-run":
            own.dry_run = True
            i += 1
        elif own.recipe is None and not own.extra_args and not token.startswith("-"):
            own.recipe = token
            i += 1
        elif _is_recipe_file(token):
            _set_recipe(own, token)
            i += 1
        else:
            own.extra_args.append(token)
            i += 1
    if own.port is not None:
        try:
            own.port = listen_port(own.port)
        except argparse.ArgumentTypeError as error:
            raise SystemExit(f"sglang-m3 serve: --port: {error}") from None
    return own


def _is_recipe_file(token: str) -> bool:
    """Whether ``token`` is a recipe file (a YAML file of kind M3Recipe). Given after an SGLang
    flag (``serve --enable-metrics recipe.yaml``) it used to go to SGLang as a stray argument
    while the tiny model was served; read by its kind, not its name, since SGLang's own
    ``--config`` takes a YAML file too."""
    if not token.endswith((".yaml", ".yml")) or not os.path.isfile(token):
        return False
    import yaml

    try:
        with open(token, encoding="utf-8") as handle:
            document = yaml.safe_load(handle)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False
    return isinstance(document, dict) and document.get("kind") == "M3Recipe"


def _set_recipe(own: argparse.Namespace, path: str) -> None:
    """Take a recipe found among the SGLang options, once."""
    if own.recipe is not None:
        raise SystemExit(f"sglang-m3 serve: two recipes ({own.recipe}, {path}): give one")
    own.recipe = path


def _set_model(own: argparse.Namespace, flag: str, value: str) -> None:
    """Take the model from ``flag``, once: of two, SGLang would silently serve the last."""
    if own.model is not None:
        raise SystemExit(f"sglang-m3 serve: the model is given twice ({own.model_flag} {own.model}, {flag} {value}): give it once")
    own.model, own.model_flag = value, flag


def listen_port(text: str) -> int:
    """A TCP port number, refused here rather than by the server minutes into its start-up."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is outside 1-65535")
    return port


def build_launch(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """(SGLang arguments, extra environment) for the parsed command line."""
    if args.recipe and args.model:
        raise SystemExit(f"sglang-m3 serve: give a recipe or {args.model_flag}, not both")
    extra_args = list(args.extra_args)
    if args.recipe:
        argv, env, extra_args = recipe_launch(args.recipe, extra_args, local=not args.dry_run)
        if TINY_MODEL_PATH in argv:
            argv[argv.index(TINY_MODEL_PATH)] = _tiny_checkpoint()
            argv += ["--dtype", "float32"]
    elif args.model:
        argv, env = ["--model-path", args.model, *_m3_parsers(args.model)], {}
    else:
        # SGLang's own defaults (127.0.0.1:30000) apply unless --host / --port say otherwise.
        argv, env = ["--model-path", _tiny_checkpoint(), *TINY_CPU_ARGS], dict(CPU_PLATFORM_ENV)
    if args.host:
        argv += ["--host", args.host]
    if args.port:
        argv += ["--port", str(args.port)]
    return argv + extra_args, env


#: What the tiny model and every recipe pass: M3's reasoning and tool-call parsers.
M3_PARSER_ARGS = ("--reasoning-parser", PARSER_NAME, "--tool-call-parser", PARSER_NAME)


def _m3_parsers(model: str) -> list[str]:
    """M3's parsers for a local M3 checkpoint: SGLang only suggests them in its log, so such a
    ``--model`` was served with reasoning left in ``content`` and tool calls as plain text (a
    ``tool_choice="required"`` fell to SGLang's JSON grammar, which M3 does not write). Put
    before the user's SGLang flags, so a ``--tool-call-parser`` given there overrides them. A
    config that cannot be read adds nothing: the checks before the start name it."""
    if not is_local_model(model):
        return []
    try:
        config = read_model_config(model)
    except ServeInputError:
        return []
    return list(M3_PARSER_ARGS) if first_architecture(config) in M3_ARCHITECTURES else []


def _tiny_checkpoint() -> str:
    """The cached tiny checkpoint, built on first use; a cache it cannot be built in (unwritable,
    or holding a directory of that name that is not the build) is named, with the way out."""
    try:
        return ensure_tiny_checkpoint()
    except OSError as error:
        problem = describe_write_error(tiny_checkpoint_path(), error)
        raise SystemExit(
            f"sglang-m3 serve: cannot build the tiny M3 checkpoint: {problem} (set SGLANG_M3_CACHE to another directory)"
        ) from None


def _option(argv: list[str], flag: str, default: str) -> str:
    """The value of the last ``flag`` in ``argv``, given as ``flag value`` or ``flag=value``
    (SGLang's argparse keeps the last one)."""
    for i in range(len(argv) - 1, -1, -1):
        name, has_inline, inline = argv[i].partition("=")
        if name == flag and has_inline:
            return inline
        if argv[i] == flag and i + 1 < len(argv):
            return argv[i + 1]
    return default


def _with_cpu_kv_bound(args: argparse.Namespace, argv: list[str]) -> list[str]:
    """``argv`` of ``--model`` with the CPU platform's KV bound before the user's SGLang options,
    said in the progress output, unless those options size the KV cache (in any spelling SGLang
    reads, or in its ``--config`` file, which they would override). SGLang sized it from its
    default ``--mem-fraction-static`` of the machine's whole memory; GPUs keep SGLang's sizing,
    and ``--dry-run`` (whose line may be meant for another machine) does not come here.

    A local M3 checkpoint declaring a longer context than the bound holds (M3's own: 1M) also
    gets ``--context-length`` of the bound, unless the user gives one: no longer request fits the
    pool, and SGLang's request-slot table holds a context's worth of slots for each of its 2,048
    requests (8 GB for 1M, written at start-up)."""
    if not args.model or _gives_option(args.extra_args, KV_SIZE_OPTIONS) or not serves_on_cpu_platform():
        return argv
    bound = ["--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS)]
    declared = m3_context_length(args.model, _model_overrides(argv))
    if declared and declared > CPU_MAX_TOTAL_TOKENS and not _gives_option(args.extra_args, ("--context-length",)):
        bound += ["--context-length", str(CPU_MAX_TOTAL_TOKENS)]
    print(
        f"sglang-m3 serve: on the CPU platform the KV cache is capped at {' '.join(bound)} "
        + (f"(the model declares {declared:,} tokens) " if len(bound) > 2 else "")
        + "(SGLang would size it to most of this machine's memory); give --max-total-tokens N or "
        "--mem-fraction-static F to size it yourself",
        file=sys.stderr, flush=True,
    )
    at = len(argv) - len(args.extra_args)
    return [*argv[:at], *bound, *argv[at:]]


def _gives_option(sglang_args: list[str], names: tuple[str, ...]) -> bool:
    """Whether the user's SGLang options give one of ``names``, in any spelling SGLang reads
    (abbreviated, with ``=``) or in its ``--config`` file."""
    from sglang_m3.recipe.sglang_options import is_option_token, resolve

    for token in sglang_args:
        if is_option_token(token) and len(matches := resolve(token).matches) == 1 and matches[0] in names:
            return True
    config = _option(sglang_args, "--config", "")
    return bool(config) and any(f"--{key}" in names for key in _config_keys(config))


def _config_keys(path: str) -> list[str]:
    """The option names of SGLang's ``--config`` YAML file, hyphenated (SGLang reads either); none
    when it cannot be read (SGLang names that file itself)."""
    import yaml

    try:
        with open(path, encoding="utf-8") as handle:
            document = yaml.safe_load(handle)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return []
    return [str(key).replace("_", "-") for key in document] if isinstance(document, dict) else []


def _check_before_start(args: argparse.Namespace, argv: list[str], host: str, port: int) -> None:
    """Refuse, naming it, what SGLang would meet only well into its start: a bad local model
    directory or an address it cannot listen on. Not for ``--dry-run``: its line may be meant
    for another machine."""
    try:
        if args.model:
            _check_model(args.model, argv)
        elif args.recipe:
            _check_recipe_model(args.recipe, _option(argv, "--model-path", ""), argv)
        check_listen_address(host, port)
    except ServeInputError as error:
        raise SystemExit(f"sglang-m3 serve: {error}") from None


def _check_model(model: str, argv: list[str]) -> None:
    """Refuse a local model SGLang could not start; say when it is not M3 (served all the same)."""
    note = check_model(model, _model_overrides(argv))
    if note:
        print(f"sglang-m3 serve: {note}", file=sys.stderr, flush=True)


def _check_recipe_model(recipe: str, model: str, argv: list[str]) -> None:
    """A recipe's local ``spec.model.path`` is checked as ``--model`` is (README: the model
    folder is checked before SGLang starts), with the recipe field named: a missing one reached
    SGLang, which took it for a hub id and failed with a traceback."""
    if not is_local_model(model):
        return
    field = f"{recipe}: spec.model.path {model}"
    if not os.path.exists(model):
        raise ServeInputError(f"{field}: no such directory")
    if not os.path.isdir(model):
        raise ServeInputError(f"{field}: not a directory (a model is a directory with config.json)")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ServeInputError(f"{field}: no config.json there (not a model directory)")
    _check_model(model, argv)


def _model_overrides(argv: list[str]) -> dict:
    """SGLang's ``--json-model-override-args``, which the server applies to config.json."""
    text = _option(argv, "--json-model-override-args", "{}")
    try:
        overrides = json.loads(text)
    except json.JSONDecodeError as error:
        raise ServeInputError(f"--json-model-override-args: not valid JSON ({error})") from None
    if not isinstance(overrides, dict):
        raise ServeInputError(f"--json-model-override-args: must be a JSON object, got {text}")
    return overrides


def shell_word(text: str) -> str:
    """``text`` quoted for a POSIX shell, its Kubernetes references turned into the shell's
    ``"${NAME}"``: pasted in the pod, the line expands them as Kubernetes would, where quoted
    as they stand they would reach SGLang literally, and unquoted the shell would run
    ``LWS_LEADER_ADDRESS`` as a command."""
    parts = KUBERNETES_REFERENCE.split(text)  # literal, name, literal, name, ..., literal
    words = [f'"${{{part}}}"' if index % 2 else shlex.quote(part) for index, part in enumerate(parts) if part]
    return "".join(words) or "''"


def shell_line(env: dict[str, str], command: list[str]) -> str:
    """The command line ``--dry-run`` prints, to paste into a POSIX shell: the recipe's JSON
    arguments (``--default-chat-template-kwargs {"thinking_mode": ...}``) used to be split by
    the shell at their spaces and quotes."""
    return " ".join([f"{name}={shell_word(value)}" for name, value in env.items()] + [shell_word(word) for word in command])


def _wait_until_ready(base_url: str, process: subprocess.Popen, timeout_s: float = 900) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"{base_url}/model_info", timeout=5) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    return False


def _print_usage(base_url: str, model: str) -> None:
    print(
        f"""
sglang-m3: M3 is being served at {base_url}
  curl {base_url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 32}}'
  python -c "import openai; c = openai.OpenAI(base_url='{base_url}/v1', api_key='none'); \\
print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hello'}}], max_tokens=32))"
Press Ctrl+C to stop.""",
        flush=True,
    )


def _forward_stop_signals(process: subprocess.Popen) -> None:
    """SIGTERM and SIGHUP sent to this command reach the server too. Without this, ``kill``,
    ``timeout`` or a service manager stopping the command ends it alone and leaves the server
    running, still holding its port (and as a container's PID 1 the command would ignore SIGTERM).
    The command then waits for the server to shut down and exits with its status."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda received, frame: process.send_signal(received))


def run(args: argparse.Namespace) -> int:
    args = split_command_line(args.argv)
    argv, env = build_launch(args)
    if args.dry_run:
        note_pod_references(argv, env)
        print(shell_line(env, launch_command(argv)))
        return 0
    host, port = _option(argv, "--host", "127.0.0.1"), int(_option(argv, "--port", "30000"))
    _check_before_start(args, argv, host, port)
    command = launch_command(_with_cpu_kv_bound(args, argv))
    if args.recipe and args.host is None and host == "0.0.0.0":
        print(f"sglang-m3 serve: {args.recipe}: spec.serving.host 0.0.0.0 (what a pod needs) opens the server to every "
              "network this machine is on; give --host 127.0.0.1 to keep it to this machine", file=sys.stderr, flush=True)
    base_url = f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"
    print("starting:", " ".join(command), flush=True)
    # Its own process group: a terminal's Ctrl+C reaches this command alone, which stops the server
    # by SIGTERM (see _stop_on_interrupt) instead of every SGLang process printing a traceback.
    process = subprocess.Popen(command, env={**os.environ, **env}, process_group=0)
    _forward_stop_signals(process)
    try:
        if _wait_until_ready(base_url, process):
            _print_usage(base_url, _option(argv, "--served-model-name", _option(argv, "--model-path", "")))
        return process.wait()
    except KeyboardInterrupt:
        return _stop_on_interrupt(process)


#: Seconds a Ctrl+C waits for SGLang's own shutdown before it kills the server.
STOP_GRACE_S = 30


def _stop_on_interrupt(process: subprocess.Popen) -> int:
    """Ctrl+C: a clean shutdown by SIGTERM (SGLang drains and stops its scheduler and detokenizer);
    a second Ctrl+C, or a shutdown past ``STOP_GRACE_S`` (on a loaded 2-core CI runner one took
    over two minutes), kills the server's whole process group. Exits 130, the shell's status for
    an interrupted command, so that a script can tell a stop by Ctrl+C from the server's own exit."""
    print("\nsglang-m3: stopping the server (Ctrl+C again to kill it)", file=sys.stderr, flush=True)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        print(f"sglang-m3: the server did not stop within {STOP_GRACE_S} s; killing it", file=sys.stderr, flush=True)
        _kill_server(process)
    except KeyboardInterrupt:
        _kill_server(process)
    return 130


def _kill_server(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
