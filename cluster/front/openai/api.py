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
from pdserve.transport.requests.structured import StructuredOutputError, guided_spec_from_openai
from pdserve.cluster.validation import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_PRIORITY,
    GenerateSpec,
    ValidationError,
    sampling_params,
)
from pdserve.transport.requests.sampling import MAX_LOGPROBS

from .tools import ToolError, ToolRequest, guided_decoding, parse_tools, template_messages

COMPLETIONS, CHAT = "completions", "chat"

# Fields each endpoint uses (besides the no-op and ignored ones below).
_USED = {
    COMPLETIONS: {"model", "prompt", "max_tokens", "logprobs", "echo", "best_of", "add_special_tokens"},
    CHAT: {"model", "messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
           "tools", "tool_choice", "parallel_tool_calls", "add_special_tokens"},
}
# vLLM's add_special_tokens defaults: a completions prompt gets the tokenizer's special tokens
# (its BOS); a chat template writes its own, so chat adds none unless asked (then, as in vLLM,
# a template that writes a BOS gets a second one: the client asked for it).
ADD_SPECIAL_TOKENS_DEFAULT = {COMPLETIONS: True, CHAT: False}
# The sampling record's fields, as vLLM's OpenAI server takes them (SamplingParams says how each
# is applied), and pdserve's own extras.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "n", "min_tokens",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "stop_token_ids",
                    "include_stop_str_in_output", "ignore_eos", "logit_bias", "bad_words",
                    "prompt_logprobs")
_SHARED_USED = {*_SAMPLING_FIELDS, "stop", "stream", "stream_options", "priority",
                "agent_hierarchy", "disaggregation", "deadline_ms", "response_format", "guided_json",
                "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                "return_tokens_as_token_ids"}
IGNORED = {"user"}  # accepted and ignored: an end-user id for abuse tracking
# Fields accepted only with the value that means "off" (or pdserve's own behaviour); anything
# else is refused.
_NO_OP = {
    "suffix": (None,),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "functions": (None, []),
    "function_call": (None, "none"),
}
_NO_OP_FIELDS = {
    COMPLETIONS: {"suffix", "skip_special_tokens", "spaces_between_special_tokens"},
    CHAT: {"functions", "function_call", "skip_special_tokens", "spaces_between_special_tokens"},
}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An error answered with OpenAI's error object; ``status`` is the HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.counted = False  # already in the router's rejected total

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: str
    spec: GenerateSpec  # for chat: no prompt yet (the router renders the messages)
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    messages: tuple[dict[str, Any], ...] = ()  # chat only, content flattened to text
    max_tokens_given: bool = True  # chat without max_tokens: as many as the context allows
    tools: ToolRequest | None = None  # chat only
    # stream_options.continuous_usage_stats (vLLM's): every chunk carries the usage so far.
    continuous_usage: bool = False
    # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:{id}"; None: the
    # server's default (--return-tokens-as-token-ids).
    tokens_as_ids: bool | None = None


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
    include_usage, continuous_usage = _stream_options(body.get("stream_options"), stream)

    max_tokens = body.get("max_tokens")
    if kind == CHAT and body.get("max_completion_tokens") is not None:
        if max_tokens is not None and max_tokens != body["max_completion_tokens"]:
            raise invalid("max_completion_tokens", "differs from max_tokens; give one of them")
        max_tokens = body["max_completion_tokens"]
    given = max_tokens is not None
    if not given:
        max_tokens = DEFAULT_MAX_TOKENS  # chat: replaced once the prompt's length is known

    fields: dict[str, Any] = {"max_tokens": max_tokens}
    for name in _SAMPLING_FIELDS:
        value = body.get(name)
        if value is not None:
            fields[name] = value
    fields["top_k"] = _top_k(body.get("top_k"))
    fields["stop_token_ids"] = _int_list(body.get("stop_token_ids"), "stop_token_ids")
    fields["bad_words"] = _str_list(body.get("bad_words"), "bad_words")
    fields["stop"] = _stop(body.get("stop"))
    if body.get("logit_bias") is not None:
        fields["logit_bias"] = _logit_bias(body["logit_bias"])
    echo = False
    if kind == COMPLETIONS:
        logprobs = body.get("logprobs")
        if logprobs is not None:
            if not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS:
                raise invalid("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {logprobs!r}")
            fields["logprobs"] = logprobs
        echo = _bool(body.get("echo"), "echo")
        if echo and logprobs is not None:
            # The prompt's tokens come back with their logprobs too (the loglikelihood path).
            fields.setdefault("prompt_logprobs", logprobs)
        if body.get("best_of") is not None:
            fields["best_of"] = body["best_of"]
    else:
        wants = _bool(body.get("logprobs"), "logprobs")
        top = body.get("top_logprobs")
        if top is not None:
            if not _is_int(top) or not 0 <= top <= MAX_LOGPROBS:
                raise invalid("top_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {top!r}")
            if not wants:
                raise invalid("top_logprobs", "needs logprobs: true")
        if wants:
            fields["logprobs"] = top or 0
    try:
        guided = guided_spec_from_openai(body)
    except StructuredOutputError as exc:  # names the body field itself
        raise invalid(exc.field, exc.message) from None
    if guided is not None:
        fields["guided"] = (guided.kind, guided.text)
    tools = None
    if kind == CHAT:
        try:
            tools = parse_tools(body)
        except ToolError as exc:
            raise invalid(exc.param, exc.detail) from None
        forced = guided_decoding(tools)
        if forced is not None:
            if guided is not None:
                raise invalid("tool_choice", f"{tools.choice!r} forces a call, so the output cannot "
                              "also follow response_format or a guided_* field")
            fields["guided"] = forced
    try:
        sampling = sampling_params(**fields)
    except ValidationError as exc:
        raise field_error(exc.field, exc.message, kind) from None
    if sampling.candidates > sampling.n and stream:
        raise invalid("best_of", "best_of > n cannot be streamed (the best are known at the end)")

    tokens_as_ids = body.get("return_tokens_as_token_ids")
    if tokens_as_ids is not None and not isinstance(tokens_as_ids, bool):
        raise invalid("return_tokens_as_token_ids", f"must be a boolean, got {tokens_as_ids!r}")
    spec = GenerateSpec(
        sampling=sampling,
        priority=_default(body.get("priority"), DEFAULT_PRIORITY),
        agent_hierarchy=_agent_hierarchy(body.get("agent_hierarchy")),
        disaggregation=_disaggregation(body.get("disaggregation")),
        deadline_ms=body.get("deadline_ms"),
        echo=echo,
        add_special_tokens=_add_special_tokens(body.get("add_special_tokens"), kind),
    )
    if kind == COMPLETIONS:
        text, token_ids = _prompt(body.get("prompt"))
        return ParsedRequest(kind, dataclasses.replace(spec, text=text, token_ids=token_ids), stream,
                             include_usage, continuous_usage=continuous_usage,
                             tokens_as_ids=tokens_as_ids)
    return ParsedRequest(kind, spec, stream, include_usage, _messages(body.get("messages")), given, tools,
                         continuous_usage, tokens_as_ids)


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    prompt: str | None
    messages: tuple[dict[str, Any], ...] | None
    add_special_tokens: bool
    add_generation_prompt: bool
    return_token_strs: bool
    tools: ToolRequest | None = None


def parse_tokenize(body: Any, served_model: str) -> TokenizeRequest:
    """vLLM's /tokenize body: ``prompt`` (add_special_tokens defaults to true), or chat
    ``messages`` (add_generation_prompt defaults to true, add_special_tokens to false), with
    ``return_token_strs``."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_model(body.get("model"), served_model)
    chat = "messages" in body
    allowed = {"model", "add_special_tokens", "return_token_strs"} | (
        {"messages", "add_generation_prompt", "continue_final_message", "tools", "chat_template_kwargs"}
        if chat else {"prompt"})
    for name in body:
        if name not in allowed:
            raise invalid(name, "unrecognized request argument")
    if chat and body.get("chat_template_kwargs") not in (None, {}):
        raise invalid("chat_template_kwargs", "is not supported")
    if chat and body.get("continue_final_message") not in (None, False):
        raise invalid("continue_final_message", "is not supported")
    # The same defaults as the request it previews: a prompt as completions, messages as chat.
    add_special = _add_special_tokens(body.get("add_special_tokens"), CHAT if chat else COMPLETIONS)
    strs = _bool(body.get("return_token_strs"), "return_token_strs")
    if chat:
        gen = body.get("add_generation_prompt")
        gen = True if gen is None else _bool(gen, "add_generation_prompt")
        try:
            tools = parse_tools({"tools": body.get("tools")})
        except ToolError as exc:
            raise invalid(exc.param, exc.detail) from None
        return TokenizeRequest(None, _messages(body.get("messages")), add_special, gen, strs, tools)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise invalid("prompt", f"must be a string, got {type(prompt).__name__}")
    return TokenizeRequest(prompt, None, add_special, False, strs)


def parse_detokenize(body: Any, served_model: str, vocab_size: int | None) -> list[int]:
    """vLLM's /detokenize body: ``tokens``, ids in the vocabulary."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_model(body.get("model"), served_model)
    for name in body:
        if name not in ("model", "tokens"):
            raise invalid(name, "unrecognized request argument")
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise invalid("tokens", "must be a list of token ids")
    for i, t in enumerate(tokens):
        if not _is_int(t) or t < 0 or (vocab_size is not None and t >= vocab_size):
            raise invalid(f"tokens[{i}]", f"token id {t!r} is outside [0, {vocab_size})")
    return tokens


def _check_model(model: Any, served_model: str) -> None:
    if model is not None and model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist (this server serves `{served_model}`)",
                       param="model", code="model_not_found")


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _str_list(value: Any, name: str) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid(name, f"must be a list of strings, got {value!r}")
    for i, v in enumerate(value):
        if not isinstance(v, str):
            raise invalid(f"{name}[{i}]", f"must be a string, got {v!r}")
    return tuple(value)


def _logit_bias(value: Any) -> tuple:
    """OpenAI's map of token ids (as JSON strings) to biases."""
    if not isinstance(value, dict):
        raise invalid("logit_bias", f"must map token ids to numbers, got {value!r}")
    pairs = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise invalid(f"logit_bias[{key!r}]", "keys must be token ids") from None
        pairs.append((token, bias))
    return tuple(sorted(pairs, key=lambda p: p[0]))


def _top_k(value: Any) -> Any:
    # vLLM's convention: -1 (or 0) disables top-k; pdserve's is 0.
    return 0 if value is None or (type(value) is int and value == -1) else value


def _int_list(value: Any, name: str) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise invalid(name, f"must be a list of token ids, got {value!r}")
    return tuple(value)


def _stream_options(value: Any, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats)."""
    if value is None:
        return False, False
    if not stream:
        raise invalid("stream_options", "is only allowed when stream is true")
    if not isinstance(value, dict):
        raise invalid("stream_options", f"must be an object, got {value!r}")
    for key in value:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise invalid(f"stream_options.{key}", "unrecognized option")
    return (_bool(value.get("include_usage"), "stream_options.include_usage"),
            _bool(value.get("continuous_usage_stats"), "stream_options.continuous_usage_stats"))


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


def _add_special_tokens(value: Any, kind: str) -> bool:
    """For a text prompt only (completions) or the rendered template (chat); token-id prompts
    are never changed."""
    if value is None:
        return ADD_SPECIAL_TOKENS_DEFAULT[kind]
    return _bool(value, "add_special_tokens")


def _messages(value: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(value, list) or not value:
        raise invalid("messages", "must be a non-empty list of messages")
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise invalid(f"messages[{i}]", "must be an object with role and content")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        for key in message:
            if key not in ("role", "content", "name", "tool_calls", "tool_call_id"):
                raise invalid(f"messages[{i}].{key}", "is not supported")
    try:
        # Text parts joined, tool results and assistant tool calls as chat templates expect them.
        return tuple(template_messages(value))
    except ToolError as exc:
        raise invalid(exc.param, exc.detail) from None


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


LOGPROB_FLOOR = -9999.0  # vLLM's stand-in for -inf, which JSON cannot carry


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def token_id_label(token_id: int) -> str:
    """A token named by its id (vLLM's return_tokens_as_token_ids): byte-level tokenizers decode
    several ids (pieces of one UTF-8 character) to the same U+FFFD, so names by text collide
    where a client needs to tell the tokens apart (top_logprobs is a map keyed by the name)."""
    return f"token_id:{token_id}"


def chat_logprobs_json(entries: Any, token_text) -> dict[str, Any]:
    """OpenAI's chat ``logprobs``: {"content": [{token, logprob, bytes, top_logprobs}]}.
    ``token_text`` names a token (its text, or ``token_id_label``); ``bytes`` are the name's."""
    content = []
    for e in entries:
        token = token_text(e.token_id)
        content.append({"token": token, "logprob": _lp(e.logprob), "bytes": list(token.encode()),
                        "top_logprobs": [{"token": (t := token_text(i)), "logprob": _lp(v),
                                          "bytes": list(t.encode())} for i, v in e.top]})
    return {"content": content}


class CompletionLogprobs:
    """OpenAI's completions ``logprobs`` (tokens, token_logprobs, top_logprobs, text_offset),
    built up as tokens arrive; ``text_offset`` counts characters from the start of the
    choice's text (the echoed prompt included). ``label`` names a token in ``tokens`` and the
    ``top_logprobs`` keys (default: its text; ``token_id_label`` for token ids); offsets keep
    counting the text, so they still index the choice's text when tokens are named by id."""

    def __init__(self, token_text, offset: int = 0, label=None) -> None:
        self.token_text = token_text
        self.label = token_text if label is None else label
        self.offset = offset

    def add_prompt(self, prompt_ids: Any, entries: Any) -> dict[str, list]:
        """The echoed prompt: its first token has no logprob."""
        out = self._empty()
        first = prompt_ids[0]
        self._append(out, first, None, None)
        for e in entries or ():
            self._append(out, e.token_id, e.logprob, e.top)
        return out

    def add(self, entries: Any) -> dict[str, list]:
        out = self._empty()
        for e in entries or ():
            self._append(out, e.token_id, e.logprob, e.top)
        return out

    @staticmethod
    def _empty() -> dict[str, list]:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    def _append(self, out: dict[str, list], token_id: int, logprob: float | None, top) -> None:
        token = self.label(token_id)
        out["tokens"].append(token)
        out["token_logprobs"].append(None if logprob is None else _lp(logprob))
        if top is None:
            out["top_logprobs"].append(None)
        else:
            # vLLM's shape: the top k by name, and the chosen token too.
            tops = {self.label(i): _lp(v) for i, v in top}
            tops.setdefault(token, _lp(logprob))
            out["top_logprobs"].append(tops)
        out["text_offset"].append(self.offset)
        self.offset += len(token if self.label is self.token_text else self.token_text(token_id))

    @staticmethod
    def merge(parts: list[dict[str, list]]) -> dict[str, list]:
        out = CompletionLogprobs._empty()
        for part in parts:
            for key in out:
                out[key].extend(part[key])
        return out


def prompt_logprobs_json(prompt_ids: Any, entries: Any, token_text) -> list[Any]:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token a map of token
    id -> {logprob, rank, decoded_token} holding the prompt's own token and the top k."""
    out: list[Any] = [None]
    for e in entries or ():
        ranked = {str(e.token_id): {"logprob": _lp(e.logprob), "rank": e.rank,
                                    "decoded_token": token_text(e.token_id)}}
        for rank, (i, v) in enumerate(e.top, start=1):
            ranked.setdefault(str(i), {"logprob": _lp(v), "rank": rank, "decoded_token": token_text(i)})
        out.append(ranked)
    return out


def choice_json(kind: str, index: int, text: str, finish_reason: str | None, *, logprobs: Any = None,
                message: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice of a non-streamed response; ``message``: chat's when it is more than text."""
    if kind == CHAT:
        return {"index": index, "message": message or {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_json(kind: str, rid: str, created: int, model: str, text: str, finish_reason: str,
                    usage: Any, timings: Any, *, logprobs: Any = None,
                    prompt_logprobs: Any = None, message: dict[str, Any] | None = None,
                    choices: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A non-streamed response: one choice from ``text``/``message``, or ``choices`` as given
    (choice_json's, n > 1)."""
    if choices is None:
        choices = [choice_json(kind, 0, text, finish_reason, logprobs=logprobs, message=message)]
    if kind != CHAT and prompt_logprobs is not None:
        for choice in choices:
            choice["prompt_logprobs"] = prompt_logprobs
    out = {"id": rid, "object": "chat.completion" if kind == CHAT else "text_completion",
           "created": created, "model": model, "choices": choices,
           "usage": usage_json(usage), "pdserve_timings": timings_json(timings)}
    if kind == CHAT and prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs
    return out


def chunk_json(kind: str, rid: str, created: int, model: str, *, text: str | None = None,
               role: bool = False, finish_reason: str | None = None, timings: Any = None,
               logprobs: Any = None, prompt_logprobs: Any = None,
               delta: dict[str, Any] | None = None, index: int = 0) -> dict[str, Any]:
    """One streamed chunk. Chat: the first carries the role, later ones content deltas (or
    ``delta`` as given: tool call deltas), the last an empty delta with the finish reason."""
    if kind == CHAT:
        delta = dict(delta or {})
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        obj = "text_completion"
    out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
    if kind == CHAT and prompt_logprobs is not None:
        out["prompt_logprobs"] = prompt_logprobs
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
