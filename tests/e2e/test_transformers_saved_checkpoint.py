"""Regression: a checkpoint saved by transformers, with sizes unlike the project's tiny one, serves
and matches transformers (greedy identical, prompt logprobs within 2e-3 in float32).

It once failed to load: SGLang's CPU path padded the 48-wide experts to 64 on the config object
the model read its sizes from. The vision intermediate size is 64, unlike the expert width, so a
size taken from the padded object or from the vision config fails here as well.
"""

from __future__ import annotations

import pytest
from server_harness import launch_cpu_server
from transformers_oracle import greedy_tokens, random_prompt

from tests.e2e.served_vs_reference import NEW_TOKENS, assert_matches_reference
from tests.e2e.transformers_saved import EXPERT_INTERMEDIATE, build_transformers_saved_checkpoint

pytestmark = pytest.mark.server

VISION_INTERMEDIATE = 64
assert VISION_INTERMEDIATE != EXPERT_INTERMEDIATE
# block size 8, top-4: beyond 32 tokens the selection drops context
PROMPTS = {"p6": random_prompt(6, 6), "p34": random_prompt(34, 34), "p97": random_prompt(97, 97), "p233": random_prompt(233, 233)}


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    return build_transformers_saved_checkpoint(str(tmp_path_factory.mktemp("transformers-saved")), VISION_INTERMEDIATE)


@pytest.fixture(scope="module")
def saved_server(saved_checkpoint, server_log_dir):
    with launch_cpu_server(saved_checkpoint, server_log_dir) as server:
        yield server


def test_saved_config_has_the_regression_sizes(saved_checkpoint):
    import json

    with open(f"{saved_checkpoint}/config.json", encoding="utf-8") as handle:
        config = json.load(handle)
    assert config["text_config"]["intermediate_size"] == EXPERT_INTERMEDIATE
    assert config["vision_config"]["intermediate_size"] == VISION_INTERMEDIATE
    assert config["text_config"]["rope_parameters"]["partial_rotary_factor"] == 0.5


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_transformers_saved_checkpoint_matches_transformers(saved_server, saved_checkpoint, name):
    assert_matches_reference(saved_server, saved_checkpoint, PROMPTS[name], f"transformers-saved {name}")


def test_weights_reloaded_from_another_checkpoint_serve_its_tokens(saved_server, tmp_path_factory):
    """SGLang's update_weights_from_disk sends a whole checkpoint through ``load_weights`` of the
    loaded model (an update, as RL trainers use it): the server then answers as transformers does
    with the new weights. Runs last in this module: the server keeps the new weights."""
    import requests

    other = build_transformers_saved_checkpoint(str(tmp_path_factory.mktemp("transformers-saved-seed1")), VISION_INTERMEDIATE, seed=1)
    prompt = PROMPTS["p97"]
    # the new weights answer otherwise: a reload that kept the old ones cannot pass
    assert greedy_tokens(other, prompt, NEW_TOKENS) != greedy_tokens(saved_server.model_path, prompt, NEW_TOKENS)
    reply = requests.post(f"{saved_server.base_url}/update_weights_from_disk", json={"model_path": other}, timeout=300)
    assert reply.status_code == 200 and reply.json()["success"], reply.text
    assert_matches_reference(saved_server, other, prompt, "transformers-saved, reloaded from seed 1")
