"""The grammar engine adapter (pdserve.workers.engine.grammar) on the tiny byte-level tokenizer: text
sampled token by token from random logits under the mask is valid for its guide; replay gives
the live matcher's masks; bad sources raise GrammarError naming the body field; the compile
cache hands back one object.

Random logits alone can wander (a JSON string closes with probability ~1/200 per byte), so each
run turns deterministic-ish after a few tokens: EOS and the bytes that close a structure get a
large bonus and whitespace and openers a large penalty, which ends every guide used here within
a bounded number of tokens, so the tests assert full validity."""
from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pdserve.transport.requests.structured import (
    GuidedSpec,
    choice_spec,
    grammar_spec,
    guided_spec_from_openai,
    json_object_spec,
    json_schema_spec,
    regex_spec,
)
from pdserve.workers.engine.grammar import GrammarCompiler, GrammarError, GrammarMatcher
from pdserve.workers.loading.tiny_model import EOS_ID, build_byte_tokenizer

OFFSET = 3  # id 3 + b is byte b
VOCAB = 300  # wider than the tokenizer's 259: ids 259.. are a model's padding, never allowed
SEEDS = [0, 1, 2, 3, 4]
CAP = 600

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}(\.[a-z]+)?"
CHOICES = ["red", "green", "blue", "reddish"]
# Arithmetic in GBNF (llama.cpp's EBNF dialect) and the same in Lark.
GBNF = '''
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= num | "(" expr ")"
num  ::= [0-9] [0-9]?
'''
LARK = '''
start: expr
expr: term (("+" | "-") term)*
term: NUM | "(" expr ")"
NUM: /[0-9]{1,2}/
'''

WHITESPACE = [OFFSET + ord(c) for c in " \t\n\r"]
CLOSERS = [OFFSET + ord(c) for c in '"}])']
OPENERS = [OFFSET + ord(c) for c in "{[("]


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, [EOS_ID])


def decode(tokens: list[int]) -> str:
    return bytes(t - OFFSET for t in tokens if t >= OFFSET).decode("utf-8")


def sample(compiler: GrammarCompiler, spec: GuidedSpec, seed: int, *, warmup: int = 12,
           check_each_step: bool = True) -> tuple[str, list[int]]:
    """Draw under the mask until the matcher terminates; returns (text, tokens incl. EOS)."""
    gen = torch.Generator().manual_seed(seed)
    m = compiler.matcher(spec)
    tokens: list[int] = []
    bias = torch.zeros(VOCAB)
    bias[[EOS_ID, *CLOSERS]] = 40.0
    bias[[*WHITESPACE, *OPENERS]] = -40.0
    while not m.is_terminated():
        assert len(tokens) < CAP, f"no end after {CAP} tokens: {decode(tokens)!r}"
        logits = torch.randn(VOCAB, generator=gen) * 3.0
        if len(tokens) >= warmup:
            logits += bias
        m.apply(logits)
        allowed = torch.isfinite(logits)
        if check_each_step:
            assert not allowed[VOCAB - 41:].any()  # ids past the tokenizer: never
            assert not allowed[0] and not allowed[1]  # <unk>, <s>
            assert bool(allowed[EOS_ID]) == m.is_accepting()  # EOS exactly when the text can end
            assert allowed.any()
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        assert m.accept(token), (decode(tokens), token)
        tokens.append(token)
    assert not m.is_error()
    return decode(tokens), tokens


def check_schema_by_hand(obj) -> None:
    assert isinstance(obj, dict)
    assert set(obj) <= set(SCHEMA["properties"]) and set(SCHEMA["required"]) <= set(obj)
    assert isinstance(obj["name"], str) and 1 <= len(obj["name"]) <= 8
    assert isinstance(obj["age"], int) and not isinstance(obj["age"], bool) and 0 <= obj["age"] <= 120
    assert obj["color"] in ("red", "green", "blue")
    assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3
    assert all(isinstance(t, str) and len(t) <= 4 for t in obj["tags"])
    assert "ok" not in obj or isinstance(obj["ok"], bool)


def check_arithmetic(text: str) -> None:
    """A recursive-descent check of the GBNF/Lark arithmetic grammar."""
    pos = 0

    def term() -> None:
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            expr()
            assert text[pos] == ")", text
            pos += 1
        else:
            digits = re.match(r"[0-9]{1,2}", text[pos:])
            assert digits, text
            pos += digits.end()

    def expr() -> None:
        nonlocal pos
        term()
        while pos < len(text) and text[pos] in "+-":
            pos += 1
            term()

    expr()
    assert pos == len(text), text


# ---- sampled text is valid ------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_json_schema(compiler, seed):
    spec = guided_spec_from_openai({"response_format": {"type": "json_schema",
                                                        "json_schema": {"name": "person", "schema": SCHEMA}}})
    text, tokens = sample(compiler, spec, seed, warmup=25)
    obj = json.loads(text)
    check_schema_by_hand(obj)
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(obj, SCHEMA)


def test_generated_keys_follow_the_schema_order(compiler):
    for order in (["name", "age", "color", "tags"], ["tags", "color", "age", "name"]):
        schema = dict(SCHEMA, properties={k: SCHEMA["properties"][k] for k in order})
        text, _ = sample(compiler, json_schema_spec(schema), seed=1, warmup=25)
        assert list(json.loads(text)) == order


@pytest.mark.parametrize("seed", SEEDS)
def test_json_object(compiler, seed):
    text, _ = sample(compiler, guided_spec_from_openai({"response_format": {"type": "json_object"}}), seed)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("seed", SEEDS)
def test_regex(compiler, seed):
    text, _ = sample(compiler, regex_spec(REGEX), seed, warmup=8)
    assert re.fullmatch(REGEX, text), text


def test_choice(compiler):
    seen = set()
    for seed in range(12):
        text, _ = sample(compiler, choice_spec(CHOICES), seed, warmup=3)
        assert text in CHOICES
        seen.add(text)
    assert len(seen) >= 2  # the draws really differ


@pytest.mark.parametrize("source", [GBNF, LARK], ids=["gbnf", "lark"])
@pytest.mark.parametrize("seed", SEEDS)
def test_grammar(compiler, source, seed):
    text, _ = sample(compiler, grammar_spec(source), seed, warmup=10)
    check_arithmetic(text)


def test_terminated_without_eos_when_nothing_can_follow(compiler):
    m = compiler.matcher(choice_spec(["green"]))
    assert m.accept_many([OFFSET + b for b in b"green"])
    assert m.is_terminated() and m.is_accepting()
    assert m.allowed_mask().nonzero().flatten().tolist() == [EOS_ID]  # only EOS can follow
    assert m.accept(EOS_ID) and m.is_terminated()


def test_every_eos_id_ends_the_text(tokenizer):
    c = GrammarCompiler(tokenizer, VOCAB, [EOS_ID, 1])
    m = c.matcher(regex_spec("ab?"))
    assert not m.allowed_mask()[[1, EOS_ID]].any()
    assert m.accept(OFFSET + ord("a"))
    assert m.allowed_mask()[[1, EOS_ID]].all()
    assert m.accept(1) and m.is_terminated()


# ---- state: replay, rollback, rejected tokens ------------------------------------------------------

@pytest.mark.parametrize("spec", [json_schema_spec(SCHEMA), regex_spec(REGEX), grammar_spec(GBNF)],
                         ids=["json_schema", "regex", "grammar"])
def test_replay_of_a_prefix_gives_the_live_mask(compiler, tokenizer, spec):
    _, tokens = sample(compiler, spec, seed=7, warmup=20, check_each_step=False)
    live = compiler.matcher(spec)
    other_worker = GrammarCompiler(tokenizer, VOCAB, [EOS_ID])  # where a migrated request lands
    rebuilt = compiler.matcher(spec)
    for k, token in enumerate(tokens):
        expected = live.allowed_mask()
        if k % 3 == 0:
            assert torch.equal(compiler.matcher(spec, tokens[:k]).allowed_mask(), expected)
            assert torch.equal(other_worker.matcher(spec, tokens[:k]).allowed_mask(), expected)
            assert rebuilt.replay(tokens[:k])  # in place, from any earlier state
            assert torch.equal(rebuilt.allowed_mask(), expected)
            assert rebuilt.num_tokens == k
        assert live.accept(token)
    assert live.is_terminated()
    assert rebuilt.replay(tokens) and rebuilt.is_terminated()


def test_rollback_and_copy(compiler):
    m = compiler.matcher(regex_spec("abc|abd"))
    start = m.allowed_mask()
    assert m.accept_many([OFFSET + ord("a"), OFFSET + ord("b")])
    after_ab = m.allowed_mask()
    fork = m.copy()
    assert fork.accept(OFFSET + ord("c")) and fork.is_accepting()
    assert torch.equal(m.allowed_mask(), after_ab)  # the fork left the original alone
    assert m.rollback(2) and m.num_tokens == 0
    assert torch.equal(m.allowed_mask(), start)
    with pytest.raises(ValueError):
        m.rollback(1)


def test_a_rejected_token_leaves_only_eos(compiler):
    m = compiler.matcher(regex_spec("[0-9]+"))
    assert not m.accept(OFFSET + ord("x"))
    assert m.is_error() and m.error and m.is_terminated()
    assert m.allowed_mask().nonzero().flatten().tolist() == [EOS_ID]
    assert not compiler.matcher(regex_spec("[0-9]+")).accept(VOCAB - 1)  # a padding id
    assert not compiler.matcher(regex_spec("[0-9]+")).accept(VOCAB + 5)  # past the vocabulary
    assert not compiler.matcher(regex_spec("[0-9]+")).replay([OFFSET + ord("1"), OFFSET + ord("y")])


# ---- masks ---------------------------------------------------------------------------------------

def test_apply_handles_dtypes_and_widths(compiler):
    m = compiler.matcher(regex_spec("[ab]"))
    want = {OFFSET + ord("a"), OFFSET + ord("b")}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        row = torch.zeros(VOCAB, dtype=dtype)
        assert m.apply(row) is row and set(torch.isfinite(row).nonzero().flatten().tolist()) == want
    wide = torch.zeros(VOCAB + 77)  # logits padded past vocab_size
    m.mask(wide)
    assert set(torch.isfinite(wide).nonzero().flatten().tolist()) == want
    assert m.allowed_mask().shape == (VOCAB,) and m.allowed_mask().dtype == torch.bool


def test_mask_batch_matches_rows(compiler):
    specs = [regex_spec(REGEX), None, choice_spec(CHOICES), json_object_spec(), None, grammar_spec(LARK)]
    matchers: list[GrammarMatcher | None] = [compiler.matcher(s) if s else None for s in specs]
    matchers[0].accept_many([OFFSET + b for b in b"ab-1"])
    matchers[3].accept_many([OFFSET + b for b in b'{"k": '])
    logits = torch.randn(len(specs), VOCAB, generator=torch.Generator().manual_seed(0))
    original = logits.clone()
    compiler.mask_batch(logits, matchers)
    for i, m in enumerate(matchers):
        if m is None:
            assert torch.equal(logits[i], original[i])
        else:
            assert torch.equal(logits[i], m.apply(original[i].clone()))
    full = [m for m in matchers if m is not None]
    rows = torch.zeros(len(full), VOCAB)
    compiler.mask_batch(rows, full)
    for i, m in enumerate(full):
        assert torch.equal(torch.isfinite(rows[i]), m.allowed_mask())
    compiler.mask_batch(torch.zeros(2, VOCAB), [None, None])  # nothing to do
    with pytest.raises(ValueError):
        compiler.mask_batch(torch.zeros(3, VOCAB), full)


# ---- compile errors and the cache ------------------------------------------------------------------

@pytest.mark.parametrize("body,field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": {"$ref": "#/$defs/missing"}}, "guided_json"),
    ({"guided_json": {"type": "string", "minLength": 5, "maxLength": 2}}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_regex": "[z-a]"}, "guided_regex"),
    ({"structured_outputs": {"regex": "(?=a)a"}}, "structured_outputs.regex"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ({"guided_grammar": "start: x y"}, "guided_grammar"),
    ({"structured_outputs": {"grammar": "start: (("}}, "structured_outputs.grammar"),
])
def test_invalid_sources_raise_grammar_error_with_the_field(compiler, body, field):
    spec = guided_spec_from_openai(body)
    with pytest.raises(GrammarError) as info:
        compiler.validate(spec)
    err = info.value
    assert err.field == field and isinstance(err, ValueError)
    assert err.message and "<state>" not in err.message and len(err.message) < 1000
    with pytest.raises(GrammarError) as again:  # from the cache, still naming this field
        compiler.matcher(GuidedSpec(spec.kind, spec.text, "other_field"))
    assert again.value.field == "other_field" and again.value.message == err.message


def test_compile_cache_returns_the_same_object(tokenizer):
    c = GrammarCompiler(tokenizer, VOCAB, EOS_ID, cache_size=2)
    a = c.compile(regex_spec("x+", "guided_regex"))
    assert c.compile(GuidedSpec("regex", "x+", "structured_outputs.regex")) is a
    assert c.cache_info() == {"size": 1, "max_size": 2, "hits": 1, "misses": 1}
    c.validate(regex_spec("y+"))
    assert c.compile(regex_spec("x+")) is a  # x+ is now the most recent
    c.validate(regex_spec("z+"))  # evicts y+
    assert c.compile(regex_spec("x+")) is a
    assert c.cache_info()["size"] == 2 and c.cache_info()["misses"] == 3
    c.compile(regex_spec("y+"))
    assert c.cache_info()["misses"] == 4
    # Many threads at once: all get one object.
    spec = json_schema_spec(SCHEMA)
    barrier = threading.Barrier(8)

    def compile_once(_):
        barrier.wait()
        return c.compile(spec)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(compile_once, range(8)))
    assert all(r is results[0] for r in results)
    assert c.matcher(results[0]).compiled is results[0]


def test_compiler_arguments(tokenizer):
    with pytest.raises(ValueError):
        GrammarCompiler(tokenizer, VOCAB, [])
    with pytest.raises(ValueError):
        GrammarCompiler(tokenizer, VOCAB, [VOCAB + 1])
    with pytest.raises(ValueError):
        GrammarCompiler(tokenizer, 0, [EOS_ID])
    other = GrammarCompiler(tokenizer, VOCAB, [EOS_ID])
    mine = GrammarCompiler(tokenizer, VOCAB, [EOS_ID])
    with pytest.raises(ValueError):
        mine.mask_batch(torch.zeros(1, VOCAB), [other.matcher(regex_spec("a"))])
