"""``sglang-m3 serve``: the embedded tiny M3 on CPU, a recipe, or any model passed through to SGLang."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from sglang_m3.commands.output_errors import describe_write_error
from sglang_m3.serve_support import (
    CPU_PLATFORM_ENV,
    TINY_CPU_ARGS,
    TINY_MODEL_PATH,
    ServeInputError,
    check_listen_address,
    check_model,
    ensure_tiny_checkpoint,
    launch_command,
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
            "platform, then print how to query it. With --model, pass everything through to SGLang.\n"
            "With a recipe file, serve what the recipe renders."
        ),
        epilog=(
            "SGLang options: every other option goes to SGLang unchanged, wherever it stands\n"
            "(python -m sglang.launch_server --help lists them), e.g. --tp-size 8. It follows the\n"
            "tiny model's CPU defaults (--dtype float32 --max-total-tokens 8192 ...) and a recipe's\n"
            "flags, so it overrides them. SGLang's --model-path is read as --model: give the model once.\n"
            "\n"
            "Checks: before SGLang starts, a local --model directory must hold a readable config.json\n"
            "(an M3 one is checked field by field) and the listen port must be free; --dry-run checks\n"
            "neither (its line may be meant for another machine)."
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
        else:
            own.extra_args.append(token)
            i += 1
    if own.port is not None:
        try:
            own.port = listen_port(own.port)
        except argparse.ArgumentTypeError as error:
            raise SystemExit(f"sglang-m3 serve: --port: {error}") from None
    return own


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


def _recipe_launch(path: str) -> tuple[list[str], dict[str, str]]:
    from sglang_m3.recipe import RecipeLoadError, has_errors, load_recipe, render_launch, validate_recipe

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
    launch = render_launch(recipe)
    argv = list(launch.argv)
    if TINY_MODEL_PATH in argv:
        argv[argv.index(TINY_MODEL_PATH)] = _tiny_checkpoint()
        argv += ["--dtype", "float32"]
    return argv, dict(launch.env)


def build_launch(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """(SGLang arguments, extra environment) for the parsed command line."""
    if args.recipe and args.model:
        raise SystemExit(f"sglang-m3 serve: give a recipe or {args.model_flag}, not both")
    if args.recipe:
        argv, env = _recipe_launch(args.recipe)
    elif args.model:
        argv, env = ["--model-path", args.model], {}
    else:
        # SGLang's own defaults (127.0.0.1:30000) apply unless --host / --port say otherwise.
        argv, env = ["--model-path", _tiny_checkpoint(), *TINY_CPU_ARGS], dict(CPU_PLATFORM_ENV)
    if args.host:
        argv += ["--host", args.host]
    if args.port:
        argv += ["--port", str(args.port)]
    return argv + list(args.extra_args), env


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


def _check_before_start(args: argparse.Namespace, argv: list[str], host: str, port: int) -> None:
    """Refuse, naming it, what SGLang would meet only well into its start: a bad local model
    directory or an address it cannot listen on. Not for ``--dry-run``: its line may be meant
    for another machine."""
    try:
        if args.model:
            note = check_model(args.model, _model_overrides(argv))
            if note:
                print(f"sglang-m3 serve: {note}", file=sys.stderr, flush=True)
        check_listen_address(host, port)
    except ServeInputError as error:
        raise SystemExit(f"sglang-m3 serve: {error}") from None


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
    command = launch_command(argv)
    if args.dry_run:
        print(" ".join(f"{k}={v}" for k, v in env.items()), *command)
        return 0
    host, port = _option(argv, "--host", "127.0.0.1"), int(_option(argv, "--port", "30000"))
    _check_before_start(args, argv, host, port)
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
