"""M3 configuration: one validated view of the model, whatever layout the checkpoint uses.

``source`` finds the checkpoint's own config (its ``config.json``, never a copy SGLang has padded
or coerced), ``fields`` reads typed values with errors that name the field, ``text_spec`` turns
the text part into :class:`M3TextSpec`. Every field of the shipped layout is read in exactly one
place there; values the project does not implement are refused with the accepted values.
"""

from sglang_m3.config.errors import M3ConfigError
from sglang_m3.config.source import checkpoint_config, text_part, vision_part
from sglang_m3.config.quantization import MXFP8Config
from sglang_m3.config.text_spec import DENSE_LAYER, SPARSE_LAYER, M3TextSpec

__all__ = [
    "DENSE_LAYER",
    "SPARSE_LAYER",
    "M3ConfigError",
    "M3TextSpec",
    "MXFP8Config",
    "checkpoint_config",
    "text_part",
    "vision_part",
]
