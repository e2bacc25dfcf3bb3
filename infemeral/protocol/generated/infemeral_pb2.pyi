from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("data", "dtype", "shape", "scale")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    scale: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., scale: _Optional[_Iterable[float]] = ...) -> None: ...

class OpenTurn(_message.Message):
    __slots__ = ("session_id", "session_key", "expected_version", "bundle_fingerprint", "turn_id", "pending_turn_id", "reserve_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    PENDING_TURN_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    session_key: bytes
    expected_version: int
    bundle_fingerprint: str
    turn_id: bytes
    pending_turn_id: bytes
    reserve_tokens: int
    def __init__(self, session_id: _Optional[bytes] = ..., session_key: _Optional[bytes] = ..., expected_version: _Optional[int] = ..., bundle_fingerprint: _Optional[str] = ..., turn_id: _Optional[bytes] = ..., pending_turn_id: _Optional[bytes] = ..., reserve_tokens: _Optional[int] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("hidden", "cache_length", "outputs", "evict", "answer_dtype", "parents")
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    ANSWER_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    hidden: Tensor
    cache_length: int
    outputs: int
    evict: int
    answer_dtype: str
    parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, hidden: _Optional[_Union[Tensor, _Mapping]] = ..., cache_length: _Optional[int] = ..., outputs: _Optional[int] = ..., evict: _Optional[int] = ..., answer_dtype: _Optional[str] = ..., parents: _Optional[_Iterable[int]] = ...) -> None: ...

class Truncate(_message.Message):
    __slots__ = ("tokens", "cache_length", "keep")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    KEEP_FIELD_NUMBER: _ClassVar[int]
    tokens: int
    cache_length: int
    keep: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[int] = ..., cache_length: _Optional[int] = ..., keep: _Optional[_Iterable[int]] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KeepAlive(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TurnRequest(_message.Message):
    __slots__ = ("open", "step", "truncate", "commit", "keepalive")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    open: OpenTurn
    step: Step
    truncate: Truncate
    commit: Commit
    keepalive: KeepAlive
    def __init__(self, open: _Optional[_Union[OpenTurn, _Mapping]] = ..., step: _Optional[_Union[Step, _Mapping]] = ..., truncate: _Optional[_Union[Truncate, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., keepalive: _Optional[_Union[KeepAlive, _Mapping]] = ...) -> None: ...

class Opened(_message.Message):
    __slots__ = ("version", "cache_length", "pending_committed")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CACHE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PENDING_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    version: int
    cache_length: int
    pending_committed: bool
    def __init__(self, version: _Optional[int] = ..., cache_length: _Optional[int] = ..., pending_committed: _Optional[bool] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("hidden", "cache_length", "evicted")
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    hidden: Tensor
    cache_length: int
    evicted: int
    def __init__(self, hidden: _Optional[_Union[Tensor, _Mapping]] = ..., cache_length: _Optional[int] = ..., evicted: _Optional[int] = ...) -> None: ...

class Truncated(_message.Message):
    __slots__ = ("cache_length",)
    CACHE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    cache_length: int
    def __init__(self, cache_length: _Optional[int] = ...) -> None: ...

class Committed(_message.Message):
    __slots__ = ("version", "cache_length")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CACHE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    version: int
    cache_length: int
    def __init__(self, version: _Optional[int] = ..., cache_length: _Optional[int] = ...) -> None: ...

class TurnResponse(_message.Message):
    __slots__ = ("opened", "step", "truncated", "committed")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    opened: Opened
    step: StepResult
    truncated: Truncated
    committed: Committed
    def __init__(self, opened: _Optional[_Union[Opened, _Mapping]] = ..., step: _Optional[_Union[StepResult, _Mapping]] = ..., truncated: _Optional[_Union[Truncated, _Mapping]] = ..., committed: _Optional[_Union[Committed, _Mapping]] = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("bundle_fingerprint", "model_type", "hidden_size", "first_layer", "num_layers", "total_layers", "dtype", "device", "max_step_tokens", "max_context", "max_message_bytes", "server_version", "protocol_version", "window", "sink_tokens", "page_size", "turn_idle_seconds", "max_turn_seconds", "bundle_unverified", "draft_trees")
    BUNDLE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TURN_IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TURN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_UNVERIFIED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TREES_FIELD_NUMBER: _ClassVar[int]
    bundle_fingerprint: str
    model_type: str
    hidden_size: int
    first_layer: int
    num_layers: int
    total_layers: int
    dtype: str
    device: str
    max_step_tokens: int
    max_context: int
    max_message_bytes: int
    server_version: str
    protocol_version: int
    window: bool
    sink_tokens: int
    page_size: int
    turn_idle_seconds: float
    max_turn_seconds: float
    bundle_unverified: bool
    draft_trees: bool
    def __init__(self, bundle_fingerprint: _Optional[str] = ..., model_type: _Optional[str] = ..., hidden_size: _Optional[int] = ..., first_layer: _Optional[int] = ..., num_layers: _Optional[int] = ..., total_layers: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., max_step_tokens: _Optional[int] = ..., max_context: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., server_version: _Optional[str] = ..., protocol_version: _Optional[int] = ..., window: _Optional[bool] = ..., sink_tokens: _Optional[int] = ..., page_size: _Optional[int] = ..., turn_idle_seconds: _Optional[float] = ..., max_turn_seconds: _Optional[float] = ..., bundle_unverified: _Optional[bool] = ..., draft_trees: _Optional[bool] = ...) -> None: ...

class DeleteSessionRequest(_message.Message):
    __slots__ = ("session_id", "session_key")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    session_id: bytes
    session_key: bytes
    def __init__(self, session_id: _Optional[bytes] = ..., session_key: _Optional[bytes] = ...) -> None: ...

class DeleteSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ForkSessionRequest(_message.Message):
    __slots__ = ("source_id", "source_key", "source_version", "bundle_fingerprint", "session_id", "session_key", "drop")
    SOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_KEY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    DROP_FIELD_NUMBER: _ClassVar[int]
    source_id: bytes
    source_key: bytes
    source_version: int
    bundle_fingerprint: str
    session_id: bytes
    session_key: bytes
    drop: int
    def __init__(self, source_id: _Optional[bytes] = ..., source_key: _Optional[bytes] = ..., source_version: _Optional[int] = ..., bundle_fingerprint: _Optional[str] = ..., session_id: _Optional[bytes] = ..., session_key: _Optional[bytes] = ..., drop: _Optional[int] = ...) -> None: ...

class ForkSessionResponse(_message.Message):
    __slots__ = ("version", "cache_length")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CACHE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    version: int
    cache_length: int
    def __init__(self, version: _Optional[int] = ..., cache_length: _Optional[int] = ...) -> None: ...
