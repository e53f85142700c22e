"""SGLang model classes for MiniMax M3, registered under the checkpoint's architecture names.

SGLang's ``ModelRegistry.register("sglang_m3.models", overwrite=True)`` imports every module in
this package and collects each module's ``EntryClass``; modules that hold building blocks only
define no ``EntryClass``.
"""
