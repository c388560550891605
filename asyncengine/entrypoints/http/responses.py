"""Response bodies of the OpenAI-compatible API (the shapes OpenAI's clients parse)."""

from __future__ import annotations

from msgspec import Struct


class CompletionTokensDetails(Struct):
    reasoning_tokens: int = 0


class PromptTokensDetails(Struct):
    cached_tokens: int  # the prompt's tokens found in the prefix cache


class Usage(Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Set when the server splits reasoning (--reasoning-parser).
    completion_tokens_details: CompletionTokensDetails | None = None
    # Set under --enable-prompt-tokens-details.
    prompt_tokens_details: PromptTokensDetails | None = None


class ErrorInfo(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(Struct):
    error: ErrorInfo


# -- completions -------------------------------------------------------------------------------
class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Completion(Struct):
    """The body of a non-streaming completion, and of each streamed chunk (SSE ``data:``)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None = None


# -- chat --------------------------------------------------------------------------------------
class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[TokenLogprob] | None


class FunctionCallOut(Struct):
    name: str
    arguments: str


class ToolCallOut(Struct):
    id: str
    function: FunctionCallOut
    type: str = "function"


class AssistantMessage(Struct, omit_defaults=True):
    """``reasoning`` and ``reasoning_content`` hold the same text (--reasoning-parser): vLLM
    renamed the field to ``reasoning``; llama-server and older clients read
    ``reasoning_content``."""

    role: str
    content: str | None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletion(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class DeltaFunction(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Struct, omit_defaults=True):
    """A piece of a streamed tool call: ``id``, ``type`` and the name on its first piece."""

    index: int
    function: DeltaFunction
    id: str | None = None
    type: str | None = None


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None  # and reasoning_content: the same text (see AssistantMessage)
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(Struct):
    """One streamed chat chunk (SSE ``data:``)."""

    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None


# -- other routes ------------------------------------------------------------------------------
class ModelCard(Struct):
    id: str
    created: int
    owned_by: str
    max_model_len: int
    root: str | None = None
    parent: str | None = None
    object: str = "model"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(Struct):
    prompt: str
    content: str  # llama-server's name for it


class VersionResponse(Struct):
    version: str


class HealthResponse(Struct):
    """GET /health: ``ok``, with the scheduler's queues and the KV-cache block pool."""

    status: str
    num_requests_running: int
    num_requests_waiting: int
    num_free_blocks: int
    num_total_blocks: int
