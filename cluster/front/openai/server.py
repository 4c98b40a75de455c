"""The OpenAI-compatible HTTP front door (aiohttp), served on the router's own event loop.

It is a second door into the same router core as gRPC, over the same narrow interface
(``FrontDoorApi``): requests become the same GenerateSpec and go through ``admit`` /
``results``, so validation, the bounded queue, agent-tree order,
priorities, deadlines, conditional disaggregation, retries and metrics are one code path.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (JSON, or server-sent
events with ``stream``), GET /health, GET /metrics. Errors are OpenAI error objects; the status
comes from the router's error kind (see STATUS_FOR). A streamed request waits for its first
result before sending headers, so an error before the first token still gets its status; an
error after it arrives as an ``{"error": ...}`` event, then ``data: [DONE]``. A client that
disconnects cancels its request (handler cancellation), as a gRPC cancel does.

Security (``cluster/auth.py``): with API keys set, every path but /health needs
``Authorization: Bearer <key>`` (401 and an OpenAI error object otherwise), and a key over its
cap of requests in flight gets 429; with TLS files set, the door serves HTTPS (and requires a
client certificate under mutual TLS).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
from typing import Any

from aiohttp import web

import pdserve
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.cluster.auth import UNAUTHENTICATED_MESSAGE, KeyRing
from pdserve.cluster.router import RouterConfig, RouterError, RouterErrorKind
from pdserve.cluster.router.api import FrontDoorApi
from pdserve.cluster.validation import ValidationError

from .api import (
    CHAT,
    COMPLETIONS,
    ApiError,
    CompletionLogprobs,
    ParsedRequest,
    chat_logprobs_json,
    choice_json,
    chunk_json,
    completion_json,
    field_error,
    invalid,
    models_json,
    parse_detokenize,
    parse_request,
    parse_tokenize,
    prompt_logprobs_json,
    response_id,
    token_id_label,
    usage_chunk_json,
)
from .chat_template import ChatTemplate, ChatTemplateError
from .tools import ToolError, chat_message, finish_reason_for, get_tool_parser, output_parser

log = logging.getLogger("pdserve.http")

# A RouterError's kind -> (HTTP status, OpenAI error type, code); anything else is a 500.
STATUS_FOR: dict[RouterErrorKind, tuple[int, str, str | None]] = {
    RouterErrorKind.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    RouterErrorKind.ALREADY_EXISTS: (409, "invalid_request_error", "duplicate_request_id"),
    RouterErrorKind.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "queue_full"),
    RouterErrorKind.UNAVAILABLE: (503, "service_unavailable", None),
    RouterErrorKind.DEADLINE_EXCEEDED: (504, "timeout", "deadline_exceeded"),
}
STOP_GRACE_S = 2.0
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"
OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without a key
LIMITED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})  # count against a key's cap


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse_bytes(obj: dict[str, Any]) -> bytes:
    return b"data: " + _dumps(obj).encode() + b"\n\n"


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(obj, status=status, headers=headers, dumps=_dumps)


def error_response(exc: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    return json_response(exc.body(), status=exc.status, headers=headers)


class OpenAIServer:
    def __init__(self, api: FrontDoorApi, config: RouterConfig, keys: KeyRing, model_id: str,
                 chat_template: ChatTemplate | None) -> None:
        self.api = api
        self.config = config
        self.keys = keys
        self.model_id = model_id
        self.chat_template = chat_template
        if config.tool_call_parser is not None:
            get_tool_parser(config.tool_call_parser)  # an unknown name fails at start-up
        self.created = int(time.time())
        self.runner: web.AppRunner | None = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_RouterCollector(api))

    async def start(self, host: str, port: int) -> int:
        middlewares = [_errors_as_openai_objects]
        if self.keys.enabled:  # outermost: a request without a key learns nothing more
            middlewares.insert(0, _api_keys(self.keys))
        tls = self.config.tls_files()
        app = web.Application(client_max_size=self.config.max_message_bytes,
                              middlewares=middlewares)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", self.version)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        # handler_cancellation: a client that disconnects cancels its handler, which cancels
        # the request in the router (Router.results' cleanup). On stop, handlers still running
        # get the same grace as gRPC's (aiohttp's default would wait a minute).
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                                    shutdown_timeout=STOP_GRACE_S)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, reuse_address=True,
                           ssl_context=tls.server_ssl_context() if tls is not None else None)
        await site.start()
        bound = self.runner.addresses[0][1]
        log.info("OpenAI-compatible %s on %s:%d (model %s)", "HTTPS" if tls else "HTTP", host, bound,
                 self.model_id)
        return bound

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    # ---------------------------------------------------------------- simple endpoints

    async def models(self, request: web.Request) -> web.Response:
        return json_response(models_json(self.model_id, self.created))

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.model_id:
            return error_response(ApiError(404, f"The model `{request.match_info['model']}` does not exist",
                                           param="model", code="model_not_found"))
        return json_response(models_json(self.model_id, self.created)["data"][0])

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: a ``prompt`` (or chat ``messages``, rendered by the template) to
        {count, max_model_len, tokens[, token_strs]}."""
        try:
            body = await _json_body(request)
            req = parse_tokenize(body, self.model_id)
            if req.messages is not None:
                text = await self._render(req.messages, req.add_generation_prompt, req.tools)
                field = "messages"
            else:
                text, field = req.prompt, "prompt"
            try:
                ids = await self.api.tokenize(text, field, req.add_special_tokens)
            except ValidationError as exc:
                raise invalid(exc.field, exc.message) from None
        except ApiError as exc:
            return error_response(exc)
        out = {"count": len(ids), "max_model_len": self.api.limits.max_seq_len, "tokens": ids,
               "token_strs": [self.api.token_text(t) for t in ids] if req.return_token_strs else None}
        return json_response(out)

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's /detokenize: ``tokens`` to {prompt}."""
        try:
            body = await _json_body(request)
            ids = parse_detokenize(body, self.model_id, self.api.limits.vocab_size)
        except ApiError as exc:
            return error_response(exc)
        return json_response({"prompt": self.api.detokenize(ids)})

    async def version(self, request: web.Request) -> web.Response:
        return json_response({"version": pdserve.__version__})

    async def health(self, request: web.Request) -> web.Response:
        """The gRPC health's verdict: 503 while NOT_SERVING or shutting down."""
        if self.api.serving and self.api.accepting:
            return json_response({"status": "ok"})
        return json_response({"status": "unavailable"}, status=503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # ---------------------------------------------------------------- generation

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, CHAT)

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            body = await _json_body(request)
            parsed = parse_request(body, kind, self.model_id)
            tool_parser = None
            if parsed.tools is not None:
                try:
                    tool_parser = output_parser(parsed.tools, self.config.tool_call_parser)
                except ToolError as exc:
                    raise invalid(exc.param, exc.detail) from None
            spec = await self._spec(parsed, request.headers.get("X-Request-Id"))
            req = await self._admit(spec, kind)
        except ApiError as exc:
            if exc.status == 400 and not exc.counted:
                self.api.note_rejected()  # refused by the door's own parsing, before admit()
            return error_response(exc)
        headers = {"X-Request-Id": req.external_id}
        rid, created = response_id(kind, req.external_id), int(time.time())
        # The request's own return_tokens_as_token_ids, else the server's (vLLM's precedence).
        as_ids = (parsed.tokens_as_ids if parsed.tokens_as_ids is not None
                  else self.config.return_tokens_as_token_ids)
        choices = _Choices(self.api, parsed, spec, req.prompt, tool_parser, tokens_as_ids=as_ids)
        async with contextlib.aclosing(self.api.results(req)) as results:
            try:
                first = await anext(results)  # before any header: an early error keeps its status
            except RouterError as exc:
                return error_response(self._api_error(exc, kind), headers)
            if parsed.stream:
                return await self._stream(request, parsed, choices, results, first, rid, created,
                                          headers)
            last = first
            choices.add(first)
            try:
                while not last.finish_reason:
                    last = await anext(results)
                    choices.add(last)
            except RouterError as exc:
                return error_response(self._api_error(exc, kind), headers)
            return json_response(
                completion_json(kind, rid, created, self.model_id, "", last.finish_reason,
                                last.usage, last.timings, prompt_logprobs=choices.prompt_logprobs,
                                choices=choices.json()),
                headers=headers)

    async def _stream(self, request, parsed: ParsedRequest, choices: "_Choices", results, first,
                      rid: str, created: int, headers: dict[str, str]) -> web.StreamResponse:
        kind = parsed.kind
        resp = web.StreamResponse(headers={**SSE_HEADERS, **headers})
        await resp.prepare(request)
        model = self.model_id
        prompt_tokens = len(choices.prompt_ids)

        def sse(chunk: dict[str, Any]) -> bytes:
            if parsed.continuous_usage:  # vLLM's continuous_usage_stats: the usage so far
                done = choices.completion_tokens
                chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                                  "total_tokens": prompt_tokens + done}
            return sse_bytes(chunk)
        try:
            if kind == CHAT:
                for index in range(choices.count):
                    await resp.write(sse(chunk_json(kind, rid, created, model, text="", role=True,
                                                    index=index)))
            item = first
            while True:
                choice = choices.get(item.index)
                index = item.index
                text, logprobs, prompt_lps = choice.delta(item)
                ended = item.choice_finish_reason or item.finish_reason
                tools = choice.stream_parser
                if tools is not None:
                    # Tool calls: the parser decides what of the text is content and what calls.
                    deltas = tools.feed(text) if text else []
                    if ended:
                        deltas += tools.finish()
                    for i, delta in enumerate(deltas):
                        await resp.write(sse(chunk_json(kind, rid, created, model, delta=delta,
                                                        logprobs=logprobs if i == 0 else None,
                                                        index=index)))
                    if not deltas and logprobs is not None:
                        await resp.write(sse(chunk_json(kind, rid, created, model, logprobs=logprobs,
                                                        index=index)))
                elif text or logprobs is not None or prompt_lps is not None or (item.token_ids and not ended):
                    # A token whose text is held back (part of a UTF-8 character, a token with no
                    # text) still gets its chunk, with empty text, as vLLM sends it: a client timing
                    # tokens by chunks then sees every step. The last one rides on the finish chunk.
                    await resp.write(sse(chunk_json(kind, rid, created, model, text=text,
                                                    logprobs=logprobs, prompt_logprobs=prompt_lps,
                                                    index=index)))
                if ended:
                    reason = ended
                    if tools is not None:
                        reason = finish_reason_for(tools.calls, reason, parsed.tools)
                    await resp.write(sse(chunk_json(
                        kind, rid, created, model, finish_reason=reason, index=index,
                        timings=item.timings if item.finish_reason else None)))
                if item.finish_reason:
                    if parsed.include_usage:
                        await resp.write(sse(usage_chunk_json(kind, rid, created, model, item.usage)))
                    break
                item = await anext(results)
        except RouterError as exc:
            await resp.write(sse_bytes(self._api_error(exc, kind).body()))
        except ConnectionResetError:
            return resp  # the client left; leaving the `aclosing` block cancels the request
        await resp.write(DONE)
        await resp.write_eof()
        return resp

    async def _spec(self, parsed: ParsedRequest, request_id: str | None):
        spec = dataclasses.replace(parsed.spec, request_id=request_id)
        if parsed.kind != CHAT:
            return spec
        text = await self._render(parsed.messages, True, parsed.tools)
        try:
            # The template writes its own BOS: no special tokens unless the client asks.
            ids = await self.api.tokenize(text, "messages", spec.add_special_tokens)
        except ValidationError as exc:
            raise invalid(exc.field, exc.message) from None
        if not parsed.max_tokens_given:
            limits = self.api.limits
            room = (limits.max_seq_len or len(ids) + limits.max_tokens_limit) - len(ids)
            max_tokens = max(1, min(room, limits.max_tokens_limit))
            spec = dataclasses.replace(spec, sampling=spec.sampling.replace(max_tokens=max_tokens))
        return dataclasses.replace(spec, token_ids=tuple(ids))

    async def _render(self, messages, add_generation_prompt: bool, tools) -> str:
        if self.chat_template is None:
            raise invalid("messages", f"the model {self.model_id} has no chat template "
                                      "(tokenizer_config.json chat_template); use /v1/completions")
        try:
            return self.chat_template.render(list(messages), add_generation_prompt=add_generation_prompt,
                                             tools=tools.template_tools() if tools else None)
        except ChatTemplateError as exc:
            raise invalid("messages", f"the chat template refused them: {exc}") from exc

    async def _admit(self, spec, kind: str):
        try:
            return await self.api.admit(spec)
        except RouterError as exc:
            error = self._api_error(exc, kind)
            error.counted = True  # admit() counted it
            raise error from None

    @staticmethod
    def _api_error(exc, kind: str) -> ApiError:
        status, type_, code = STATUS_FOR.get(exc.kind, (500, "server_error", None))
        if exc.field:
            return field_error(exc.field, exc.detail, kind, status=status, type_=type_, code=code)
        return ApiError(status, exc.message, type_=type_, code=code)


class _Choice:
    """One choice's text and logprobs as RouterOutputs arrive, in the endpoint's shapes. With
    ``echo`` the prompt leads the text (and, with logprobs, the logprobs)."""

    def __init__(self, api: FrontDoorApi, parsed: ParsedRequest, spec, prompt_ids,
                 tool_parser=None, index: int = 0, tokens_as_ids: bool = False) -> None:
        self.index = index
        # How logprobs name a token: its text, or "token_id:{id}" (return_tokens_as_token_ids).
        self.label = token_id_label if tokens_as_ids else api.token_text
        self.finish_reason: str | None = None
        self.cumulative_logprob = 0.0
        self.kind = parsed.kind
        self.tools = parsed.tools
        self.tool_parser = tool_parser
        self.api = api
        self.sampling = spec.sampling
        self.prompt_ids = list(prompt_ids)
        self.echo = spec.echo
        self.prompt_text = spec.text
        self.texts: list[str] = []
        self.parts: list[Any] = []  # completions: logprob dicts; chat: content entries
        self.prompt_logprobs: list[Any] | None = None
        self.completion_lps = CompletionLogprobs(api.token_text, label=self.label)
        self._echoed = False
        self._stream_parser = None
        self.completion_tokens = 0

    def _echo_text(self) -> str:
        # vLLM's rule: a text prompt is echoed as the client sent it (not as its ids decode: the
        # BOS that tokenizing added is no part of what the client wrote); a token-id prompt as
        # its ids decode.
        if self.prompt_text is not None:
            return self.prompt_text
        return self.api.detokenize(self.prompt_ids)

    def delta(self, out) -> tuple[str, Any, Any]:
        """(text, logprobs, prompt_logprobs) to send for this output."""
        self.completion_tokens += len(out.token_ids)
        if out.logprobs:
            self.cumulative_logprob += sum(e.logprob for e in out.logprobs)
        if out.choice_finish_reason:
            self.finish_reason = out.choice_finish_reason
        text = out.text
        logprobs = None
        prompt_lps = None
        wants = self.sampling.logprobs is not None
        if self.echo and not self._echoed:
            self._echoed = True
            text = self._echo_text() + text
            if wants and self.kind == COMPLETIONS:
                head = self.completion_lps.add_prompt(self.prompt_ids, out.prompt_logprobs)
                logprobs = CompletionLogprobs.merge([head, self.completion_lps.add(out.logprobs)])
        if out.prompt_logprobs is not None and self.sampling.prompt_logprobs is not None:
            prompt_lps = prompt_logprobs_json(self.prompt_ids, out.prompt_logprobs, self.api.token_text)
        if wants and logprobs is None and out.logprobs:
            if self.kind == COMPLETIONS:
                logprobs = self.completion_lps.add(out.logprobs)
            else:
                logprobs = chat_logprobs_json(out.logprobs, self.label)
        return text, logprobs, prompt_lps

    def add(self, out) -> None:
        text, logprobs, prompt_lps = self.delta(out)
        self.texts.append(text)
        if logprobs is not None:
            self.parts.append(logprobs)
        if prompt_lps is not None:
            self.prompt_logprobs = prompt_lps

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def stream_parser(self):
        """Chat with tools: this choice's streaming tool-call parser (None: plain text)."""
        if self.tool_parser is None:
            return None
        if self._stream_parser is None:
            self._stream_parser = self.tool_parser.stream()
        return self._stream_parser

    def json(self) -> dict[str, Any]:
        message, reason = self.message(self.finish_reason)
        return choice_json(self.kind, self.index, self.text, reason, logprobs=self.logprobs(),
                           message=message)

    def message(self, finish_reason: str) -> tuple[dict[str, Any] | None, str]:
        """Chat with tools: the message with its tool calls and the finish reason they give."""
        if self.tool_parser is None:
            return None, finish_reason
        content, calls = self.tool_parser.parse(self.text)
        return chat_message(content, calls), finish_reason_for(calls, finish_reason, self.tools)

    def logprobs(self) -> Any:
        if self.sampling.logprobs is None:
            return None
        if self.kind == COMPLETIONS:
            return CompletionLogprobs.merge(self.parts)
        return {"content": [c for part in self.parts for c in part["content"]]}


class _Choices:
    """Every choice of a request (n / best_of), by the router's candidate index."""

    def __init__(self, api: FrontDoorApi, parsed: ParsedRequest, spec, prompt_ids, tool_parser,
                 *, tokens_as_ids: bool = False) -> None:
        sampling = spec.sampling
        self.count = sampling.candidates
        self.n = sampling.n
        self.prompt_ids = list(prompt_ids)
        self.choices = [_Choice(api, parsed, spec, prompt_ids, tool_parser, index=i,
                                tokens_as_ids=tokens_as_ids)
                        for i in range(self.count)]

    def get(self, index: int) -> _Choice:
        return self.choices[index]

    def add(self, out) -> None:
        self.choices[out.index].add(out)

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    @property
    def prompt_logprobs(self):
        return self.choices[0].prompt_logprobs

    def json(self) -> list[dict[str, Any]]:
        """The choices in OpenAI's shape; with best_of > n the n with the highest cumulative
        logprob, best first (vLLM's ranking), numbered 0..n-1."""
        picked = self.choices
        if self.count > self.n:
            picked = sorted(picked, key=lambda c: -c.cumulative_logprob)[: self.n]
        out = []
        for index, choice in enumerate(picked):
            body = choice.json()
            body["index"] = index
            out.append(body)
        return out


async def _json_body(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise ApiError(413, f"the request body is larger than {exc.max_size} bytes") from None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None


@web.middleware
async def _errors_as_openai_objects(request: web.Request, handler):
    """aiohttp's own errors (unknown path, wrong method) as OpenAI error objects too."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}",
                                       type_="invalid_request_error"))


def _api_keys(ring: KeyRing):
    """The bearer key check, and the per-key cap on generation requests in flight. A streamed
    response is written inside the handler, so the count is held until its last byte."""

    @web.middleware
    async def check(request: web.Request, handler):
        if request.path in OPEN_PATHS:
            return await handler(request)
        index = ring.authenticate(request.headers.get("Authorization"))
        if index is None:
            return error_response(ApiError(401, UNAUTHENTICATED_MESSAGE, type_="invalid_request_error",
                                           code="invalid_api_key"),
                                  headers={"WWW-Authenticate": 'Bearer realm="pdserve"'})
        if ring.max_inflight_per_key is None or request.path not in LIMITED_PATHS:
            return await handler(request)
        if not ring.try_acquire(index):
            return error_response(ApiError(429, ring.limit_message(), type_="rate_limit_error",
                                           code="too_many_requests_in_flight"))
        try:
            return await handler(request)
        finally:
            ring.release(index)

    return check


class _RouterCollector:
    """The router's own live counters in Prometheus' text format (the workers' metrics and the
    router's latency histograms are on Ray's metrics endpoint as ray_pdserve_*)."""

    def __init__(self, api: FrontDoorApi) -> None:
        self.api = api

    def collect(self):
        r = self.api.live_counters()
        requests = CounterMetricFamily("pdserve_router_requests", "Requests by outcome since the router started.",
                                       labels=["outcome"])
        for outcome in ("received", "completed", "failed", "aborted", "rejected"):
            requests.add_metric([outcome], r.totals[outcome])
        yield requests
        yield CounterMetricFamily("pdserve_router_retries", "Attempts retried after a worker failure.",
                                  value=r.totals["retries"])
        prefills = CounterMetricFamily("pdserve_router_prefills", "Prefills by where they ran.", labels=["kind"])
        prefills.add_metric(["remote"], r.totals["remote_prefills"])
        prefills.add_metric(["local"], r.totals["local_prefills"])
        yield prefills
        yield GaugeMetricFamily("pdserve_router_queue_depth", "Requests waiting for dispatch.", value=r.queue_depth)
        yield GaugeMetricFamily("pdserve_router_in_flight", "Requests dispatched and not finished.", value=r.in_flight)
        yield GaugeMetricFamily("pdserve_router_serving", "1 while health is SERVING.", value=int(r.serving))
        healthy = GaugeMetricFamily("pdserve_worker_healthy", "1 while the router routes to the worker.",
                                    labels=["worker"])
        for worker_id, ok in sorted(r.workers_healthy.items()):
            healthy.add_metric([worker_id], int(ok))
        yield healthy
