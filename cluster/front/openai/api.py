"""OpenAI's completions and chat completions API, as plain data (pure: no aiohttp, no gRPC).

Request bodies become a GenerateSpec, the same one a gRPC request becomes, so one validator and
one admission path serve both front doors. Every field is either used, accepted with a no-op
value, accepted and ignored (``user`` only), or refused with a 400 that names it: nothing is
silently dropped. The response builders return OpenAI's JSON shapes.

pdserve's own fields are extra body fields: ``priority`` (0..1), ``agent_hierarchy`` (a list of
``{"agent_type", "node_id"}``), ``disaggregation`` ("auto", "always", "never") and
``deadline_ms``. vLLM's common extras are accepted too: ``top_k``, ``ignore_eos``,
``stop_token_ids``, and ``min_tokens`` when it is 0.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pdserve.cluster.policies import DisaggregationMode
from pdserve.cluster.validation import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_PRIORITY,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    GenerateSpec,
)

COMPLETIONS, CHAT = "completions", "chat"

# Fields each endpoint uses (besides the no-op and ignored ones below).
_USED = {
    COMPLETIONS: {"model", "prompt", "max_tokens"},
    CHAT: {"model", "messages", "max_tokens", "max_completion_tokens"},
}
_SHARED_USED = {"temperature", "top_p", "seed", "stop", "stream", "stream_options", "top_k", "ignore_eos",
                "stop_token_ids", "min_tokens", "priority", "agent_hierarchy", "disaggregation", "deadline_ms"}
IGNORED = {"user"}  # accepted and ignored: an end-user id for abuse tracking
# Fields accepted only with the value that means "off"; anything else is unsupported.
_NO_OP = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None,),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, False),
    "response_format": (None, {"type": "text"}),
}
_NO_OP_FIELDS = {
    COMPLETIONS: {"n", "best_of", "echo", "suffix", "presence_penalty", "frequency_penalty", "logit_bias",
                  "logprobs"},
    CHAT: {"n", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "tools",
           "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format"},
}
CHAT_ROLES = ("system", "developer", "user", "assistant")


class ApiError(Exception):
    """An error answered with OpenAI's error object; ``status`` is the HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: str
    spec: GenerateSpec  # for chat: no prompt yet (the router renders the messages)
    stream: bool
    include_usage: bool
    messages: tuple[dict[str, Any], ...] = ()  # chat only, content flattened to text
    max_tokens_given: bool = True  # chat without max_tokens: as many as the context allows


def openai_param(field: str, kind: str) -> str:
    """A GenerateSpec field path ("sampling.top_p", "prompt.token_ids[3]") as the body field."""
    if field.startswith("prompt"):
        return "messages" if kind == CHAT else "prompt"
    if field.startswith("sampling."):
        field = field[len("sampling."):]
    if field == "request_id":
        return "X-Request-Id"
    return field


def field_error(field: str, detail: str, kind: str, *, status: int = 400,
                type_: str = "invalid_request_error", code: str | None = None) -> ApiError:
    """An error in one request field (a GenerateSpec path such as "sampling.top_p"): gRPC's
    rule and message, naming the body field instead ("top_p: must be in (0, 1], got 1.5")."""
    param = openai_param(field, kind)
    return ApiError(status, f"{param}: {detail}", param=param, type_=type_, code=code)


def parse_request(body: Any, kind: str, served_model: str) -> ParsedRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name in body:
        if name in _USED[kind] or name in _SHARED_USED or name in IGNORED:
            continue
        if name in _NO_OP_FIELDS[kind]:
            if not _is_one_of(body[name], _NO_OP[name]):
                raise invalid(name, f"{body[name]!r} is not supported (accepted: "
                              f"{', '.join(repr(v) for v in _NO_OP[name])})")
            continue
        raise invalid(name, "unrecognized request argument")
    model = body.get("model")
    if model is not None and model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist (this server serves `{served_model}`)",
                       param="model", code="model_not_found")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise invalid("stream", f"must be a boolean, got {stream!r}")
    include_usage = _stream_options(body.get("stream_options"), stream)
    if body.get("min_tokens") not in (None, 0):
        raise invalid("min_tokens", "only 0 is supported")

    max_tokens = body.get("max_tokens")
    if kind == CHAT and body.get("max_completion_tokens") is not None:
        if max_tokens is not None and max_tokens != body["max_completion_tokens"]:
            raise invalid("max_completion_tokens", "differs from max_tokens; give one of them")
        max_tokens = body["max_completion_tokens"]
    given = max_tokens is not None
    if not given:
        max_tokens = DEFAULT_MAX_TOKENS  # chat: replaced once the prompt's length is known

    spec = GenerateSpec(
        max_tokens=max_tokens,
        temperature=_default(body.get("temperature"), DEFAULT_TEMPERATURE),
        top_p=_default(body.get("top_p"), DEFAULT_TOP_P),
        top_k=_top_k(body.get("top_k")),
        seed=body.get("seed"),
        stop_token_ids=_int_list(body.get("stop_token_ids"), "stop_token_ids"),
        ignore_eos=_bool(body.get("ignore_eos"), "ignore_eos"),
        stop=_stop(body.get("stop")),
        priority=_default(body.get("priority"), DEFAULT_PRIORITY),
        agent_hierarchy=_agent_hierarchy(body.get("agent_hierarchy")),
        disaggregation=_disaggregation(body.get("disaggregation")),
        deadline_ms=body.get("deadline_ms"),
    )
    if kind == COMPLETIONS:
        text, token_ids = _prompt(body.get("prompt"))
        return ParsedRequest(kind, dataclasses.replace(spec, text=text, token_ids=token_ids), stream,
                             include_usage)
    return ParsedRequest(kind, spec, stream, include_usage, _messages(body.get("messages")), given)


# ---- field parsers -------------------------------------------------------------------------------

def _is_one_of(value: Any, accepted: tuple) -> bool:
    # Types are compared too: in Python 0 == False and 1 == True, but `n: true` is not `n: 1`.
    return any(type(value) is type(a) and value == a for a in accepted)


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _bool(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(name, f"must be a boolean, got {value!r}")
    return value


def _top_k(value: Any) -> Any:
    # vLLM's convention: -1 (or 0) disables top-k; pdserve's is 0.
    return 0 if value is None or (type(value) is int and value == -1) else value


def _int_list(value: Any, name: str) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid(name, f"must be a list of token ids, got {value!r}")
    return tuple(value)


def _stream_options(value: Any, stream: bool) -> bool:
    if value is None:
        return False
    if not stream:
        raise invalid("stream_options", "is only allowed when stream is true")
    if not isinstance(value, dict):
        raise invalid("stream_options", f"must be an object, got {value!r}")
    for key in value:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise invalid(f"stream_options.{key}", "unrecognized option")
    if value.get("continuous_usage_stats"):
        raise invalid("stream_options.continuous_usage_stats", "is not supported")
    return _bool(value.get("include_usage"), "stream_options.include_usage")


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list):
        for i, s in enumerate(value):
            if not isinstance(s, str):
                raise invalid(f"stop[{i}]", f"must be a string, got {s!r}")
        return tuple(value)
    raise invalid("stop", f"must be a string or a list of strings, got {value!r}")


def _agent_hierarchy(value: Any) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid("agent_hierarchy", "must be a list of {agent_type, node_id} objects")
    levels = []
    for i, level in enumerate(value):
        if isinstance(level, dict):
            unknown = set(level) - {"agent_type", "node_id"}
            if unknown:
                raise invalid(f"agent_hierarchy[{i}].{sorted(unknown)[0]}", "unrecognized field")
            levels.append((level.get("agent_type"), level.get("node_id", 0)))
        elif isinstance(level, list) and len(level) == 2:
            levels.append(tuple(level))
        else:
            raise invalid(f"agent_hierarchy[{i}]", "must be an {agent_type, node_id} object")
    return tuple(levels)


def _disaggregation(value: Any) -> Any:
    if value is None:
        return DisaggregationMode.AUTO
    if isinstance(value, str):
        try:
            return DisaggregationMode[value.upper()]
        except KeyError:
            raise invalid("disaggregation", f"must be auto, always or never, got {value!r}") from None
    return value  # a number: validate_disaggregation checks it


def _prompt(value: Any) -> tuple[str | None, tuple | None]:
    """A string, a list of token ids, or a list holding one of either (OpenAI's batch form with
    one element). Batches of more prompts are refused."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return value, None
    if isinstance(value, list):
        if value and all(isinstance(v, (str, list)) for v in value):
            raise invalid("prompt", f"a batch of {len(value)} prompts is not supported; send one per request")
        return None, tuple(value)
    if value is None:
        raise invalid("prompt", "is required")
    raise invalid("prompt", f"must be a string or a list of token ids, got {type(value).__name__}")


def _messages(value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise invalid("messages", "must be a non-empty list of messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise invalid(f"messages[{i}]", "must be an object with role and content")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        for key in message:
            if key not in ("role", "content", "name"):
                raise invalid(f"messages[{i}].{key}", "is not supported")
        out.append({**message, "content": _content(message.get("content"), f"messages[{i}].content")})
    return tuple(out)


def _content(value: Any, where: str) -> str:
    """A string, or a list of text parts (joined by newlines, as vLLM does for text templates)."""
    if isinstance(value, str):
        return value
    if value is None:
        raise invalid(where, "is required")
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise invalid(f"{where}[{j}]", f"only text parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise invalid(where, f"must be a string or a list of text parts, got {type(value).__name__}")


# ---- responses -----------------------------------------------------------------------------------

def usage_json(usage: Any) -> dict[str, Any]:
    """From the router's Usage (prompt_tokens, completion_tokens, cached_prompt_tokens)."""
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_prompt_tokens}}


def timings_json(timings: Any) -> dict[str, Any]:
    """pdserve's per-request figures (the extension field ``pdserve_timings``)."""
    return {"queue_ms": round(timings.queue_ms, 3), "ttft_ms": round(timings.ttft_ms, 3),
            "e2e_ms": round(timings.e2e_ms, 3), "kv_transfer_bytes": timings.kv_transfer_bytes,
            "kv_transfer_ms": round(timings.kv_transfer_ms, 3), "pauses": timings.pauses,
            "ctx_worker": timings.ctx_worker, "gen_worker": timings.gen_worker,
            "retries": timings.retries, "local_prefill": timings.local_prefill}


def response_id(kind: str, request_id: str) -> str:
    return f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{request_id}"


def completion_json(kind: str, rid: str, created: int, model: str, text: str, finish_reason: str,
                    usage: Any, timings: Any) -> dict[str, Any]:
    if kind == CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            "usage": usage_json(usage), "pdserve_timings": timings_json(timings)}


def chunk_json(kind: str, rid: str, created: int, model: str, *, text: str | None = None,
               role: bool = False, finish_reason: str | None = None, timings: Any = None) -> dict[str, Any]:
    """One streamed chunk. Chat: the first carries the role, later ones content deltas, the last
    an empty delta with the finish reason."""
    if kind == CHAT:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if timings is not None:
        out["pdserve_timings"] = timings_json(timings)
    return out


def usage_chunk_json(kind: str, rid: str, created: int, model: str, usage: Any) -> dict[str, Any]:
    """The last chunk when stream_options.include_usage is set: no choices, the usage."""
    obj = "chat.completion.chunk" if kind == CHAT else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage_json(usage)}


def models_json(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created,
                                        "owned_by": "pdserve"}]}
