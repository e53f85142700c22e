"""EAGLE3 drafts whose config.json leaves out the optional fields.

Published EAGLE3 drafts differ in which keys their config carries. SGLang 0.5.23's
``LlamaForCausalLMEagle3`` has a default for ``target_hidden_size``, ``eagle_config`` and
``num_aux_hidden_states``, and means one for ``draft_vocab_size`` (None: the target's lm_head),
but reads that key unconditionally: a draft without it died in the scheduler with
``AttributeError: 'LlamaConfig' object has no attribute 'draft_vocab_size'``. The drafts here are
``sglang-m3 tiny-draft`` copies with those keys removed.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from transformers import AutoConfig
from transformers_oracle import greedy_tokens, random_prompt

from sglang_m3.speculative.hooks import default_absent_draft_vocab_size
from tests.speculative.conftest import CHAIN_FLAGS
from tests.speculative.no_interpreter import launch_without_interpreter
from tests.speculative.spec_requests import generate

NEW_TOKENS = 16
OPTIONAL = ("draft_vocab_size", "target_hidden_size", "eagle_config", "head_dim", "torch_dtype", "tie_word_embeddings")


def draft_without(source: str, destination, keys: tuple[str, ...], drop_lm_head: bool = False) -> str:
    shutil.copytree(source, destination)
    path = destination / "config.json"
    config = json.loads(path.read_text())
    for key in keys:
        config.pop(key, None)
    path.write_text(json.dumps(config))
    if drop_lm_head:
        from safetensors.torch import load_file, save_file

        file = os.path.join(destination, "model.safetensors")
        tensors = load_file(file)
        del tensors["lm_head.weight"]
        save_file(tensors, file)
    return str(destination)


@pytest.mark.parametrize(("drop_lm_head", "expected"), [(False, 512), (True, None)], ids=["own-head", "no-head"])
def test_absent_draft_vocab_size_is_the_full_vocabulary_or_the_targets_head(tiny_draft_factory, tmp_path, drop_lm_head, expected):
    draft = draft_without(tiny_draft_factory(), tmp_path / "draft", ("draft_vocab_size",), drop_lm_head)
    config = AutoConfig.from_pretrained(draft)  # as SGLang reads it (get_config): name_or_path is the draft's directory
    assert not hasattr(config, "draft_vocab_size")
    default_absent_draft_vocab_size(object(), config=config)
    assert config.draft_vocab_size == expected
    config.draft_vocab_size = 300  # a value the file states is kept
    default_absent_draft_vocab_size(object(), config=config)
    assert config.draft_vocab_size == 300


@pytest.mark.server
def test_draft_without_optional_fields_serves_the_targets_tokens(tiny_m3_checkpoint, tiny_draft_factory, server_log_dir, tmp_path):
    """Tokens equal transformers' greedy ones (the draft's aux layers are M3's default now, so
    its proposals are rarely accepted; exactness is what the target guarantees)."""
    draft = draft_without(tiny_draft_factory(copy_target_lm_head=True), tmp_path / "draft", OPTIONAL)
    flags = (*CHAIN_FLAGS, "--speculative-draft-model-path", draft)
    with launch_without_interpreter(tiny_m3_checkpoint, server_log_dir, *flags) as server:
        for prompt in ([139] * 24, random_prompt(41, 57)):
            result = generate(server.base_url, prompt, NEW_TOKENS)
            assert result["output_ids"] == greedy_tokens(tiny_m3_checkpoint, prompt, NEW_TOKENS)
            assert result["meta_info"]["spec_verify_ct"] > 0
