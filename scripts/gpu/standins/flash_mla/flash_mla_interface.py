"""``flash_mla.flash_mla_interface`` of the stand-in (see the package docstring)."""

from ._missing import missing_attribute


def __getattr__(name: str):
    return missing_attribute(__name__, name)
