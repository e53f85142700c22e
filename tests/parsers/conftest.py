"""Fixtures shared by the parser tests."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sglang_m3.parsers import chat_template_path


@pytest.fixture(scope="session")
def chat_tokenizer():
    """A word-level tokenizer carrying the project's chat template.

    Rendering goes through `apply_chat_template`, the same sandboxed path SGLang and the tiny
    checkpoint use, so a template that only works in plain Jinja fails here.
    """
    backend = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = chat_template_path().read_text()
    return tokenizer


@pytest.fixture
def render(chat_tokenizer):
    """Render messages to the prompt string, with a generation prompt unless told otherwise."""

    def _render(messages, tools=None, add_generation_prompt=True, **template_kwargs):
        return chat_tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **template_kwargs,
        )

    return _render


@pytest.fixture(scope="session")
def m3_parser_server(tiny_m3_server):
    """The shared tiny-M3 server (tests/conftest.py), which selects the parsers by their
    `minimax_m3` alias; one server start serves the model and the parser tests."""
    return tiny_m3_server
