"""Kubernetes operator for M3Recipe custom resources.

The operator turns each recipe into a running SGLang deployment: one pure function computes
the desired objects (``desired.desired_state``), server-side apply makes the cluster match, and
the recipe's status mirrors what the workload and its pods do. It imports only
``sglang_m3.recipe`` from the project, so its container needs neither torch nor SGLang.
"""

__version__ = "0.1.0"
