"""How far a bf16 server's outputs stray from the fp32 transformers reference (the GPU tests' bf16 criterion).

bf16 cannot be held to fp32's tokens or logprobs on the tiny model (sharp logits from random
weights; ``test_tiny_m3_gpu.py`` gives the measurements). What can be held: every served token is
a near-argmax of the fp32 reference along the served sequence, within twice the prompt-logprob
noise ``delta`` of the same request, and one bf16 path's ``delta`` is not larger than another's
by more than a small ratio. For short prompts (a few dozen positions) the prompt alone samples
too little of the noise; :func:`sequence_noise` adds the served tokens' own positions.
"""

from __future__ import annotations

import torch
from served_vs_reference import output_ids
from transformers_oracle import load_reference_model, prompt_logprobs


def served_logprobs(result, prompt) -> dict[int, float]:
    """{prompt position: served logprob} for the positions the server returned a value for."""
    entries = result["meta_info"]["input_token_logprobs"]
    start = len(prompt) - len(entries)
    assert [t[1] for t in entries] == prompt[start:]
    return {start + i: t[0] for i, t in enumerate(entries) if t[0] is not None}


@torch.no_grad()
def _served_rows(model_dir, prompt, served) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logprob rows predicting each served token given the served prefix, and the served tokens' values."""
    sequence = torch.tensor([prompt + served])
    logprobs = load_reference_model(model_dir)(input_ids=sequence).logits[0].float().log_softmax(-1)
    rows = logprobs[len(prompt) - 1 : len(prompt) - 1 + len(served)]
    return rows, rows.gather(1, torch.tensor(served)[:, None])[:, 0]


def reference_gaps(model_dir, prompt, served) -> list[float]:
    """For each served token: fp32 max logprob minus the served token's, given the served prefix."""
    rows, picked = _served_rows(model_dir, prompt, served)
    return (rows.max(-1).values - picked).tolist()


def sequence_noise(result, model_dir, prompt, prompt_delta: float) -> float:
    """The larger of ``prompt_delta`` and the largest |bf16 - fp32| logprob of the served tokens
    themselves (each given the served prefix): the noise the served sequence carried."""
    entries = result["meta_info"]["output_token_logprobs"]
    served = [token for _, token, *_ in entries]
    _, picked = _served_rows(model_dir, prompt, served)
    return max(prompt_delta, *(abs(lp - ref) for (lp, *_), ref in zip(entries, picked.tolist())))



def request_noise(model_dir, prompt, result) -> tuple[float, float]:
    """(the request's noise: :func:`sequence_noise` over its prompt-logprob delta, the largest of
    its served tokens' :func:`reference_gaps`)."""
    reference = prompt_logprobs(model_dir, prompt)
    delta = max(abs(v - reference[p - 1].item()) for p, v in served_logprobs(result, prompt).items())
    return sequence_noise(result, model_dir, prompt, delta), max(reference_gaps(model_dir, prompt, output_ids(result)))
