"""Which target layers feed an EAGLE3 draft (its "aux hidden states").

An EAGLE3 draft's ``fc`` reads the concatenation of a few target hidden states per token. The
draft's ``config.json`` may name them in ``eagle_config.eagle_aux_hidden_state_layer_ids``: each
id is a decoder layer whose *output* (the residual stream after that layer, before the final
norm) is captured. Without that key SGLang calls ``set_eagle3_layers_to_capture(None)``.

The default for M3 is the output of layers ``[2, n // 2, n - 3]`` (2, 30 and 57 on the 60-layer
model). Source: SGLang 0.5.23's ``models/minimax_m3_vl.py`` (the class of the real, VL
checkpoint), whose comment records that the published ``Inferact/MiniMax-M3-EAGLE3`` ships no
``eagle_aux_hidden_state_layer_ids`` and that with the Llama rule (inputs of those layers, one
layer earlier) its acceptance collapses. SGLang's text-only M3 class applies the Llama rule; this
project uses the draft's convention for both classes.
"""

from __future__ import annotations

from typing import Sequence

AUX_LAYER_FIELD = "eagle_config.eagle_aux_hidden_state_layer_ids"


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """Outputs of layers ``2, n // 2, n - 3`` (what the published M3 draft was trained on)."""
    return (2, num_layers // 2, num_layers - 3)


def resolve_aux_layer_ids(
    layer_ids: Sequence[int] | None, num_layers: int, given_as: str | None = None,
) -> tuple[int, ...]:
    """The layers to capture, in the draft's order (repeats kept: the draft's ``fc`` expects one
    slice per id); ids outside ``0 .. num_layers - 1`` are refused naming the draft field, or
    ``given_as`` (e.g. the command-line flag that gave them) when set."""
    ids = default_aux_layer_ids(num_layers) if layer_ids is None else tuple(layer_ids)
    source = "the default for M3" if layer_ids is None else "the draft's config.json"
    named = given_as or f"{AUX_LAYER_FIELD} = {list(ids)} ({source})"
    if not ids:
        empty = f"{AUX_LAYER_FIELD} is empty" if given_as is None else f"{given_as} names no layer"
        raise ValueError(f"{empty}: an EAGLE3 draft reads at least one target layer")
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"{named} names layer(s) {bad} outside the target's "
            f"layers 0 .. {num_layers - 1} (num_hidden_layers {num_layers})"
        )
    return ids
