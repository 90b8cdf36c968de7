"""Structured outputs: what a request's output must match (a JSON schema, any JSON object, a regular expression,
one of some strings, a Lark or GBNF grammar: `GrammarSpec`), compiled by llguidance against the served vocabulary
(`Grammars`), and the matcher each request advances token by token, which writes the bitmask of the tokens
allowed next (`Grammars.matcher`; used by master/logits.py).

llguidance does the work: it compiles each kind to its own grammar format, computes a step's token mask in tens
of microseconds from a token trie, and reports a grammar it cannot compile as a message, which becomes the
request's 400. The vocabulary it sees is built once, on the first constrained request: each token's bytes
(`Tokenizer.token_bytes`), special tokens marked with a leading 0xFF byte so that no text can produce them, and a
tokenize function that keeps the text as it is (llguidance tokenizes the text a grammar forces with it).

JSON is generated compact but readable (`", "` and `": "` between items, no other whitespace): a model left free
to add whitespace can add it forever.

A hostile grammar (`(a{1000}){1000}`, a rule of 10,000 alternatives, a highly ambiguous Lark grammar) must cost the
step loop little and never fail a request with a 500. Three bounds do it:
- `limits()`: llguidance's per-step budgets, lower than its defaults, so that one token's mask stays within tens
  of milliseconds (it is computed on the master's step loop, master/logits.py); a grammar that exhausts them
  mid-output ends its request with finish reason "length" and a message naming the limit (`why_stuck`).
- `Grammars.compile_now` computes the first mask and takes one token in the worker thread that compiles: a
  grammar that already hits a limit there, allows no output, or forces more than MAX_FORCED_BYTES before the model
  chooses anything is refused (400) before its request is queued; the first mask's work (often the largest) is
  then done off the loop, once, and the matchers copied from it start with it.
- `_Vocabulary`: llguidance tokenizes a grammar's forced text with it at every step; a long one is tokenized
  canonically only at its head (the tokens the mask forces come from there).
"""
from __future__ import annotations

import asyncio
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

__all__ = ["GrammarError", "GrammarSpec", "Grammars", "JSON_OPTIONS", "limits", "one_line", "why_stuck"]

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_GRAMMAR_CHARS = 1 << 17          # a request's grammar or schema, as text
CACHE_SIZE = 64                      # compiled grammars kept (a matcher to copy each)
# llguidance's budget for one token's mask and one token taken (its defaults: 200,000, 50,000 and 2,000). Measured
# on a slow shared core, with these a hostile grammar's step stays under ~50 ms; with the defaults an ambiguous
# grammar (`s: s s | s s s | "a" | ""`) passes half a second a step and then seconds, as its Earley rows grow with
# the output. The heaviest sample grammar tried (llama.cpp's english.gbnf, character-level rules) needs 1,500 items
# a mask; JSON schemas and tool calls far fewer, and a row of more than 500 items is a rule of that many
# alternatives (`choice` and JSON enums are one lexeme each, and cost none).
STEP_LEXER_FUEL = 50_000
STEP_MAX_ITEMS = 5_000
MAX_ITEMS_IN_ROW = 500
MAX_FORCED_BYTES = 1 << 16           # text a grammar forces at its start, before the model chooses anything
CANONICAL_CHARS = 1024               # of a forced text, tokenized by the model's tokenizer (the rest greedily)
# How llguidance words a limit it hit (regexvec.rs, parser.rs).
LIMIT_MARKERS = ("too many expressions", "too many states", "too many items", "items; max is", "fuel exhausted")


class GrammarError(ValueError):
    """The request's grammar cannot be used (`param`: the field that gave it); answered with 400."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match, as the request gave it: `kind` one of KINDS, `value` (a schema as
    a JSON string, a regex, a tuple of choices, a Lark or GBNF grammar; None for json_object) and `field`,
    the request field it came from (named in errors)."""
    kind: str
    value: Any
    field: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"{self.field}: unknown kind {self.kind!r} (one of {', '.join(KINDS)})", self.field)

    @classmethod
    def json_schema(cls, schema, field: str) -> "GrammarSpec":
        """A JSON schema given as an object or as its JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"{field}: not valid JSON ({exc.msg})", field) from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"{field} must be a JSON schema (an object)", field)
        return cls("json", json.dumps(schema), field)      # (key order kept: properties come out in it)

    def source(self) -> str:
        """The llguidance grammar (its JSON form) this spec compiles to."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        if self.kind == "json":
            return LLMatcher.grammar_from_json_schema(self.value, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":      # one lexeme: a rule of as many alternatives is an Earley row of that many items
            return LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(map(json.dumps, self.value)))
        try:
            lark = any_to_lark(self.value)       # GBNF (llama.cpp's) becomes Lark; Lark stays as it is
        except Exception as exc:                 # noqa: BLE001 - the converter's errors are the grammar's
            raise GrammarError(f"{self.field}: {exc}", self.field) from None
        return LLMatcher.grammar_from_lark(lark)

    @property
    def size(self) -> int:
        return len(self.value) if isinstance(self.value, str) else sum(map(len, self.value or ()))


def limits():
    """llguidance's limits for every grammar here: the per-step budgets above (the others are its defaults), and
    errors without the parser's state dump (they reach the client)."""
    from llguidance import LLParserLimits

    return LLParserLimits(step_lexer_fuel=STEP_LEXER_FUEL, step_max_items=STEP_MAX_ITEMS,
                          max_items_in_row=MAX_ITEMS_IN_ROW, verbose_errors=False)


def why_stuck(message: str) -> Optional[str]:
    """Why a grammar cannot go on when llguidance's error `message` says it is the grammar's own doing (one of the
    limits hit, or no token can continue it); None for any other failure (a token it refused, say)."""
    text = one_line(message)
    if "items; max is" in text:              # (llguidance's advice fits a right-recursive list, not this)
        text = text.split(";")[0] + f"; max is {MAX_ITEMS_IN_ROW}: a rule of many alternatives, or an ambiguous one"
    if any(marker in text.lower() for marker in LIMIT_MARKERS):
        return f"the grammar is too complex for the grammar engine ({text})"
    if text.startswith("NoExtension"):       # its stop reason when no token, not even EOS, is allowed
        return "no text the model can write continues the grammar here"
    return None


def one_line(message: str) -> str:
    """llguidance's message on one line (it points at the place over several)."""
    message = message.replace("<non-verbose/>", "")        # (where the state would be, with verbose errors)
    text = " ".join(line.strip() for line in message.splitlines() if line.strip() and set(line.strip()) != {"^"})
    return text[:500]


class _Vocabulary:
    """The served vocabulary in the shape llguidance's TokenizerWrapper reads: every token's bytes, specials
    marked with 0xFF, EOS and BOS, and a tokenize function (text without BOS)."""

    def __init__(self, tokenizer, vocab_size: int):
        specials = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]
        special = frozenset(specials)
        self.tokens = [b"\xff" + tokenizer.special_text(i).encode("utf-8") if i in special
                       else tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.tokens += [b""] * (vocab_size - len(self.tokens))       # the model's padding rows: never allowed
        self.special_token_ids = specials
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self._encode = tokenizer.encode
        self._verbatim = getattr(tokenizer, "encode_verbatim", None)     # a sentencepiece model's
        self.greedy = None      # llguidance's greedy tokenization over the vocabulary, once it is built

    def __call__(self, text: str) -> list:
        """Token ids of `text` as it continues other text (llguidance tokenizes what a grammar forces with it):
        without the space a sentencepiece model puts before a text's first word. A long text (a grammar forcing
        `a{100000}`: llguidance asks at every step) has its head tokenized so, the rest greedily: the mask takes
        the first tokens, and the rest need only spell the bytes."""
        if isinstance(text, bytes):
            raise TypeError("text, not bytes")      # (the wrapper asks once; it then passes str)
        if len(text) > CANONICAL_CHARS and self.greedy is not None:
            return self._canonical(text[:CANONICAL_CHARS]) + self.greedy(text[CANONICAL_CHARS:])
        return self._canonical(text)

    def _canonical(self, text: str) -> list:
        if self._verbatim is not None:
            return self._verbatim(text)
        ids = self._encode(text, add_bos=False)
        if ids and text and not text.startswith(" ") and self.tokens[ids[0]].startswith(b" "):
            # the model's dummy prefix: tokenize after a newline (a byte piece, which joins nothing) and drop it
            newline = self._encode("\n", add_bos=False)
            after = self._encode("\n" + text, add_bos=False)
            if after[:len(newline)] == newline:
                return after[len(newline):]
        return ids


class Grammars:
    """The served vocabulary as llguidance sees it (built on first use) and the grammars compiled against it
    (the last CACHE_SIZE, each kept as a fresh matcher to copy: n choices, or the same schema sent again, compile
    once). `compile` runs in a worker thread: a large schema can take a while, and llguidance releases the GIL."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids=None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids or tokenizer.eos_ids)      # the tokens that end a matched output
        self._lltokenizer = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict = OrderedDict()      # GrammarSpec -> LLMatcher (never advanced)

    @property
    def mask_words(self) -> int:
        """int32 words of a token bitmask."""
        return (self.vocab_size + 31) // 32

    def lltokenizer(self):
        with self._lock:
            if self._lltokenizer is None:
                from llguidance import LLTokenizer, TokenizerWrapper

                vocab = _Vocabulary(self.tokenizer, self.vocab_size)
                self._lltokenizer = LLTokenizer(TokenizerWrapper(vocab), n_vocab=self.vocab_size,
                                                eos_token=self.eos_ids)
                vocab.greedy = self._lltokenizer.greedy_tokenize
            return self._lltokenizer

    async def compile(self, spec: GrammarSpec):
        """A fresh matcher of `spec` (GrammarError: it does not compile, with llguidance's message)."""
        return await asyncio.to_thread(self.compile_now, spec)

    def compile_now(self, spec: GrammarSpec):
        from llguidance import LLMatcher

        if spec.size > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"{spec.field} is too large ({spec.size} characters; at most {MAX_GRAMMAR_CHARS})",
                               spec.field)
        with self._lock:
            cached = self._compiled.get(spec)
            if cached is not None:
                self._compiled.move_to_end(spec)
                return cached.deep_copy()
        tokenizer = self.lltokenizer()
        try:
            source = spec.source()
            is_error, messages = LLMatcher.validate_grammar_with_warnings(source, tokenizer, limits=limits())
            if is_error:
                raise _refusal(spec, messages[0])
            matcher = LLMatcher(tokenizer, source, log_level=0, limits=limits())
        except (ValueError, TypeError, RuntimeError) as exc:       # llguidance's refusals of a grammar
            if isinstance(exc, GrammarError):
                raise
            raise _refusal(spec, str(exc)) from None
        if matcher.is_error():
            raise _refusal(spec, matcher.get_error())
        self._first_step(matcher, spec)
        with self._lock:
            self._compiled[spec] = matcher
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher.deep_copy()

    def _first_step(self, matcher, spec: GrammarSpec) -> None:
        """The grammar's first mask, computed on `matcher` (its copies start with it), and one token taken on a copy
        of it: GrammarError if either fails, or the grammar forces more than MAX_FORCED_BYTES first."""
        allowed = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
        if matcher.is_error():
            raise _refusal(spec, matcher.get_error())
        forced = len(matcher.compute_ff_bytes())
        if forced > MAX_FORCED_BYTES:
            raise GrammarError(f"{spec.field}: the grammar forces {forced} bytes before the model chooses anything "
                               f"(at most {MAX_FORCED_BYTES})", spec.field)
        tokens = [t for t in np.flatnonzero(allowed[:self.vocab_size]).tolist() if t not in self.eos_ids]
        if tokens:
            probe = matcher.deep_copy()
            if not probe.consume_token(tokens[0]):
                raise _refusal(spec, probe.get_error())


def _refusal(spec: GrammarSpec, message: str) -> GrammarError:
    """The 400 of a grammar llguidance cannot use (saying so when it is too complex)."""
    text = why_stuck(message) or one_line(message) or "the grammar does not compile"
    return GrammarError(f"{spec.field}: {text}", spec.field)
