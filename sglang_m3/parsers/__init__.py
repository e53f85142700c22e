"""MiniMax M3 chat template, tool-call parser and reasoning parser for SGLang.

Importing this package is cheap (no torch, no sglang): the CLI copies the chat template into
tiny checkpoints without loading the serving stack.
"""

from pathlib import Path

_CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")


def chat_template_path() -> Path:
    """Path of the project's M3 chat template (Jinja2, Hugging Face chat-template style)."""
    return _CHAT_TEMPLATE


def register_parsers() -> None:
    """Make SGLang use this package's M3 tool-call and reasoning parsers (`minimax-m3`,
    alias `minimax_m3`). Imports SGLang, so it is only called from the plugin."""
    from sglang_m3.parsers.registration import register_parsers as register

    register()
