"""The recipe file format: a Kubernetes custom resource that also drives the CLI.

Every field is documented by the docstring under it; those docstrings become the descriptions
of the JSON Schema and of the CRD's OpenAPI schema, so the YAML, the CLI and ``kubectl explain``
read the same words. Fields are spelled in camelCase in YAML (the Kubernetes convention) and in
snake_case in Python. Unknown fields are rejected everywhere except ``metadata``, which
Kubernetes owns.

The schema checks shapes and ranges only. Whether the pieces fit together (GPU counts, heads,
variants, memory) is the job of ``rules.validate_recipe``, which reports every problem at once.
"""

from __future__ import annotations

import datetime
import re
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic.alias_generators import to_camel

from .catalog import ProfileName, Variant

GROUP = "m3.sglang.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "M3Recipe"
PLURAL = "m3recipes"
SINGULAR = "m3recipe"
SHORT_NAMES = ("m3r",)

ThinkingMode = Literal["adaptive", "enabled", "disabled"]
KVCacheDtype = Literal["auto", "bf16", "fp8_e4m3", "fp8_e5m2"]
IndexKeyDtype = Literal["bf16", "fp8_e4m3"]
SpeculativeAlgorithm = Literal["EAGLE3", "EAGLE", "NGRAM"]
HostOffloadMode = Literal["hierarchical-cache", "sparse-offload", "hisparse"]


#: Largest integer a Kubernetes object holds (the API server stores int64): a recipe the CLI
#: accepts must also be one the cluster can store.
INT64_MAX = 2**63 - 1

#: The longest recipe name whose children all get valid names: the operator's model-download
#: Job ``<name>-download-<10-hex hash>`` must fit 63 characters (it becomes a pod label), and a
#: multi-node recipe's LeaderWorkerSet ``<name>-lws`` names StatefulSets ``<name>-lws-<group>``
#: whose pods carry ``controller-revision-hash: <statefulset>-<10 characters>``, also a
#: 63-character label. It lives here, not in the operator, so that ``recipe validate`` refuses
#: such names too (this layer does not import the operator; the operator imports this).
MAX_RECIPE_NAME = 43

#: A recipe name is a DNS-1035 label: it names the recipe's Service, which Kubernetes requires
#: to start with a letter.
RECIPE_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

#: Parser name that turns a parser off (``parsers.reasoning: none``). A null cannot: kubectl
#: apply drops null fields, so the cluster would run the default parser.
NO_PARSER = "none"


def _refuse_null(value: Any, default: Any, instead: str) -> Any:
    """``value``, unless it is an explicit null. Client-side ``kubectl apply`` deletes null fields,
    server-side apply takes null for removal and the API server prunes nulls the CRD does not
    declare nullable: the cluster deploys the field's default. A null the CLI accepted would
    deploy something other than what ``recipe validate`` and ``recipe render`` showed."""
    if value is None:
        raise ValueError(f"null is dropped by kubectl apply, so the cluster would deploy the default "
                         f"{default}; {instead}, or leave the field out for {default}")
    return value


def _scalar_kinds(annotation: Any) -> set[Any]:
    """The types a field annotation admits, ``None`` left out (``int | None`` -> ``{int}``)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return {arg for arg in typing.get_args(annotation) if arg is not type(None)}
    return {annotation}


class RecipeModel(BaseModel):
    """Base of every recipe section: camelCase in YAML, closed to unknown fields, immutable.

    Scalars are taken as written, the way the CRD's schema (which the API server enforces)
    takes them: a number written as a string (``tp: "8"``), a boolean as a number or a string
    (``trustRemoteCode: "yes"``), an infinite float (``.inf``) or an integer beyond int64 is
    refused naming its field, where pydantic's lax mode would quietly convert it and the CLI
    would accept a recipe that ``kubectl apply`` refuses."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=False,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        allow_inf_nan=False,
    )

    @field_validator("*", mode="before")
    @classmethod
    def _scalars_as_written(cls, value: Any, info: ValidationInfo) -> Any:
        kinds = _scalar_kinds(cls.model_fields[info.field_name].annotation)
        if bool in kinds:
            if isinstance(value, (str, bytes, int, float)) and not isinstance(value, bool):
                kind = "string" if isinstance(value, (str, bytes)) else "number"
                raise ValueError(f"Input should be a valid boolean (true or false, unquoted), not a {kind}")
        elif kinds & {int, float}:
            wanted = "a valid integer" if int in kinds else "a valid number"
            if isinstance(value, bool):
                raise ValueError(f"Input should be {wanted}, not a boolean")
            if isinstance(value, (str, bytes)):
                raise ValueError(f"Input should be {wanted} written unquoted, not a string")
            if int in kinds and isinstance(value, (int, float)) and abs(value) > INT64_MAX:
                raise ValueError(f"Input should be at most {INT64_MAX} (Kubernetes stores 64-bit integers)")
        elif str in kinds and isinstance(value, (bytes, bytearray)):
            raise ValueError("Input should be text, not binary data")
        return value


#: A day as the CRD's ``format: date`` takes it (RFC 3339 full-date).
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}", re.ASCII)


class Verified(RecipeModel):
    """A run that confirmed this recipe serves correctly."""

    hardware: str = Field(min_length=1)
    """Machines the recipe was run on, e.g. "8x H200 SXM, one node"."""
    sglang_version: str = Field(min_length=1)
    """SGLang version it ran with, e.g. "0.5.23"."""
    date: datetime.date
    """Day of the run (YYYY-MM-DD)."""

    @field_validator("date", mode="before")
    @classmethod
    def _date_as_the_crd_takes_it(cls, value: Any) -> Any:
        """A day written YYYY-MM-DD, quoted or not (YAML reads it unquoted as a date): the CRD's
        ``format: date``. pydantic's lax mode also took a number (seconds since 1970) and a
        date-time, which the API server refuses, so ``recipe validate`` refuses them too."""
        written = value.isoformat() if type(value) is datetime.date else value
        if not isinstance(written, str) or not _DATE.fullmatch(written):
            raise ValueError("Input should be a valid date written YYYY-MM-DD, the day alone (the CRD's "
                             "format: date, which kubectl apply checks, takes no time and no number)")
        return value


class Provenance(RecipeModel):
    """Where the recipe comes from and how far it has been checked."""

    source: str = Field(min_length=1)
    """URL or citation of the published recipe or measurement this file follows."""
    notes: str = ""
    """What differs from the source, and what is known not to work."""
    verified: Verified | None = None
    """A run that confirmed the recipe; omit when it has not been run."""


class ModelSpec(RecipeModel):
    """Which M3 weights to serve."""

    path: str = Field(min_length=1)
    """Hugging Face hub id (e.g. MiniMaxAI/MiniMax-M3-MXFP8) or a local directory. The reserved
    value "sglang-m3:tiny" names the project's embedded tiny random-weight M3, which
    `sglang-m3 serve` builds and serves on CPU."""
    revision: str | None = None
    """Hub branch, tag or commit to pin; omit for the default branch."""
    variant: Variant
    """Weight format of the checkpoint: bf16 (~854 GB) or mxfp8 (~440 GB)."""
    served_model_name: str | None = None
    """Name the OpenAI-compatible API reports; defaults to the model path."""
    trust_remote_code: bool = False
    """Let the checkpoint's own Python code run (--trust-remote-code); the SGLang cookbook asks
    for it with the hub checkpoints."""


class HardwareSpec(RecipeModel):
    """The machines the recipe runs on."""

    profile: ProfileName
    """Accelerator profile from the hardware catalog (`sglang-m3 recipe catalog` lists them)."""
    gpus_per_node: int | None = Field(default=None, ge=1)
    """GPUs used on each node; defaults to the profile's GPUs per node."""
    nodes: int = Field(default=1, ge=1)
    """Number of nodes; more than one runs as a multi-node group (LeaderWorkerSet)."""


class Parallelism(RecipeModel):
    """How the model is split across GPUs. GPUs used = tp x pp x dp = gpusPerNode x nodes."""

    tp: int = Field(default=1, ge=1)
    """Tensor-parallel size (SGLang --tp-size)."""
    pp: int = Field(default=1, ge=1)
    """Pipeline-parallel size (--pp-size)."""
    dp: int = Field(default=1, ge=1)
    """Data-parallel replicas of the whole model, each of tp x pp GPUs (--dp-size)."""
    ep: int = Field(default=1, ge=1)
    """Expert-parallel size inside the TP group (--ep-size); must divide tp."""
    attention_dp: int = Field(default=1, ge=1)
    """Data-parallel attention groups inside the TP group (--attn-dp-size, the successor of
    --enable-dp-attention); 1 disables DP attention. Must divide tp."""


class KVCache(RecipeModel):
    """Paged KV cache layout."""

    page_size: int = Field(default=128, ge=1)
    """Tokens per KV page. MSA kernels on GPUs need 128 (the sparse block size)."""
    dtype: KVCacheDtype = "auto"
    """KV cache element type; auto follows the model (bf16). fp8 halves the KV bytes."""
    index_key_dtype: IndexKeyDtype = "bf16"
    """Element type of the MSA index keys (one 128-dim key per token and sparse layer, scanned
    by every decode step): bf16 (256 B), or fp8_e4m3 with a per-token fp32 scale (132 B), which
    halves the index scan's bytes at a measured cost in block selection
    (benchmarks/results/index_fp8_quality.md). Independent of dtype: an fp8 KV cache keeps bf16
    index keys unless this says fp8_e4m3."""


class DraftModel(RecipeModel):
    """Draft weights for speculative decoding."""

    path: str = Field(min_length=1)
    """Hub id or local directory, e.g. Inferact/MiniMax-M3-EAGLE3."""
    revision: str | None = None
    """Hub branch, tag or commit to pin."""


class Speculative(RecipeModel):
    """Speculative decoding. Omit the section to decode without speculation."""

    algorithm: SpeculativeAlgorithm
    """EAGLE3 (the published M3 draft), EAGLE, or NGRAM (no draft model)."""
    draft_model: DraftModel | None = None
    """Draft weights; required by EAGLE and EAGLE3, refused by NGRAM."""
    num_steps: int = Field(default=3, ge=1)
    """Draft steps per verification (--speculative-num-steps)."""
    eagle_topk: int = Field(default=1, ge=1)
    """Branching per draft step (--speculative-eagle-topk); 1 is a chain, more a draft tree (not
    with Blackwell's dense attention backends)."""
    num_draft_tokens: int = Field(default=4, ge=2)
    """Tokens verified per step (--speculative-num-draft-tokens); numSteps + 1 for a chain."""
    adaptive: bool = False
    """Let SGLang re-pick the chain's draft steps between verify steps from the acceptance it sees
    (--speculative-adaptive): among 1, 3, 5 and 7 in batches under 8 requests, shorter ones in
    larger batches (none from 64). numSteps is the starting length, one of 1, 3, 5, 7. EAGLE and
    EAGLE3 chains only (eagleTopk 1), and not beside the extraArgs --enable-multi-layer-eagle,
    --enable-two-batch-overlap or --enable-pdmux (SGLang drops it there). Start-up captures CUDA
    graphs for every length: it takes longer (about 1.5 min more on an H200) and a few GB more GPU
    memory. It pays off at low concurrency with a draft the target often accepts, whose chains it
    lengthens (one request on an H200, a mid-size M3 with a well-accepted draft: decode 2.3x as
    fast as without a draft, against 1.5-1.9x for a fixed chain of 3), and where acceptance varies
    with the prompts. With sparse offload, hostOffload.cacheBlocks must hold the longest chain's
    selection (8 verify tokens per request)."""


class Parsers(RecipeModel):
    """Output parsing and the default reasoning behaviour."""

    reasoning: str = "minimax-m3"
    """SGLang reasoning parser (--reasoning-parser); none leaves reasoning in the content."""
    tool_call: str = "minimax-m3"
    """SGLang tool-call parser (--tool-call-parser); none disables tool-call parsing."""
    default_thinking_mode: ThinkingMode = "adaptive"
    """thinking_mode applied when a request sets none: adaptive lets the model decide,
    enabled starts every reply inside reasoning, disabled skips reasoning."""

    @field_validator("reasoning", "tool_call", mode="before")
    @classmethod
    def _off_is_none_not_null(cls, value: Any, info: ValidationInfo) -> Any:
        """Null cannot turn a parser off: kubectl would drop it and the cluster run the default."""
        default = cls.model_fields[info.field_name].default
        return _refuse_null(value, default, f"write {NO_PARSER} to turn the parser off")


class MediaLimits(RecipeModel):
    """Most media items one request may carry."""

    image: int = Field(default=8, ge=0)
    """Images per request."""
    video: int = Field(default=1, ge=0)
    """Videos per request."""


class MediaBudget(RecipeModel):
    """Size, pixel, duration and frame caps on each media item, enforced by the M3 media
    processor before anything large is decoded (rendered into --mm-process-config)."""

    max_image_megabytes: int | None = Field(default=None, ge=1)
    """Largest encoded image accepted, in MiB (default 32)."""
    max_video_megabytes: int | None = Field(default=None, ge=1)
    """Largest encoded video accepted, in MiB (default 512)."""
    max_image_pixels: int | None = Field(default=None, ge=1)
    """Most pixels an image may declare in its header (default 8192 x 8192)."""
    max_video_seconds: float | None = Field(default=None, gt=0)
    """Longest video accepted, by its declared duration in seconds (default 1200)."""
    max_video_frames: int | None = Field(default=None, ge=1)
    """Most frames sampled from one video (default 768)."""
    video_fps: float | None = Field(default=None, gt=0)
    """Frames sampled per second of video (default 1.0)."""


class Multimodal(RecipeModel):
    """Image and video input."""

    enabled: bool = True
    """Serve the vision tower; false loads the language model only (less memory)."""
    limit_per_request: MediaLimits | None = None
    """Per-request media limits; omit for SGLang's defaults."""
    media: MediaBudget | None = None
    """Per-item caps of the M3 media processor; omit for its defaults."""


class HostOffload(RecipeModel):
    """KV cache offload to host memory."""

    mode: HostOffloadMode = "hierarchical-cache"
    """hierarchical-cache keeps evicted prefixes in host memory (HiCache, sized by
    sizeGbPerRank); sparse-offload keeps the sparse layers' main K/V of every token in host
    memory (sizeGbPerRank) and serves decode from a per-layer block cache on the device
    (cacheBlocks), radix cache kept; hisparse is SGLang's own sparse offload, which this
    plugin replaces (refused)."""
    size_gb_per_rank: int | None = Field(default=None, ge=1)
    """Host memory per GPU rank, in GB: the host tier (--hicache-size) of hierarchical-cache,
    the host store of sparse-offload (SGLANG_M3_SPARSE_OFFLOAD_HOST_GB; the server holds no
    more tokens than it has room for)."""
    cache_blocks: int | None = Field(default=None, ge=1)
    """sparse-offload only: device block-cache entries (one MSA block of K/V each) per sparse
    layer (SGLANG_M3_SPARSE_OFFLOAD_BLOCKS); at least one request's selection (KV heads per
    rank x top-k blocks x query tokens per step)."""
    host_to_device_ratio: float | None = Field(default=None, gt=0)
    """Host KV pool size as a multiple of the GPU pool; hisparse only."""


class Serving(RecipeModel):
    """Server knobs not covered by the sections above."""

    mem_fraction_static: float = Field(default=0.85, gt=0, lt=1)
    """Share of GPU memory for weights plus KV pool (--mem-fraction-static); the rest holds
    activations and CUDA graphs. The SGLang cookbook uses 0.75 on NVIDIA Blackwell and 0.80 on
    AMD for MXFP8; the BF16 weights on Hopper need more."""
    chunked_prefill_size: int = Field(default=8192, ge=-1)
    """Tokens per prefill chunk (--chunked-prefill-size); -1 disables chunking."""
    max_running_requests: int = Field(default=64, ge=1)
    """Concurrent requests per replica (--max-running-requests); the memory fit sizes the KV
    pool for this many requests at full context."""
    max_total_tokens: int | None = Field(default=None, ge=1)
    """Cap on KV pool tokens (--max-total-tokens); required on CPU, where memory is not probed."""
    watchdog_timeout: float | None = Field(default=None, gt=0)
    """Seconds a forward batch may take before the server aborts (--watchdog-timeout)."""
    host: str = "0.0.0.0"
    """Address the HTTP server binds."""
    port: int = Field(default=30000, ge=1, le=65535)
    """Port the HTTP server listens on."""
    extra_args: list[str] = Field(default_factory=list)
    """Further SGLang arguments, appended verbatim. Arguments that duplicate a typed field are
    refused: set the typed field instead."""

    @field_validator("chunked_prefill_size", mode="before")
    @classmethod
    def _chunk_not_null(cls, value: Any) -> Any:
        """Null cannot mean "SGLang's own chunk size": kubectl would drop it and the cluster run
        the default."""
        return _refuse_null(value, cls.model_fields["chunked_prefill_size"].default,
                            "write the chunk size in tokens (-1 disables chunking)")


class RecipeSpec(RecipeModel):
    """A complete M3 deployment."""

    provenance: Provenance
    """Where the recipe comes from and what has been verified."""
    model: ModelSpec
    """Which weights to serve."""
    hardware: HardwareSpec
    """Where to run."""
    parallelism: Parallelism = Field(default_factory=Parallelism)
    """How to split the model across GPUs."""
    context_length: int = Field(default=131072, ge=1)
    """Longest request (prompt + output) in tokens; at most 1,048,576."""
    kv_cache: KVCache = Field(default_factory=KVCache)
    """KV cache layout and type."""
    speculative: Speculative | None = None
    """Speculative decoding; omit to disable."""
    parsers: Parsers = Field(default_factory=Parsers)
    """Reasoning and tool-call parsing."""
    multimodal: Multimodal = Field(default_factory=Multimodal)
    """Image and video input."""
    host_offload: HostOffload | None = None
    """KV offload to host memory; omit to keep all KV on the GPUs."""
    serving: Serving = Field(default_factory=Serving)
    """Memory share, batching and extra server arguments."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables for the server process, added to those the recipe implies."""


class ObjectMeta(BaseModel):
    """Kubernetes object metadata. Fields other than these four are accepted and ignored, so
    an object read back from the API server (uid, resourceVersion, ...) still loads."""

    model_config = ConfigDict(extra="ignore", frozen=True, use_attribute_docstrings=True)

    name: str = Field(json_schema_extra={"maxLength": MAX_RECIPE_NAME, "pattern": RECIPE_NAME_PATTERN})
    """Recipe name: lower-case letters, digits and '-', starting with a letter (it names the
    Service), and short enough that the names and pod labels the operator derives from it fit
    63 characters (see maxLength)."""
    namespace: str | None = None
    """Namespace of the custom resource; ignored by the CLI."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Kubernetes labels."""
    annotations: dict[str, str] = Field(default_factory=dict)
    """Kubernetes annotations."""

    @field_validator("name")
    @classmethod
    def _names_every_child(cls, name: str) -> str:
        """A name the operator cannot give its children is refused here, with the reason, rather
        than accepted by ``recipe validate`` and refused once applied. The CRD carries the same
        pattern and length (``crd_openapi_schema``), so the API server refuses it as well."""
        problems = []
        if not re.fullmatch(RECIPE_NAME_PATTERN, name):
            problems.append("must start with a letter and hold only lower-case letters, digits and '-', "
                            "ending in a letter or digit (it names the recipe's Service, which Kubernetes "
                            "requires to be a DNS-1035 label)")
        if len(name) > MAX_RECIPE_NAME:
            problems.append(f"is {len(name)} characters; at most {MAX_RECIPE_NAME} fit, because the operator "
                            f"names the model-download Job <name>-download-<hash> and a multi-node group's "
                            f"StatefulSets <name>-lws-<group> after the recipe, and their pod labels must fit "
                            f"63 characters; shorten the name")
        if problems:
            raise ValueError("; ".join(problems))
        return name


class Recipe(RecipeModel):
    """An M3 serving recipe: a Kubernetes custom resource and the input of `sglang-m3`."""

    api_version: Literal["m3.sglang.io/v1alpha1"]
    """Always m3.sglang.io/v1alpha1."""
    kind: Literal["M3Recipe"]
    """Always M3Recipe."""
    metadata: ObjectMeta
    """Name, and for Kubernetes namespace, labels and annotations."""
    spec: RecipeSpec
    """The deployment."""
