"""GPU-harness stand-in for the ``sgl-flash-mla`` wheel (test infrastructure only).

SGLang's EAGLE worker imports its FlashMLA backend class while choosing a draft-extend graph
runner (an ``isinstance`` check against the draft's attention backend), and that import needs
``flash_mla``. The real wheel is a compiled CUDA extension the device call cannot carry; M3 and
its EAGLE3 draft use no MLA kernel, so names resolve and any call raises, naming this stand-in.
"""

from ._missing import missing_attribute

__version__ = "0.0.0.standin"


def __getattr__(name: str):
    return missing_attribute(__name__, name)
