"""A small byte-level BPE tokenizer that carries M3's special tokens (M3_FACTS s.4).

It is trained at build time on a fixed English corpus, so it is deterministic and needs no
download. Every string round-trips (byte level), the chat and media markers are single tokens.
"""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS = "]~!b["
TURN_START = "]~b]"
EOS = "[e~["
SPECIAL_TOKENS = (
    BOS,
    TURN_START,
    EOS,
    "<mm:think>",
    "</mm:think>",
    "]<]minimax[>[",
    "]<]image[>[",
    "]<]video[>[",
    "]<]start of image[>[",
    "]<]end of image[>[",
)
IMAGE_TOKEN, VIDEO_TOKEN = "]<]image[>[", "]<]video[>["

_CORPUS = """
The quick brown fox jumps over the lazy dog. A model that serves many users must be fast,
correct and easy to deploy. Sparse attention chooses a few blocks of keys for every query and
attends only those, so long contexts cost less. Tell me about the weather in Paris today.
What is the capital of France? Write a function that adds two numbers and returns the result.
def add(a, b):
    return a + b
The user asked for a list of three cities: Tokyo, Lagos and Lima. Numbers 0 1 2 3 4 5 6 7 8 9.
JSON looks like {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}.
Reasoning happens before the answer; tools are called with names and typed arguments.
""".strip()


def build_tokenizer(vocab_size: int = 512) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return tokenizer


def save_tokenizer(directory: str, tokenizer: Tokenizer, chat_template: str, model_max_length: int) -> dict[str, int]:
    """Write tokenizer.json + tokenizer_config.json; return the special token ids."""
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
        "extra_special_tokens": {"image_token": IMAGE_TOKEN, "video_token": VIDEO_TOKEN},
    }
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)
    with open(os.path.join(directory, "special_tokens_map.json"), "w", encoding="utf-8") as handle:
        json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}, handle, indent=2)
    return ids
