"""When the draft-extend hook (``triton_draft_extend_on_msa_kernels``) leaves SGLang's Triton backend
in place: the switch off (its default) or ``sglang``, and with ``SGLANG_M3_DRAFT_EXTEND=msa`` any
device but CUDA, a target other than M3, a KV page other than the MSA block. Where it takes the
backend (an M3 target on CUDA) is served in ``tests/gpu/test_eagle3_gpu.py`` under the switch.
"""

from types import SimpleNamespace

import pytest

from sglang_m3.speculative.hooks import triton_draft_extend_on_msa_kernels

M3 = SimpleNamespace(architectures=["MiniMaxM3SparseForCausalLM"])
LLAMA = SimpleNamespace(architectures=["LlamaForCausalLM"])


@pytest.fixture
def target(monkeypatch):
    """Set the target's config; ``spec_of`` answers M3's block size of 128."""
    from sglang.srt.arg_groups import model_override_base

    from sglang_m3.integration import hooks as integration_hooks

    chosen = {}
    monkeypatch.setattr(model_override_base, "model_config_of", lambda server_args: chosen["config"])
    monkeypatch.setattr(integration_hooks, "spec_of", lambda config: SimpleNamespace(index_block_size=128))
    monkeypatch.delenv("SGLANG_M3_DRAFT_EXTEND", raising=False)

    def choose(hf_config):
        chosen["config"] = SimpleNamespace(hf_config=hf_config)

    return choose


def _factory(device="cuda", page_size=128):
    return SimpleNamespace(draft_model_runner=SimpleNamespace(device=device, page_size=page_size, server_args=object()))


@pytest.mark.parametrize("hf_config, device, page_size, switch", [
    (M3, "cuda", 128, None),
    (M3, "cuda", 128, "sglang"),
    (M3, "cpu", 128, "msa"),
    (LLAMA, "cuda", 128, "msa"),
    (M3, "cuda", 64, "msa"),
])
def test_sglangs_backend_is_kept(target, monkeypatch, hf_config, device, page_size, switch):
    target(hf_config)
    if switch is not None:
        monkeypatch.setenv("SGLANG_M3_DRAFT_EXTEND", switch)
    factory = _factory(device, page_size)
    sglangs = ("triton", object())
    assert triton_draft_extend_on_msa_kernels(lambda f: sglangs if f is factory else None, factory) is sglangs


def test_a_bad_switch_value_is_refused_at_start_up(target, monkeypatch):
    target(M3)
    monkeypatch.setenv("SGLANG_M3_DRAFT_EXTEND", "yes")
    with pytest.raises(ValueError, match="SGLANG_M3_DRAFT_EXTEND='yes'"):
        triton_draft_extend_on_msa_kernels(lambda f: None, _factory())
