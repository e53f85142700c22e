"""Builds a tiny EAGLE3 draft for a (tiny) M3 checkpoint, in the format SGLang 0.5.23 loads.

SGLang serves ``--speculative-algorithm EAGLE3`` drafts with ``LlamaForCausalLMEagle3``
(``sglang/srt/models/llama_eagle3.py``): one Llama decoder layer whose q/k/v projections read
``[input_layernorm(embed(token)), hidden_norm(h)]`` (twice the hidden width), where ``h`` is
``fc(concat(aux hidden states of the target))`` on the first draft step and the draft's own
pre-norm output afterwards; a final ``norm`` and its own ``lm_head`` over a draft vocabulary whose
ids map to target ids through ``d2t`` (``target = draft + d2t[draft]``; ``t2d`` marks the target
ids that have a draft id and is not read by SGLang). The draft's embedding is the target's:
SGLang replaces it with the target's at start-up when ``target_hidden_size == hidden_size``,
which holds here; the file still carries a copy so it loads on its own.

Tensor names are those of the published drafts (``midlayer.*``, ``fc``, ``norm``, ``lm_head``,
``d2t``, ``t2d``, ``embed_tokens``); ``config.json`` has ``architectures``
``["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``, ``target_hidden_size`` and, when the aux
layers are not M3's default, ``eagle_config.eagle_aux_hidden_state_layer_ids``.

Two kinds:

* random (default): seeded weights at scales that keep activations O(1), so drafts are
  proposals the target mostly rejects; ``draft_vocab_size`` picks the first N target ids.
* ``copy_target_lm_head``: full draft vocabulary, ``lm_head`` and the final norm copied from the
  target, ``fc`` passing the last target layer's output through, and a midlayer that adds
  nothing (``o_proj`` and ``down_proj`` zero). Its logits equal the target's at the position it
  reads. EAGLE3 feeds the draft the target's hidden state at position ``t`` with the token of
  ``t + 1``, so this draft proposes "the last token again": it is accepted exactly where the
  target repeats a token (a trained draft predicts ``t + 2`` instead; this one cannot).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sglang_m3.config import M3TextSpec
from sglang_m3.config.errors import M3ConfigError
from sglang_m3.integration.hooks import M3_ARCHITECTURES, first_architecture
from sglang_m3.models.checkpoint_layout import text_tensor_name
from sglang_m3.speculative.aux_layers import default_aux_layer_ids, resolve_aux_layer_ids
from sglang_m3.tiny.output_dir import apply_umask, move_into_place, prepare_output

DRAFT_ARCH = "LlamaForCausalLMEagle3"
#: Draft attention geometry (the draft's own; only its hidden size must equal the target's).
DRAFT_HEADS = 4
DRAFT_KV_HEADS = 2
DRAFT_INTERMEDIATE = 256


def build_tiny_draft(
    target_dir: str,
    out_dir: str,
    *,
    seed: int = 0,
    draft_vocab_size: int | None = None,
    copy_target_lm_head: bool = False,
    aux_layer_ids: list[int] | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> str:
    """Write the draft into ``out_dir`` (created; must be empty or absent) and return its path.

    Built in a hidden sibling of ``out_dir`` and moved in whole, so that neither a failure nor a
    killed process leaves weights without their ``config.json`` there. ``progress`` gets one line
    per stage (the command prints them)."""
    parent = prepare_output(out_dir)
    spec = _target_spec(target_dir)
    progress(f"reading target {target_dir}: hidden_size {spec.hidden_size}, vocab_size {spec.vocab_size}, {spec.num_layers} layers")
    target = _target_tensors(target_dir, ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"))
    if copy_target_lm_head:
        if draft_vocab_size not in (None, spec.vocab_size):
            raise ValueError(
                f"--copy-target-lm-head keeps the target's vocabulary ({spec.vocab_size}); "
                f"--draft-vocab-size {draft_vocab_size} contradicts it"
            )
        # The pass-through fc reads the last target layer's output from the last aux slot.
        aux_layer_ids = list(aux_layer_ids or (*default_aux_layer_ids(spec.num_layers)[:2], spec.num_layers - 1))
        if aux_layer_ids[-1] != spec.num_layers - 1:
            raise ValueError(
                f"--copy-target-lm-head needs the last aux layer to be the target's last layer "
                f"({spec.num_layers - 1}), got --aux-layer-ids {aux_layer_ids}"
            )
    vocab = spec.vocab_size if draft_vocab_size is None else draft_vocab_size
    if not 1 <= vocab <= spec.vocab_size:
        raise ValueError(f"--draft-vocab-size must be in 1 .. {spec.vocab_size} (the target's vocab_size), got {vocab}")
    layer_ids = resolve_aux_layer_ids(aux_layer_ids, spec.num_layers, given_as=_flag(aux_layer_ids))
    kind = "an lm-head-copy draft" if copy_target_lm_head else f"a random draft (seed {seed})"
    default = " (M3's default)" if aux_layer_ids is None else ""
    progress(f"building {kind}: draft vocabulary {vocab}, aux layers {', '.join(map(str, layer_ids))}{default}")

    generator = torch.Generator().manual_seed(seed)
    tensors = _random_draft(spec, vocab, len(layer_ids), generator)
    tensors["embed_tokens.weight"] = target["model.embed_tokens.weight"].float().clone()
    hot = torch.arange(vocab)
    tensors["d2t"] = hot - torch.arange(vocab)
    t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
    t2d[hot] = True
    tensors["t2d"] = t2d
    if copy_target_lm_head:
        _make_copy_draft(tensors, target, spec, len(layer_ids))

    progress(f"writing {out_dir}")
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(out_dir))}.partial-", dir=parent)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(staging, "model.safetensors"))
        with open(os.path.join(staging, "config.json"), "w", encoding="utf-8") as handle:
            json.dump(_draft_config(spec, vocab, aux_layer_ids, copy_target_lm_head), handle, indent=2)
        apply_umask(staging)
        move_into_place(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def _target_spec(target_dir: str) -> M3TextSpec:
    """The target's text settings; a directory that is no M3 checkpoint is refused naming it
    (a Llama config otherwise failed on the first M3 field it lacked, naming neither)."""
    config_path = os.path.join(target_dir, "config.json")
    try:
        with open(config_path, encoding="utf-8") as handle:
            config = json.load(handle)
    except OSError:  # absent or unreadable: the spec reader names the directory
        config = None
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path} is not valid JSON ({error})") from None
    if config is not None and first_architecture(config) not in M3_ARCHITECTURES:
        architectures = (config.get("architectures") or []) if isinstance(config, dict) else []
        raise ValueError(
            f"{target_dir}: architectures {architectures} is not an M3 checkpoint "
            f"({' or '.join(M3_ARCHITECTURES)}); TARGET must be one"
        )
    try:
        return M3TextSpec.from_config(None, target_dir)
    except M3ConfigError as error:
        if str(error).startswith(f"{target_dir}:"):
            raise
        raise M3ConfigError(f"{target_dir}: {error}") from None


def _flag(aux_layer_ids: list[int] | None) -> str | None:
    """How refusals name ids the caller gave: the command's flag, not the config field they go to."""
    return None if aux_layer_ids is None else f"--aux-layer-ids {','.join(map(str, aux_layer_ids))}".rstrip()


def _target_tensors(target_dir: str, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The target's tensors under canonical text names (VL checkpoints prefix ``language_model.``)."""
    found: dict[str, torch.Tensor] = {}
    for file in sorted(os.listdir(target_dir)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(target_dir, file), "pt") as handle:
                for name in handle.keys():
                    canonical = text_tensor_name(name)
                    if canonical in names:
                        found[canonical] = handle.get_tensor(name)
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"target checkpoint {target_dir} lacks tensor(s) {missing}")
    return found


def _random_draft(spec: M3TextSpec, vocab: int, num_aux: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    hidden, head_dim = spec.hidden_size, spec.hidden_size // DRAFT_HEADS

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, generator=generator) / in_features**0.5

    return {
        "fc.weight": linear(hidden, num_aux * spec.hidden_size),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "midlayer.self_attn.q_proj.weight": linear(DRAFT_HEADS * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": linear(DRAFT_KV_HEADS * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": linear(DRAFT_KV_HEADS * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": linear(hidden, DRAFT_HEADS * head_dim),
        "midlayer.mlp.gate_proj.weight": linear(DRAFT_INTERMEDIATE, hidden),
        "midlayer.mlp.up_proj.weight": linear(DRAFT_INTERMEDIATE, hidden),
        "midlayer.mlp.down_proj.weight": linear(hidden, DRAFT_INTERMEDIATE),
        "norm.weight": torch.ones(hidden),
        # Logits of a few nats' spread: greedy drafting is not a coin toss.
        "lm_head.weight": 4.0 * linear(vocab, hidden),
    }


def _make_copy_draft(tensors: dict, target: dict, spec: M3TextSpec, num_aux: int) -> None:
    """Draft logits = the target's logits of the hidden state it reads (see the module docstring)."""
    hidden = spec.hidden_size
    fc = torch.zeros(hidden, num_aux * hidden)
    fc[:, (num_aux - 1) * hidden :] = torch.eye(hidden)
    tensors["fc.weight"] = fc
    tensors["midlayer.self_attn.o_proj.weight"].zero_()
    tensors["midlayer.mlp.down_proj.weight"].zero_()
    norm = target["model.norm.weight"].float()
    # SGLang's Llama RMSNorm scales by w; M3's Gemma form by 1 + w.
    tensors["norm.weight"] = norm + 1.0 if spec.use_gemma_norm else norm.clone()
    tensors["lm_head.weight"] = target["lm_head.weight"].float().clone()


def _draft_config(spec: M3TextSpec, vocab: int, aux_layer_ids, copy_target_lm_head: bool) -> dict:
    config = {
        "architectures": [DRAFT_ARCH],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "target_hidden_size": spec.hidden_size,
        "intermediate_size": DRAFT_INTERMEDIATE,
        "num_hidden_layers": 1,
        "num_attention_heads": DRAFT_HEADS,
        "num_key_value_heads": DRAFT_KV_HEADS,
        "head_dim": spec.hidden_size // DRAFT_HEADS,
        "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": 10000.0,
        "max_position_embeddings": spec.max_position_embeddings,
        "vocab_size": spec.vocab_size,
        "draft_vocab_size": vocab,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "sglang_m3_tiny_draft": "copy-target-lm-head" if copy_target_lm_head else "random",
    }
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True}
    return config
