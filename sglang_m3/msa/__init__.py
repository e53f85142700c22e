"""SGLang attention backend for M3's sparse (MSA) layers.

``plan`` turns SGLang's batch into per-request MSA metadata once per forward; ``backend`` runs
each sparse layer against it (torch path on the CPU) and ``hybrid`` routes dense layers to
SGLang's own backend.
"""
