"""A high-acceptance EAGLE3 draft for the mid-size M3 served with ``--load-format dummy``.

The speculative benchmark needs a draft that the target accepts often, as a trained draft is
(vLLM reports an acceptance length of about 3.0 on M3); a trained draft for a random-weight
target cannot exist. This builds the lm-head-copy draft of ``sglang-m3 tiny-draft
--copy-target-lm-head`` for the mid-size target, whose weights are not in any file: SGLang's
dummy loader fills each parameter with ``uniform_(-1e-3, 1e-3)`` from a CUDA generator seeded
1234 anew per parameter, so the target's ``lm_head`` is reproduced here exactly by the same call
on a tensor of its shape, dtype and device.

The draft: ``fc`` passes the last target layer's output through (the last aux slot), the
midlayer adds nothing (``o_proj`` and ``down_proj`` zero; its other weights random, so it costs
what a real midlayer costs), the final norm weight is 1 (the target's Gemma norm scales by
``1 + w`` with ``|w| <= 1e-3``), and ``lm_head`` holds the target's rows for a draft vocabulary
of ``draft_vocab`` ids (``d2t`` maps them), as published EAGLE3 drafts have a reduced vocabulary.
Its logits at a position equal the target's over those ids, so it proposes "the last token
again". The dummy target continues any prompt with its last token (its ``lm_head`` and
``embed_tokens`` get the same values, and a token's embedding scores itself far above any other
token), so every draft is accepted when the prompt's last token is in the draft vocabulary: the
benchmark draws prompts from it. Acceptance is measured, not assumed.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

DUMMY_LOW, DUMMY_HIGH, DUMMY_SEED = -1e-3, 1e-3, 1234  # sglang.srt.model_loader.weight_utils.initialize_dummy_weights
DRAFT_HEAD_DIM, DRAFT_KV_HEADS = 128, 8
#: Draft vocabulary: target ids ``FIRST_HOT_ID ..`` (clear of M3's special tokens at both ends).
FIRST_HOT_ID = 1000


def dummy_weight(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """What SGLang's dummy loader puts in a CUDA parameter of this shape and dtype."""
    generator = torch.Generator(device="cuda")
    generator.manual_seed(DUMMY_SEED)
    return torch.empty(shape, dtype=dtype, device="cuda").uniform_(DUMMY_LOW, DUMMY_HIGH, generator=generator)


def hot_ids(draft_vocab: int) -> range:
    return range(FIRST_HOT_ID, FIRST_HOT_ID + draft_vocab)


def write_copy_draft(directory: str, target_config: dict, draft_vocab: int = 32000, aux_layer_ids: list[int] | None = None) -> str:
    """Write the draft (bf16 safetensors + config.json) for a target with ``target_config``."""
    hidden, vocab, layers = target_config["hidden_size"], target_config["vocab_size"], target_config["num_hidden_layers"]
    if not 0 < FIRST_HOT_ID + draft_vocab <= vocab:
        raise ValueError(f"draft_vocab {draft_vocab} does not fit the target's vocabulary of {vocab} from id {FIRST_HOT_ID}")
    aux = list(aux_layer_ids or (2 % layers, layers // 2, layers - 1))
    if aux[-1] != layers - 1:
        raise ValueError(f"the copy draft reads the last target layer ({layers - 1}) from its last aux slot, got {aux}")
    heads = hidden // DRAFT_HEAD_DIM
    intermediate = 8 * hidden // 3
    generator = torch.Generator(device="cuda").manual_seed(0)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return (torch.randn(out_features, in_features, generator=generator, device="cuda") / in_features**0.5).to(torch.bfloat16)

    fc = torch.zeros(hidden, len(aux) * hidden, dtype=torch.bfloat16, device="cuda")
    fc[:, (len(aux) - 1) * hidden :] = torch.eye(hidden, dtype=torch.bfloat16, device="cuda")
    ids = torch.tensor(hot_ids(draft_vocab), device="cuda")
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids.cpu()] = True
    tensors = {
        "fc.weight": fc,
        "midlayer.hidden_norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "midlayer.input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "midlayer.self_attn.q_proj.weight": linear(heads * DRAFT_HEAD_DIM, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": linear(DRAFT_KV_HEADS * DRAFT_HEAD_DIM, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": linear(DRAFT_KV_HEADS * DRAFT_HEAD_DIM, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": torch.zeros(hidden, heads * DRAFT_HEAD_DIM, dtype=torch.bfloat16),
        "midlayer.mlp.gate_proj.weight": linear(intermediate, hidden),
        "midlayer.mlp.up_proj.weight": linear(intermediate, hidden),
        "midlayer.mlp.down_proj.weight": torch.zeros(hidden, intermediate, dtype=torch.bfloat16),
        "norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        "lm_head.weight": dummy_weight((vocab, hidden), torch.bfloat16)[ids],
        "d2t": (ids - torch.arange(draft_vocab, device="cuda")).cpu(),
        "t2d": t2d,
    }
    os.makedirs(directory, exist_ok=True)
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, os.path.join(directory, "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": hidden, "target_hidden_size": hidden, "intermediate_size": intermediate,
        "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": DRAFT_KV_HEADS,
        "head_dim": DRAFT_HEAD_DIM, "hidden_act": "silu", "rms_norm_eps": target_config["rms_norm_eps"],
        "rope_theta": 10000.0, "max_position_embeddings": target_config["max_position_embeddings"],
        "vocab_size": vocab, "draft_vocab_size": draft_vocab, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
    }
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)
    return directory
