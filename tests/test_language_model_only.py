"""``--language-model-only`` serves M3 text alone (a recipe's ``multimodal.enabled: false``).

SGLang 0.5.23 accepts the flag only for the architectures on its allow-list and refused M3's at
start-up; the plugin's hook (``hooks.allow_language_model_only_for_m3``) lets M3's pass. Checked with
SGLang's own resolution (M3 text and VL accepted, another model still refused) and with the real
server: the tiny VL M3 starts without its vision tower, answers a chat, and refuses an image request
with a 400 (the chat API: text input only; SGLang's own: naming the flag), then keeps serving.
"""

from __future__ import annotations

import json
import subprocess
import sys

import openai
import pytest
import requests
from server_harness import launch_cpu_server, server_environment

from tests.multimodal.vl_oracle import IMAGE_A, data_url

# Runs in a fresh interpreter (SGLang loads its plugins once per process); prints one JSON line.
RESOLVE_SCRIPT = '''\
import json, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.server_args import ServerArgs, prepare_server_args

allowed = ServerArgs.LANGUAGE_MODEL_ONLY_ARCHITECTURES
outcomes = {}
for path in sys.argv[1:]:
    try:
        prepare_server_args(["--model-path", path, "--language-model-only", "--device", "cpu"]).resolve_once()
        outcomes[path] = "ok"
    except ValueError as error:
        outcomes[path] = str(error)
print(json.dumps({"outcomes": outcomes, "list_unchanged": ServerArgs.LANGUAGE_MODEL_ONLY_ARCHITECTURES == allowed}))
'''

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 512,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "float32",
}


def test_sglang_resolution_accepts_the_flag_for_m3_only(tiny_m3_checkpoint, tiny_m3_vl_checkpoint, tmp_path):
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    run = subprocess.run([sys.executable, "-c", RESOLVE_SCRIPT, tiny_m3_checkpoint, tiny_m3_vl_checkpoint, str(llama)],
                         capture_output=True, text=True, env=server_environment(), timeout=1800)
    assert run.returncode == 0, run.stderr[-4000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    outcomes = found["outcomes"]
    assert outcomes[tiny_m3_checkpoint] == "ok"
    assert outcomes[tiny_m3_vl_checkpoint] == "ok"
    assert outcomes[str(llama)].startswith("--language-model-only does not support ['LlamaForCausalLM']")
    assert found["list_unchanged"]


@pytest.fixture(scope="module")
def text_only_vl_server(tiny_m3_vl_checkpoint, server_log_dir):
    with launch_cpu_server(tiny_m3_vl_checkpoint, server_log_dir, "--language-model-only") as server:
        yield server


@pytest.fixture
def client(text_only_vl_server):
    return openai.OpenAI(base_url=text_only_vl_server.openai_url, api_key="unused", timeout=900)


@pytest.mark.server
def test_the_vl_model_serves_text_without_its_vision_tower(text_only_vl_server, client):
    reply = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Say something."}],
        max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 4 and reply.choices[0].message is not None
    log = text_only_vl_server.log_tail(lines=100_000)
    assert "language_model_only: skipped" in log  # the checkpoint's vision tensors were not loaded


@pytest.mark.server
def test_an_image_request_is_refused_with_a_400_and_the_server_keeps_serving(text_only_vl_server, client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="default", max_tokens=4,
            messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url("image/png", IMAGE_A)}},
                {"type": "text", "text": "What is this?"},
            ]}])
    assert "only supports text input" in str(refused.value) and "image_url" in str(refused.value)
    # SGLang's own API names the flag
    native = requests.post(f"{text_only_vl_server.base_url}/generate", timeout=600, json={
        "text": "Describe ]<]image[>[ briefly.", "image_data": [data_url("image/png", IMAGE_A)],
        "sampling_params": {"max_new_tokens": 2}})
    assert native.status_code == 400 and "--language-model-only" in native.text, native.text
    again = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Still there?"}], max_tokens=2, temperature=0)
    assert again.usage.completion_tokens >= 1
