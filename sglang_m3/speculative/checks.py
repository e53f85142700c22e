"""Start-up checks of speculative settings for an M3 target: refuse what cannot serve, by name.

Run when SGLang resolves the EAGLE family's server arguments (launcher process, before any
model loads). Without them a draft of the wrong width fails deep inside the first forward, aux
layer ids past the target's depth silently capture nothing, and a draft tree too large for the
MSA kernels' plans fails only at the first verify batch. (Draft trees themselves are verified by
every MSA path; SGLang refuses dense attention backends that do not verify them.)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from msa_kernels.plan import DraftTree

from sglang_m3.speculative.aux_layers import AUX_LAYER_FIELD, resolve_aux_layer_ids
from sglang_m3.speculative.draft_tensors import DraftTensorError, check_draft_tensors


class SpeculativeConfigError(ValueError):
    """A speculative setting an M3 server cannot serve; the message names the flag or field."""


@dataclass(frozen=True)
class TargetShape:
    hidden_size: int
    vocab_size: int
    num_layers: int


def check_eagle_settings(
    algorithm: str, topk: int | None, draft_path: str | None, target: TargetShape, num_draft_tokens: int | None = None
) -> None:
    """Refuse draft trees of more verify tokens than the MSA plans hold, and an EAGLE3 draft
    whose widths, aux layers or weight tensors do not fit the target."""
    if topk is not None and topk > 1 and num_draft_tokens is not None and num_draft_tokens > DraftTree.MAX_TOKENS:
        raise SpeculativeConfigError(
            f"--speculative-num-draft-tokens {num_draft_tokens} with --speculative-eagle-topk {topk}: M3's "
            f"sparse attention verifies draft trees of at most {DraftTree.MAX_TOKENS} tokens per request "
            "(each token's ancestors are one 64-bit mask)"
        )
    draft = _local_config(draft_path)
    if draft is None or algorithm != "EAGLE3":
        return
    where = f"draft config {os.path.join(draft_path, 'config.json')}"
    width = draft.get("target_hidden_size", draft.get("hidden_size"))
    field = "target_hidden_size" if "target_hidden_size" in draft else "hidden_size"
    if width != target.hidden_size:
        raise SpeculativeConfigError(
            f"{where}: {field} = {width}, but the target's hidden_size is {target.hidden_size} "
            "(the draft's fc reads the target's hidden states)"
        )
    if draft.get("vocab_size") != target.vocab_size:
        raise SpeculativeConfigError(
            f"{where}: vocab_size = {draft.get('vocab_size')}, but the target's vocab_size is {target.vocab_size}"
        )
    draft_vocab = draft.get("draft_vocab_size")
    if draft_vocab is not None and not 1 <= draft_vocab <= target.vocab_size:
        raise SpeculativeConfigError(
            f"{where}: draft_vocab_size = {draft_vocab} is outside 1 .. {target.vocab_size} (the target's vocab_size)"
        )
    ids = (draft.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    try:
        layers = resolve_aux_layer_ids(ids, target.num_layers)
    except ValueError as error:
        raise SpeculativeConfigError(f"{where}: {error}") from None
    num_aux = draft.get("num_aux_hidden_states")
    if num_aux is not None and ids is not None and num_aux != len(ids):
        raise SpeculativeConfigError(
            f"{where}: num_aux_hidden_states = {num_aux} disagrees with {AUX_LAYER_FIELD} ({len(ids)} ids)"
        )
    try:
        check_draft_tensors(draft_path, draft_vocab or draft["vocab_size"], target.vocab_size, len(layers) * target.hidden_size)
    except DraftTensorError as error:
        raise SpeculativeConfigError(f"draft weights: {error}") from None


def _local_config(path: str | None) -> dict | None:
    """The draft's ``config.json`` when it is a local directory (hub ids are checked by SGLang)."""
    file = os.path.join(path, "config.json") if path else None
    if not file or not os.path.isfile(file):
        return None
    with open(file, encoding="utf-8") as handle:
        return json.load(handle)
