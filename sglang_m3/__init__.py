"""MiniMax M3 on SGLang.

This package imports nothing heavy on purpose: the operator and the recipe CLI import
``sglang_m3.recipe`` on machines without torch or SGLang.
"""

__version__ = "0.1.0"
