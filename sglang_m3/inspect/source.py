"""The config ``inspect`` measures: a ``config.json`` file or a checkpoint directory.

Read through ``sglang_m3.config`` like the server reads it, so a config the server would refuse
is refused here with the same message naming the field.
"""

from __future__ import annotations

import json
import os

from sglang_m3.config import M3ConfigError, M3TextSpec, checkpoint_config


def read_config(path: str) -> tuple[dict, M3TextSpec]:
    """(top-level config dict, text spec) of a config file or a checkpoint directory."""
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise M3ConfigError(f"{path} has no config.json")
        top = checkpoint_config(None, path)
    elif os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as handle:
                raw = json.load(handle)
        except json.JSONDecodeError as error:
            raise M3ConfigError(f"{path} is not valid JSON: {error}") from None
        if not isinstance(raw, dict):
            raise M3ConfigError(f"{path} must hold a JSON object, got {type(raw).__name__}")
        top = checkpoint_config(raw)
    else:
        raise M3ConfigError(f"{path}: no such file or directory")
    return top, M3TextSpec.from_config(top)
