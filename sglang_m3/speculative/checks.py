"""Start-up checks of speculative settings for an M3 target: refuse what cannot serve, by name.

Run when SGLang resolves the EAGLE family's server arguments (launcher process, before any
model loads). Without them a draft of the wrong width fails deep inside the first forward, aux
layer ids past the target's depth silently capture nothing, and a draft tree too large for the
MSA kernels' plans fails only at the first verify batch. (Draft trees themselves are verified by
every MSA path; SGLang refuses dense attention backends that do not verify them.)

SGLang 0.5.23 accepts, and then fails on, more (each served on the CPU platform, see
``tests/speculative/test_start_up_refusals.py``): NEXTN / EAGLE without a draft, or with the M3
checkpoint as its own draft, load the whole target again as the "draft" and die in the scheduler
(no M3 MTP draft model exists: the checkpoint's ``model.mtp.*`` modules are skipped at load);
draft trees whose verify width the draft pass cannot fill, or that is narrower than its steps,
kill the scheduler at the first request; and an EAGLE draft gets the target's embedding and
lm_head, so one of another width dies at the first request.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from msa_kernels.plan import DraftTree

from sglang_m3.integration.hooks import M3_ARCHITECTURES, first_architecture
from sglang_m3.speculative.aux_layers import AUX_LAYER_FIELD, resolve_aux_layer_ids
from sglang_m3.speculative.draft_tensors import DraftTensorError, check_draft_tensors


class SpeculativeConfigError(ValueError):
    """A speculative setting an M3 server cannot serve; the message names the flag or field."""


@dataclass(frozen=True)
class TargetShape:
    hidden_size: int
    vocab_size: int
    num_layers: int
    num_mtp_modules: int = 0


def check_eagle_settings(
    algorithm: str,
    topk: int | None,
    draft_path: str | None,
    target: TargetShape,
    num_draft_tokens: int | None = None,
    num_steps: int | None = None,
) -> None:
    """Refuse a missing or M3 draft, draft trees the draft pass cannot fill or the MSA plans cannot
    hold, an EAGLE draft of another width or of the EAGLE3 format, and an EAGLE3 draft whose
    widths, aux layers or weight tensors do not fit the target."""
    draft = _local_config(draft_path)
    _check_draft_is_no_m3(algorithm, draft_path, draft, target)
    _check_tree_width(topk, num_steps, num_draft_tokens)
    if draft is None:
        return
    where = f"draft config {os.path.join(draft_path, 'config.json')}"
    if algorithm == "EAGLE":
        _check_eagle_draft(where, draft, target)
    elif algorithm == "EAGLE3":
        _check_eagle3_draft(where, draft_path, draft, target)


def _check_eagle3_draft(where: str, draft_path: str, draft: dict, target: TargetShape) -> None:
    """An EAGLE3 draft's widths, vocabularies, aux layers and weight tensors against the target."""
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


def _check_draft_is_no_m3(algorithm: str, draft_path: str | None, draft: dict | None, target: TargetShape) -> None:
    """Refuse serving M3's own MTP modules, asked for by naming no draft or (EAGLE, EAGLE3: the
    NEXTN family) the M3 checkpoint: SGLang then loads the whole target again as the draft and
    its scheduler dies at start-up. (A STANDALONE draft is a whole model of its own and may be one.)"""
    mtp = (
        f"M3's multi-token-prediction modules (num_mtp_modules = {target.num_mtp_modules} in the target's "
        "config) are skipped at load and no MTP draft model for M3 exists; serve --speculative-algorithm "
        "EAGLE3 with an M3 EAGLE3 draft (e.g. Inferact/MiniMax-M3-EAGLE3) as --speculative-draft-model-path"
    )
    if draft_path is None:
        raise SpeculativeConfigError(f"--speculative-algorithm {algorithm} without --speculative-draft-model-path: {mtp}")
    if algorithm in ("EAGLE", "EAGLE3") and first_architecture(draft) in M3_ARCHITECTURES:
        architectures = draft.get("architectures")
        raise SpeculativeConfigError(
            f"--speculative-draft-model-path {draft_path} is an M3 checkpoint (architectures {architectures}), "
            f"not a draft: {mtp}"
        )


def _check_tree_width(topk: int | None, num_steps: int | None, num_draft_tokens: int | None) -> None:
    """A tree's verify tokens (root included) must hold the longest accepted path (``steps + 1``,
    which SGLang packs into them after verify), be no more than the draft pass proposes (``topk``
    at the first step, ``topk**2`` at each later one, plus the root) and fit the MSA plans'
    64-bit ancestor masks. Chains (top-k 1) get ``steps + 1`` tokens from SGLang itself."""
    if topk is None or topk <= 1 or num_draft_tokens is None:
        return
    flags = f"--speculative-num-draft-tokens {num_draft_tokens} with --speculative-eagle-topk {topk}"
    if num_draft_tokens > DraftTree.MAX_TOKENS:
        raise SpeculativeConfigError(
            f"{flags}: M3's sparse attention verifies draft trees of at most {DraftTree.MAX_TOKENS} tokens per "
            "request (each token's ancestors are one 64-bit mask)"
        )
    if num_steps is None:
        return
    flags = f"{flags} and --speculative-num-steps {num_steps}"
    proposed = 1 + topk + (num_steps - 1) * topk**2
    if num_draft_tokens > proposed:
        raise SpeculativeConfigError(
            f"{flags}: a draft pass proposes at most {proposed} (1 + topk + (steps - 1) * topk**2) verify "
            "tokens; SGLang's draft step fails on the first request asking for more"
        )
    if num_draft_tokens < num_steps + 1:
        raise SpeculativeConfigError(
            f"{flags}: a tree needs at least {num_steps + 1} (steps + 1) verify tokens to hold its longest "
            "accepted path; SGLang's verify fails on the first request with fewer"
        )


def _check_eagle_draft(where: str, draft: dict, target: TargetShape) -> None:
    """An EAGLE (not EAGLE3) draft: SGLang gives it the target's embedding and lm_head and the
    target's last hidden state, so it must be as wide as the target; an EAGLE3 draft would read
    none of the aux layers it was trained on (and, narrower, dies at the first request)."""
    architectures = draft.get("architectures") or []
    if any("Eagle3" in name for name in architectures):
        raise SpeculativeConfigError(
            f"{where}: architectures {architectures} is an EAGLE3 draft, but --speculative-algorithm is EAGLE "
            "(NEXTN resolves to it): serve it with --speculative-algorithm EAGLE3"
        )
    if draft.get("hidden_size") != target.hidden_size:
        raise SpeculativeConfigError(
            f"{where}: hidden_size = {draft.get('hidden_size')}, but the target's hidden_size is {target.hidden_size} "
            "(an EAGLE draft shares the target's embedding and lm_head)"
        )


def _local_config(path: str | None) -> dict | None:
    """The draft's ``config.json`` when it is a local directory (hub ids are checked by SGLang)."""
    file = os.path.join(path, "config.json") if path else None
    if not file or not os.path.isfile(file):
        return None
    with open(file, encoding="utf-8") as handle:
        return json.load(handle)
