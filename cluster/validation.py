"""Request validation for both front doors (gRPC and the OpenAI HTTP API): ``GenerateSpec`` is a
request as plain values with the API defaults applied; each ``validate_*`` raises
``ValidationError`` naming the offending field. PURE: stdlib only."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from pdserve.scheduler.reorder import ACCEPTED_AGENT_TYPE_NAMES

from pdserve.transport.requests.sampling import (
    MAX_LOGPROBS,
    FieldError,
    SamplingError,
    SamplingLimits,
    SamplingParams,
)

from .policies import DisaggregationMode

DEFAULT_PRIORITY = 0.5
DEFAULT_MAX_TOKENS = SamplingParams().max_tokens
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
DEFAULT_ADD_SPECIAL_TOKENS = True  # vLLM's for completions (see GenerateSpec.add_special_tokens)


class ValidationError(FieldError):
    """A malformed request; ``field`` is the dotted path of the offending field (the router maps
    this to gRPC INVALID_ARGUMENT with str(error) as the details)."""


@dataclass(frozen=True, slots=True)
class ValidationLimits:
    vocab_size: int | None = None  # None skips the vocabulary checks
    max_input_len: int | None = None  # prompt tokens
    max_seq_len: int | None = None  # prompt + max_tokens
    max_tokens_limit: int = 1 << 16
    max_stop_token_ids: int = 32
    max_stop_strings: int = 4  # OpenAI's limit
    max_stop_string_chars: int = 256
    max_n: int = 16  # choices (and best_of candidates) per request
    max_logprobs: int = MAX_LOGPROBS
    max_agent_depth: int = 8
    max_request_id_len: int = 128
    max_text_chars: int = 1 << 22  # before tokenization; the token limit is checked after it
    max_deadline_ms: int = 24 * 3600 * 1000

    def sampling_limits(self) -> SamplingLimits:
        return SamplingLimits(vocab_size=self.vocab_size, max_tokens_limit=self.max_tokens_limit,
                              max_stop_token_ids=self.max_stop_token_ids,
                              max_stop_strings=self.max_stop_strings,
                              max_stop_string_chars=self.max_stop_string_chars,
                              max_n=self.max_n, max_logprobs=self.max_logprobs)


@dataclass(frozen=True, slots=True)
class GenerateSpec:
    """A Generate request as plain values with the API defaults applied (the gRPC door and the
    OpenAI door each build one). ``sampling`` is the record that travels on to the worker."""

    request_id: str | None = None
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    sampling: SamplingParams = SamplingParams()
    priority: float = DEFAULT_PRIORITY
    agent_hierarchy: tuple[tuple[str, int], ...] = ()
    disaggregation: int = DisaggregationMode.AUTO
    deadline_ms: int | None = None
    echo: bool = False  # the prompt's text (and logprobs) lead the output (OpenAI completions)
    # A text prompt is tokenized with the tokenizer's special tokens (its post-processor's BOS),
    # vLLM's default for completions and the gRPC door: Llama 3 and Gemma expect the BOS, and
    # Gemma without it writes garbage. Chat sets it False, since its template writes the BOS.
    # Token-id prompts are taken as given whatever it says.
    add_special_tokens: bool = DEFAULT_ADD_SPECIAL_TOKENS

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    @property
    def stop(self) -> tuple[str, ...]:
        return self.sampling.stop


def sampling_params(**fields) -> SamplingParams:
    """Build the record, a range error raised as ``ValidationError`` naming ``sampling.<field>``
    (how both doors build it)."""
    try:
        return SamplingParams(**fields)
    except SamplingError as exc:
        raise ValidationError(f"sampling.{exc.field}", exc.message) from None
    except TypeError as exc:  # an unknown keyword: a door's bug, not the client's
        raise ValidationError("sampling", str(exc)) from None


_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
_SEED_LIMIT = 1 << 63  # node ids share the seed's range


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate_request_id(request_id: str | None, limits: ValidationLimits = ValidationLimits()
                        ) -> None:
    """None means unset (the router assigns one); a set id is 1..max_request_id_len characters of
    [A-Za-z0-9._:-], starting with a letter or digit."""
    if request_id is None:
        return
    if not isinstance(request_id, str) or not request_id:
        raise ValidationError("request_id", "must be a non-empty string when set")
    if len(request_id) > limits.max_request_id_len:
        raise ValidationError("request_id", f"longer than {limits.max_request_id_len} characters")
    if not _REQUEST_ID_RE.fullmatch(request_id):
        raise ValidationError("request_id", "may only hold [A-Za-z0-9._:-] and must start with a "
                              "letter or digit")


def validate_token_ids(token_ids: Sequence[int], limits: ValidationLimits,
                       field: str = "prompt.token_ids") -> None:
    """Non-empty, ids in [0, vocab_size), at most max_input_len. The router calls this again on
    the tokens of a text prompt."""
    if len(token_ids) == 0:
        raise ValidationError(field, "must not be empty")
    if limits.max_input_len is not None and len(token_ids) > limits.max_input_len:
        raise ValidationError(field, f"{len(token_ids)} tokens exceed max_input_len "
                              f"{limits.max_input_len}")
    upper = limits.vocab_size
    for i, t in enumerate(token_ids):
        if not _is_int(t) or t < 0 or (upper is not None and t >= upper):
            raise ValidationError(f"{field}[{i}]", f"token id {t!r} is outside [0, {upper})")


def validate_prompt(text: str | None, token_ids: Sequence[int] | None,
                    limits: ValidationLimits = ValidationLimits()) -> None:
    """Exactly one of text and token_ids."""
    if (text is None) == (token_ids is None):
        raise ValidationError("prompt", "give exactly one of text and token_ids")
    if text is not None:
        if not isinstance(text, str) or not text:
            raise ValidationError("prompt.text", "must be a non-empty string")
        if len(text) > limits.max_text_chars:
            raise ValidationError("prompt.text", f"longer than {limits.max_text_chars} characters")
    else:
        validate_token_ids(token_ids, limits)  # type: ignore[arg-type]


def validate_sampling(params: SamplingParams, limits: ValidationLimits = ValidationLimits(),
                      prompt_len: int | None = None) -> None:
    """The record's rules under the server's limits, and prompt + max_tokens against
    max_seq_len."""
    try:
        params.validate(limits.sampling_limits())
    except SamplingError as exc:
        raise ValidationError(f"sampling.{exc.field}", exc.message) from None
    max_tokens = params.max_tokens
    if (prompt_len is not None and limits.max_seq_len is not None
            and prompt_len + max_tokens > limits.max_seq_len):
        raise ValidationError("sampling.max_tokens", f"prompt ({prompt_len}) + max_tokens "
                              f"({max_tokens}) exceeds max_seq_len {limits.max_seq_len}")


def validate_priority(priority: float) -> None:
    if not _is_real(priority) or not 0.0 <= priority <= 1.0:  # NaN and inf fail the comparison
        raise ValidationError("priority", f"must be a finite number in [0, 1], got {priority!r}")


def validate_agent_hierarchy(levels: Sequence[tuple[str, int]],
                             limits: ValidationLimits = ValidationLimits()) -> None:
    """Each level names a known agent type (UpperCamelCase or snake_case) and a node id >= 0."""
    if len(levels) > limits.max_agent_depth:
        raise ValidationError("agent_hierarchy", f"{len(levels)} levels exceed the depth limit "
                              f"{limits.max_agent_depth}")
    for i, level in enumerate(levels):
        if not isinstance(level, (tuple, list)) or len(level) != 2:
            raise ValidationError(f"agent_hierarchy[{i}]", "must be an (agent_type, node_id) pair")
        agent_type, node_id = level
        if not isinstance(agent_type, str) or not agent_type:
            raise ValidationError(f"agent_hierarchy[{i}].agent_type", "must be a non-empty string")
        if agent_type not in ACCEPTED_AGENT_TYPE_NAMES:
            raise ValidationError(f"agent_hierarchy[{i}].agent_type", f"unknown agent type "
                                  f"{agent_type!r}")
        if not _is_int(node_id) or not 0 <= node_id < _SEED_LIMIT:
            raise ValidationError(f"agent_hierarchy[{i}].node_id", f"must be an integer in "
                                  f"[0, 2**63), got {node_id!r}")


def validate_disaggregation(mode: int) -> DisaggregationMode:
    if not _is_int(mode) or mode not in {m.value for m in DisaggregationMode}:
        raise ValidationError("disaggregation", f"must be AUTO (0), ALWAYS (1) or NEVER (2), "
                              f"got {mode!r}")
    return DisaggregationMode(mode)


def validate_deadline_ms(deadline_ms: int | None, limits: ValidationLimits = ValidationLimits()
                         ) -> None:
    """None means no deadline beyond the gRPC call's own."""
    if deadline_ms is None:
        return
    if not _is_int(deadline_ms) or not 0 < deadline_ms <= limits.max_deadline_ms:
        raise ValidationError("deadline_ms", f"must be an integer in [1, {limits.max_deadline_ms}], "
                              f"got {deadline_ms!r}")


def validate_generate_spec(spec: GenerateSpec, limits: ValidationLimits = ValidationLimits()
                           ) -> None:
    """Every rule above, in field order; raises the first ValidationError."""
    validate_request_id(spec.request_id, limits)
    validate_prompt(spec.text, spec.token_ids, limits)
    if not isinstance(spec.sampling, SamplingParams):
        raise ValidationError("sampling", "must be a SamplingParams record")
    validate_sampling(spec.sampling, limits,
                      prompt_len=len(spec.token_ids) if spec.token_ids is not None else None)
    validate_priority(spec.priority)
    validate_agent_hierarchy(spec.agent_hierarchy, limits)
    validate_disaggregation(spec.disaggregation)
    validate_deadline_ms(spec.deadline_ms, limits)
