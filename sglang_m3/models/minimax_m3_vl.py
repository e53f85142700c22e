"""MiniMax M3 with its vision tower for SGLang (architecture ``MiniMaxM3SparseForConditionalGeneration``).

The text half is ``MiniMaxM3SparseForCausalLM`` unchanged; images and videos are encoded by
``MiniMaxM3VisionEncoder`` (ViT, projector, 2x2 patch merge) and their rows replace the
placeholder tokens' embeddings through SGLang's multimodal embedding routine, which also keys
the radix cache on media content (padded placeholder ids carry the media hash).
"""

from __future__ import annotations

import logging
from array import array
from typing import Iterable

import torch
from sglang.srt.managers.mm_utils import general_mm_embed_routine, pad_mm_tokens
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from sglang_m3.models.checkpoint_layout import is_derived_buffer
from sglang_m3.models.minimax_m3 import MiniMaxM3SparseForCausalLM, TextWeightLoader
from sglang_m3.models.vision import MiniMaxM3VisionEncoder
from sglang_m3.quant.loading import checked_vision_tensors

logger = logging.getLogger(__name__)


class MiniMaxM3SparseForConditionalGeneration(MiniMaxM3SparseForCausalLM):
    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__(config, quant_config, prefix)
        # SGLang's switch for a multimodal checkpoint served as text only: the checkpoint's own
        # ``language_model_only`` or ``--language-model-only``, both written onto the config, and
        # SGLang then sends no media. A tower built anyway demanded weights such a checkpoint
        # lacks ("missing vision tensor ...") or held ones no request reads. Under pipeline
        # parallelism only the first stage embeds media (SGLang's multimodal routine).
        text_only = getattr(config, "language_model_only", False) or not self.model.stage.is_first_rank
        self.vision = None if text_only else MiniMaxM3VisionEncoder(config)

    def pad_input_ids(self, input_ids: array, mm_inputs) -> array:
        return pad_mm_tokens(input_ids, mm_inputs)

    def get_image_feature(self, items) -> torch.Tensor:
        return self.vision.encode_items(items, "image_grid_thw")

    def get_video_feature(self, items) -> torch.Tensor:
        return self.vision.encode_items(items, "video_grid_thw")

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch: ForwardBatch, input_embeds=None, pp_proxy_tensors=None, **kwargs):
        # The text model's output: hidden states, with the EAGLE3 aux states when they are captured
        # (a stage before the last: the PPProxyTensors for the next one).
        output = general_mm_embed_routine(
            input_ids=input_ids,
            forward_batch=forward_batch,
            language_model=self.model,
            multimodal_model=self,
            positions=positions,
            pp_proxy_tensors=pp_proxy_tensors,
        )
        return self.logits(input_ids, output, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Vision tensors go to the encoder, everything else to the text model; both check that a
        load brings every tensor (an update, after a load, may bring some).

        One pass over the stream, each tensor copied before the next is drawn, as SGLang's weight
        iterators expect: its fastsafetensors iterator closes a file's device buffer once it has
        yielded that file's tensors, and without mmap (``--weight-loader-disable-mmap``) every
        yielded tensor is host memory. Holding the text tensors back until the vision tower had
        seen the whole stream loaded freed memory or held the whole text model in RAM.
        """
        whole = not self.weights_loaded
        text = TextWeightLoader(self, whole=whole)

        def vision_stream():
            for name, tensor in weights:
                if MiniMaxM3VisionEncoder.param_name(name) is None or is_derived_buffer(name):  # the text loader skips buffers
                    text.load_one(name, tensor)
                else:
                    yield name, tensor

        if self.vision is None:
            skipped = sum(1 for _ in vision_stream())  # read past, each dropped as it is drawn
            if skipped:
                why = "language_model_only" if self.model.stage.is_first_rank else "a later pipeline stage"
                logger.info("%s: skipped %d vision tensor(s)", why, skipped)
        else:
            # the tower casts what it is given: quantized tensors are refused on the way (quant.loading)
            self.vision.load_weights(checked_vision_tensors(vision_stream(), self.spec.quantization), whole=whole)
        text.finish()
        self.post_load_weights()


EntryClass = [MiniMaxM3SparseForConditionalGeneration]
