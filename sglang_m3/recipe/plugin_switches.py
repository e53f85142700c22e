"""The plugin's own environment switches (``SGLANG_M3_*``) a recipe may set in ``spec.env``.

The plugin reads each one at start-up, with ``sglang_m3.env_switch`` or (two of them) a check of
its own, in modules that import torch, so the recipe layer cannot call those readers; each switch
is stated here with the values its reader takes, parsed the way that reader parses them, so that
``recipe validate`` refuses the values the server would refuse. ``tests/recipe/test_plugin_switches.py``
holds every entry to its reader and fails on a switch the plugin reads that is not listed.
The switches a typed field renders (``render.TYPED_ENV``) are not listed: a recipe may not set them
in ``spec.env`` at all.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Switch:
    """What one switch takes."""

    choices: tuple[str, ...] = ()
    """The values it takes (``env_switch.env_choice``: as written, and exactly one of these);
    none: a whole number >= 0 (``env_switch.env_non_negative_int``: blanks around it ignored,
    an empty value the default)."""
    stripped: bool = False
    """Its reader strips blanks from the value before comparing it with the choices."""

    def accepts(self, value: str) -> bool:
        if self.choices:
            return (value.strip() if self.stripped else value) in self.choices
        written = value.strip()
        if not written:
            return True
        try:
            return int(written) >= 0
        except ValueError:
            return False

    @property
    def expected(self) -> str:
        if not self.choices:
            return "a whole number >= 0"
        if len(self.choices) == 2:
            return " or ".join(map(repr, self.choices))
        return f"one of {', '.join(map(repr, self.choices))}"


ON_OFF = Switch(("1", "0"))
MSA_OR_SGLANG = Switch(("msa", "sglang"))
WHOLE_NUMBER = Switch()

#: Every switch of the plugin that a recipe may set, with what it takes.
PLUGIN_SWITCHES: dict[str, Switch] = {
    "SGLANG_M3_SPARSE_OFFLOAD_LOG_STEPS": WHOLE_NUMBER,
    "SGLANG_M3_DENSE_CUDNN_CHUNK_PLANS": WHOLE_NUMBER,
    "SGLANG_M3_DENSE_PREFILL": Switch(("sdpa", "sglang")),
    "SGLANG_M3_DENSE_CUDNN": Switch(("aligned", "always")),
    "SGLANG_M3_DENSE_PREFIX_SPLIT": ON_OFF,
    "SGLANG_M3_FUSED_LSE_MERGE": ON_OFF,
    "SGLANG_M3_FULL_SELECTION_DENSE": ON_OFF,
    "SGLANG_M3_DENSE_VERIFY": MSA_OR_SGLANG,
    "SGLANG_M3_DENSE_DECODE": MSA_OR_SGLANG,
    "SGLANG_M3_DRAFT_EXTEND": MSA_OR_SGLANG,
    "SGLANG_M3_MOE_IMPL": Switch(("auto", "loop", "static", "fused", "mxfp8", "torch")),
    "SGLANG_M3_MOE_OVERLAP": ON_OFF,
    "SGLANG_M3_FUSE_SHARED_EXPERT": ON_OFF,
    "SGLANG_M3_FUSED_ROUTE": ON_OFF,
    "SGLANG_M3_FUSED_ACT": ON_OFF,
    "SGLANG_M3_FUSED_ATTN_OPS": Switch(("0", "1"), stripped=True),
    "SGLANG_M3_FUSED_NORM": Switch(("1", "0"), stripped=True),
}
