"""What ``sglang-m3 serve`` needs besides SGLang: the cached tiny checkpoint and the launch line.

Kept apart from the command so tests can build the same launch lines the command runs.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys

from sglang_m3.integration.hooks import M3_ARCHITECTURES, first_architecture
from sglang_m3.recipe.model_geometry import TINY_MODEL_PATH

#: The KV cache (in tokens) of a model served on the CPU platform when its command does not size
#: one: the platform reports the machine's RAM as device memory, and SGLang's default
#: ``--mem-fraction-static`` then took most of it (about 15 GB for a tiny model on a 23 GB
#: machine). The tiny model's bound.
CPU_MAX_TOTAL_TOKENS = 8192
#: SGLang's options that size the KV cache: a user who gives either sizes it.
KV_SIZE_OPTIONS = ("--max-total-tokens", "--mem-fraction-static")

# CPU serving defaults for the tiny model: small KV budget, float32 for exact comparisons.
TINY_CPU_ARGS = (
    "--dtype", "float32", "--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS), "--context-length", "4096",
    "--mem-fraction-static", "0.5", "--sleep-on-idle",
    "--reasoning-parser", "minimax-m3", "--tool-call-parser", "minimax-m3",
)
# The tiny model is the only one served: SGLang then skips importing its ~200 model modules
# (tens of seconds per process on a small machine).
CPU_PLATFORM_ENV = {"SGLANG_PLATFORM": "sglang_m3_cpu", "SGLANG_EXTERNAL_MODEL_PACKAGE": "sglang_m3.models"}


def serves_on_cpu_platform() -> bool:
    """Whether a server started from here runs on sglang-m3's CPU platform: named by
    ``SGLANG_PLATFORM``, or (none named) activated by the platform itself, which it is where torch
    sees no accelerator. Imports torch (seconds), so asked only on the way to a real start."""
    from sglang_m3.platform import PLATFORM_NAME, activate

    named = os.environ.get("SGLANG_PLATFORM")
    if named:
        return named == PLATFORM_NAME
    return activate() is not None


def cache_dir() -> str:
    base = os.environ.get("SGLANG_M3_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "sglang-m3")
    return base


def tiny_checkpoint_path(seed: int = 0) -> str:
    """Where the cached tiny checkpoint of ``seed`` lives (built or not)."""
    from sglang_m3.tiny.checkpoint import BUILD_FORMAT

    return os.path.join(cache_dir(), f"tiny-m3-v{BUILD_FORMAT}-seed{seed}")


def ensure_tiny_checkpoint(seed: int = 0, log=print) -> str:
    """Build the tiny checkpoint once per seed and builder format, and reuse it afterwards.

    Two first runs at once both build it; the one that renames its build into place second finds
    the directory taken (an OSError) and uses the other's finished build.
    """
    from sglang_m3.tiny.checkpoint import build_tiny_checkpoint

    path = tiny_checkpoint_path(seed)
    config = os.path.join(path, "config.json")
    if os.path.isfile(config):
        return path
    log(f"building the tiny M3 checkpoint in {path} (once; a few seconds) ...")
    try:
        build_tiny_checkpoint(path, seed=seed)
    except OSError:
        if not os.path.isfile(config):
            raise
    return path


class ServeInputError(ValueError):
    """An input ``sglang-m3 serve`` refuses before SGLang starts; the message names it."""


def is_local_model(model: str) -> bool:
    """Whether ``--model`` names a local directory rather than a hub id (``org/name``, which
    SGLang downloads) or a URL: it exists, is absolute or relative with a leading ``.``, or has
    more parts than a hub id."""
    if "://" in model:
        return False
    return os.path.exists(model) or model.startswith(("/", ".")) or model.count("/") > 1


def read_model_config(model: str) -> dict:
    """The config.json of local model directory ``model``. SGLang meets a missing directory, a
    missing or broken config.json half a minute into its start, with a traceback that names
    neither the option nor the file."""
    if not os.path.exists(model):
        raise ServeInputError(f"--model {model}: no such directory")
    if not os.path.isdir(model):
        raise ServeInputError(
            f"--model {model}: not a directory (a model is a directory with config.json; give a recipe file without --model)"
        )
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise ServeInputError(f"--model {model}: no config.json there (not a model directory)")
    try:
        with open(path, encoding="utf-8") as handle:
            config = json.load(handle)
    except json.JSONDecodeError as error:
        raise ServeInputError(f"{path}: not valid JSON ({error})") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ServeInputError(f"{path}: cannot read ({error})") from None
    if not isinstance(config, dict):
        raise ServeInputError(f"{path}: not a JSON object")
    return config


def check_model(model: str, overrides: dict) -> str | None:
    """Refuse a local ``--model`` SGLang could not start (``ServeInputError``); return a note for
    a checkpoint other than M3, which SGLang serves without the plugin's M3 support (README:
    ``--model`` takes any checkpoint). An M3 config is read as the server will read it, with
    ``overrides`` (``--json-model-override-args``) applied, so a bad field is named now; an M3
    ``model_type`` under an architecture the plugin does not serve would otherwise fall back to
    some other implementation."""
    from sglang_m3.config import M3ConfigError, M3TextSpec

    if not is_local_model(model):
        return None
    config = read_model_config(model)
    path = os.path.join(model, "config.json")
    architecture = first_architecture(config)
    if architecture in M3_ARCHITECTURES:
        try:
            M3TextSpec.from_config(None, model, overrides=overrides)
        except M3ConfigError as error:
            raise ServeInputError(f"{path}: {error}") from None
        return None
    if str(config.get("model_type", "")).startswith("minimax_m3"):
        raise ServeInputError(
            f"{path}: architecture {architecture!r} is not one sglang-m3 serves (architectures[0] must be "
            f"{' or '.join(M3_ARCHITECTURES)})"
        )
    return f"{path} names {architecture or config.get('model_type')}, not MiniMax M3: SGLang serves it without sglang-m3's M3 support"


def m3_context_length(model: str, overrides: dict) -> int | None:
    """The context length a local M3 checkpoint declares (its text config's
    ``max_position_embeddings``, ``overrides`` applied), which SGLang takes as the server's; None
    for a hub id, another model, or a config the checks before the start refuse."""
    from sglang_m3.config import M3ConfigError, M3TextSpec

    if not is_local_model(model):
        return None
    try:
        if first_architecture(read_model_config(model)) not in M3_ARCHITECTURES:
            return None
        return M3TextSpec.from_config(None, model, overrides=overrides).max_position_embeddings
    except (ServeInputError, M3ConfigError):
        return None


def check_listen_address(host: str, port: int) -> None:
    """Refuse an address the server could not listen on. SGLang binds its HTTP port only after
    loading the model; on a port in use it then logs the bind error and hangs in its warm-up,
    and a second ``serve`` on a first one's port would take the first server's answers for its
    own. Bound as uvicorn binds it (``SO_REUSEADDR``), so a port in TIME_WAIT passes."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as error:
        raise ServeInputError(f"--host {host}: cannot resolve it ({error.strerror})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise ServeInputError(f"port {port} on {host} is in use (another server?): choose another with --port") from None
            raise ServeInputError(f"cannot listen on {host}:{port}: {error.strerror}") from None


def launch_command(sglang_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "sglang.launch_server", *sglang_args]
