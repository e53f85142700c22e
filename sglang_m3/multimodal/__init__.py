"""Image and video preprocessing for MiniMax M3, run in SGLang's tokenizer manager process.

Media sources (URL, data URL / base64, allowed local path, raw bytes) are read once with size
caps, decoded with their declared size checked first, resized to multiples of patch x merge,
normalised and cut into patch rows with grid metadata; the prompt's placeholders are expanded to
the matching number of tokens. The GPU worker only ever sees patch tensors.

Modules: ``limits`` (configurable caps), ``errors`` (errors that name the content part),
``sources`` (reading media bytes), ``patches`` (resize geometry, normalise, patchify),
``image`` / ``video`` (decoding), ``pool`` (bounded worker pool), ``prompt`` (placeholder
expansion), ``preprocessor`` (one request's media end to end), ``sglang_processor`` (SGLang's
multimodal processor for the M3 architecture).
"""
