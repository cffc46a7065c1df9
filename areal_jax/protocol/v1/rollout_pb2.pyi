from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "greedy", "stop_token_ids", "seed")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    GREEDY_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    greedy: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., greedy: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ...) -> None: ...

class RolloutRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "prompt_text", "metadata", "reward_name", "group_size", "sampling_params", "cancel")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    REWARD_NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    metadata: _containers.ScalarMap[str, str]
    reward_name: str
    group_size: int
    sampling_params: SamplingParams
    cancel: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., reward_name: _Optional[str] = ..., group_size: _Optional[int] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., cancel: _Optional[bool] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("output_ids", "behav_logprobs", "versions", "output_mask", "reward", "finish_reason")
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    BEHAV_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_MASK_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    behav_logprobs: _containers.RepeatedScalarFieldContainer[float]
    versions: _containers.RepeatedScalarFieldContainer[int]
    output_mask: _containers.RepeatedScalarFieldContainer[int]
    reward: float
    finish_reason: FinishReason
    def __init__(self, output_ids: _Optional[_Iterable[int]] = ..., behav_logprobs: _Optional[_Iterable[float]] = ..., versions: _Optional[_Iterable[int]] = ..., output_mask: _Optional[_Iterable[int]] = ..., reward: _Optional[float] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_s", "generation_s", "reward_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    GENERATION_S_FIELD_NUMBER: _ClassVar[int]
    REWARD_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    generation_s: float
    reward_s: float
    def __init__(self, queue_s: _Optional[float] = ..., generation_s: _Optional[float] = ..., reward_s: _Optional[float] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("code", "field", "message", "draining")
    CODE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    code: int
    field: str
    message: str
    draining: bool
    def __init__(self, code: _Optional[int] = ..., field: _Optional[str] = ..., message: _Optional[str] = ..., draining: _Optional[bool] = ...) -> None: ...

class TrajectoryGroup(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "trajectories", "timing", "error", "reward_failures", "reward_error", "reward_calls")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REWARD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    REWARD_ERROR_FIELD_NUMBER: _ClassVar[int]
    REWARD_CALLS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    trajectories: _containers.RepeatedCompositeFieldContainer[Trajectory]
    timing: Timing
    error: RequestError
    reward_failures: int
    reward_error: str
    reward_calls: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., trajectories: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., error: _Optional[_Union[RequestError, _Mapping]] = ..., reward_failures: _Optional[int] = ..., reward_error: _Optional[str] = ..., reward_calls: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "sampling_params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "versions", "finish_reason")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    versions: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., versions: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("path", "version", "force")
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    path: str
    version: int
    force: bool
    def __init__(self, path: _Optional[str] = ..., version: _Optional[int] = ..., force: _Optional[bool] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("version", "load_s")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    version: int
    load_s: float
    def __init__(self, version: _Optional[int] = ..., load_s: _Optional[float] = ...) -> None: ...

class WeightFile(_message.Message):
    __slots__ = ("name", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class WeightsHeader(_message.Message):
    __slots__ = ("version", "files", "force")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    version: int
    files: _containers.RepeatedCompositeFieldContainer[WeightFile]
    force: bool
    def __init__(self, version: _Optional[int] = ..., files: _Optional[_Iterable[_Union[WeightFile, _Mapping]]] = ..., force: _Optional[bool] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("name", "offset", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushWeightsRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: WeightsHeader
    chunk: FileChunk
    def __init__(self, header: _Optional[_Union[WeightsHeader, _Mapping]] = ..., chunk: _Optional[_Union[FileChunk, _Mapping]] = ...) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerStatus(_message.Message):
    __slots__ = ("version", "running_requests", "queued_requests", "tokens_generated", "tokens_per_second", "engine_kind", "paused", "vocab_size", "max_context_len", "engine_stats", "instance_id", "draining", "run_id", "reward_names", "max_group_size")
    class EngineStatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    ENGINE_KIND_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STATS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_NAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    version: int
    running_requests: int
    queued_requests: int
    tokens_generated: int
    tokens_per_second: float
    engine_kind: str
    paused: bool
    vocab_size: int
    max_context_len: int
    engine_stats: _containers.ScalarMap[str, float]
    instance_id: str
    draining: bool
    run_id: str
    reward_names: _containers.RepeatedScalarFieldContainer[str]
    max_group_size: int
    def __init__(self, version: _Optional[int] = ..., running_requests: _Optional[int] = ..., queued_requests: _Optional[int] = ..., tokens_generated: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., engine_kind: _Optional[str] = ..., paused: _Optional[bool] = ..., vocab_size: _Optional[int] = ..., max_context_len: _Optional[int] = ..., engine_stats: _Optional[_Mapping[str, float]] = ..., instance_id: _Optional[str] = ..., draining: _Optional[bool] = ..., run_id: _Optional[str] = ..., reward_names: _Optional[_Iterable[str]] = ..., max_group_size: _Optional[int] = ...) -> None: ...
