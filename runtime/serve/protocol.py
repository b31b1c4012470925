"""The ring protocol: what the ingress and the engine process say to each other through the rings,
beyond the rings' own layout (docs/rings.md): a request's flags, a result's flags, and the error
code an ERROR result carries in its token field. Both sides import this module and neither imports
the other, so the engine process never loads the ingress and the ingress never loads the executor's
side.
"""

from __future__ import annotations

import enum

MAX_TOP_LOGPROBS = 20  # alternatives per token a LOGPROBS request may ask for (OpenAI's limit)
# The longest output grammar (UTF-8 bytes) a GRAMMAR request carries: the request ring is sized for
# a prompt of max_seq tokens plus this many bytes (engine_client.request_ring_slots).
MAX_GRAMMAR_BYTES = 32768


class RequestFlag(enum.IntFlag):
    """Request flags: bits 0..30 are the serving layer's (bit 31 marks the ring's continuation
    chunks and is refused on push)."""

    CANCEL = 1  # stop the request with this id (its prompt is empty)
    PING = 2  # answer with a PONG result (no prompt): the supervisor's liveness check of an idle engine
    LOGPROBS = 4  # every token's result carries its logprob, after top_logprobs TOP results (sampling.py)
    # PROMPT results first: the logprob of every prompt token after the first (completions' echo);
    # the prompt is then fed one token per step and never taken from the prefix cache
    PROMPT_LOGPROBS = 8
    # The request carries an llguidance Lark grammar its output must match (constraints.py); on the
    # ring its UTF-8 bytes go before the prompt's tokens (rings.Request packs and unpacks them)
    GRAMMAR = 16


class ResultFlag(enum.IntFlag):
    """Result flags; the ring carries them as an opaque u32. A frame result forwards them as they are
    (frames.FrameFlag has the same EOS, ERROR and LAST bits)."""

    EOS = 1  # the token is an end-of-sequence token
    ERROR = 2  # the request failed; the token field is an EngineError
    LAST = 4  # no more results for this request id (EOS, max_tokens, error or cancel)
    PONG = 8  # the answer to a PING request
    # One of a LOGPROBS request's top_logprobs alternatives, most likely first: token and logprob
    # field are a candidate and its log-probability; the chosen token's own result follows them.
    TOP = 16
    # A PROMPT_LOGPROBS request's prompt token (token) and its logprob, after its TOP alternatives
    PROMPT = 32
    # A GRAMMAR request's grammar is complete with this token (nothing but an end-of-sequence token
    # could follow): the reply ends here as at an end-of-sequence token (with LAST)
    COMPLETE = 64


class EngineError(enum.IntEnum):
    """Error codes carried in an ERROR result's token field (a frame result forwards them: the same
    numbers as frames.FrameErrorCode)."""

    OVERLOADED = 1  # the waiting queue is full
    BAD_REQUEST = 2  # the executor refused the prompt (too long, token outside the vocabulary)
    INTERNAL = 3  # the executor failed
    CANCELLED = 4  # a CANCEL request stopped it
    KV_BUDGET = 9  # the prompt needs more KV pages than the engine's whole budget (--kv-pages)
    GRAMMAR = 10  # a GRAMMAR request's grammar did not compile, or its matcher failed while generating
    # Never sent by the engine: the ingress ends a request with it when the engine is lost (exited,
    # hung) or the server shuts down before the request finished.
    UNAVAILABLE = 8
