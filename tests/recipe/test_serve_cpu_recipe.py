"""Acceptance: ``sglang-m3 serve recipes/cpu-tiny.yaml`` serves the tiny M3 on CPU.

The recipe goes through the command's own load, validate and render (``build_launch``) and the
server it renders answers a chat request on the OpenAI-compatible endpoint. The server is forked
from the test zygote (``server_harness.serve_tiny_recipe``); ``tests/test_serve_command.py`` runs
the command's process handling itself, cold.
"""

from __future__ import annotations

import pytest
import requests
import yaml
from server_harness import serve_tiny_recipe

from tests.recipe.recipe_factory import LIBRARY

pytestmark = pytest.mark.server


def _chat(server, max_tokens: int):
    """A greedy chat request of ``max_tokens`` to the recipe's server."""
    return requests.post(
        f"{server.openai_url}/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "Hello"}],
              "max_tokens": max_tokens, "temperature": 0},
        timeout=900)


def test_serve_cpu_tiny_recipe_answers_a_chat_request(tmp_path):
    with serve_tiny_recipe(str(LIBRARY / "cpu-tiny.yaml"), tmp_path) as server:
        response = _chat(server, 6)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"]["completion_tokens"] == 6
        assert body["choices"][0]["finish_reason"] == "length"
        with open(server.log_path, encoding="utf-8") as log:
            log_text = log.read()
    # SGLang resolved what the recipe rendered
    assert "'page_size': 1," in log_text and "'max_total_tokens': 8192," in log_text


def test_a_recipe_with_multimodal_off_serves(tmp_path):
    """``multimodal.enabled: false`` renders ``--language-model-only``, which SGLang 0.5.23 refused
    for M3 at start-up; the plugin lets M3 serve text alone with it (``tests/test_language_model_only.py``)."""
    document = yaml.safe_load((LIBRARY / "cpu-tiny.yaml").read_text())
    document["spec"]["multimodal"] = {"enabled": False}
    path = tmp_path / "cpu-text-only.yaml"
    path.write_text(yaml.safe_dump(document))
    with serve_tiny_recipe(str(path), tmp_path) as server:
        response = _chat(server, 3)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 3
        with open(server.log_path, encoding="utf-8") as log:
            assert "'language_model_only': True," in log.read()
