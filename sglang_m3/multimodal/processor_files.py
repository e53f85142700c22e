"""Which reader a VL checkpoint's processor files need: SGLang's, or transformers' own.

SGLang 0.5.23 builds M3's HF processor from ``preprocessor_config.json`` in the form the published
checkpoint ships (``patch_size``, ``img_token_compression_config``, ``size`` as ``[h, w]``).
transformers writes other files: its processor's ``save_pretrained`` writes ``processor_config.json``
only, and its image processor saved alone writes ``preprocessor_config.json`` in its own form
(naming ``image_processor_type``; ``merge_size``; ``size`` as shortest / longest edge). A VL
checkpoint saved that way did not start: SGLang looked for the missing file, or failed on the
other form's ``size`` (``KeyError: 'height'``). Such files are read by transformers, which wrote
them; the published form stays with SGLang's reader.
"""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger(__name__)

SHIPPED_FILE = "preprocessor_config.json"


def in_shipped_form(model_path: str) -> bool:
    """Whether the local checkpoint ``model_path`` has a ``preprocessor_config.json`` in the
    published form (transformers' own form names the class that reads it, ``image_processor_type``)."""
    path = os.path.join(model_path, SHIPPED_FILE)
    if not os.path.isfile(path):
        return False
    with open(path, encoding="utf-8") as handle:
        return "image_processor_type" not in json.load(handle)


def read_processor_files_transformers_wrote(original, model_path, config, revision, *args, **kwargs):
    """Around SGLang's M3 processor loader: a local checkpoint without the published
    ``preprocessor_config.json`` gets transformers' processor from its own files (an error naming
    the files when it has none); anything else goes to SGLang's loader unchanged."""
    if not os.path.isdir(model_path) or in_shipped_form(model_path):
        return original(model_path, config, revision, *args, **kwargs)
    from transformers import AutoProcessor

    logger.info("%s: processor files written by transformers, read with transformers' AutoProcessor", model_path)
    return AutoProcessor.from_pretrained(model_path, revision=revision)
