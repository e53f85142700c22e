"""Placeholders for the stand-in's names: importable, and raising when used."""


def missing_attribute(module: str, name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def refuse(*args, **kwargs):
        raise NotImplementedError(
            f"{module}.{name}: FlashMLA is a stand-in in the GPU harness (scripts/gpu/standins/flash_mla); no MLA kernel runs there"
        )

    refuse.__qualname__ = f"{module}.{name}"
    return refuse
