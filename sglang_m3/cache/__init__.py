"""KV cache pieces for M3: the index-key pool that rides on SGLang's main KV slots."""
