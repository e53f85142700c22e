"""An EAGLE3 draft's weight files checked against its config and the target, before any load.

``config.json`` can agree with the target while the tensors do not: a ``d2t`` map cut to another
draft vocabulary, an ``lm_head`` of another size, ids mapped past the target's vocabulary, an
``fc`` trained on another number of aux layers. Read from SGLang 0.5.23's draft loader (not
run): it then fails inside weight loading with a bare shape assertion in the scheduler, or (an
out-of-range ``d2t``) proposes token ids the target's embedding cannot index. The shapes come
from the safetensors headers (nothing is loaded); only ``d2t``, one integer per draft token, is
read to check its range.
"""

from __future__ import annotations

import glob
import os

import torch
from safetensors import safe_open


class DraftTensorError(ValueError):
    """A draft tensor disagrees with the draft's config or the target; the message names both."""


def tensor_shapes(draft_dir: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """``name -> (shape, file)`` over the draft's ``*.safetensors`` files (empty when it has none)."""
    shapes = {}
    for file in sorted(glob.glob(os.path.join(draft_dir, "*.safetensors"))):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = (tuple(handle.get_slice(name).get_shape()), file)
    return shapes


def absent_draft_vocab_size(draft_dir: str, vocab_size: int) -> int | None:
    """The ``draft_vocab_size`` of a draft config that has none: the full ``vocab_size`` where the
    draft's files hold its own ``lm_head.weight`` (the rows ``check_draft_tensors`` requires then),
    else None, SGLang's value for "take the target's lm_head"."""
    return vocab_size if "lm_head.weight" in tensor_shapes(draft_dir) else None


def _read_tensor(file: str, name: str):
    with safe_open(file, framework="pt") as handle:
        return handle.get_tensor(name)


def check_draft_tensors(draft_dir: str, draft_vocab: int, target_vocab: int, fc_inputs: int) -> None:
    """Refuse tensors that disagree with ``draft_vocab`` (the config's ``draft_vocab_size``, else
    its ``vocab_size``), the target's vocabulary, or ``fc_inputs`` (aux layers x hidden size)."""
    shapes = tensor_shapes(draft_dir)
    if not shapes:
        return

    def shape_of(name: str) -> tuple[int, ...] | None:
        return shapes.get(name, (None,))[0]

    def where(name: str) -> str:
        return f"{os.path.basename(shapes[name][1])}: {name}"

    lm_head = shape_of("lm_head.weight")
    if lm_head is not None and lm_head[0] != draft_vocab:
        raise DraftTensorError(
            f"{where('lm_head.weight')} has {lm_head[0]} rows, but the draft's config gives a draft vocabulary "
            f"of {draft_vocab} (draft_vocab_size, else vocab_size)")
    d2t = shape_of("d2t")
    if d2t is None and draft_vocab < target_vocab:
        raise DraftTensorError(
            f"the draft's config gives draft_vocab_size = {draft_vocab} below the target's {target_vocab}, "
            f"but no d2t tensor in {draft_dir} maps draft ids to target ids")
    if d2t is not None:
        if d2t != (draft_vocab,):
            raise DraftTensorError(
                f"{where('d2t')} has shape {list(d2t)}, but the draft vocabulary is {draft_vocab} "
                "(one offset per draft id)")
        offsets = _read_tensor(shapes["d2t"][1], "d2t").long()
        targets = offsets + torch.arange(draft_vocab)
        bad = ((targets < 0) | (targets >= target_vocab)).nonzero().flatten()
        if len(bad):
            first = int(bad[0])
            raise DraftTensorError(
                f"{where('d2t')} maps {len(bad)} draft id(s) outside the target's vocabulary 0 .. {target_vocab - 1} "
                f"(draft id {first} -> target id {int(targets[first])})")
    t2d = shape_of("t2d")
    if t2d is not None and t2d != (target_vocab,):
        raise DraftTensorError(
            f"{where('t2d')} has shape {list(t2d)}, but the target's vocabulary is {target_vocab} (one flag per target id)")
    fc = shape_of("fc.weight")
    if fc is not None and (len(fc) != 2 or fc[1] != fc_inputs):
        raise DraftTensorError(
            f"{where('fc.weight')} has shape {list(fc)}, but the draft reads {fc_inputs} inputs per token "
            "(its aux layers x the target's hidden_size; eagle_config.eagle_aux_hidden_state_layer_ids)")
