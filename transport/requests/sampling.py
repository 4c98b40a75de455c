"""The one sampling record, from the front door to the sampler. PURE: stdlib only.

``SamplingParams`` is built by a door (gRPC's ``SamplingParams`` message or an OpenAI body),
checked by ``validate`` (the doors, the router and the worker all call the same rules), carried
to the worker as a msgpack map by ``to_wire``/``from_wire``, and read field by field by the
sampler. Adding a field means: the field here, its rule in ``validate``, the two doors, and the
sampler; the wire format follows the dataclass by itself.

Semantics are vLLM's (its ``SamplingParams`` and v1 sampler), so the same request gets the same
answer from either server:
- ``repetition_penalty`` (1 = off) divides positive / multiplies negative logits of every token
  seen in the prompt or the output; ``frequency_penalty`` subtracts count x penalty and
  ``presence_penalty`` subtracts the penalty once, for tokens of the output only.
- ``min_p`` drops tokens whose probability (after temperature) is below min_p x the largest.
- ``min_tokens``: EOS and ``stop_token_ids`` are masked until that many tokens were generated
  (and stop strings are not matched before then).
- ``logit_bias``: added to the raw logits, (token id, bias) pairs.
- ``bad_words``: a word's token sequence may not be completed; the router resolves the words to
  token sequences (``bad_words_token_ids``) with the model's tokenizer, as vLLM does (the word
  as given and with one leading space).
- ``logprobs``: k >= 0 returns the sampled token's log-probability and the k most likely tokens'
  (the model's raw log-softmax, before any penalty or temperature); ``prompt_logprobs`` the same
  for every prompt token after the first.
- ``n`` choices, ``best_of`` candidates ranked by cumulative log-probability (best_of >= n).
- ``seed``: with n > 1, choice i draws with seed + i (vLLM's rule), so each choice is
  reproducible on its own.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs (and OpenAI's top_logprobs limit)
SEED_LIMIT = 1 << 63
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a bias value


class FieldError(ValueError):
    """A request field is malformed; ``field`` names it (a dotted path, with an index for an
    element), ``message`` says why. The base of every field-naming error, so each layer can
    catch its own kind."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class SamplingError(FieldError):
    """A field of the record is out of range; ``field`` is the record's field name ("top_p",
    "stop_token_ids[2]")."""


@dataclass(frozen=True, slots=True)
class SamplingLimits:
    """What the server allows beyond the record's own ranges (``vocab_size`` None skips the
    vocabulary checks, e.g. before the router knows the model)."""

    vocab_size: int | None = None
    max_tokens_limit: int | None = 1 << 16
    max_stop_token_ids: int | None = 32
    max_stop_strings: int | None = 4  # OpenAI's limit
    max_stop_string_chars: int | None = 256
    max_n: int | None = 16
    max_logprobs: int | None = MAX_LOGPROBS
    max_logit_bias: int | None = 1024  # entries
    max_bad_words: int | None = 64

    @classmethod
    def vocab_only(cls, vocab_size: int) -> "SamplingLimits":
        """Only the vocabulary checks (a worker's: the router applied the server's limits)."""
        return cls(vocab_size, None, None, None, None, None, None, None, None)


UNBOUNDED = SamplingLimits(None, None, None, None, None, None, None, None, None)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    n: int = 1
    best_of: int | None = None  # None: n
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # (0, 1]
    min_p: float = 0.0  # 0 disables
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()  # matched by the router on the text
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # resolved from bad_words
    logprobs: int | None = None  # None: none; k: the sampled token's and the top k
    prompt_logprobs: int | None = None
    # Structured output: (kind, source) with kind json_object / json_schema / regex / choice /
    # grammar (see pdserve.transport.requests.structured); None: free text.
    guided: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        # Lists are accepted for convenience; stored as tuples so the record stays hashable.
        set_ = object.__setattr__
        set_(self, "stop", _tuple(self.stop))
        set_(self, "stop_token_ids", _tuple(self.stop_token_ids))
        set_(self, "bad_words", _tuple(self.bad_words))
        set_(self, "bad_words_token_ids", tuple(_tuple(w) for w in self.bad_words_token_ids)
             if _iterable(self.bad_words_token_ids) else self.bad_words_token_ids)
        bias = self.logit_bias
        if isinstance(bias, Mapping):
            bias = tuple(sorted(bias.items()))
        if _iterable(bias):
            bias = tuple(_tuple(pair) for pair in bias)
        set_(self, "logit_bias", bias)
        if self.guided is not None and _iterable(self.guided):
            set_(self, "guided", _tuple(self.guided))
        # A record that exists is in range; the server's own limits are validate()'s.
        self.validate(UNBOUNDED)

    # ------------------------------------------------------------------ reading

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def candidates(self) -> int:
        """How many sequences the request runs: best_of, or n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def needs_logits_processing(self) -> bool:
        """Anything besides temperature/top-k/top-p that changes the logits."""
        return (self.has_penalties or self.min_tokens > 0 or bool(self.logit_bias)
                or bool(self.bad_words_token_ids) or self.min_p > 0.0)

    def replace(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    def for_choice(self, index: int) -> "SamplingParams":
        """The record one of the request's candidates samples with: n = best_of = 1, the seed
        shifted by the candidate's index."""
        seed = None if self.seed is None else (self.seed + index) % SEED_LIMIT
        return dataclasses.replace(self, n=1, best_of=None, seed=seed)

    # ------------------------------------------------------------------ rules

    def validate(self, limits: SamplingLimits = SamplingLimits()) -> None:
        """Raise SamplingError naming the first offending field."""
        _int_in("n", self.n, 1, limits.max_n)
        if self.best_of is not None:
            _int_in("best_of", self.best_of, 1, limits.max_n)
            if self.best_of < self.n:
                raise SamplingError("best_of", f"must be >= n ({self.n}), got {self.best_of}")
        _int_in("max_tokens", self.max_tokens, 1, limits.max_tokens_limit)
        _int_in("min_tokens", self.min_tokens, 0, None)
        if limits.max_tokens_limit is not None and self.min_tokens > self.max_tokens:
            # A client's rule (the server's limits apply): an attempt's record may hold fewer
            # max_tokens than min_tokens, the rest having been generated before.
            raise SamplingError("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got "
                                f"{self.min_tokens}")
        _real("temperature", self.temperature, lo=0.0)
        _int_in("top_k", self.top_k, 0, None, "must be an integer >= 0 (0 disables)")
        _real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        _real("min_p", self.min_p, lo=0.0, hi=1.0)
        _real("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _real("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _real("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0.0:
            raise SamplingError("repetition_penalty", f"must be > 0 (1 disables), got "
                                f"{self.repetition_penalty!r}")
        if self.seed is not None:
            _int_in("seed", self.seed, 0, SEED_LIMIT - 1, "must be in [0, 2**63)")
        self._validate_stops(limits)
        _bool("include_stop_str_in_output", self.include_stop_str_in_output)
        _bool("ignore_eos", self.ignore_eos)
        self._validate_bias(limits)
        self._validate_bad_words(limits)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _int_in(name, value, 0, limits.max_logprobs)
        if self.guided is not None:
            if (not isinstance(self.guided, tuple) or len(self.guided) != 2
                    or not all(isinstance(v, str) for v in self.guided)):
                raise SamplingError("guided", "must be a (kind, source) pair of strings")
            if self.guided[0] not in GUIDED_KINDS:
                raise SamplingError("guided", f"unknown kind {self.guided[0]!r}; one of "
                                    f"{', '.join(GUIDED_KINDS)}")

    def _validate_stops(self, limits: SamplingLimits) -> None:
        if not isinstance(self.stop, tuple):
            raise SamplingError("stop", "must be a list of strings")
        if _over(len(self.stop), limits.max_stop_strings):
            raise SamplingError("stop", f"{len(self.stop)} stop strings; at most "
                                f"{limits.max_stop_strings}")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise SamplingError(f"stop[{i}]", "must be a non-empty string")
            if _over(len(s), limits.max_stop_string_chars):
                raise SamplingError(f"stop[{i}]", f"longer than {limits.max_stop_string_chars} "
                                    "characters")
        if not isinstance(self.stop_token_ids, tuple):
            raise SamplingError("stop_token_ids", "must be a list of token ids")
        if _over(len(self.stop_token_ids), limits.max_stop_token_ids):
            raise SamplingError("stop_token_ids", f"more than {limits.max_stop_token_ids} ids")
        for i, t in enumerate(self.stop_token_ids):
            _token(f"stop_token_ids[{i}]", t, limits.vocab_size)

    def _validate_bias(self, limits: SamplingLimits) -> None:
        if not isinstance(self.logit_bias, tuple):
            raise SamplingError("logit_bias", "must map token ids to numbers")
        if _over(len(self.logit_bias), limits.max_logit_bias):
            raise SamplingError("logit_bias", f"{len(self.logit_bias)} entries; at most "
                                f"{limits.max_logit_bias}")
        seen = set()
        for pair in self.logit_bias:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise SamplingError("logit_bias", "must map token ids to numbers")
            token, bias = pair
            _token(f"logit_bias[{token!r}]", token, limits.vocab_size)
            if token in seen:
                raise SamplingError(f"logit_bias[{token}]", "given twice")
            seen.add(token)
            _real(f"logit_bias[{token}]", bias, lo=-LOGIT_BIAS_LIMIT, hi=LOGIT_BIAS_LIMIT)

    def _validate_bad_words(self, limits: SamplingLimits) -> None:
        if not isinstance(self.bad_words, tuple):
            raise SamplingError("bad_words", "must be a list of strings")
        if _over(len(self.bad_words), limits.max_bad_words):
            raise SamplingError("bad_words", f"{len(self.bad_words)} words; at most "
                                f"{limits.max_bad_words}")
        for i, w in enumerate(self.bad_words):
            if not isinstance(w, str) or not w.strip():
                raise SamplingError(f"bad_words[{i}]", "must be a non-empty string")
        if not isinstance(self.bad_words_token_ids, tuple):
            raise SamplingError("bad_words_token_ids", "must be a list of token id lists")
        for i, seq in enumerate(self.bad_words_token_ids):
            if not isinstance(seq, tuple) or not seq:
                raise SamplingError(f"bad_words_token_ids[{i}]", "must be a non-empty list")
            for j, t in enumerate(seq):
                _token(f"bad_words_token_ids[{i}][{j}]", t, limits.vocab_size)

    # ------------------------------------------------------------------ wire

    def to_wire(self) -> dict[str, Any]:
        """The fields that differ from the defaults, as msgpack-ready values."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != _DEFAULTS[f.name]:
                out[f.name] = _plain(value)
        return out

    @classmethod
    def from_wire(cls, fields: Any) -> "SamplingParams":
        """The inverse of ``to_wire``; raises SamplingError for an unknown field or a value of
        the wrong type (the ranges are ``validate``'s)."""
        if not isinstance(fields, dict):
            raise SamplingError("sampling", "expected a map of fields")
        kwargs = {}
        for name, value in fields.items():
            kind = _WIRE_KINDS.get(name)
            if kind is None:
                raise SamplingError(str(name), "unknown sampling field")
            if not kind(value):
                raise SamplingError(name, f"wrong type {type(value).__name__}")
            kwargs[name] = value
        return cls(**kwargs)


GUIDED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")

_DEFAULTS = {f.name: (f.default if f.default is not dataclasses.MISSING else f.default_factory())
             for f in dataclasses.fields(SamplingParams)}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _list_of(check):
    return lambda v: isinstance(v, (list, tuple)) and all(check(x) for x in v)


_WIRE_KINDS = {
    "n": _is_int, "best_of": lambda v: v is None or _is_int(v), "max_tokens": _is_int,
    "min_tokens": _is_int, "temperature": _is_real, "top_k": _is_int, "top_p": _is_real,
    "min_p": _is_real, "presence_penalty": _is_real, "frequency_penalty": _is_real,
    "repetition_penalty": _is_real, "seed": lambda v: v is None or _is_int(v),
    "stop": _list_of(lambda s: isinstance(s, str)), "stop_token_ids": _list_of(_is_int),
    "include_stop_str_in_output": lambda v: isinstance(v, bool),
    "ignore_eos": lambda v: isinstance(v, bool),
    "logit_bias": _list_of(lambda p: isinstance(p, (list, tuple)) and len(p) == 2
                           and _is_int(p[0]) and _is_real(p[1])),
    "bad_words": _list_of(lambda s: isinstance(s, str)),
    "bad_words_token_ids": _list_of(_list_of(_is_int)),
    "logprobs": lambda v: v is None or _is_int(v),
    "prompt_logprobs": lambda v: v is None or _is_int(v),
    "guided": lambda v: v is None or (isinstance(v, (list, tuple)) and len(v) == 2
                                      and all(isinstance(s, str) for s in v)),
}
assert set(_WIRE_KINDS) == set(_DEFAULTS), "every field needs its wire type"


def _over(count: int, limit: int | None) -> bool:
    return limit is not None and count > limit


def _iterable(v: Any) -> bool:
    return isinstance(v, (list, tuple))


def _tuple(v: Any) -> Any:
    if isinstance(v, (list, tuple)):
        return tuple(v)
    return v


def _plain(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_plain(x) for x in v]
    return v


def _int_in(name: str, value: Any, lo: int, hi: int | None, message: str | None = None) -> None:
    if not _is_int(value) or value < lo or (hi is not None and value > hi):
        if message is None:
            message = (f"must be an integer in [{lo}, {hi}]" if hi is not None
                       else f"must be an integer >= {lo}")
        raise SamplingError(name, f"{message}, got {value!r}")


def _real(name: str, value: Any, lo: float | None = None, hi: float | None = None) -> None:
    if not _is_real(value) or not math.isfinite(value):
        raise SamplingError(name, f"must be a finite number, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        span = (f"in [{lo:g}, {hi:g}]" if lo is not None and hi is not None
                else f">= {lo:g}" if lo is not None else f"<= {hi:g}")
        raise SamplingError(name, f"must be {span}, got {value!r}")


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise SamplingError(name, f"must be a boolean, got {value!r}")


def _token(name: str, value: Any, vocab_size: int | None) -> None:
    if not _is_int(value) or value < 0 or (vocab_size is not None and value >= vocab_size):
        raise SamplingError(name, f"token id {value!r} is outside [0, {vocab_size})")


def bad_words_to_token_ids(words: Iterable[str], encode) -> tuple[tuple[int, ...], ...]:
    """vLLM's rule: each word as given, and with one leading space when that tokenizes to a
    different first token but the same length. ``encode(text) -> list[int]`` adds no special
    tokens."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(encode(word.lstrip()))
        if plain:
            out.append(plain)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return tuple(dict.fromkeys(out))
