from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelSpec(_message.Message):
    __slots__ = ("num_heads", "num_kv_heads", "head_dim", "dtype_bytes", "hidden_size", "ffn_hidden_size")
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    FFN_HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    hidden_size: int
    ffn_hidden_size: int
    def __init__(self, num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype_bytes: _Optional[int] = ..., hidden_size: _Optional[int] = ..., ffn_hidden_size: _Optional[int] = ...) -> None: ...

class PlanRequest(_message.Message):
    __slots__ = ("doc_lengths", "cp_size", "strategy", "context_length", "truncate", "imbalance_target", "comm_mode", "model", "kernel", "link", "options_json", "max_kv_tokens_per_rank", "window", "layers")
    DOC_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    CP_SIZE_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    IMBALANCE_TARGET_FIELD_NUMBER: _ClassVar[int]
    COMM_MODE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    LINK_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    MAX_KV_TOKENS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    doc_lengths: _containers.RepeatedScalarFieldContainer[int]
    cp_size: int
    strategy: str
    context_length: int
    truncate: bool
    imbalance_target: float
    comm_mode: str
    model: ModelSpec
    kernel: str
    link: str
    options_json: str
    max_kv_tokens_per_rank: int
    window: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerGroup]
    def __init__(self, doc_lengths: _Optional[_Iterable[int]] = ..., cp_size: _Optional[int] = ..., strategy: _Optional[str] = ..., context_length: _Optional[int] = ..., truncate: _Optional[bool] = ..., imbalance_target: _Optional[float] = ..., comm_mode: _Optional[str] = ..., model: _Optional[_Union[ModelSpec, _Mapping]] = ..., kernel: _Optional[str] = ..., link: _Optional[str] = ..., options_json: _Optional[str] = ..., max_kv_tokens_per_rank: _Optional[int] = ..., window: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerGroup, _Mapping]]] = ...) -> None: ...

class LayerGroup(_message.Message):
    __slots__ = ("window", "count")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    window: int
    count: int
    def __init__(self, window: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class PlanMetrics(_message.Message):
    __slots__ = ("imbalance", "comm_tokens", "full_comm_tokens", "comm_saving", "est_step_ms", "tokens_per_rank")
    IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    COMM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FULL_COMM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMM_SAVING_FIELD_NUMBER: _ClassVar[int]
    EST_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    imbalance: float
    comm_tokens: int
    full_comm_tokens: int
    comm_saving: float
    est_step_ms: float
    tokens_per_rank: int
    def __init__(self, imbalance: _Optional[float] = ..., comm_tokens: _Optional[int] = ..., full_comm_tokens: _Optional[int] = ..., comm_saving: _Optional[float] = ..., est_step_ms: _Optional[float] = ..., tokens_per_rank: _Optional[int] = ...) -> None: ...

class PlanReply(_message.Message):
    __slots__ = ("plan_json", "plan_id", "strategy", "solve_ms", "cached", "metrics")
    PLAN_JSON_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    SOLVE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    plan_json: bytes
    plan_id: str
    strategy: str
    solve_ms: float
    cached: bool
    metrics: PlanMetrics
    def __init__(self, plan_json: _Optional[bytes] = ..., plan_id: _Optional[str] = ..., strategy: _Optional[str] = ..., solve_ms: _Optional[float] = ..., cached: _Optional[bool] = ..., metrics: _Optional[_Union[PlanMetrics, _Mapping]] = ...) -> None: ...

class CompareRequest(_message.Message):
    __slots__ = ("request", "strategies")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    STRATEGIES_FIELD_NUMBER: _ClassVar[int]
    request: PlanRequest
    strategies: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request: _Optional[_Union[PlanRequest, _Mapping]] = ..., strategies: _Optional[_Iterable[str]] = ...) -> None: ...

class CompareReply(_message.Message):
    __slots__ = ("plans", "errors")
    class ErrorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PLANS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    plans: _containers.RepeatedCompositeFieldContainer[PlanReply]
    errors: _containers.ScalarMap[str, str]
    def __init__(self, plans: _Optional[_Iterable[_Union[PlanReply, _Mapping]]] = ..., errors: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ScheduleRequest(_message.Message):
    __slots__ = ("request_json",)
    REQUEST_JSON_FIELD_NUMBER: _ClassVar[int]
    request_json: str
    def __init__(self, request_json: _Optional[str] = ...) -> None: ...

class ScheduleReply(_message.Message):
    __slots__ = ("result_json", "solve_ms")
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    SOLVE_MS_FIELD_NUMBER: _ClassVar[int]
    result_json: bytes
    solve_ms: float
    def __init__(self, result_json: _Optional[bytes] = ..., solve_ms: _Optional[float] = ...) -> None: ...

class SubmitBatchRequest(_message.Message):
    __slots__ = ("job", "batch", "request")
    JOB_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    job: str
    batch: str
    request: PlanRequest
    def __init__(self, job: _Optional[str] = ..., batch: _Optional[str] = ..., request: _Optional[_Union[PlanRequest, _Mapping]] = ...) -> None: ...

class SubmitBatchReply(_message.Message):
    __slots__ = ("job", "batch", "status", "request_hash", "plan_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_HASH_FIELD_NUMBER: _ClassVar[int]
    PLAN_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    batch: str
    status: str
    request_hash: str
    plan_id: str
    def __init__(self, job: _Optional[str] = ..., batch: _Optional[str] = ..., status: _Optional[str] = ..., request_hash: _Optional[str] = ..., plan_id: _Optional[str] = ...) -> None: ...

class GetBatchRequest(_message.Message):
    __slots__ = ("job", "batch", "wait_ms")
    JOB_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    job: str
    batch: str
    wait_ms: int
    def __init__(self, job: _Optional[str] = ..., batch: _Optional[str] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class GetBatchReply(_message.Message):
    __slots__ = ("status", "plan")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    status: str
    plan: PlanReply
    def __init__(self, status: _Optional[str] = ..., plan: _Optional[_Union[PlanReply, _Mapping]] = ...) -> None: ...

class StreamBatch(_message.Message):
    __slots__ = ("job", "batch", "request")
    JOB_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    job: str
    batch: str
    request: PlanRequest
    def __init__(self, job: _Optional[str] = ..., batch: _Optional[str] = ..., request: _Optional[_Union[PlanRequest, _Mapping]] = ...) -> None: ...

class StreamPlan(_message.Message):
    __slots__ = ("job", "batch", "plan", "error_code", "error")
    JOB_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    job: str
    batch: str
    plan: PlanReply
    error_code: str
    error: str
    def __init__(self, job: _Optional[str] = ..., batch: _Optional[str] = ..., plan: _Optional[_Union[PlanReply, _Mapping]] = ..., error_code: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class StrategiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StrategyInfo(_message.Message):
    __slots__ = ("name", "description", "comm_mode", "options")
    class OptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    COMM_MODE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    comm_mode: str
    options: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., comm_mode: _Optional[str] = ..., options: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StrategiesReply(_message.Message):
    __slots__ = ("strategies",)
    STRATEGIES_FIELD_NUMBER: _ClassVar[int]
    strategies: _containers.RepeatedCompositeFieldContainer[StrategyInfo]
    def __init__(self, strategies: _Optional[_Iterable[_Union[StrategyInfo, _Mapping]]] = ...) -> None: ...

class SubmitGlobalBatchRequest(_message.Message):
    __slots__ = ("job", "batch", "request_json")
    JOB_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    REQUEST_JSON_FIELD_NUMBER: _ClassVar[int]
    job: str
    batch: str
    request_json: str
    def __init__(self, job: _Optional[str] = ..., batch: _Optional[str] = ..., request_json: _Optional[str] = ...) -> None: ...

class GlobalBatchStatus(_message.Message):
    __slots__ = ("job", "batch", "status", "request_hash", "schedule_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_HASH_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    batch: str
    status: str
    request_hash: str
    schedule_id: str
    def __init__(self, job: _Optional[str] = ..., batch: _Optional[str] = ..., status: _Optional[str] = ..., request_hash: _Optional[str] = ..., schedule_id: _Optional[str] = ...) -> None: ...

class GetGlobalBatchRequest(_message.Message):
    __slots__ = ("job", "batch", "wait_ms")
    JOB_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    job: str
    batch: str
    wait_ms: int
    def __init__(self, job: _Optional[str] = ..., batch: _Optional[str] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class GetGlobalBatchReply(_message.Message):
    __slots__ = ("status", "schedule_json", "schedule_id", "solve_ms")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_JSON_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_ID_FIELD_NUMBER: _ClassVar[int]
    SOLVE_MS_FIELD_NUMBER: _ClassVar[int]
    status: str
    schedule_json: bytes
    schedule_id: str
    solve_ms: float
    def __init__(self, status: _Optional[str] = ..., schedule_json: _Optional[bytes] = ..., schedule_id: _Optional[str] = ..., solve_ms: _Optional[float] = ...) -> None: ...
