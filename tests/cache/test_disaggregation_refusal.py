"""An M3 KV pool is refused under ``--disaggregation-mode prefill`` / ``decode``, naming the flag.

SGLang's KV transfer between a prefill and a decode instance lists an MHA pool's buffers as the K
of every layer then the V of every layer (``get_contiguous_buf_infos``) and splits that list in
halves, by layer and by head, wherever the instances differ in pipeline stages or TP; the index keys
this project keeps beside K/V fit none of those splits, and SGLang's own index-key transfer state is
wired to its own M3 pool only. A decode instance would attend with K/V and select blocks from index
keys it never received, so the pool refuses to be built for either role.
"""

from __future__ import annotations

import json
import types

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

from sglang_m3.cache.index_kv_pool import M3IndexedKVPool
from sglang_m3.integration.hooks import build_indexed_kv_pool
from sglang_m3.recipe.render import SPARSE_OFFLOAD_BLOCKS_ENV
from tests.recipe.test_fit_matches_sglang import m3_config


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    from sglang.srt.configs.model_config import ModelConfig

    directory = tmp_path_factory.mktemp("m3-config")
    (directory / "config.json").write_text(json.dumps(m3_config()))
    return ModelConfig(str(directory), trust_remote_code=False, dtype="bfloat16")


def configurator(model_config):
    """The fields of SGLang's ``KVCacheConfigurator`` the M3 pool builder reads."""
    return types.SimpleNamespace(model_config=model_config, pool_page_size=128, model_dtype=torch.bfloat16,
                                 server_args=types.SimpleNamespace(), device="cpu")


def pool_class_built(model_config, monkeypatch, mode: str):
    """The pool class SGLang's builder would get for an M3 rank of ``--disaggregation-mode mode``."""
    import sglang.srt.runtime_context as runtime_context

    monkeypatch.delenv(SPARSE_OFFLOAD_BLOCKS_ENV, raising=False)
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: types.SimpleNamespace(attn_dp_size=1))
    monkeypatch.setattr(runtime_context, "get_disagg", lambda: types.SimpleNamespace(disaggregation_mode=mode))
    return build_indexed_kv_pool(lambda configurator, **pool: pool["mha_pool_class"], configurator(model_config),
                                 max_total_num_tokens=1024, mha_pool_class=MHATokenToKVPool)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_an_m3_pool_is_refused_for_either_disaggregated_role(model_config, monkeypatch, mode):
    with pytest.raises(ValueError, match=rf"^--disaggregation-mode {mode}: .*index keys.*--disaggregation-mode null"):
        pool_class_built(model_config, monkeypatch, mode)


def test_without_disaggregation_the_index_key_pool_is_built(model_config, monkeypatch):
    assert issubclass(pool_class_built(model_config, monkeypatch, "null"), M3IndexedKVPool)
