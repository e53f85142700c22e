"""SGLang's multimodal processor for MiniMax M3 (``MiniMaxM3SparseForConditionalGeneration``).

It runs in the tokenizer manager process: media are decoded and patched there, in a bounded
worker pool, and the scheduler receives patch rows, grids and the expanded token ids. Errors are
:class:`MediaError` (a ValueError naming the content part), which SGLang's OpenAI layer turns
into an HTTP 400 while the server keeps serving. Each item's own options (``min_pixels``,
``max_pixels``, ``fps``, ``max_frames``) and the request's ``mm_processor_kwargs`` are read by
:mod:`sglang_m3.multimodal.options`.

Registration goes through SGLang's own switch for out-of-tree processors: the tokenizer manager
imports ``SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE`` with ``overwrite=True``, which replaces the
upstream M3 processor of the same architecture name.
"""

from __future__ import annotations

import logging
import os

import torch
from sglang.srt.arg_groups.model_override_base import model_config_of
from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem, MultimodalProcessorOutput
from sglang.srt.multimodal.processors.base_processor import BaseMultimodalProcessor
from sglang.srt.runtime_context import get_mm
from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3SparseForConditionalGeneration

from sglang_m3.config import checkpoint_config, vision_part
from sglang_m3.multimodal.errors import MediaError
from sglang_m3.multimodal.pool import MediaWorkerPool
from sglang_m3.multimodal.preprocessor import MediaPreprocessor, PreprocessConfig, ProcessedMedia, check_against_vision_config
from sglang_m3.multimodal.prompt import MediaTokens, expand_ids, expand_text, placeholder_runs

logger = logging.getLogger(__name__)

PACKAGE = "sglang_m3.multimodal"
PACKAGE_ENV = "SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE"
PENDING_PER_WORKER = 8


def register_multimodal_processor() -> None:
    """Make SGLang's tokenizer manager pick this processor for the M3 VL architecture.

    Called by the plugin in every SGLang process; the variable is inherited by the processes
    SGLang starts later. A different package already named there is left alone (logged).
    """
    current = os.environ.get(PACKAGE_ENV)
    if current and current != PACKAGE:
        logger.warning("%s=%s is set; the MiniMax M3 media processor is not registered", PACKAGE_ENV, current)
        return
    os.environ[PACKAGE_ENV] = PACKAGE


class MiniMaxM3MultimodalProcessor(BaseMultimodalProcessor):
    # Keyed by architecture name; transformers' class carries the checkpoint's name.
    models = [MiniMaxM3SparseForConditionalGeneration]
    gpu_image_decode = False

    def __init__(self, hf_config, server_args, _processor, transport_mode, *args, **kwargs):
        super().__init__(hf_config, server_args, _processor, transport_mode, *args, **kwargs)
        config = PreprocessConfig.from_settings(_processor, get_mm().mm_process_config)
        check_against_vision_config(config, vision_part(checkpoint_config(hf_config)) or {})
        workers = max(1, self.mm_io_worker_num)
        self.media = MediaPreprocessor(config, MediaWorkerPool(workers, workers * PENDING_PER_WORKER))
        self.tokens = config.tokens
        # Patch rows travel in the model's dtype: half the bytes for bf16, and no cast left to
        # do in the model worker (the vision tower casts to its weight dtype first anyway).
        self.feature_dtype = model_config_of(server_args).dtype
        self.token_ids = {kind: self._special_id(getattr(self.tokens, kind)) for kind in ("image", "video", "start", "end")}
        if self.token_ids["image"] != getattr(hf_config, "image_token_id", self.token_ids["image"]):
            raise ValueError(
                f"tokenizer id {self.token_ids['image']} of {self.tokens.image!r} differs from the "
                f"config's image_token_id {hf_config.image_token_id}"
            )

    def _special_id(self, token: str) -> int:
        token_id = self._tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == self._tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no token {token!r}, which MiniMax M3 media need")
        return token_id

    def _encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def _encode_prompt(self, text: str) -> list[int]:
        """The expanded prompt, tokenized as SGLang tokenizes a text prompt and transformers'
        processor tokenizes its text: with the special tokens the tokenizer adds by itself, unless
        the text already starts with BOS (the chat template's), as upstream SGLang's processors
        guard against a second one. It was always encoded without them, so a tokenizer that adds
        BOS gave the same ``/generate`` prompt a BOS without an image and none with one."""
        bos = getattr(self._tokenizer, "bos_token", None)
        adds_specials = getattr(self, "_tokenizer_auto_adds_specials", False)  # set by SGLang's base class
        add = bool(adds_specials) and not (bos and text.startswith(bos))
        return self._tokenizer.encode(text, add_special_tokens=add)

    async def process_mm_data_async(
        self, image_data, audio_data, input_text, request_obj, **kwargs
    ) -> MultimodalProcessorOutput:
        if audio_data:
            raise MediaError("audio 1", "MiniMax M3 takes images and videos, not audio")
        videos = list(getattr(request_obj, "video_data", None) or [])
        request_kwargs = getattr(request_obj, "mm_processor_kwargs", None)
        media = await self.media.process(list(image_data or []), videos, request_kwargs)
        if isinstance(input_text, str):
            ids = self._encode_prompt(expand_text(input_text, self.tokens, media.image_texts, media.video_texts))
        else:
            ids = expand_ids(list(input_text), self.token_ids, media.image_texts, media.video_texts, self._encode)
        return MultimodalProcessorOutput(
            input_ids=ids,
            mm_items=self.data_items(ids, media),
            im_token_id=self.token_ids["image"],
            im_start_id=self.token_ids["start"],
            im_end_id=self.token_ids["end"],
            video_token_id=self.token_ids["video"],
        )

    def data_items(self, ids: list[int], media: ProcessedMedia) -> list[MultimodalDataItem]:
        """One item per image / video, holding its patch rows, grid and placeholder spans."""
        image_runs = placeholder_runs(ids, self.token_ids["image"])
        video_runs = placeholder_runs(ids, self.token_ids["video"])
        frames = sum(video.grid_thw[0] for video in media.videos)
        if len(image_runs) != len(media.images) or len(video_runs) != frames:
            raise RuntimeError(f"{len(image_runs)} image / {len(video_runs)} video token runs for {len(media.images)} images / {frames} video frames")
        items = [
            MultimodalDataItem(
                modality=Modality.IMAGE,
                feature=image.pixel_values.to(self.feature_dtype),
                offsets=[run],
                model_specific_data={"image_grid_thw": torch.tensor([image.grid_thw])},
            )
            for image, run in zip(media.images, image_runs)
        ]
        start = 0
        for video in media.videos:
            count = video.grid_thw[0]
            items.append(
                MultimodalDataItem(
                    modality=Modality.VIDEO,
                    feature=video.pixel_values.to(self.feature_dtype),
                    offsets=video_runs[start : start + count],
                    model_specific_data={"video_grid_thw": torch.tensor([video.grid_thw])},
                )
            )
            start += count
        return items

    def shutdown(self) -> None:
        self.media.pool.shutdown()
        super().shutdown()
