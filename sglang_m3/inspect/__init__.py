"""``sglang-m3 inspect``: the real size of an M3 configuration without its weights.

The project's own model classes are built on the meta device (shapes, no memory) inside an
SGLang runtime context for each tensor-parallel rank, so the per-rank shapes are the ones
SGLang's parallel layers choose, not a re-derivation. ``source`` reads the config,
``meta_build`` builds one rank, ``sharding`` sorts each built parameter under the rule that
splits it, ``decode_floor`` counts what one decode step must read, ``report`` adds it all up
(and writes the geometry record the recipe layer reads).
"""
