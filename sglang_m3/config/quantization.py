"""The checkpoint's ``quantization_config``: MXFP8 is read, every other scheme is refused by name.

Accepted keys and values are the ones SGLang 0.5.23's ``Fp8Config.from_config`` reads for an
MXFP8 checkpoint (``quant_method`` containing "mxfp8", ``activation_scheme`` "dynamic",
``weight_block_size`` [1, 32], ``fmt`` "e4m3", ``scale_fmt`` "ue8m0", the ignore list under
``ignored_layers`` or ``modules_to_not_convert``). A key this reader does not know is refused
rather than skipped, because it may change what the tensors mean (SGLang's MiniMax M3.1 NVFP4
variant, for instance, is an "mxfp8" config plus ``moe_quant_algo``). Pure data: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from sglang_m3.config.errors import M3ConfigError

FIELD = "quantization_config"
MXFP8 = "mxfp8"
_IGNORE_KEYS = ("ignored_layers", "modules_to_not_convert")
#: key -> the only value accepted (None: absent or null is accepted too)
_FIXED = {
    "activation_scheme": "dynamic",
    "weight_block_size": [1, 32],
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
}
_NULL_ONLY = ("kv_cache_quant_algo",)


@dataclass(frozen=True)
class MXFP8Config:
    """An MXFP8 checkpoint: e4m3 weights with e8m0 scales per 32 input elements."""

    #: module names (checkpoint spelling, ``model.`` prefix optional) that stay unquantized
    ignored_modules: tuple[str, ...] = ()
    block_size: int = 32

    def ignores(self, module: str) -> bool:
        """True when ``module`` (or a parent of it) is on the checkpoint's ignore list."""
        bare = _bare(module)
        return any(bare == _bare(name) or bare.startswith(_bare(name) + ".") for name in self.ignored_modules)

    def to_json(self) -> dict:
        """The ``quantization_config`` a writer puts into config.json for this checkpoint."""
        return {
            "quant_method": MXFP8,
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": [1, self.block_size],
            "modules_to_not_convert": list(self.ignored_modules),
        }


def _bare(name: str) -> str:
    for prefix in ("language_model.", "model."):
        name = name.removeprefix(prefix)
    return name


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
    return MXFP8Config(ignored_modules=_ignore_list(quant))


def _normalised(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    return value.lower() if isinstance(value, str) else value


def _ignore_list(quant: Mapping) -> tuple[str, ...]:
    given = [key for key in _IGNORE_KEYS if quant.get(key) is not None]
    if len(given) == 2 and list(quant[given[0]]) != list(quant[given[1]]):
        raise M3ConfigError(
            f"config fields '{FIELD}.ignored_layers' and '{FIELD}.modules_to_not_convert' disagree"
        )
    names = quant[given[0]] if given else []
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
        raise M3ConfigError(f"config field '{FIELD}.{given[0]}' must be a list of module names, got {names!r}")
    return tuple(names)
