"""Where the model's settings come from: the checkpoint's own ``config.json``.

Inside the server, the config object SGLang hands to the model is not the checkpoint's: on the
CPU device SGLang pads MoE intermediate sizes to multiples of 64 for its own CPU kernels
(``adjust_config_with_unaligned_cpu_tp``: a 48-wide expert became 64 and its checkpoint no longer
loaded), coerces sub-configs into classes that drop or rename fields (transformers'
``minimax_m3_vl_text`` pops ``sparse_attention_config`` and ``moe_layer_freq``, and rewrites
``hidden_act``), and adds attributes of its own. So every reader of M3 settings (model classes,
KV pool, MSA backend, vision tower, ``inspect``) starts from the checkpoint's file when it can be
found, and from the object only when it cannot (then SGLang's ``original_*`` values win over
its padded ones). The server's ``--json-model-override-args`` are applied on top of the file
the way SGLang applies them to its object (a mapping merges into a sub-config or
``rope_parameters``), so an override reaches the model exactly once. Text and vision settings are
split here once, so one can never be read from the other.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Mapping

from sglang_m3.config import fields
from sglang_m3.config.errors import M3ConfigError
from sglang_m3.config.quantization import read_quantization

logger = logging.getLogger(__name__)

#: Attributes SGLang may pad or rewrite on the config object, each with the key it keeps the
#: checkpoint's value under.
_SGLANG_PADDED = {
    "intermediate_size": "original_intermediate_size",
    "num_attention_heads": "original_num_attention_heads",
    "num_key_value_heads": "original_total_num_kv_heads",
}


def checkpoint_config(config: Any, config_dir: str | None = None, overrides: Mapping | None = None) -> dict:
    """The checkpoint's top-level config as a plain dict (VL wrapper or text-only layout).

    Read from ``config_dir/config.json`` (or the directory the object was loaded from) when it
    exists, with ``overrides`` (default: the serving process's ``--json-model-override-args``)
    applied; otherwise from the object with SGLang's padding undone. Its ``quantization_config``
    is checked here, before any tensor is read: MXFP8 passes, any other scheme is refused.
    """
    directory = config_dir or _loaded_from(config)
    path = os.path.join(directory, "config.json") if directory else None
    if path and os.path.isfile(path):
        with open(path, encoding="utf-8") as handle:
            top = _with_overrides(json.load(handle), _server_overrides() if overrides is None else overrides)
    elif path and config is None:  # a directory was named and is all there is to read
        raise M3ConfigError(f"{directory}: no config.json there (not an M3 checkpoint directory)")
    else:
        top = _object_dict(config)
    read_quantization(text_part(top))
    return top


def _server_overrides() -> dict:
    """The serving process's ``--json-model-override-args`` ({} outside a server)."""
    try:
        from sglang.srt.runtime_context import get_model

        raw = get_model().json_model_override_args
    except ValueError:  # "config namespace 'model' not published": not inside an SGLang server (tests, inspect, tools)
        return {}
    overrides = json.loads(raw) if isinstance(raw, str) and raw.strip() else (raw or {})
    if not isinstance(overrides, Mapping):
        raise M3ConfigError(f"--json-model-override-args must be a JSON object, got {raw!r}")
    return dict(overrides)


#: keys whose mapping override is merged into the current value, as SGLang does for config-object
#: sub-configs and RoPE dicts; any other key is replaced whole, as SGLang's ``setattr`` does.
#: (SGLang 0.5.23's own MiniMaxM3VLConfig keeps ``text_config`` as a plain dict and so replaces
#: it whole: a partial text_config override fails inside SGLang before M3 code runs, and a whole
#: one gives the same result merged or replaced.)
_MERGED_ON_OVERRIDE = ("text_config", "vision_config", "rope_parameters", "rope_scaling")


def _with_overrides(top: dict, overrides: Mapping) -> dict:
    for key, override in overrides.items():
        current = top.get(key)
        if key in _MERGED_ON_OVERRIDE and isinstance(override, Mapping) and isinstance(current, Mapping):
            top[key] = {**current, **override}
        else:
            top[key] = override
    return top


def text_part(top: Mapping) -> dict:
    """The text model's settings: ``text_config`` of a VL layout, else the top level itself.

    Nothing is ever taken from ``vision_config``. Of the wrapper's own keys only
    ``tie_word_embeddings`` and ``quantization_config`` are text settings, taken when
    ``text_config`` lacks them. The embeddings are tied when either level says so, as
    transformers' ``MiniMaxM3VLConfig`` ties them (``MiniMaxM3VLConfig(tie_word_embeddings=True)``
    over an untied text config saves no ``lm_head`` at all; upstream SGLang reads the text
    config alone and would look for one). Two different quantization configs are refused.
    """
    text = top.get("text_config")
    if text is None:
        return dict(top)
    if not isinstance(text, Mapping):
        if isinstance(text, (str, bytes, int, float, list, tuple)):
            raise M3ConfigError(f"config field 'text_config' must be a mapping, got {text!r}")
        text = _object_dict(text)
    merged = dict(text)
    if top.get("tie_word_embeddings") is not None:
        tied = fields.boolean(top, "tie_word_embeddings")
        merged["tie_word_embeddings"] = tied or fields.boolean(merged, "tie_word_embeddings", False, "text_config.tie_word_embeddings")
    if top.get("quantization_config") is not None:
        merged["quantization_config"] = fields.agree(
            "quantization_config", top["quantization_config"], "text_config.quantization_config", merged.get("quantization_config"))
    return merged


def vision_part(top: Mapping) -> dict | None:
    """The vision tower's settings, or None for a text-only checkpoint."""
    vision = top.get("vision_config")
    if vision is None or isinstance(vision, Mapping):
        return None if vision is None else dict(vision)
    return _object_dict(vision)


def _loaded_from(config: Any) -> str | None:
    if config is None or isinstance(config, Mapping):
        return None
    path = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
    return path if isinstance(path, str) and os.path.isdir(path) else None


def _object_dict(config: Any) -> dict:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return dict(config)
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    for key, original in _SGLANG_PADDED.items():
        if raw.get(original) is not None:
            raw[key] = raw[original]
    for key in ("text_config", "vision_config"):
        if raw.get(key) is not None and not isinstance(raw[key], Mapping):
            raw[key] = _object_dict(raw[key])
        elif isinstance(raw.get(key), Mapping):
            sub = dict(raw[key])
            for name, original in _SGLANG_PADDED.items():
                if sub.get(original) is not None:
                    sub[name] = sub[original]
            raw[key] = sub
    return raw
