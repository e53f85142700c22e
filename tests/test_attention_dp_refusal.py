"""``--attn-dp-size`` > 1 is refused at start-up, naming the flag.

M3's attention in this plugin splits its heads over the whole tensor-parallel group (SGLang's own
M3 uses the attention-TP group), so attention data parallelism would hand each attention group a
batch its heads and KV pool were not built for. The refusal runs where the M3 KV pool is sized.
"""

import pytest

from sglang_m3.integration.hooks import refuse_attention_data_parallel


@pytest.mark.parametrize("attn_dp", [2, 4])
def test_attention_data_parallel_is_refused_naming_the_flag(attn_dp):
    with pytest.raises(ValueError, match=rf"--attn-dp-size {attn_dp}: .*--attn-dp-size 1"):
        refuse_attention_data_parallel(attn_dp)
    assert refuse_attention_data_parallel(1) is None  # one attention group: served
