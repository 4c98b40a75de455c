"""The grammar engine behind structured outputs: a ``GuidedSpec`` (pdserve.transport.requests.structured)
compiled for the served tokenizer, and per request a matcher that masks each step's logits to
the tokens that keep the text inside the grammar.

The engine is llguidance (Microsoft's low-level guidance, a Rust library with a small wheel
that needs neither torch nor transformers): it reads the ``tokenizers`` JSON of the served
tokenizer, compiles JSON Schema, regexes and Lark/GBNF grammars, and computes a packed bitmask
(one bit per token id, 32 per int32 word) of the tokens allowed next. EOS is allowed exactly
when the text so far is complete, and once the grammar admits no more bytes only EOS is.

* ``GrammarCompiler(tokenizer, vocab_size, eos_token_ids)``: one per process and tokenizer.
  ``compile(spec)`` builds a grammar once and keeps it in a bounded, thread-safe LRU cache
  (also of failures, so a bad schema resent is answered without recompiling); ``validate(spec)``
  is the router's admission check; ``matcher(spec)`` gives a request its ``GrammarMatcher``;
  ``mask_batch(logits, matchers)`` masks the grammar rows of a batch with one parallel
  bitmask computation.
* ``GrammarMatcher``: ``apply(logits_row)`` (alias ``mask``) sets disallowed logits to -inf in
  place, ``allowed_mask()`` is the boolean mask, ``accept(token)`` advances,
  ``is_terminated()`` says the text is complete (EOS taken, or nothing but EOS can follow),
  ``replay(tokens)`` rebuilds the state from the tokens generated so far (after a pause with
  recompute, or on the worker a request migrated to).

Ids from the tokenizer's size up to ``vocab_size`` (a model's padded vocabulary) are never
allowed. A matcher that took a token the grammar rejects stays in an error state whose mask
allows only EOS, so the request ends instead of sampling from an empty distribution.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Iterable, Sequence

import llguidance
import torch
from tokenizers import Tokenizer

from pdserve.transport.requests.structured import GuidedSpec, StructuredOutputError

__all__ = ["GrammarError", "GrammarCompiler", "CompiledGrammar", "GrammarMatcher"]

DEFAULT_CACHE_SIZE = 256
MAX_ERROR_CHARS = 800


class GrammarError(StructuredOutputError):
    """A schema, regex or grammar the engine cannot compile; ``field`` is the body field that
    gave it (``GuidedSpec.error_field``), so a door answers a 400 naming it."""


class CompiledGrammar:
    """A compiled guide: the engine's grammar and a fresh matcher that per-request matchers are
    copied from (a copy is microseconds; building a matcher is the compile)."""

    __slots__ = ("spec", "grammar", "_template")

    def __init__(self, spec: GuidedSpec, grammar: str, template: llguidance.LLMatcher) -> None:
        self.spec = spec
        self.grammar = grammar
        self._template = template

    def new_state(self) -> llguidance.LLMatcher:
        return self._template.deep_copy()

    def __repr__(self) -> str:
        return f"CompiledGrammar({self.spec.kind}, {self.spec.cache_key})"


_executor: llguidance.LLExecutor | None = None
_executor_lock = threading.Lock()


def _shared_executor() -> llguidance.LLExecutor:
    """One engine thread pool per process for batched mask computation."""
    global _executor
    with _executor_lock:
        if _executor is None:
            threads = os.environ.get("PDSERVE_GRAMMAR_THREADS")
            _executor = llguidance.LLExecutor(int(threads) if threads else None)
        return _executor


class GrammarCompiler:
    """Compiles guides for one tokenizer. ``vocab_size``: the width of the model's logits (may
    exceed the tokenizer's size: the extra ids are never allowed). ``eos_token_ids``: the ids
    that end the text (each is allowed exactly when the grammar can end)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: int | Iterable[int],
                 *, cache_size: int = DEFAULT_CACHE_SIZE, json_whitespace_flexible: bool = True,
                 json_lenient: bool = False) -> None:
        eos = [eos_token_ids] if isinstance(eos_token_ids, int) else list(dict.fromkeys(eos_token_ids))
        if not eos:
            raise ValueError("a grammar needs at least one EOS token id")
        self.tokenizer_size = tokenizer.get_vocab_size(with_added_tokens=True)
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        if any(not 0 <= e < max(vocab_size, self.tokenizer_size) for e in eos):
            raise ValueError(f"EOS ids {eos} outside the vocabulary of {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos)
        # The engine's vocabulary covers both the tokenizer and the logits; ids the tokenizer
        # does not know decode to nothing the grammar matches, so they are never allowed.
        self.engine_vocab = max(vocab_size, self.tokenizer_size)
        self.mask_words = (self.engine_vocab + 31) // 32
        self._tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=self.engine_vocab,
                                                 eos_token=list(eos))
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._json_options = {"whitespace_flexible": json_whitespace_flexible, "lenient": json_lenient}
        self._cache_size = max(1, cache_size)
        self._cache: OrderedDict[str, CompiledGrammar | str] = OrderedDict()  # str: an error
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self._shifts: dict[torch.device, torch.Tensor] = {}
        self._eos_words = torch.zeros(self.mask_words, dtype=torch.int32)
        for e in eos:
            self._eos_words[e // 32] |= _bit(e % 32)

    # ---- compiling -----------------------------------------------------------------------------

    def compile(self, spec: GuidedSpec) -> CompiledGrammar:
        """The compiled guide, from the cache when it was compiled before. Raises GrammarError
        naming ``spec.error_field`` when the engine rejects it."""
        key = spec.cache_key
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.hits += 1
        if cached is None:
            try:
                cached = self._build(spec)
            except GrammarError as exc:
                cached = exc.message
            with self._lock:
                self.misses += 1
                # Two threads may compile the same guide at once: the first stored one wins,
                # so every caller gets the same object.
                cached = self._cache.setdefault(key, cached)
                self._cache.move_to_end(key)
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(cached, str):
            raise GrammarError(spec.error_field, cached)
        return cached

    def validate(self, spec: GuidedSpec) -> None:
        """Raise GrammarError when ``spec`` does not compile (the router's admission check; the
        compiled guide stays cached)."""
        self.compile(spec)

    def matcher(self, spec: GuidedSpec | CompiledGrammar, tokens: Sequence[int] = ()) -> GrammarMatcher:
        """A request's matcher, advanced over ``tokens`` (its output so far) when given."""
        compiled = spec if isinstance(spec, CompiledGrammar) else self.compile(spec)
        m = GrammarMatcher(self, compiled)
        if tokens:
            m.replay(tokens)
        return m

    def matcher_after(self, guided: tuple[str, str], output: Sequence[int]) -> GrammarMatcher:
        """The matcher of a request's wire ``guided`` pair, advanced over its output so far;
        ValueError (the request is refused) when the output breaks the grammar."""
        m = self.matcher(GuidedSpec.from_pair(guided))
        if output and not m.replay(output):
            raise ValueError("guided: the tokens generated so far do not follow the grammar")
        return m

    def cache_info(self) -> dict[str, int]:
        with self._lock:
            return {"size": len(self._cache), "max_size": self._cache_size,
                    "hits": self.hits, "misses": self.misses}

    def _build(self, spec: GuidedSpec) -> CompiledGrammar:
        field = spec.error_field
        try:
            if spec.kind in ("json_object", "json_schema"):
                source = '{"type":"object"}' if spec.kind == "json_object" else spec.text
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    source, defaults=self._json_options)
            elif spec.kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(spec.text)
            elif spec.kind == "choice":
                grammar = llguidance.grammar_from("choice", spec.text)
            else:  # Lark, or GBNF/EBNF (rules written with ::=), converted to Lark by the engine
                grammar = llguidance.grammar_from("grammar", spec.text)
        except (ValueError, TypeError) as exc:
            raise GrammarError(field, _clean_error(str(exc))) from None
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        if template.is_error():
            raise GrammarError(field, _clean_error(template.get_error()))
        # The first mask: a grammar that allows nothing at all (not even EOS) is unusable, and
        # computing it on a copy warms the lexer the request matchers share.
        probe = template.deep_copy()
        words = torch.zeros(self.mask_words, dtype=torch.int32)
        probe.unsafe_compute_mask_ptr(words.data_ptr(), self.mask_words * 4)
        if probe.is_error():
            raise GrammarError(field, _clean_error(probe.get_error()))
        if not bool(words.any()):
            raise GrammarError(field, "matches no text")
        return CompiledGrammar(spec, grammar, template)

    # ---- masks -----------------------------------------------------------------------------------

    def new_bitmask(self, rows: int) -> torch.Tensor:
        """A packed mask buffer: int32 [rows, mask_words], bit t%32 of word t//32 is token t."""
        return torch.zeros((rows, self.mask_words), dtype=torch.int32)

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """Row i of ``bitmask`` (CPU int32 [>= len(matchers), mask_words], contiguous) gets
        matcher i's mask; computed in parallel on the engine's threads."""
        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous():
            raise ValueError("the bitmask must be a contiguous CPU int32 tensor")
        if bitmask.dim() != 2 or bitmask.shape[1] != self.mask_words or bitmask.shape[0] < len(matchers):
            raise ValueError(f"the bitmask must be [>= {len(matchers)}, {self.mask_words}], "
                             f"got {list(bitmask.shape)}")
        if not matchers:
            return
        for m in matchers:
            if m._compiler is not self:
                raise ValueError("a matcher of another compiler (another tokenizer)")
        if len(matchers) == 1:
            matchers[0].fill_bitmask(bitmask[0])
            return
        _shared_executor().unsafe_compute_mask_ptr(
            [(m._state, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
            self.mask_words * 4, bitmask.shape[0])
        self._guard_empty(bitmask[:len(matchers)])

    def unpack(self, bitmask: torch.Tensor, width: int | None = None,
               device: torch.device | str | None = None, *, disallowed: bool = False) -> torch.Tensor:
        """Packed int32 [..., mask_words] -> bool [..., width], True where allowed (or, with
        ``disallowed``, where not), on ``device`` (the packed words travel, not the booleans).
        ``width`` defaults to vocab_size; ids past the engine's vocabulary are not allowed."""
        width = self.vocab_size if width is None else width
        device = torch.device(device) if device is not None else bitmask.device
        words = bitmask.to(device, non_blocking=True)
        shifts = self._shifts.get(device)
        if shifts is None:
            shifts = self._shifts[device] = torch.arange(32, dtype=torch.int32, device=device)
        bits = (words.unsqueeze(-1) >> shifts) & 1
        bits = (bits == 0 if disallowed else bits.bool()).flatten(-2)
        n = bits.shape[-1]
        if width <= n:
            return bits[..., :width]
        pad = torch.full((*bits.shape[:-1], width - n), disallowed, dtype=torch.bool, device=device)
        return torch.cat([bits, pad], dim=-1)

    def mask_batch(self, logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> torch.Tensor:
        """Set the disallowed logits of every row with a matcher to -inf, in place (logits:
        [rows, width], any float dtype and device; None: an unconstrained row). One parallel
        mask computation for all the rows; returns ``logits``."""
        if logits.dim() != 2 or logits.shape[0] != len(matchers):
            raise ValueError(f"logits {list(logits.shape)} for {len(matchers)} matchers")
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        bitmask = self.new_bitmask(len(rows))
        self.fill_bitmasks([matchers[i] for i in rows], bitmask)
        banned = self.unpack(bitmask, logits.shape[1], logits.device, disallowed=True)
        if len(rows) == logits.shape[0]:
            logits.masked_fill_(banned, float("-inf"))
        else:
            index = torch.tensor(rows, dtype=torch.long, device=logits.device)
            sub = logits.index_select(0, index).masked_fill_(banned, float("-inf"))
            logits.index_copy_(0, index, sub)
        return logits

    def _guard_empty(self, bitmask: torch.Tensor) -> None:
        """A row that allows nothing (which the engine avoids) gets EOS, so sampling never
        meets an all -inf row."""
        empty = ~bitmask.any(dim=-1)
        if bool(empty.any()):
            bitmask[empty] = self._eos_words


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe (a request is stepped by one
    thread); ``copy()`` forks it."""

    __slots__ = ("_compiler", "compiled", "_state", "_words", "num_tokens")

    def __init__(self, compiler: GrammarCompiler, compiled: CompiledGrammar) -> None:
        self._compiler = compiler
        self.compiled = compiled
        self._state = compiled.new_state()
        self._words: torch.Tensor | None = None
        self.num_tokens = 0  # tokens accepted (EOS included)

    @property
    def spec(self) -> GuidedSpec:
        return self.compiled.spec

    # ---- masks -----------------------------------------------------------------------------------

    def fill_bitmask(self, words: torch.Tensor) -> torch.Tensor:
        """Write the packed mask into ``words`` (contiguous CPU int32 [mask_words])."""
        c = self._compiler
        if (words.dtype != torch.int32 or words.device.type != "cpu" or not words.is_contiguous()
                or words.numel() != c.mask_words):
            raise ValueError(f"the mask row must be a contiguous CPU int32 tensor of {c.mask_words}")
        self._state.unsafe_compute_mask_ptr(words.data_ptr(), c.mask_words * 4)
        if not bool(words.any()):
            words.copy_(c._eos_words)
        return words

    def bitmask(self) -> torch.Tensor:
        """The packed mask (a buffer of this matcher's, overwritten by the next call)."""
        if self._words is None:
            self._words = torch.zeros(self._compiler.mask_words, dtype=torch.int32)
        return self.fill_bitmask(self._words)

    def allowed_mask(self, width: int | None = None, device: torch.device | str | None = None
                     ) -> torch.Tensor:
        """bool [width] (default vocab_size): True where the token may come next."""
        return self._compiler.unpack(self.bitmask(), width, device)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Set the disallowed entries of ``logits`` (one row [width], any float dtype and
        device) to -inf in place; returns it."""
        banned = self._compiler.unpack(self.bitmask(), logits.shape[-1], logits.device, disallowed=True)
        return logits.masked_fill_(banned, float("-inf"))

    mask = apply  # the name the sampler calls

    # ---- state -----------------------------------------------------------------------------------

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False when the grammar rejects it (the matcher then
        stays in an error state whose mask allows only EOS)."""
        ok = self._state.consume_token(int(token_id))
        if ok:
            self.num_tokens += 1
        return ok

    def accept_many(self, tokens: Sequence[int]) -> bool:
        """Advance over several tokens; False (and the error state) at the first rejected one."""
        for token in tokens:
            if not self.accept(token):
                return False
        return True

    def replay(self, tokens: Sequence[int]) -> bool:
        """Rebuild the state from scratch over ``tokens`` (the output so far): after a pause
        with recompute, or on the worker a request migrated to. False when they do not fit."""
        self._state = self.compiled.new_state()
        self.num_tokens = 0
        return self.accept_many(tokens)

    def rollback(self, num_tokens: int) -> bool:
        """Undo the last ``num_tokens`` accepted tokens (speculative decoding's rejected drafts)."""
        if not 0 <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {self.num_tokens} tokens")
        ok = self._state.rollback(num_tokens)
        if ok:
            self.num_tokens -= num_tokens
        return ok

    def is_terminated(self) -> bool:
        """The text is complete: EOS was accepted, or the grammar admits nothing but EOS (or the
        matcher is in an error state). A worker may end the request here."""
        return self._state.is_stopped()

    def is_accepting(self) -> bool:
        """The text so far is a complete match (EOS is allowed now)."""
        return self._state.is_accepting()

    def is_error(self) -> bool:
        return self._state.is_error()

    @property
    def error(self) -> str | None:
        return _clean_error(self._state.get_error()) if self._state.is_error() else None

    def copy(self) -> GrammarMatcher:
        twin = GrammarMatcher.__new__(GrammarMatcher)
        twin._compiler, twin.compiled = self._compiler, self.compiled
        twin._state = self._state.deep_copy()
        twin._words = None
        twin.num_tokens = self.num_tokens
        return twin

    def __repr__(self) -> str:
        return (f"GrammarMatcher({self.spec.kind}, tokens={self.num_tokens}, "
                f"terminated={self.is_terminated()}, error={self.is_error()})")


def _bit(position: int) -> int:
    """Bit ``position`` of an int32 word as a Python int in int32 range."""
    return -(1 << 31) if position == 31 else 1 << position


def _clean_error(message: str) -> str:
    """The engine's message without its parser-state dump, bounded."""
    for marker in ("<state>", "<non-verbose"):
        message = message.split(marker, 1)[0]
    message = message.strip()
    if message in ("NoExtension", "NoExtensionBias"):  # a stop reason: no text can start
        return "matches no text"
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + "..."
    return message or "rejected by the grammar engine"

