"""Request bodies of the control and generate routes, shaped like SGLang's ``io_struct`` classes.

Unknown keys are ignored (pydantic's default, as for SGLang's dataclasses); a missing
body or a field of the wrong type is a 400 through the app's validation handler.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

__all__ = [
    "SAMPLING_PARAM_KEYS",
    "AbortReq",
    "BeginWeightUpdateReqInput",
    "ContinueGenerationReqInput",
    "DestroyWeightsUpdateGroupReqInput",
    "EndWeightUpdateReqInput",
    "GenerateReqInput",
    "InitWeightsUpdateGroupReqInput",
    "MemoryOccupationReqInput",
    "PauseGenerationReqInput",
    "UpdateWeightFromDiskReqInput",
    "UpdateWeightVersionReqInput",
    "UpdateWeightsFromDistributedReqInput",
    "UpdateWeightsFromTensorReqInput",
]

SAMPLING_PARAM_KEYS = frozenset(
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "custom_params",
        "stream_interval",
        "logit_bias",
        "sampling_seed",
    }
)
"""The keyword arguments SGLang's ``SamplingParams`` accepts; any other key is a 400."""

DEFAULT_GROUP = "weight_update_group"


class PauseGenerationReqInput(BaseModel):
    """``POST /pause_generation``."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(BaseModel):
    """``POST /continue_generation``."""

    torch_empty_cache: bool = True


class MemoryOccupationReqInput(BaseModel):
    """``/release_memory_occupation`` and ``/resume_memory_occupation``; null or [] = every tag."""

    tags: list[str] | None = None


class BeginWeightUpdateReqInput(BaseModel):
    """``POST /begin_weight_update``."""

    selector: str = "all"


class EndWeightUpdateReqInput(BaseModel):
    """``POST /end_weight_update``."""


class UpdateWeightsFromTensorReqInput(BaseModel):
    """``POST /update_weights_from_tensor``."""

    serialized_named_tensors: list[Any]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class UpdateWeightsFromDistributedReqInput(BaseModel):
    """``POST /update_weights_from_distributed``."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class UpdateWeightFromDiskReqInput(BaseModel):
    """``POST /update_weights_from_disk``."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


class UpdateWeightVersionReqInput(BaseModel):
    """``POST /update_weight_version``."""

    new_version: str
    abort_all_requests: bool = True


class InitWeightsUpdateGroupReqInput(BaseModel):
    """``POST /init_weights_update_group``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"


class DestroyWeightsUpdateGroupReqInput(BaseModel):
    """``POST /destroy_weights_update_group``."""

    group_name: str = DEFAULT_GROUP


class AbortReq(BaseModel):
    """``POST /abort_request``: rid matched by prefix."""

    rid: str = ""
    abort_all: bool = False


class GenerateReqInput(BaseModel):
    """``POST /generate``: one request, or a batch when ``text``/``input_ids`` is a list of prompts."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
