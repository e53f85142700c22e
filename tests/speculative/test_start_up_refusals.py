"""Speculative settings SGLang 0.5.23 accepts for an M3 target but that fail later: refused at start-up.

Each was served on the CPU platform before the check existed (tiny M3, ``--speculative-*`` flags
as named in the test), and each failed only after the model had loaded:

* ``--speculative-algorithm NEXTN`` (or EAGLE / EAGLE3) without ``--speculative-draft-model-path``,
  or with the M3 checkpoint itself as the draft, expecting the checkpoint's MTP modules: SGLang
  loaded the whole target a second time as its "draft" and the scheduler died with
  ``AttributeError: 'MiniMaxM3SparseForCausalLM' object has no attribute 'set_embed_and_head'``.
  No M3 MTP draft model exists (SGLang skips ``model.mtp.*`` at load, and so does this plugin).
* Draft trees (top-k > 1) of more verify tokens than the draft pass proposes
  (``1 + topk + (steps - 1) * topk**2``; top-2, 2 steps, 10 tokens): the first request killed the
  scheduler in ``organize_draft_results`` (``selected index k out of range``).
* Draft trees of fewer verify tokens than ``steps + 1`` (top-2, 3 steps, 2 tokens): the first
  verify killed the scheduler compacting the accepted path (``The expanded size of the tensor (2)
  must match the existing size (4)``).
* ``--speculative-algorithm EAGLE`` with a draft narrower than the target (an EAGLE3-format draft
  of hidden size 64 on the 128-wide tiny M3): SGLang shares the target's embedding and lm_head
  with every EAGLE draft, and the first request died in the draft's norm (``Expected hidden_size
  to be 64, but found: 128``); the same draft serves under EAGLE3.
"""

from __future__ import annotations

import json

import pytest
from server_harness import expect_start_refused

from sglang_m3.speculative.checks import SpeculativeConfigError, TargetShape, check_eagle_settings

TINY = TargetShape(hidden_size=128, vocab_size=512, num_layers=4, num_mtp_modules=7)


def _draft_dir(tmp_path, **config) -> str:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_no_draft_model_is_refused_naming_the_mtp_modules(algorithm):
    with pytest.raises(SpeculativeConfigError) as refused:
        check_eagle_settings(algorithm, 1, None, TINY, num_draft_tokens=4, num_steps=3)
    message = str(refused.value)
    assert f"--speculative-algorithm {algorithm} without --speculative-draft-model-path" in message
    assert "num_mtp_modules = 7" in message and "--speculative-algorithm EAGLE3" in message


@pytest.mark.parametrize("architecture", ["MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration"])
def test_an_m3_checkpoint_as_the_draft_is_refused(tmp_path, architecture):
    """What a user who expects NEXTN/MTP to read the checkpoint's MTP modules passes."""
    draft = _draft_dir(tmp_path, architectures=[architecture], text_config={"hidden_size": 128, "num_mtp_modules": 7})
    for algorithm in ("EAGLE", "EAGLE3"):
        with pytest.raises(SpeculativeConfigError) as refused:
            check_eagle_settings(algorithm, 1, draft, TINY, num_draft_tokens=4, num_steps=3)
        message = str(refused.value)
        assert f"--speculative-draft-model-path {draft} is an M3 checkpoint (architectures ['{architecture}'])" in message
        assert "num_mtp_modules = 7" in message
    check_eagle_settings("STANDALONE", 1, draft, TINY, num_draft_tokens=4, num_steps=3)  # a whole model as draft


@pytest.mark.parametrize(("topk", "steps", "tokens", "named"), [
    (2, 2, 10, "at most 7 (1 + topk + (steps - 1) * topk**2)"),
    (3, 1, 5, "at most 4 (1 + topk + (steps - 1) * topk**2)"),
    (2, 3, 2, "at least 4 (steps + 1)"),
    (2, 3, 1, "at least 4 (steps + 1)"),
])
def test_trees_the_draft_pass_cannot_fill_are_refused(tiny_draft_factory, topk, steps, tokens, named):
    with pytest.raises(SpeculativeConfigError) as refused:
        check_eagle_settings("EAGLE3", topk, tiny_draft_factory(), TINY, num_draft_tokens=tokens, num_steps=steps)
    message = str(refused.value)
    assert f"--speculative-num-draft-tokens {tokens}" in message
    assert f"--speculative-eagle-topk {topk}" in message and f"--speculative-num-steps {steps}" in message
    assert named in message


@pytest.mark.parametrize(("topk", "steps", "tokens"), [(2, 2, 7), (2, 3, 4), (3, 3, 8), (3, 1, 4), (4, 3, 36)])
def test_trees_within_the_draft_pass_pass(tiny_draft_factory, topk, steps, tokens):
    """Both ends of the range (top-2 over 2 steps with 7 tokens served exactly on the CPU platform)."""
    check_eagle_settings("EAGLE3", topk, tiny_draft_factory(), TINY, num_draft_tokens=tokens, num_steps=steps)


def test_an_eagle3_draft_under_eagle_is_refused(tiny_draft_factory):
    """Under EAGLE the target captures no aux layers and SGLang replaces the draft's head with the
    target's: an EAGLE3 draft then reads features it was not trained on (or, narrower than the
    target, crashes at the first request)."""
    with pytest.raises(SpeculativeConfigError) as refused:
        check_eagle_settings("EAGLE", 1, tiny_draft_factory(), TINY, num_draft_tokens=4, num_steps=3)
    message = str(refused.value)
    assert "architectures ['LlamaForCausalLMEagle3'] is an EAGLE3 draft" in message
    assert "--speculative-algorithm EAGLE3" in message


def test_an_eagle_draft_of_another_width_is_refused(tmp_path):
    draft = _draft_dir(tmp_path, architectures=["LlamaForCausalLMEagle"], hidden_size=64, vocab_size=512)
    with pytest.raises(SpeculativeConfigError, match="hidden_size = 64, but the target's hidden_size is 128"):
        check_eagle_settings("EAGLE", 1, draft, TINY, num_draft_tokens=4, num_steps=3)
    fitting = _draft_dir(tmp_path, architectures=["LlamaForCausalLMEagle"], hidden_size=128, vocab_size=512)
    check_eagle_settings("EAGLE", 1, fitting, TINY, num_draft_tokens=4, num_steps=3)


@pytest.mark.server
def test_server_refuses_nextn_without_a_draft(tiny_checkpoint_factory, server_log_dir):
    """The tiny M3 with 2 MTP modules, served as a user expecting NEXTN to read them would."""
    refused = expect_start_refused(tiny_checkpoint_factory(mtp_modules=2), server_log_dir, "--speculative-algorithm", "NEXTN")
    assert refused.returncode != 0
    assert "without --speculative-draft-model-path" in refused.log and "num_mtp_modules = 2" in refused.log
    assert "set_embed_and_head" not in refused.log  # refused before any model loads


@pytest.mark.server
def test_server_refuses_a_tree_shorter_than_its_steps(tiny_m3_checkpoint, tiny_draft_factory, server_log_dir):
    flags = ("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", tiny_draft_factory(),
             "--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "2")
    refused = expect_start_refused(tiny_m3_checkpoint, server_log_dir, *flags)
    assert refused.returncode != 0
    assert "--speculative-num-draft-tokens 2 with --speculative-eagle-topk 2 and --speculative-num-steps 3" in refused.log
