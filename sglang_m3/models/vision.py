"""MiniMax M3 vision tower, projector and patch merge as plain torch modules.

The VL model class calls :class:`MiniMaxM3VisionEncoder` with the patch rows and grids made by
``sglang_m3.multimodal`` and scatters the returned rows at the image / video placeholder tokens.

Layout of one media item (image: ``t == 1``; video: ``t`` = frames / temporal patch): its
``t * h * w`` patch rows come block-major over 2x2 merge blocks, so every 4 consecutive rows form
one merged token. The tower is a pre-norm CLIP-style ViT whose attention rotates queries and
keys with a 3D (t, h, w) RoPE. Attention is limited to one media item (optionally to segments of
``vision_segment_max_frames`` temporal patches, when a checkpoint config sets it): results do not
depend on which other images happen to share the batch. Transformers' reference runs every item
of one call in a single attention window, which only coincides with this for one item per call.

Weight names follow the original checkpoint (``vision_tower.vision_model...``,
``multi_modal_projector.linear_1/2``, ``patch_merge_mlp.linear_1/2``). Transformers'
``save_pretrained`` writes the ViT MLP as ``...layers.N.block_sparse_moe.fc1`` (its reverse rename
of the text MoE also hits the vision layers), so that spelling is accepted too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sglang_m3.config import M3ConfigError, checkpoint_config, fields, text_part, vision_part

VISION_PREFIX = "vision_tower.vision_model."


def _size(vision: dict, key: str, *default: int) -> int:
    """A positive integer ``vision_config.key`` (required without a default).

    Read through the typed field readers rather than ``int()``: a zero, negative, fractional,
    boolean or string size otherwise built a tower that failed (or silently truncated the size)
    at the first image instead of being refused at start-up.
    """
    return fields.positive_int(vision, key, *default, name=f"vision_config.{key}")


def _check_heads(vision: dict, hidden: int, heads: int) -> None:
    """Channels per attention head are ``hidden_size / num_attention_heads``, which must be whole.

    transformers' tower reads its axial RoPE bands from ``vision_config.head_dim`` when the config
    has one, but sizes its heads as ``hidden_size // num_attention_heads``; a head_dim that differs
    rotates other channels there (or fails), so it must agree (it is ignored here otherwise).
    """
    if hidden % heads:
        raise M3ConfigError(
            f"config field 'vision_config.hidden_size' ({hidden}) must be a multiple of "
            f"'vision_config.num_attention_heads' ({heads})"
        )
    stated = vision.get("head_dim")
    if stated is not None and (isinstance(stated, bool) or stated != hidden // heads):
        raise M3ConfigError(
            f"config field 'vision_config.head_dim' ({stated!r}) must equal hidden_size / num_attention_heads "
            f"({hidden} / {heads} = {hidden // heads})"
        )


def _rope_theta(vision: dict) -> float:
    """The 3D RoPE base: ``rope_theta`` (shipped) or ``rope_parameters.rope_theta`` (transformers);
    both present must agree, as for the text model (one was silently preferred before)."""
    rope = vision.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise M3ConfigError(f"config field 'vision_config.rope_parameters' must be a mapping, got {rope!r}")
    theta = fields.agree(
        "vision_config.rope_theta", vision.get("rope_theta"), "vision_config.rope_parameters.rope_theta", rope.get("rope_theta")
    )
    return fields.positive_float({"rope_theta": theta}, "rope_theta", 10000.0, name="vision_config.rope_theta")


def _projector_width(top: dict, vision: dict) -> int:
    """Hidden width of the projector MLPs: ``projector_hidden_size`` (transformers' layout, top
    level) or ``vision_config.projection_dim`` (the shipped file); both present must agree, and
    neither present is refused (transformers would assume 6144, not the text width)."""
    top_level, nested = top.get("projector_hidden_size"), vision.get("projection_dim")
    if top_level is not None and nested is not None and top_level != nested:
        raise M3ConfigError(
            f"config fields 'projector_hidden_size' ({top_level!r}) and 'vision_config.projection_dim' ({nested!r}) disagree"
        )
    width = top_level if top_level is not None else nested
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise M3ConfigError(
            f"config field 'projector_hidden_size' (or 'vision_config.projection_dim') must be a positive integer, got {width!r}"
        )
    return width


@dataclass(frozen=True)
class VisionDims:
    """The sizes the vision path needs, read once from the VL config."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    layer_norm_eps: float
    rope_theta: float
    projector_hidden_size: int
    text_hidden_size: int
    segment_max_frames: int | None

    @classmethod
    def from_config(cls, config: Any) -> "VisionDims":
        """Read from the checkpoint's own config (see ``sglang_m3.config.source``): the object
        SGLang hands over may have padded or coerced sub-configs, and the vision sizes must come
        from ``vision_config`` alone, the text width from ``text_config`` alone."""
        return cls.from_checkpoint_config(checkpoint_config(config))

    @classmethod
    def from_checkpoint_config(cls, top: dict) -> "VisionDims":
        """Read from the checkpoint's top-level config as a plain dict (``checkpoint_config``)."""
        vision = vision_part(top)
        if vision is None or top.get("text_config") is None:
            raise M3ConfigError("the VL config needs both vision_config and text_config")
        text_hidden = int(text_part(top)["hidden_size"])
        act = vision.get("hidden_act", "gelu")
        if act != "gelu":
            raise M3ConfigError(f"config field 'vision_config.hidden_act' is {act!r}; sglang-m3 supports 'gelu'")
        hidden, heads = _size(vision, "hidden_size"), _size(vision, "num_attention_heads")
        _check_heads(vision, hidden, heads)
        return cls(
            hidden_size=hidden,
            intermediate_size=_size(vision, "intermediate_size"),
            num_layers=_size(vision, "num_hidden_layers"),
            num_heads=heads,
            num_channels=_size(vision, "num_channels", 3),
            patch_size=_size(vision, "patch_size", 14),
            temporal_patch_size=_size(vision, "temporal_patch_size", 2),
            spatial_merge_size=_size(vision, "spatial_merge_size", 2),
            layer_norm_eps=fields.positive_float(vision, "layer_norm_eps", 1e-5, name="vision_config.layer_norm_eps"),
            rope_theta=_rope_theta(vision),
            projector_hidden_size=_projector_width(top, vision),
            text_hidden_size=text_hidden,
            segment_max_frames=None if vision.get("vision_segment_max_frames") is None else _size(vision, "vision_segment_max_frames"),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.num_channels * self.temporal_patch_size * self.patch_size**2


def _as_grid_list(grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> list[tuple[int, int, int]]:
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else grid_thw
    return [(int(t), int(h), int(w)) for t, h, w in rows]


class AxialRotaryEmbedding(nn.Module):
    """3D RoPE: equal frequency bands for t, h and w on the first ``3 * band`` pairs of a head.

    ``band = (head_dim // 3) // 2`` frequencies per axis; the remaining head channels (2 of 80 on
    M3) pass through unrotated. Rotation is rotate-half over the rotated span.
    """

    def __init__(self, head_dim: int, theta: float, spatial_merge_size: int):
        super().__init__()
        axis_dim = 2 * ((head_dim // 3) // 2)
        inv_freq = 1.0 / (theta ** (torch.arange(0, axis_dim, 2, dtype=torch.float32) / axis_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.spatial_merge_size = spatial_merge_size

    def positions(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """``[rows, 3]`` (t, h, w) indices in the block-major order the processor emits."""
        m = self.spatial_merge_size
        device = self.inv_freq.device
        per_item = []
        for t, h, w in grids:
            hh = torch.arange(h, device=device).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
            ww = torch.arange(w, device=device).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
            hh = hh.permute(0, 2, 1, 3).reshape(-1).repeat(t)
            ww = ww.permute(0, 2, 1, 3).reshape(-1).repeat(t)
            tt = torch.arange(t, device=device).repeat_interleave(h * w)
            per_item.append(torch.stack([tt, hh, ww], dim=-1))
        return torch.cat(per_item)

    def forward(self, grids: list[tuple[int, int, int]], dtype: torch.dtype):
        angles = self.positions(grids).float()[..., None] * self.inv_freq  # [rows, 3, band]
        angles = angles.flatten(1)
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the leading ``cos.shape[-1]`` channels of ``x [rows, heads, dim]``."""
    span = cos.shape[-1]
    rot, rest = x[..., :span], x[..., span:]
    first, second = rot.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat([rot * cos + rotated * sin, rest], dim=-1)


class VisionAttention(nn.Module):
    def __init__(self, dims: VisionDims):
        super().__init__()
        self.num_heads = dims.num_heads
        self.head_dim = dims.head_dim
        self.q_proj = nn.Linear(dims.hidden_size, dims.hidden_size)
        self.k_proj = nn.Linear(dims.hidden_size, dims.hidden_size)
        self.v_proj = nn.Linear(dims.hidden_size, dims.hidden_size)
        self.out_proj = nn.Linear(dims.hidden_size, dims.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, windows: list[int]) -> torch.Tensor:
        rows = x.shape[0]
        q = _rotate(self.q_proj(x).view(rows, self.num_heads, self.head_dim), cos, sin)
        k = _rotate(self.k_proj(x).view(rows, self.num_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(rows, self.num_heads, self.head_dim)
        outputs = []
        for q_w, k_w, v_w in zip(q.split(windows), k.split(windows), v.split(windows)):
            out = F.scaled_dot_product_attention(q_w.transpose(0, 1), k_w.transpose(0, 1), v_w.transpose(0, 1))
            outputs.append(out.transpose(0, 1).reshape(-1, self.num_heads * self.head_dim))
        return self.out_proj(torch.cat(outputs))


class VisionMLP(nn.Module):
    def __init__(self, dims: VisionDims):
        super().__init__()
        self.fc1 = nn.Linear(dims.hidden_size, dims.intermediate_size)
        self.fc2 = nn.Linear(dims.intermediate_size, dims.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, dims: VisionDims):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(dims.hidden_size, eps=dims.layer_norm_eps)
        self.self_attn = VisionAttention(dims)
        self.layer_norm2 = nn.LayerNorm(dims.hidden_size, eps=dims.layer_norm_eps)
        self.mlp = VisionMLP(dims)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, windows: list[int]) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), cos, sin, windows)
        return x + self.mlp(self.layer_norm2(x))


class TwoLayerGelu(nn.Module):
    """``linear_2(gelu(linear_1(x)))``: the shape of both the projector and the patch merge MLP."""

    def __init__(self, in_features: int, hidden: int, out_features: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden)
        self.linear_2 = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


def checkpoint_name_of(param_name: str) -> str:
    """The original checkpoint name of one of this module's parameters (for error messages)."""
    if param_name.startswith(("multi_modal_projector.", "patch_merge_mlp.")):
        return param_name
    if param_name == "patch_embedding":
        return VISION_PREFIX + "embeddings.patch_embedding.weight"
    return VISION_PREFIX + re.sub(r"^layers\.", "encoder.layers.", param_name)


def missing_tensor_spellings(param_name: str) -> str:
    """The checkpoint name of parameter ``param_name``, for naming it missing: a layer's MLP under
    both spellings ``param_name`` (the method) accepts, since transformers saves it under
    ``block_sparse_moe.``, which :func:`checkpoint_name_of` does not show."""
    name = checkpoint_name_of(param_name)
    other = re.sub(r"\.mlp\.(fc[12])\.", r".block_sparse_moe.\1.", name)
    return name if other == name else f"{name} (or {other})"


class MiniMaxM3VisionEncoder(nn.Module):
    """Patch rows + grids -> one text-hidden row per merged 2x2 patch block.

    Parameter names are the checkpoint's (minus the ``vision_tower.vision_model.`` prefix for
    the tower), so :meth:`load_weights` is a direct name map.
    """

    def __init__(self, config: Any):
        super().__init__()
        dims = VisionDims.from_config(config)
        self.dims = dims
        kernel = (dims.temporal_patch_size, dims.patch_size, dims.patch_size)
        self.patch_embedding = nn.Parameter(torch.empty(dims.hidden_size, dims.num_channels, *kernel))
        self.pre_layrnorm = nn.LayerNorm(dims.hidden_size, eps=dims.layer_norm_eps)
        self.layers = nn.ModuleList(VisionEncoderLayer(dims) for _ in range(dims.num_layers))
        self.rotary = AxialRotaryEmbedding(dims.head_dim, dims.rope_theta, dims.spatial_merge_size)
        merge = dims.spatial_merge_size**2
        self.multi_modal_projector = TwoLayerGelu(dims.hidden_size, dims.projector_hidden_size, dims.text_hidden_size)
        self.patch_merge_mlp = TwoLayerGelu(
            dims.text_hidden_size * merge, dims.projector_hidden_size, dims.text_hidden_size
        )

    def attention_windows(self, grids: list[tuple[int, int, int]]) -> list[int]:
        """Row counts of the attention windows: one per item, or per temporal segment."""
        step = self.dims.segment_max_frames
        windows = []
        for t, h, w in grids:
            if step is None or t <= step:
                windows.append(t * h * w)
            else:
                windows.extend(min(step, t - start) * h * w for start in range(0, t, step))
        return windows

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        grids = _as_grid_list(grid_thw)
        dims = self.dims
        expected_rows = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape != (expected_rows, dims.patch_dim):
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}, grids {grids} need "
                f"({expected_rows}, {dims.patch_dim})"
            )
        merge = dims.spatial_merge_size
        for t, h, w in grids:
            if h % merge or w % merge:
                raise ValueError(f"grid {(t, h, w)} is not a multiple of spatial_merge_size {merge}")
        dtype = self.patch_embedding.dtype
        weight = self.patch_embedding.reshape(dims.hidden_size, -1)
        x = self.pre_layrnorm(pixel_values.to(dtype) @ weight.t())
        cos, sin = self.rotary(grids, dtype)
        windows = self.attention_windows(grids)
        for layer in self.layers:
            x = layer(x, cos, sin, windows)
        x = self.multi_modal_projector(x)
        x = x.reshape(-1, merge * merge * dims.text_hidden_size)
        return self.patch_merge_mlp(x)

    def encode_items(self, items: Sequence[Any], grid_key: str) -> torch.Tensor:
        """Rows for SGLang ``MultimodalDataItem``s of one modality, concatenated in item order.

        ``grid_key`` is ``"image_grid_thw"`` or ``"video_grid_thw"`` (as the M3 processor sets
        them); this is what a VL model's ``get_image_feature`` / ``get_video_feature`` return.
        """
        weight = self.patch_embedding
        pixel_values = torch.cat([item.feature for item in items]).to(device=weight.device, dtype=weight.dtype)
        grids = torch.cat([getattr(item, grid_key).reshape(-1, 3) for item in items])
        return self(pixel_values, grids)

    @staticmethod
    def param_name(checkpoint_name: str) -> str | None:
        """This module's parameter name for a checkpoint tensor name, or None if not a vision tensor.

        A VL loader can route the checkpoint stream with it: names it maps go to
        :meth:`load_weights`, the rest (``language_model.``) to the text model.
        """
        if checkpoint_name.startswith(("multi_modal_projector.", "patch_merge_mlp.")):
            return checkpoint_name
        if not checkpoint_name.startswith(VISION_PREFIX):
            return None
        name = checkpoint_name[len(VISION_PREFIX) :]
        if name == "embeddings.patch_embedding.weight":
            return "patch_embedding"
        name = re.sub(r"^encoder\.layers\.", "layers.", name)
        return re.sub(r"\.block_sparse_moe\.(fc[12])\.", r".mlp.\1.", name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], whole: bool = True) -> set[str]:
        """Copies the vision tensors of a checkpoint stream; other names are skipped.

        Raises ValueError naming every unknown vision name, weight stored twice, wrongly shaped
        tensor or (``whole``: a load, not an update of some weights) parameter left unloaded, so
        a broken checkpoint fails at load time, never at the first image.
        Returns the checkpoint names consumed.
        """
        params = dict(self.named_parameters())
        arrived: set[str] = set()  # broken ones too: named as such, never also as missing
        consumed: set[str] = set()
        problems: list[str] = []
        for checkpoint_name, tensor in weights:
            name = self.param_name(checkpoint_name)
            if name is None:
                continue
            param = params.get(name)
            if param is None:
                problems.append(f"unexpected vision tensor {checkpoint_name}")
                continue
            if name in arrived:  # both MLP spellings, or one name twice: the later would win silently
                problems.append(f"{checkpoint_name}: a second tensor for one weight (an earlier tensor loads into it)")
                continue
            arrived.add(name)
            if tuple(tensor.shape) != tuple(param.shape):
                problems.append(
                    f"{checkpoint_name}: shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
                continue
            if not tensor.is_floating_point():  # the copy would cast integers into a weight
                problems.append(f"{checkpoint_name}: {tensor.dtype}, expected a floating-point weight")
                continue
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
            consumed.add(checkpoint_name)
        if whole:
            problems.extend(f"missing vision tensor {missing_tensor_spellings(name)}" for name in sorted(params.keys() - arrived))
        if problems:
            raise ValueError("vision weights do not match the config:\n  " + "\n  ".join(problems))
        return consumed
