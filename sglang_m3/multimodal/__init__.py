"""Image and video preprocessing for MiniMax M3, run in SGLang's tokenizer manager process.

Media sources (URL, data URL / base64, allowed local path, raw bytes, in-memory PIL images from
SGLang's Engine API) are read once with size caps, decoded with their declared size checked first,
resized to multiples of patch x merge, normalised and cut into patch rows with grid metadata; the
prompt's placeholders are expanded to the matching number of tokens. The GPU worker only ever
sees patch tensors. The output equals transformers' ``MiniMaxM3VLImageProcessor`` /
``MiniMaxM3VLVideoProcessor``.

Configuration, through SGLang's ``--mm-process-config`` JSON::

    {"image": {"min_pixels": 3136, "max_pixels": 451584},
     "video": {"min_pixels": 3136, "max_pixels": 602112, "fps": 1.0},
     "limits": {"max_images": 16, "max_video_frames": 768, "max_video_seconds": 1200, ...}}

``limits`` takes the fields of :class:`~sglang_m3.multimodal.limits.MediaLimits`; unknown keys
fail at startup. Without ``video.fps`` / ``limits.video_fps`` the checkpoint's video processor
``fps`` is the default rate, as in transformers; a processor that switches off a step or names a
resampler other than bicubic is refused at startup. The worker pool is ``--mm-io-worker-num``
threads wide. A request's item may set its own ``min_pixels`` / ``max_pixels`` (up to the server's
``max_pixels``) and, for a video, ``fps`` / ``max_frames`` (up to ``limits.max_video_frames``);
any other per-item option is refused, naming it and the item. A request's ``mm_processor_kwargs``
set the same options for all its items (flat, or in ``images_kwargs`` / ``videos_kwargs``, as
transformers' processor takes its call's kwargs); an item's own option wins.

Images: PNG, JPEG, WebP, GIF, BMP, TIFF, AVIF, JPEG 2000, ICO, QOI and PBM/PGM/PPM (the formats
PIL decodes and transformers' processor so takes), first frame, alpha dropped, no EXIF rotation
(transformers' processor applies none). Videos: what PyAV decodes, an animated GIF included.
Data URLs with or without ``;base64`` (RFC 2397 percent-encoding, or base64 as transformers reads
it); HTTP bodies of a generic ``application/octet-stream`` type are judged by their content.

Modules: ``limits`` (configurable caps), ``errors`` (errors that name the content part),
``sources`` (reading media bytes), ``patches`` (resize geometry, normalise, patchify),
``image`` / ``video`` (decoding), ``options`` (an item's own ``min_pixels`` / ``max_pixels`` /
``fps`` / ``max_frames``, honoured or refused by name), ``pool`` (bounded worker pool), ``prompt``
(placeholder expansion), ``preprocessor`` (one request's media end to end), ``sglang_processor``
(SGLang's multimodal processor for the M3 architecture).
"""
