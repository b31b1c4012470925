"""What the Anthropic and OpenAI front ends share: the shape of an API object (`Api`: its parsing,
replies, errors and model list; api_anthropic.ANTHROPIC and api_openai.OPENAI are the two), the
validated generation request, API errors, and strict field checks (a wrong type names the field
instead of failing later)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

MAX_N = 8  # the most choices one request may ask for (OpenAI `n`)


class ApiError(Exception):
    """An error answered to the client. ``kind`` is the Anthropic error type; the OpenAI front end
    maps it to its own shape (see OpenAiApi.error_body)."""

    STATUS = {
        "invalid_request_error": 400,
        "authentication_error": 401,
        "permission_error": 403,
        "not_found_error": 404,
        "request_too_large": 413,
        "rate_limit_error": 429,
        "api_error": 500,
        "overloaded_error": 529,
    }

    def __init__(self, kind: str, message: str, *, status: int | None = None, param: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.status = status if status is not None else self.STATUS[kind]
        self.param = param
        # seconds, sent as Retry-After: overload and rate limits always say when to come back
        self.retry_after = retry_after if retry_after is not None else (
            1 if kind in ("overloaded_error", "rate_limit_error") else None)


@dataclass(slots=True)
class GenerationSpec:
    """One validated request, whatever API it came in through."""

    prompt_ids: list[int]
    max_tokens: int
    stream: bool = False
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_sequences: list[str] = field(default_factory=list)
    include_usage: bool = False  # OpenAI stream_options.include_usage
    top_k: int = 0  # 0: off (sampling.py has the options' rules)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1  # choices (OpenAI): n engine requests, seeds seed, seed + 1, ...
    echo: bool = False  # completions: the prompt comes back before the answer
    clipped: bool = False  # max_tokens was cut to what fits in the context
    tools: Any = None  # a tools.ToolSetup (tools.py imports this module): replies parse calls when offered
    # constrained decoding (constraints.py): an llguidance Lark grammar the output must match, and
    # the request field it came from (a grammar that does not compile is a 400 naming it)
    grammar: str | None = None
    grammar_param: str = "response_format"


@dataclass(slots=True)
class ChatPrompt:
    """What an API's messages become before tokenizing (prompts.py): the chat, and for Anthropic a
    final assistant message the reply continues (``prefill``: encoded after the template of the rest).
    A completion's prompt is no chat: ``text`` (encoded as is, the tokenizer's special tokens
    added) or ``ids`` (token ids, sent as they are)."""

    chat: list[dict[str, Any]]
    prefill: str | None = None
    text: str | None = None
    ids: list[int] | None = None
    tools: Any = None  # the request's tools.ToolSetup: rendered with the chat (prompts.py)


@dataclass(slots=True)
class TokenLogprob:
    """One token of a reply (or of an echoed prompt) with its logprob (None: the prompt's first
    token, which nothing predicts) and its alternatives, most likely first."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]]


@dataclass(slots=True)
class Outcome:
    """How one choice of a reply ended. ``reason`` is eos, max_tokens or stop_sequence; logprobs
    are None unless asked; ``prompt``/``prompt_logprobs``: the echoed prompt (completions)."""

    text: str
    reason: str
    stop_sequence: str | None
    tokens: int
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt: str = ""
    prompt_logprobs: list[TokenLogprob] | None = None


class Reply(Protocol):
    """One reply's wire form in its API's shapes; the generation path feeds it text as tokens arrive.
    A reply has spec.n choices (index 0.. n - 1; Anthropic's always 1)."""

    id: str  # also sent as the request-id header

    def stream_head(self) -> bytes:
        """What a stream starts with (it goes out with the first token)."""

    def stream_delta(self, text: str, index: int = 0, logprobs: list[TokenLogprob] | None = None) -> bytes:
        """One piece of text of choice `index` as a stream event (with its tokens' logprobs when asked)."""

    def stream_end(self, outcome: Outcome, output_tokens: int, last: bool = True) -> bytes:
        """What ends choice outcome.index's stream; `last`: the whole stream's end (the last choice
        to finish; output_tokens then counts every choice's tokens)."""

    def body(self, outcomes: list[Outcome], output_tokens: int) -> bytes:
        """The whole reply as one JSON body (not streaming), its choices in index order."""


class Api(Protocol):
    """One HTTP API: everything of a request that depends on which API it came in through. The route
    picks the object (server.py); what runs after it asks the object and never the API's name."""

    name: str  # its label in /metrics
    bad_key: str  # the 401's message on its generation path

    def parse(self, body: Any, served_model: str) -> tuple[GenerationSpec, ChatPrompt]:
        """The validated request (its prompt ids still empty) and the chat to tokenize."""

    def reply(self, model: str, spec: GenerationSpec) -> Reply:
        """The reply to `spec`, once its prompt ids are known."""

    def status(self, e: ApiError) -> int:
        """The HTTP status that answers `e`."""

    def error_body(self, e: ApiError) -> bytes:
        """`e` as a whole response body."""

    def stream_error(self, e: ApiError) -> bytes:
        """`e` as the event that ends a stream already under way."""

    def models(self, model: str, created: int, max_seq: int, *, single: bool) -> bytes:
        """GET /v1/models, or /v1/models/{model} when `single`; `created` is a Unix time."""


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError("invalid_request_error", message, param=param)


def request_fields(body: Any, known: frozenset[str], unknown: str, served_model: str) -> dict[str, Any]:
    """The body as a request: a JSON object of `known` fields only, for the served model. `unknown`
    words the error that names the first other field (its ``{}``), as each API words it."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    extra = sorted(set(body) - known)
    if extra:
        raise invalid(unknown.format(extra[0]), extra[0])
    check_model(body.get("model"), served_model)
    return body


def get_messages(body: dict[str, Any]) -> list[Any]:
    """The request's messages: a list of at least one (each API checks the messages themselves)."""
    messages = body.get("messages")
    if messages is None:
        raise invalid("messages: Field required", "messages")
    if not isinstance(messages, list):
        raise invalid("messages: Input should be a valid list", "messages")
    if not messages:
        raise invalid("messages: at least one message is required", "messages")
    return messages


def get_int(body: dict[str, Any], key: str, *, required: bool = False, default: int | None = None,
            lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        if required:
            raise invalid(f"{key}: Field required", key)
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(f"{key}: Input should be a valid integer, got {type(v).__name__}", key)
    if lo is not None and v < lo:
        raise invalid(f"{key}: Input should be greater than or equal to {lo}", key)
    if hi is not None and v > hi:
        raise invalid(f"{key}: Input should be less than or equal to {hi}", key)
    return v


def get_float(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise invalid(f"{key}: Input should be a valid number, got {type(v).__name__}", key)
    if not lo <= v <= hi:
        raise invalid(f"{key}: Input should be between {lo} and {hi}", key)
    return float(v)


def get_top_k(body: dict[str, Any]) -> int:
    """top_k: absent or 0 is off; negative is refused (a u32 in the ring: at most 2**31 - 1)."""
    v = get_int(body, "top_k", default=0, lo=0, hi=2**31 - 1)
    assert v is not None
    return v


def get_bool(body: dict[str, Any], key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise invalid(f"{key}: Input should be a valid boolean, got {type(v).__name__}", key)
    return v


def get_stops(v: Any, key: str, limit: int) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise invalid(f"{key}: Input should be a string or a list of strings", key)
    if len(v) > limit:
        raise invalid(f"{key}: at most {limit} stop sequences", key)
    return [s for s in v if s]


def text_of(content: Any, where: str) -> str:
    """A message's text: a string, or a list of text blocks ({"type": "text", "text": ...})."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, block in enumerate(content):
            if not isinstance(block, dict):
                raise invalid(f"{where}.content.{i}: Input should be an object")
            kind = block.get("type")
            if kind != "text":
                raise invalid(f"{where}.content.{i}: content type {kind!r} is not supported by this model "
                              "(text only)")
            text = block.get("text")
            if not isinstance(text, str):
                raise invalid(f"{where}.content.{i}.text: Input should be a valid string")
            parts.append(text)
        return "".join(parts)
    raise invalid(f"{where}.content: Input should be a string or a list of content blocks")


def check_model(model: Any, served: str) -> None:
    if not isinstance(model, str):
        raise invalid("model: Field required" if model is None else "model: Input should be a valid string", "model")
    if model != served:
        raise ApiError("not_found_error", f"model: {model} (this server serves '{served}')", param="model")


def fit_context(spec: GenerationSpec, max_seq: int) -> GenerationSpec:
    """Refuses a prompt the context cannot hold; clips max_tokens to what fits (the reply then
    ends with max_tokens / length, as when the limit is reached)."""
    n = len(spec.prompt_ids)
    if n == 0:
        raise invalid("the prompt is empty after applying the chat template")
    if n > max_seq:
        raise invalid(f"prompt is too long: {n} tokens > {max_seq} maximum")
    room = max_seq - n + 1  # the last new token needs no cache row
    if spec.max_tokens <= 0:  # not given (OpenAI): the rest of the context
        spec.max_tokens = room
    elif spec.max_tokens > room:
        spec.max_tokens, spec.clipped = room, True
    return spec
