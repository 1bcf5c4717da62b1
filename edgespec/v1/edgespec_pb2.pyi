from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "has_seed", "seed", "presence_penalty", "frequency_penalty", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    has_seed: bool
    seed: int
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., has_seed: _Optional[bool] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class Stats(_message.Message):
    __slots__ = ("steps", "num_drafts", "drafted", "accepted", "acceptance_rate", "mean_acceptance_length", "tokens_per_s", "prefill_s", "elapsed_s", "tokens", "accepted_per_pos", "take_s", "forward_s", "commit_s", "lossy", "branch_tokens", "head_tokens", "head_accepted", "stacks", "verify", "lenient_tokens", "fill_tokens", "fill_accepted", "fill_drafts", "drafter_drafts", "drafter_tokens", "drafter_accepted")
    class StacksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POS_FIELD_NUMBER: _ClassVar[int]
    TAKE_S_FIELD_NUMBER: _ClassVar[int]
    FORWARD_S_FIELD_NUMBER: _ClassVar[int]
    COMMIT_S_FIELD_NUMBER: _ClassVar[int]
    LOSSY_FIELD_NUMBER: _ClassVar[int]
    BRANCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HEAD_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    LENIENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FILL_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    FILL_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    steps: int
    num_drafts: int
    drafted: int
    accepted: int
    acceptance_rate: float
    mean_acceptance_length: float
    tokens_per_s: float
    prefill_s: float
    elapsed_s: float
    tokens: int
    accepted_per_pos: _containers.RepeatedScalarFieldContainer[int]
    take_s: float
    forward_s: float
    commit_s: float
    lossy: bool
    branch_tokens: int
    head_tokens: int
    head_accepted: int
    stacks: _containers.ScalarMap[str, int]
    verify: str
    lenient_tokens: int
    fill_tokens: int
    fill_accepted: int
    fill_drafts: int
    drafter_drafts: int
    drafter_tokens: int
    drafter_accepted: int
    def __init__(self, steps: _Optional[int] = ..., num_drafts: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_acceptance_length: _Optional[float] = ..., tokens_per_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., elapsed_s: _Optional[float] = ..., tokens: _Optional[int] = ..., accepted_per_pos: _Optional[_Iterable[int]] = ..., take_s: _Optional[float] = ..., forward_s: _Optional[float] = ..., commit_s: _Optional[float] = ..., lossy: _Optional[bool] = ..., branch_tokens: _Optional[int] = ..., head_tokens: _Optional[int] = ..., head_accepted: _Optional[int] = ..., stacks: _Optional[_Mapping[str, int]] = ..., verify: _Optional[str] = ..., lenient_tokens: _Optional[int] = ..., fill_tokens: _Optional[int] = ..., fill_accepted: _Optional[int] = ..., fill_drafts: _Optional[int] = ..., drafter_drafts: _Optional[int] = ..., drafter_tokens: _Optional[int] = ..., drafter_accepted: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "raw", "messages", "prompt_ids", "max_new_tokens", "sampling", "device_id", "resume_session_id", "resume_from", "verify", "committed_ids", "lost_session_id", "images", "kernel_set", "kernels_differ_from", "logprobs", "prompt_logprobs", "prompt_only")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_IDS_FIELD_NUMBER: _ClassVar[int]
    LOST_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    KERNEL_SET_FIELD_NUMBER: _ClassVar[int]
    KERNELS_DIFFER_FROM_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ONLY_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    raw: bool
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    sampling: SamplingParams
    device_id: str
    resume_session_id: str
    resume_from: int
    verify: str
    committed_ids: _containers.RepeatedScalarFieldContainer[int]
    lost_session_id: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    kernel_set: str
    kernels_differ_from: int
    logprobs: int
    prompt_logprobs: int
    prompt_only: bool
    def __init__(self, prompt: _Optional[str] = ..., raw: _Optional[bool] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., device_id: _Optional[str] = ..., resume_session_id: _Optional[str] = ..., resume_from: _Optional[int] = ..., verify: _Optional[str] = ..., committed_ids: _Optional[_Iterable[int]] = ..., lost_session_id: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ..., kernel_set: _Optional[str] = ..., kernels_differ_from: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., prompt_only: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("session_id", "token_ids", "text", "finished", "finish_reason", "stats", "device_id", "prompt_tokens", "resumed", "sampling", "kernel_set", "kernels_differ_from", "logprobs", "prompt_logprobs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KERNEL_SET_FIELD_NUMBER: _ClassVar[int]
    KERNELS_DIFFER_FROM_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    finish_reason: str
    stats: Stats
    device_id: str
    prompt_tokens: int
    resumed: bool
    sampling: SamplingParams
    kernel_set: str
    kernels_differ_from: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: PromptLogprobs
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[Stats, _Mapping]] = ..., device_id: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., resumed: _Optional[bool] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., kernel_set: _Optional[str] = ..., kernels_differ_from: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("entries", "start")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    start: int
    def __init__(self, entries: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., start: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrafterStatus(_message.Message):
    __slots__ = ("device_id", "draft_model", "attached", "sessions", "max_sessions", "acceptance_rate", "mean_acceptance_length", "last_seen_s", "late", "drafts_missed", "steps_unwaited", "session_steps", "ready_drafts", "verified_drafts", "finished_drafts", "finished_draft_tokens", "finished_accepted_tokens")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_MISSED_FIELD_NUMBER: _ClassVar[int]
    STEPS_UNWAITED_FIELD_NUMBER: _ClassVar[int]
    SESSION_STEPS_FIELD_NUMBER: _ClassVar[int]
    READY_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    draft_model: str
    attached: bool
    sessions: int
    max_sessions: int
    acceptance_rate: float
    mean_acceptance_length: float
    last_seen_s: float
    late: bool
    drafts_missed: int
    steps_unwaited: int
    session_steps: int
    ready_drafts: int
    verified_drafts: int
    finished_drafts: int
    finished_draft_tokens: int
    finished_accepted_tokens: int
    def __init__(self, device_id: _Optional[str] = ..., draft_model: _Optional[str] = ..., attached: _Optional[bool] = ..., sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_acceptance_length: _Optional[float] = ..., last_seen_s: _Optional[float] = ..., late: _Optional[bool] = ..., drafts_missed: _Optional[int] = ..., steps_unwaited: _Optional[int] = ..., session_steps: _Optional[int] = ..., ready_drafts: _Optional[int] = ..., verified_drafts: _Optional[int] = ..., finished_drafts: _Optional[int] = ..., finished_draft_tokens: _Optional[int] = ..., finished_accepted_tokens: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("model", "version", "drafters", "active_sessions", "queued_sessions", "free_kv_slots", "kv_slots", "tokens_per_s_last_minute", "healthy", "dtype", "head", "runner", "cost", "unhealthy_reason")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_SLOTS_FIELD_NUMBER: _ClassVar[int]
    KV_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_LAST_MINUTE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    RUNNER_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_REASON_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    drafters: _containers.RepeatedCompositeFieldContainer[DrafterStatus]
    active_sessions: int
    queued_sessions: int
    free_kv_slots: int
    kv_slots: int
    tokens_per_s_last_minute: float
    healthy: bool
    dtype: str
    head: HeadStatus
    runner: RunnerStatus
    cost: ServerCost
    unhealthy_reason: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., drafters: _Optional[_Iterable[_Union[DrafterStatus, _Mapping]]] = ..., active_sessions: _Optional[int] = ..., queued_sessions: _Optional[int] = ..., free_kv_slots: _Optional[int] = ..., kv_slots: _Optional[int] = ..., tokens_per_s_last_minute: _Optional[float] = ..., healthy: _Optional[bool] = ..., dtype: _Optional[str] = ..., head: _Optional[_Union[HeadStatus, _Mapping]] = ..., runner: _Optional[_Union[RunnerStatus, _Mapping]] = ..., cost: _Optional[_Union[ServerCost, _Mapping]] = ..., unhealthy_reason: _Optional[str] = ...) -> None: ...

class ServerCost(_message.Message):
    __slots__ = ("cpu_s", "committed_tokens", "forwards", "draft_tokens", "accepted_tokens")
    CPU_S_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cpu_s: float
    committed_tokens: int
    forwards: int
    draft_tokens: int
    accepted_tokens: int
    def __init__(self, cpu_s: _Optional[float] = ..., committed_tokens: _Optional[int] = ..., forwards: _Optional[int] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ...) -> None: ...

class RunnerStatus(_message.Message):
    __slots__ = ("device", "kernels", "graph_buckets", "graphs_captured", "graphs_capture_s", "graphs_failed", "graph_replays", "attention", "kernel_set", "kernel_set_description")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    GRAPH_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_CAPTURED_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_CAPTURE_S_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_FAILED_FIELD_NUMBER: _ClassVar[int]
    GRAPH_REPLAYS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    KERNEL_SET_FIELD_NUMBER: _ClassVar[int]
    KERNEL_SET_DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    device: str
    kernels: str
    graph_buckets: int
    graphs_captured: int
    graphs_capture_s: float
    graphs_failed: str
    graph_replays: int
    attention: str
    kernel_set: str
    kernel_set_description: str
    def __init__(self, device: _Optional[str] = ..., kernels: _Optional[str] = ..., graph_buckets: _Optional[int] = ..., graphs_captured: _Optional[int] = ..., graphs_capture_s: _Optional[float] = ..., graphs_failed: _Optional[str] = ..., graph_replays: _Optional[int] = ..., attention: _Optional[str] = ..., kernel_set: _Optional[str] = ..., kernel_set_description: _Optional[str] = ...) -> None: ...

class HeadStatus(_message.Message):
    __slots__ = ("kind", "source", "version", "held_out_tokens_per_step", "draft_tokens", "accepted_tokens", "learning", "buffered_tokens")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HELD_OUT_TOKENS_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEARNING_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    kind: str
    source: str
    version: int
    held_out_tokens_per_step: float
    draft_tokens: int
    accepted_tokens: int
    learning: bool
    buffered_tokens: int
    def __init__(self, kind: _Optional[str] = ..., source: _Optional[str] = ..., version: _Optional[int] = ..., held_out_tokens_per_step: _Optional[float] = ..., draft_tokens: _Optional[int] = ..., accepted_tokens: _Optional[int] = ..., learning: _Optional[bool] = ..., buffered_tokens: _Optional[int] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("device_id", "draft_model", "tokenizer_fingerprint", "max_sessions", "heartbeat_ms", "batches")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    draft_model: str
    tokenizer_fingerprint: str
    max_sessions: int
    heartbeat_ms: int
    batches: bool
    def __init__(self, device_id: _Optional[str] = ..., draft_model: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., max_sessions: _Optional[int] = ..., heartbeat_ms: _Optional[int] = ..., batches: _Optional[bool] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("sent_unix_ms",)
    SENT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    sent_unix_ms: int
    def __init__(self, sent_unix_ms: _Optional[int] = ...) -> None: ...

class DraftChunk(_message.Message):
    __slots__ = ("session_id", "epoch", "start", "tokens", "idle", "tree_parents", "tree_version", "quiet")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    TREE_PARENTS_FIELD_NUMBER: _ClassVar[int]
    TREE_VERSION_FIELD_NUMBER: _ClassVar[int]
    QUIET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    idle: bool
    tree_parents: _containers.RepeatedScalarFieldContainer[int]
    tree_version: int
    quiet: bool
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., idle: _Optional[bool] = ..., tree_parents: _Optional[_Iterable[int]] = ..., tree_version: _Optional[int] = ..., quiet: _Optional[bool] = ...) -> None: ...

class DraftChunks(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[DraftChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[DraftChunk, _Mapping]]] = ...) -> None: ...

class DrafterMessage(_message.Message):
    __slots__ = ("register", "chunk", "heartbeat", "chunks")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    register: Register
    chunk: DraftChunk
    heartbeat: Heartbeat
    chunks: DraftChunks
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., chunk: _Optional[_Union[DraftChunk, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., chunks: _Optional[_Union[DraftChunks, _Mapping]] = ...) -> None: ...

class Registered(_message.Message):
    __slots__ = ("target_model", "tokenizer_fingerprint", "window", "chunk", "vocab_size", "heartbeat_ms", "batches")
    TARGET_MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    target_model: str
    tokenizer_fingerprint: str
    window: int
    chunk: int
    vocab_size: int
    heartbeat_ms: int
    batches: bool
    def __init__(self, target_model: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., window: _Optional[int] = ..., chunk: _Optional[int] = ..., vocab_size: _Optional[int] = ..., heartbeat_ms: _Optional[int] = ..., batches: _Optional[bool] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("session_id", "tokens", "sampling", "epoch", "output_end")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_END_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    epoch: int
    output_end: int
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., epoch: _Optional[int] = ..., output_end: _Optional[int] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("session_id", "epoch", "committed_end", "is_fix", "fix_position", "fix_token", "fix_more", "wanted")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_END_FIELD_NUMBER: _ClassVar[int]
    IS_FIX_FIELD_NUMBER: _ClassVar[int]
    FIX_POSITION_FIELD_NUMBER: _ClassVar[int]
    FIX_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIX_MORE_FIELD_NUMBER: _ClassVar[int]
    WANTED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    committed_end: int
    is_fix: bool
    fix_position: int
    fix_token: int
    fix_more: _containers.RepeatedScalarFieldContainer[int]
    wanted: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., committed_end: _Optional[int] = ..., is_fix: _Optional[bool] = ..., fix_position: _Optional[int] = ..., fix_token: _Optional[int] = ..., fix_more: _Optional[_Iterable[int]] = ..., wanted: _Optional[int] = ...) -> None: ...

class ChunkAck(_message.Message):
    __slots__ = ("session_id", "start", "kept", "committed_end", "code", "message")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_END_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start: int
    kept: int
    committed_end: int
    code: int
    message: str
    def __init__(self, session_id: _Optional[str] = ..., start: _Optional[int] = ..., kept: _Optional[int] = ..., committed_end: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SessionClosed(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CacheBatch(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[CacheMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[CacheMessage, _Mapping]]] = ...) -> None: ...

class CacheMessage(_message.Message):
    __slots__ = ("registered", "assignment", "commit", "ack", "closed", "heartbeat", "batch")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    registered: Registered
    assignment: Assignment
    commit: Commit
    ack: ChunkAck
    closed: SessionClosed
    heartbeat: Heartbeat
    batch: CacheBatch
    def __init__(self, registered: _Optional[_Union[Registered, _Mapping]] = ..., assignment: _Optional[_Union[Assignment, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., ack: _Optional[_Union[ChunkAck, _Mapping]] = ..., closed: _Optional[_Union[SessionClosed, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., batch: _Optional[_Union[CacheBatch, _Mapping]] = ...) -> None: ...

class FleetTableRequest(_message.Message):
    __slots__ = ("since", "limit")
    SINCE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    since: int
    limit: int
    def __init__(self, since: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class FleetTableEntry(_message.Message):
    __slots__ = ("leader", "followers")
    LEADER_FIELD_NUMBER: _ClassVar[int]
    FOLLOWERS_FIELD_NUMBER: _ClassVar[int]
    leader: _containers.RepeatedScalarFieldContainer[int]
    followers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, leader: _Optional[_Iterable[int]] = ..., followers: _Optional[_Iterable[int]] = ...) -> None: ...

class FleetTableReply(_message.Message):
    __slots__ = ("entries", "version", "more")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[FleetTableEntry]
    version: int
    more: bool
    def __init__(self, entries: _Optional[_Iterable[_Union[FleetTableEntry, _Mapping]]] = ..., version: _Optional[int] = ..., more: _Optional[bool] = ...) -> None: ...
