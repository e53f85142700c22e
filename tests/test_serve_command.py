"""``sglang-m3 serve`` as a user runs it: start, the printed query instructions, an OpenAI call."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import psutil
import pytest
from server_harness import IMPORTING_TIMEOUT_S, free_port

from sglang_m3.commands.serve import STOP_GRACE_S
from sglang_m3.tiny.checkpoint import BUILD_FORMAT

pytestmark = pytest.mark.server
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_serve(args, cache_dir, timeout_s=IMPORTING_TIMEOUT_S):
    """Start ``sglang-m3 serve ARGS``; return (process, base_url) once it printed its usage."""
    env = {**os.environ, "SGLANG_M3_CACHE": cache_dir, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "sglang_m3.cli", "serve", *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO, start_new_session=True,
    )
    lines: list[str] = []
    found = threading.Event()
    url: list[str] = []

    def read():
        for line in process.stdout:
            lines.append(line)
            match = re.search(r"M3 is being served at (http://\S+)", line)
            if match:
                url.append(match.group(1))
                found.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.time() + timeout_s
    while not found.is_set() and time.time() < deadline and process.poll() is None:
        time.sleep(1)
    if not found.is_set():
        stop(process)
        pytest.fail("serve did not print its usage:\n" + "".join(lines[-60:]))
    return process, url[0], lines


def stop(process):
    """Stop the command, then kill whatever is left of it: its session, and the server's own
    process group (the command starts the server in one, out of a terminal's Ctrl+C)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        descendants = psutil.Process(process.pid).children(recursive=True)
    try:
        os.killpg(process.pid, signal.SIGINT)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    for leftover in descendants:
        with contextlib.suppress(psutil.NoSuchProcess):
            leftover.kill()


def chat(base_url, model):
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none")
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0)
    return reply


def test_default_serve_builds_and_serves_the_tiny_model(tmp_path):
    port = free_port()
    process, base_url, lines = run_serve(["--port", str(port)], str(tmp_path))
    try:
        assert base_url == f"http://127.0.0.1:{port}"
        assert any("curl" in line and "/v1/chat/completions" in line for line in lines), "prints how to query it"
        model_dir = os.path.join(str(tmp_path), f"tiny-m3-v{BUILD_FORMAT}-seed0")
        assert os.path.isfile(os.path.join(model_dir, "model.safetensors"))
        reply = chat(base_url, model_dir)
        assert reply.usage.completion_tokens >= 1
        # SIGTERM to the command alone (how `kill`, `timeout` or a service manager stop it) takes
        # the server down too, instead of leaving it running on the port
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
        assert not server_answers(base_url, within_s=30)
    finally:
        stop(process)


def test_ctrl_c_stops_the_server_cleanly(tmp_path):
    """Ctrl+C in a terminal signals the whole foreground process group. The server sits in a group
    of its own, so only the command sees it and stops the server by SIGTERM (killing it after
    ``STOP_GRACE_S``): no SGLang process prints a traceback, none is left, and the command exits
    130 (interrupted)."""
    process, base_url, lines = run_serve(["--port", str(free_port())], str(tmp_path))
    try:
        descendants = psutil.Process(process.pid).children(recursive=True)
        assert descendants, "the server runs as the command's child"
        # SGLang answers /model_info before its own warm-up request ends; stopped during that
        # request, it logs the request's connection error with a traceback (SGLang's, not ours)
        deadline = time.time() + 120
        while not any("ready to roll" in line for line in lines) and time.time() < deadline:
            time.sleep(1)
        os.killpg(process.pid, signal.SIGINT)  # what the terminal does
        assert process.wait(timeout=STOP_GRACE_S + 60) == 130
        assert not server_answers(base_url, within_s=30)
        assert not [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        output = "".join(lines)
        assert "stopping the server" in output
        assert "Traceback" not in output
    finally:
        stop(process)


def test_a_million_token_m3_on_the_cpu_platform_serves_in_bounded_memory(tmp_path, tiny_m3_checkpoint, monkeypatch):
    """A local checkpoint declaring M3's 1M context: before the context was capped with the KV
    cache, SGLang wrote a 2,049 x 1M request-slot table at start-up (the scheduler at 9.2 GB RSS
    on a 23 GB machine). Now the server runs with the 8,192-token bound, answers a chat, and
    refuses a longer prompt up front with a 400 naming the context length."""
    model = tmp_path / "m3-1m"
    shutil.copytree(tiny_m3_checkpoint, model)
    config = json.loads((model / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 1_048_576
    (model / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("SGLANG_PLATFORM", "sglang_m3_cpu")
    process, base_url, lines = run_serve(["--model", str(model), "--port", str(free_port())], str(tmp_path))
    try:
        assert any("--context-length 8192 (the model declares 1,048,576 tokens)" in line for line in lines)
        with urllib.request.urlopen(f"{base_url}/server_info", timeout=30) as response:
            info = json.load(response)
        assert info["context_length"] == 8192 and info["max_total_num_tokens"] == 8192
        rss_gb = sum(p.memory_info().rss for p in psutil.Process(process.pid).children(recursive=True)) / 1e9
        assert rss_gb < 5, f"the server's processes hold {rss_gb:.1f} GB"
        assert chat(base_url, str(model)).usage.completion_tokens >= 1
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none")
        with pytest.raises(openai.BadRequestError, match="context length"):
            client.completions.create(model=str(model), prompt=[7] * 9000, max_tokens=4)
    finally:
        stop(process)


def server_answers(base_url: str, within_s: float) -> bool:
    """Whether the server still answers at any point ``within_s`` from now (it may take a moment
    to close its socket after its processes begin to exit)."""
    deadline = time.time() + within_s
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"{base_url}/model_info", timeout=5):
                pass
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False
        time.sleep(1)
    return True


def test_dry_run_prints_the_launch_line(tmp_path):
    env = {**os.environ, "SGLANG_M3_CACHE": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "sglang_m3.cli", "serve", "--model", "/models/m3", "--tp-size", "8", "--dry-run"],
        capture_output=True, text=True, env=env, check=True,
    ).stdout
    assert "sglang.launch_server --model-path /models/m3 --tp-size 8" in out


@pytest.mark.parametrize("content, expected", [
    (None, "no such file"),
    ("apiVersion: m3.sglang.io/v1\nkind: M3Recipe\nmetadata: {name: x}\nspec: {}\n", "apiVersion: must be"),
])
def test_a_recipe_that_cannot_be_read_is_named_without_a_traceback(tmp_path, content, expected):
    path = tmp_path / "recipe.yaml"
    if content is not None:
        path.write_text(content)
    done = subprocess.run([sys.executable, "-m", "sglang_m3.cli", "serve", str(path), "--dry-run"],
                          capture_output=True, text=True, env={**os.environ, "SGLANG_M3_CACHE": str(tmp_path)})
    assert done.returncode == 1
    assert done.stderr.startswith(f"sglang-m3 serve: {path}:") and expected in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("port, expected", [("abc", "not a port number: 'abc'"), ("99999", "99999 is outside 1-65535"), ("0", "0 is outside 1-65535")])
def test_a_bad_port_is_refused_before_anything_starts(tmp_path, port, expected):
    done = subprocess.run([sys.executable, "-m", "sglang_m3.cli", "serve", "--model", "/models/m3", "--port", port, "--dry-run"],
                          capture_output=True, text=True, env={**os.environ, "SGLANG_M3_CACHE": str(tmp_path)})
    assert done.returncode == 2 and f"argument --port: {expected}" in done.stderr
    assert done.stdout == ""


def test_the_own_option_reader_checks_the_port_too():
    from sglang_m3.commands.serve import split_command_line

    assert split_command_line(["serve", "--port=8080", "--tp-size", "8"]).port == 8080
    with pytest.raises(SystemExit, match="--port: 70000 is outside 1-65535"):
        split_command_line(["serve", "--port", "70000"])
