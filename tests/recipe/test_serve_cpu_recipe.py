"""Acceptance: ``sglang-m3 serve recipes/cpu-tiny.yaml`` serves the tiny M3 on CPU.

Runs the real command (recipe -> load, validate, render -> SGLang on the CPU platform) and asks
the OpenAI-compatible endpoint for a chat completion. Slow: one server start, about a minute.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
import requests
from server_harness import RunningServer, _stop, _wait_ready, free_port

from tests.recipe.recipe_factory import LIBRARY

pytestmark = pytest.mark.server


def test_serve_cpu_tiny_recipe_answers_a_chat_request(tmp_path):
    port = free_port()
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "SGLANG_M3_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "sglang_m3.cli", "serve", str(LIBRARY / "cpu-tiny.yaml"),
               "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    server = RunningServer(f"http://127.0.0.1:{port}", "", str(log_path), process)
    try:
        _wait_ready(server)
        response = requests.post(
            f"{server.openai_url}/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "Hello"}],
                  "max_tokens": 6, "temperature": 0},
            timeout=300)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"]["completion_tokens"] == 6
        assert body["choices"][0]["finish_reason"] == "length"
        log_text = log_path.read_text()
        # the server ran what the recipe rendered
        assert "--page-size 1" in log_text and "--max-total-tokens 8192" in log_text
    finally:
        _stop(process)
        _reap_group(process.pid)


def _reap_group(group: int, grace_s: float = 30) -> None:
    """``serve`` exits on SIGTERM before the SGLang server it started has shut down; wait for
    the whole process group this test created, then kill what is left of it."""
    deadline = time.time() + grace_s
    while time.time() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)
