"""Request bodies of the control and generate routes, shaped like SGLang's ``io_struct`` classes.

Field names, required fields and defaults are those of ``sglang/srt/managers/io_struct.py`` (the contract check
compares them with the wheel). Fields the emulator has no use for are accepted and ignored, as SGLang ignores them
where nothing reads them. Unknown keys are ignored; a missing body or a field of the wrong type is a 400 through the
app's validation handler.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

__all__ = [
    "SAMPLING_PARAM_KEYS", "AbortReq", "BeginWeightUpdateReqInput", "ContinueGenerationReqInput", "DestroyWeightsUpdateGroupReqInput",
    "EndWeightUpdateReqInput", "GenerateReqInput", "InitWeightsUpdateGroupReqInput", "MemoryOccupationReqInput",
    "PauseGenerationReqInput", "UpdateWeightFromDiskReqInput", "UpdateWeightVersionReqInput", "UpdateWeightsFromDistributedReqInput",
    "UpdateWeightsFromTensorReqInput",
]  # fmt: skip

SAMPLING_PARAM_KEYS = frozenset(
    "max_new_tokens stop stop_token_ids stop_regex temperature top_p top_k min_p frequency_penalty presence_penalty "
    "repetition_penalty min_new_tokens n json_schema regex ebnf structural_tag ignore_eos skip_special_tokens "
    "spaces_between_special_tokens no_stop_trim custom_params stream_interval logit_bias sampling_seed".split()
)
"""The keyword arguments SGLang's ``SamplingParams`` accepts; any other key is a 400."""

DEFAULT_GROUP = "weight_update_group"
Selector = Literal["target", "draft", "all"]


class _Req(BaseModel):
    """SGLang's ``BaseReq``: every control body may carry a ``rid`` (unused here)."""

    rid: str | None = None


class PauseGenerationReqInput(_Req):
    """``POST /pause_generation``."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(_Req):
    """``POST /continue_generation``."""

    torch_empty_cache: bool = True


class MemoryOccupationReqInput(_Req):
    """``/release_memory_occupation`` and ``/resume_memory_occupation``; null or [] = every tag."""

    tags: list[str] | None = None


class BeginWeightUpdateReqInput(_Req):
    """``POST /begin_weight_update``."""

    selector: Selector = "all"


class EndWeightUpdateReqInput(_Req):
    """``POST /end_weight_update``."""


class UpdateWeightsFromTensorReqInput(_Req):
    """``POST /update_weights_from_tensor``."""

    serialized_named_tensors: list[Any]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Selector = "all"
    torch_empty_cache: bool = False


class UpdateWeightsFromDistributedReqInput(_Req):
    """``POST /update_weights_from_distributed``."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Selector = "all"
    torch_empty_cache: bool = False


class UpdateWeightFromDiskReqInput(_Req):
    """``POST /update_weights_from_disk``."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None


class UpdateWeightVersionReqInput(_Req):
    """``POST /update_weight_version``."""

    new_version: str
    abort_all_requests: bool = True


class InitWeightsUpdateGroupReqInput(_Req):
    """``POST /init_weights_update_group``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = DEFAULT_GROUP
    backend: str = "nccl"


class DestroyWeightsUpdateGroupReqInput(_Req):
    """``POST /destroy_weights_update_group``."""

    group_name: str = DEFAULT_GROUP


class AbortReq(_Req):
    """``POST /abort_request``: a rid this engine knows (None or "" without ``abort_all`` is ignored), or all.

    ``finished_reason``, ``abort_message`` and ``weight_versions`` are filled by SGLang's
    scheduler on the way back; a client may send them and they are ignored.
    """

    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None
    abort_message: str | None = None
    weight_versions: list[Any] | None = None


class GenerateReqInput(BaseModel):
    """``POST /generate``: one request, or a batch when ``text``/``input_ids`` is a list of prompts."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
