"""``--warmups m3_long_prompt``: what it sends, when it stands aside, and a real server taking the flag.

On the CPU platform it stands aside (nothing there compiles per shape); what it sends on CUDA is
checked here against a recording tokenizer manager, and on the GPU by the cold-start probe
(``benchmarks/prefill_host_probe.py --server-arg=--warmups=m3_long_prompt``).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import openai
import pytest
from server_harness import launch_cpu_server

from sglang_m3.integration import long_prompt_warmup as warmup

M3 = SimpleNamespace(architectures=["MiniMaxM3SparseForCausalLM"])


class RecordingTokenizerManager:
    """What the warm-up asks of SGLang's tokenizer manager, recorded."""

    def __init__(self, context_len=131456, vocab_size=200064, hf_config=M3):
        self.model_config = SimpleNamespace(hf_config=hf_config, vocab_size=vocab_size)
        self.context_len = context_len
        self.requests, self.flushes = [], 0

    async def generate_request(self, request, http_request):
        self.requests.append(request)
        yield {"meta_info": {}}

    async def flush_cache(self):
        self.flushes += 1
        return SimpleNamespace(success=True)


def _settings(monkeypatch, device="cuda", chunk=8192):
    monkeypatch.setattr(warmup, "server_settings", lambda: (device, chunk))


@pytest.mark.parametrize("chunk, context_len, expected", [
    (8192, 131456, 20480),  # two full chunks and half a third
    (2048, 131456, 5120),
    (8192, 12000, 11998),  # bounded by the context, leaving the one output token room
    (None, 131456, warmup.UNCHUNKED_TOKENS),  # chunked prefill off
    (-1, 131456, warmup.UNCHUNKED_TOKENS),
    (8192, 2, 1),
])
def test_prompt_length(chunk, context_len, expected):
    assert warmup.warmup_prompt_tokens(chunk, context_len) == expected


def test_token_ids_are_ordinary_and_deterministic():
    ids = warmup.warmup_token_ids(20480, 200064)
    assert len(ids) == 20480 and ids == warmup.warmup_token_ids(20480, 200064)
    assert 0 <= min(ids) and max(ids) < warmup.ORDINARY_IDS  # never M3's image (200025) or video (200026) ids
    assert len(set(ids)) > 10000
    assert max(warmup.warmup_token_ids(500, 300)) < 300  # a tiny vocabulary bounds them


def test_on_cuda_one_long_prompt_then_the_radix_cache_is_emptied(monkeypatch):
    _settings(monkeypatch)
    manager = RecordingTokenizerManager()
    asyncio.run(warmup.long_prompt_warmup("null", manager))
    (request,) = manager.requests
    assert request.input_ids == warmup.warmup_token_ids(20480, 200064)
    assert request.sampling_params == {"max_new_tokens": 1, "temperature": 0}
    assert manager.flushes == 1


@pytest.mark.parametrize("architecture, device, mode, reason", [
    ("MiniMaxM3SparseForCausalLM", "cpu", "null", "device 'cpu'"),
    ("MiniMaxM3SparseForCausalLM", None, "null", "device None"),
    ("LlamaForCausalLM", "cuda", "null", "not an M3 model"),
    ("MiniMaxM3SparseForCausalLM", "cuda", "prefill", "disaggregation mode 'prefill'"),
])
def test_stands_aside_where_nothing_compiles_or_a_peer_is_needed(monkeypatch, architecture, device, mode, reason):
    hf_config = SimpleNamespace(architectures=[architecture])
    assert reason in warmup.why_skipped(hf_config, device, mode)
    _settings(monkeypatch, device=device)
    manager = RecordingTokenizerManager(hf_config=hf_config)
    asyncio.run(warmup.long_prompt_warmup(mode, manager))
    assert manager.requests == [] and manager.flushes == 0


def test_vision_language_m3_is_warmed_too():
    assert warmup.why_skipped(SimpleNamespace(architectures=["MiniMaxM3SparseForConditionalGeneration"]), "cuda", "null") is None


def test_registered_under_its_name_with_sglang():
    from sglang.srt.entrypoints.warmup import _warmup_registry

    warmup.register_long_prompt_warmup()
    assert _warmup_registry[warmup.NAME] is warmup.long_prompt_warmup


def test_a_cpu_server_takes_the_flag_and_serves(tiny_m3_checkpoint, tmp_path):
    """SGLang runs the named warm-up in the HTTP server's start-up: on the CPU platform it logs why
    it stands aside, and the server serves."""
    with launch_cpu_server(tiny_m3_checkpoint, str(tmp_path), "--warmups", warmup.NAME) as server:
        client = openai.OpenAI(base_url=server.openai_url, api_key="none")
        answer = client.completions.create(model=server.model_path, prompt="Hello", max_tokens=4, temperature=0)
        assert answer.usage.completion_tokens == 4
        with open(server.log_path, encoding="utf-8") as handle:
            log = handle.read()
        assert f"sglang-m3: {warmup.NAME} warm-up skipped: device 'cpu'" in log
        assert f"Could not find custom warmup {warmup.NAME}" not in log
