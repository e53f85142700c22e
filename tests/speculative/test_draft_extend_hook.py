"""When the draft-extend hook (``triton_draft_extend_on_msa_kernels``) leaves SGLang's Triton backend
in place: ``SGLANG_M3_DRAFT_EXTEND=sglang``, and under the default (``msa``) any device but CUDA, a
target other than M3, a KV page other than the MSA block; and what it builds for an M3 target on
CUDA (plans over the draft's pools and the target's MSA settings). That backend is served in
``tests/gpu/test_eagle3_gpu.py``.
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
    monkeypatch.setattr(integration_hooks, "spec_of", lambda config: SimpleNamespace(
        index_block_size=128, index_topk_blocks=16, index_local_blocks=1, index_init_blocks=0))
    monkeypatch.delenv("SGLANG_M3_DRAFT_EXTEND", raising=False)

    def choose(hf_config):
        chosen["config"] = SimpleNamespace(hf_config=hf_config)

    return choose


def _factory(device="cuda", page_size=128):
    return SimpleNamespace(draft_model_runner=SimpleNamespace(device=device, page_size=page_size, server_args=object()))


@pytest.mark.parametrize("hf_config, device, page_size, switch", [
    (M3, "cuda", 128, "sglang"),
    (M3, "cpu", 128, None),
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


@pytest.mark.parametrize("switch", [None, "msa"])
def test_an_m3_target_on_cuda_gets_the_msa_draft_extend_backend(target, monkeypatch, switch):
    import torch

    from sglang_m3.speculative import draft_extend

    target(M3)
    if switch is not None:
        monkeypatch.setenv("SGLANG_M3_DRAFT_EXTEND", switch)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    built = {}

    class Backend:
        def __init__(self, runner, plans, **kwargs):
            built.update(runner=runner, plans=plans, kwargs=kwargs)

    monkeypatch.setattr(draft_extend, "triton_backend_class", lambda: Backend)
    factory = _factory()
    runner = factory.draft_model_runner
    runner.req_to_token_pool = SimpleNamespace(req_to_token=torch.zeros(4, 256, dtype=torch.int32))
    runner.token_to_kv_pool = SimpleNamespace(head_num=8)
    runner.model_config = SimpleNamespace(context_len=4096)

    name, backend = triton_draft_extend_on_msa_kernels(lambda f: pytest.fail("SGLang's backend was built"), factory)

    plans = built["plans"]
    assert name == "triton" and isinstance(backend, Backend) and built["runner"] is runner
    assert built["kwargs"] == {"skip_prefill": False}
    assert plans.req_to_token is runner.req_to_token_pool.req_to_token and plans.kv_pool is runner.token_to_kv_pool
    assert (plans.params.block_size, plans.params.topk, plans.params.local_blocks, plans.params.init_blocks) == (128, 16, 1, 0)
    assert (plans.num_kv_heads, plans.context_len, plans.num_sms) == (8, 4096, 132)
