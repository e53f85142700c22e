"""The checkpoint's ``quantization_config``: MXFP8 is read, every other scheme is refused by name.

Accepted keys and values are the ones SGLang 0.5.23's ``Fp8Config.from_config`` reads for an
MXFP8 checkpoint (``quant_method`` containing "mxfp8", ``activation_scheme`` "dynamic",
``weight_block_size`` [1, 32], ``fmt`` "e4m3", ``scale_fmt`` "ue8m0", the ignore list under
``ignored_layers`` or ``modules_to_not_convert``). A key this reader does not know is refused
rather than skipped, because it may change what the tensors mean (SGLang's MiniMax M3.1 NVFP4
variant, for instance, is an "mxfp8" config plus ``moe_quant_algo``). Pure data: no torch.

Ignore-list entries match modules as SGLang 0.5.23 matches them for an MXFP8 checkpoint, so a
checkpoint SGLang reads as "this module stays unquantized" reads so here too. SGLang's path:
``Fp8Config.from_config`` (``srt/layers/quantization/fp8.py``) drops a leading ``model.`` and
keeps both variants, ``apply_weight_name_mapper`` applies the M3 model's ``hf_to_sglang_mapper``
(``.block_sparse_moe.`` -> ``.mlp.``, ``srt/models/minimax_m3.py``), and ``is_layer_skipped``
(``srt/layers/quantization/utils.py``, ``_module_path_match``) compares on dotted boundaries. So an
entry matches a module when, after trailing dots are dropped, it is

- the module's name, with or without ``model.`` / ``language_model.`` in front;
- a parent of it (``model.layers.3``, ``model.layers.3.``, ``lm_head``);
- any run of whole dotted segments inside its name: a suffix (``self_attn.o_proj``, ``o_proj``),
  a middle part (``self_attn``, ``layers.3``); never a part of a segment (``mlp.gate`` does not
  match ``mlp.gate_up_proj``, ``layers.1`` not ``layers.10``);
- spelled with ``mlp`` where the checkpoint has ``block_sparse_moe`` or the reverse;
- for a group of routed experts (``...experts``), one expert inside it: SGLang builds a layer's
  experts as one fused module and leaves all of them unquantized when one is listed.

Beyond SGLang's MXFP8 reader, which compares every entry literally: an entry ``re:PATTERN`` is a
regular expression in the form SGLang's compressed-tensors, Quark and Humming readers take
(``re.match`` from the start of the name), tried on the module's checkpoint and SGLang spellings
with and without ``language_model.``; wildcard entries (``*``, ``?``, ``[``) cannot be module
names and are refused rather than left to match nothing, as SGLang's MXFP8 reader leaves them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from sglang_m3.config.errors import M3ConfigError

FIELD = "quantization_config"
MXFP8 = "mxfp8"
_IGNORE_KEYS = ("ignored_layers", "modules_to_not_convert")
#: the ignore list's key where a checkpoint gives none (and the key the project's writer uses)
_DEFAULT_IGNORE_KEY = "modules_to_not_convert"
#: key -> the only value accepted (None: absent or null is accepted too)
_FIXED = {
    "activation_scheme": "dynamic",
    "weight_block_size": [1, 32],
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
}
_NULL_ONLY = ("kv_cache_quant_algo",)
#: an ignore-list entry that is a regular expression starts with this (SGLang's convention)
REGEX_PREFIX = "re:"
_WILDCARDS = ("*", "?", "[")
#: the checkpoint's and SGLang's names of the same MoE submodule (SGLang's M3 ``hf_to_sglang_mapper``)
_MOE_SEGMENT, _SGLANG_MOE_SEGMENT = "block_sparse_moe", "mlp"
_TEXT_ROOTS = ("model", "lm_head")


@dataclass(frozen=True)
class MXFP8Config:
    """An MXFP8 checkpoint: e4m3 weights with e8m0 scales per 32 input elements."""

    #: module names (checkpoint spelling, ``model.`` prefix optional) that stay unquantized
    ignored_modules: tuple[str, ...] = ()
    block_size: int = 32
    #: the ``quantization_config`` key the checkpoint gave ``ignored_modules`` under (one of
    #: ``_IGNORE_KEYS``): errors about the list name the key the user finds in config.json. A
    #: spelling only, so two configs that differ in it alone are equal.
    ignore_key: str = field(default=_DEFAULT_IGNORE_KEY, compare=False)

    @property
    def ignore_field(self) -> str:
        """The ignore list's config field as error messages name it (``quantization_config.<key>``)."""
        return f"{FIELD}.{self.ignore_key}"

    def ignores(self, module: str) -> bool:
        """True when an entry of the checkpoint's ignore list matches ``module`` (module docstring)."""
        return self.ignoring_entry(module) is not None

    def ignoring_entry(self, module: str) -> str | None:
        """The first ignore-list entry that matches ``module`` (any checkpoint spelling), else None;
        error messages name it."""
        path = _full_path(module)
        return next((entry for entry in self.ignored_modules if _entry_matches(entry, module, path)), None)

    def to_json(self) -> dict:
        """The ``quantization_config`` a writer puts into config.json for this checkpoint."""
        return {
            "quant_method": MXFP8,
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": [1, self.block_size],
            self.ignore_key: list(self.ignored_modules),
        }


def _sglang_segments(name: str) -> str:
    """``name`` with SGLang's segment for the MoE submodule: the checkpoint's ``block_sparse_moe``
    and SGLang's ``mlp`` name the same modules (a dense MLP is saved under either)."""
    return ".".join(_SGLANG_MOE_SEGMENT if part == _MOE_SEGMENT else part for part in name.split("."))


def _full_path(module: str) -> str:
    """``module`` as the VL checkpoint names it (text modules under ``language_model.``), in SGLang's
    segments: every shorter spelling of it is a run of its dotted segments."""
    path = _sglang_segments(module.rstrip("."))
    text = path.removeprefix("language_model.")
    return "language_model." + text if text.split(".")[0] in _TEXT_ROOTS else path


def _entry_matches(entry: str, module: str, path: str) -> bool:
    """Whether ``entry`` matches ``module`` (``path``: its :func:`_full_path`), as in the module docstring."""
    if entry.startswith(REGEX_PREFIX):
        return _regex_matches(entry[len(REGEX_PREFIX) :], module, path)
    wanted = _sglang_segments(entry.rstrip(".").removeprefix("model."))
    if f".{wanted}." in f".{path}.":
        return True
    return _names_an_expert_inside(wanted, path)


def _names_an_expert_inside(wanted: str, path: str) -> bool:
    """SGLang's rule for fused experts (``is_layer_skipped``): a group of routed experts is skipped
    when an entry names a module inside it. Compared without the ``language_model.model.`` root,
    so the rule holds alike for text and VL checkpoints."""
    if "experts" not in path or "experts" not in wanted:
        return False
    inner = path.removeprefix("language_model.").removeprefix("model.")
    return f".{inner}." in f".{wanted.removeprefix('language_model.').removeprefix('model.')}."


def _regex_matches(pattern: str, module: str, path: str) -> bool:
    """``re.match`` on the module's checkpoint and SGLang spellings (``path`` is the latter), with
    and without ``language_model.``: a pattern written against either naming finds the module."""
    text = path.removeprefix("language_model.")
    spellings = {module, path, text, path.replace(".mlp.", f".{_MOE_SEGMENT}."), text.replace(".mlp.", f".{_MOE_SEGMENT}.")}
    return any(re.match(pattern, spelling) for spelling in spellings)


def read_quantization(text: Mapping) -> MXFP8Config | None:
    """``text``'s ``quantization_config`` as an :class:`MXFP8Config`, None when absent."""
    quant = text.get(FIELD)
    if quant is None or quant == {}:
        return None
    if not isinstance(quant, Mapping):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    method = quant.get("quant_method")
    if not isinstance(method, str) or MXFP8 not in method.lower():
        raise M3ConfigError(
            f"config field '{FIELD}.quant_method' is {method!r}: sglang-m3 serves BF16 checkpoints "
            f"and MXFP8 ones (quant_method '{MXFP8}') only"
        )
    for key, wanted in _FIXED.items():
        if quant.get(key) is not None and _normalised(quant[key]) != wanted:
            raise M3ConfigError(
                f"config field '{FIELD}.{key}' is {quant[key]!r}; an MXFP8 checkpoint has {wanted!r}"
            )
    for key in _NULL_ONLY:
        if quant.get(key) is not None:
            raise M3ConfigError(
                f"config field '{FIELD}.{key}' is {quant[key]!r}: checkpoint KV-cache scales are not "
                "supported (choose the KV cache dtype with --kv-cache-dtype instead)"
            )
    known = {"quant_method", *_FIXED, *_NULL_ONLY, *_IGNORE_KEYS}
    unknown = sorted(set(quant) - known)
    if unknown:
        raise M3ConfigError(
            f"config field '{FIELD}.{unknown[0]}' is not understood by sglang-m3's MXFP8 reader "
            f"(value {quant[unknown[0]]!r}); it may change what the tensors mean, so it is refused"
        )
    key = _ignore_key(quant)
    return MXFP8Config(ignored_modules=_ignore_list(quant, key), ignore_key=key)


def _normalised(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return value.lower() if isinstance(value, str) else value


def _ignore_key(quant: Mapping) -> str:
    """The key the checkpoint gives its ignore list under: the first of ``_IGNORE_KEYS`` present
    (SGLang's ``Fp8Config`` reads them in that order; given both, they must agree), the writer's
    ``modules_to_not_convert`` when there is none."""
    given = [key for key in _IGNORE_KEYS if quant.get(key) is not None]
    if len(given) == 2 and list(quant[given[0]]) != list(quant[given[1]]):
        raise M3ConfigError(
            f"config fields '{FIELD}.ignored_layers' and '{FIELD}.modules_to_not_convert' disagree"
        )
    return given[0] if given else _DEFAULT_IGNORE_KEY


def _ignore_list(quant: Mapping, key: str) -> tuple[str, ...]:
    """The entries under ``quant[key]``, each checked to be a module name or a valid pattern."""
    names = quant[key] if quant.get(key) is not None else []
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
        raise M3ConfigError(f"config field '{FIELD}.{key}' must be a list of module names, got {names!r}")
    for name in names:
        _check_entry(f"{FIELD}.{key}", name)
    return tuple(names)


def _check_entry(field: str, entry: str) -> None:
    """Refuse an entry no module can match: a regular expression that does not compile, or a
    wildcard pattern (SGLang's MXFP8 reader compares it literally and it silently matches nothing)."""
    if entry.startswith(REGEX_PREFIX):
        try:
            re.compile(entry[len(REGEX_PREFIX) :])
        except re.error as error:
            raise M3ConfigError(f"config field '{field}' entry {entry!r} is not a valid regular expression ({error})") from None
        return
    if any(mark in entry for mark in _WILDCARDS):
        raise M3ConfigError(
            f"config field '{field}' entry {entry!r} is a wildcard pattern: entries are module names "
            f"(SGLang's MXFP8 reader compares them literally, so it would match nothing); write "
            f"'{REGEX_PREFIX}<regular expression>' or list the modules"
        )
