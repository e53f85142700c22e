"""Acceptance of the lm-head-copy draft, and bad speculative settings refused at start-up.

The copy draft's logits equal the target's at the position it reads. EAGLE3 pairs the target's
hidden state at position ``t`` with the token of ``t + 1``, so this draft proposes the last
token again: measured here, it is accepted only where the target repeats a token. On the tiny
M3, prompts of one token repeated 24 times continue with that token for 3 of the 480 ordinary
tokens (139, 140 and 178, found by scanning 20..499 with transformers); the test checks that
precondition with the transformers oracle before measuring, so a changed checkpoint fails loudly.
Its server runs without ``TRITON_INTERPRET``, so accepted drafts also take the torch kernels.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from server_harness import TINY_PREFILL_CHUNK, expect_start_refused
from transformers_oracle import greedy_tokens, random_prompt

from sglang_m3.speculative.checks import SpeculativeConfigError, TargetShape, check_eagle_settings
from tests.speculative.conftest import CHAIN_FLAGS
from tests.speculative.no_interpreter import launch_without_interpreter
from tests.speculative.spec_requests import accept_length, generate

NEW_TOKENS = 24
REPEATING_TOKEN = 139
TINY = TargetShape(hidden_size=128, vocab_size=512, num_layers=4)


@pytest.fixture(scope="module")
def copy_server(tiny_m3_checkpoint, tiny_draft_factory, server_log_dir):
    draft = tiny_draft_factory(copy_target_lm_head=True)
    flags = ("--chunked-prefill-size", str(TINY_PREFILL_CHUNK), *CHAIN_FLAGS, "--speculative-draft-model-path", draft)
    with launch_without_interpreter(tiny_m3_checkpoint, server_log_dir, *flags) as server:
        yield server


@pytest.mark.server
def test_copy_draft_is_accepted_where_the_target_repeats(copy_server, tiny_m3_checkpoint):
    prompt = [REPEATING_TOKEN] * 24
    expected = greedy_tokens(tiny_m3_checkpoint, prompt, NEW_TOKENS)
    assert expected == [REPEATING_TOKEN] * NEW_TOKENS, "precondition: the tiny M3 no longer repeats this token"
    result = generate(copy_server.base_url, prompt, NEW_TOKENS)
    assert result["output_ids"] == expected
    length = accept_length([result])
    print(f"lm-head-copy draft, repeating target: accept length {length:.3f} tokens/step")
    assert length > 2.0


@pytest.mark.server
def test_copy_draft_on_ordinary_prompts_is_exact_and_rarely_accepted(copy_server, tiny_m3_checkpoint):
    results, expected = [], []
    for seed, n in ((1, 12), (2, 40), (3, 130)):
        prompt = random_prompt(seed, n)
        expected.append(greedy_tokens(tiny_m3_checkpoint, prompt, NEW_TOKENS))
        results.append(generate(copy_server.base_url, prompt, NEW_TOKENS))
    assert [r["output_ids"] for r in results] == expected
    length = accept_length(results)
    print(f"lm-head-copy draft, ordinary prompts: accept length {length:.3f} tokens/step")
    # It proposes the last token again; the tiny M3 seldom repeats one on these prompts.
    assert length < 1.5


@pytest.mark.parametrize(
    ("draft", "topk", "named"),
    [
        ({"target_hidden_size": 64, "hidden_size": 64, "vocab_size": 512}, 1, "target_hidden_size = 64"),
        ({"hidden_size": 96, "vocab_size": 512}, 1, "hidden_size = 96"),
        ({"target_hidden_size": 128, "vocab_size": 1000}, 1, "vocab_size = 1000"),
        ({"target_hidden_size": 128, "vocab_size": 512, "draft_vocab_size": 600}, 1, "draft_vocab_size = 600"),
        ({"target_hidden_size": 128, "vocab_size": 512, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}}, 1,
         "eagle_config.eagle_aux_hidden_state_layer_ids = [1, 2, 4]"),
        ({"target_hidden_size": 128, "vocab_size": 512}, 2, "--speculative-num-draft-tokens 65 with --speculative-eagle-topk 2"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(tmp_path, draft, topk, named):
    (tmp_path / "config.json").write_text(json.dumps(draft))
    with pytest.raises(SpeculativeConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        check_eagle_settings("EAGLE3", topk, str(tmp_path), TINY, num_draft_tokens=65)


def test_fitting_draft_passes(tiny_draft_factory):
    check_eagle_settings("EAGLE3", 1, tiny_draft_factory(draft_vocab_size=100), TINY)


def test_draft_trees_pass_up_to_64_verify_tokens(tiny_draft_factory):
    """Every MSA path verifies trees (the CPU platform's torch path: test_eagle3_exact; the Triton
    kernels: tests/kernels/test_msa_tree_verify.py); their plans hold 64 tokens per tree."""
    check_eagle_settings("EAGLE3", 3, tiny_draft_factory(), TINY, num_draft_tokens=64)
    check_eagle_settings("EAGLE3", 1, tiny_draft_factory(), TINY, num_draft_tokens=65)  # a chain: no tree mask
    with pytest.raises(SpeculativeConfigError, match="at most 64 tokens per request"):
        check_eagle_settings("EAGLE3", 3, tiny_draft_factory(), TINY, num_draft_tokens=65)


@pytest.mark.server
def test_server_refuses_aux_layers_past_the_target(tiny_m3_checkpoint, tiny_draft_factory, server_log_dir, tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(tiny_draft_factory(), draft)
    config = json.loads((draft / "config.json").read_text())
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 1, 7]}
    (draft / "config.json").write_text(json.dumps(config))
    refused = expect_start_refused(tiny_m3_checkpoint, server_log_dir, *CHAIN_FLAGS, "--speculative-draft-model-path", str(draft))
    assert refused.returncode != 0
    assert "eagle_config.eagle_aux_hidden_state_layer_ids = [0, 1, 7]" in refused.log
    assert "outside the target's layers 0 .. 3" in refused.log


@pytest.mark.server
def test_server_refuses_ngram_at_start_up(tiny_m3_checkpoint, server_log_dir):
    """Breadth 1 passes SGLang's own NGRAM checks at page size > 1; M3 names the algorithm before
    any model loads (without the hook this server died in its scheduler importing NGRAM's worker,
    which needs sgl_kernel: a log that names neither the flag nor the reason)."""
    refused = expect_start_refused(tiny_m3_checkpoint, server_log_dir, "--speculative-algorithm", "NGRAM",
                                   "--speculative-ngram-max-bfs-breadth", "1", "--speculative-num-draft-tokens", "4")
    assert refused.returncode != 0
    assert "--speculative-algorithm NGRAM: NGRAM verifies irregular draft trees" in refused.log
    assert "use --speculative-algorithm EAGLE3" in refused.log


def _draft_with(source: str, destination, **changes) -> str:
    """A copy of the tiny draft whose tensors in ``changes`` are replaced (None drops one)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, destination)
    tensors = load_file(os.path.join(destination, "model.safetensors"))
    for name, value in changes.items():
        if value is None:
            del tensors[name]
        else:
            tensors[name] = value.contiguous()
    save_file(tensors, os.path.join(destination, "model.safetensors"))
    return str(destination)


@pytest.mark.parametrize(("draft_vocab", "changes", "named"), [
    (None, lambda t: {"lm_head.weight": t["lm_head.weight"][:500]}, "lm_head.weight has 500 rows, but the draft's config gives a draft vocabulary of 512"),
    (300, lambda t: {"d2t": t["d2t"][:299]}, "d2t has shape [299], but the draft vocabulary is 300"),
    (300, lambda t: {"d2t": t["d2t"] + 250}, "d2t maps 38 draft id(s) outside the target's vocabulary 0 .. 511 (draft id 262 -> target id 512)"),
    (300, lambda t: {"d2t": None}, "draft_vocab_size = 300 below the target's 512, but no d2t tensor"),
    (None, lambda t: {"t2d": t["t2d"][:511]}, "t2d has shape [511], but the target's vocabulary is 512"),
    (None, lambda t: {"fc.weight": t["fc.weight"][:, :256]}, "fc.weight has shape [128, 256], but the draft reads 384 inputs per token"),
])
def test_draft_tensors_that_disagree_with_the_config_are_refused(tiny_draft_factory, tmp_path, draft_vocab, changes, named):
    """config.json fits the target; a tensor does not: refused before SGLang loads it, naming the tensor."""
    from safetensors.torch import load_file

    source = tiny_draft_factory(draft_vocab_size=draft_vocab)
    draft = _draft_with(source, tmp_path / "draft", **changes(load_file(os.path.join(source, "model.safetensors"))))
    with pytest.raises(SpeculativeConfigError, match=re.escape(named)):
        check_eagle_settings("EAGLE3", 1, draft, TINY, num_draft_tokens=4)
    check_eagle_settings("EAGLE3", 1, source, TINY, num_draft_tokens=4)  # the unchanged draft passes
