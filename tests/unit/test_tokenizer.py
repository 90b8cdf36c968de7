"""SentencePieceTokenizer and IncrementalDetokenizer: streamed deltas always add up to whole-sequence decoding.

Runs on the LLaMA-2 tokenizer (32k pieces, byte fallback; licence-restricted, so only where a developer keeps it
beside the repository, else those cases skip naming it), its generated stand-in (the default tiny model's tokenizer,
built in a temp dir), and stories260K's tok512 (which also removes extra whitespace, so sentencepiece's
start-of-text rule reaches further).
"""
import functools
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_serving.models.default_model import ensure_default_model
from llm_serving.tokenization import IncrementalDetokenizer, SentencePieceTokenizer
from tests.conftest import LLAMA2_TOKENIZER, TOK512, restricted_file

MIXED_TEXT = "Hello world! 你好，世界 🙂🚀 naïve café\n  two  spaces\tand a tab."

PROPERTY_SETTINGS = settings(max_examples=150, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module", params=["llama2", "standin"])
def llama2(request, llama_tokenizer_standin) -> SentencePieceTokenizer:
    """The LLaMA-2 tokenizer, then its generated stand-in; a test of what only the LLaMA-2 vocabulary does takes
    the first alone (ONLY_LLAMA2)."""
    path = restricted_file(LLAMA2_TOKENIZER) if request.param == "llama2" else llama_tokenizer_standin
    return SentencePieceTokenizer(path)


ONLY_LLAMA2 = pytest.mark.parametrize("llama2", ["llama2"], indirect=True)


@pytest.fixture(scope="module", params=["llama2", "tok512", "default"])
def tokenizer(request, tmp_path_factory) -> SentencePieceTokenizer:
    if request.param == "llama2":
        return SentencePieceTokenizer(restricted_file(LLAMA2_TOKENIZER))
    if request.param == "tok512":
        return SentencePieceTokenizer(TOK512)
    return SentencePieceTokenizer(ensure_default_model(tmp_path_factory.mktemp("cache")) / "tokenizer.model")


def stream(detok: IncrementalDetokenizer, ids) -> list[str]:
    """Every push delta, then the flush delta."""
    return [detok.push(t) for t in ids] + [detok.flush()]


@functools.lru_cache(maxsize=None)
def token_ids(tok: SentencePieceTokenizer) -> st.SearchStrategy[int]:
    """Token ids weighted towards the awkward ones: byte pieces, whitespace-only pieces, specials."""
    byte_ids = [i for i in range(tok.vocab_size) if tok.byte_value(i) is not None]
    utf8_lead_bytes = [i for i in byte_ids if tok.byte_value(i) >= 0xC0]
    space_ids = [i for i in range(tok.vocab_size) if set(tok.id_to_piece(i)) == {"▁"}]
    special_ids = [i for i in range(tok.vocab_size) if tok.is_special(i)]
    return st.one_of(st.integers(0, tok.vocab_size - 1), st.sampled_from(byte_ids),
                     st.sampled_from(utf8_lead_bytes), st.sampled_from(space_ids),
                     st.sampled_from(special_ids))


# ------------------------------------------------------------------------------ SentencePieceTokenizer


@ONLY_LLAMA2
def test_llama2_ids_and_special_tokens(llama2):
    assert (llama2.vocab_size, llama2.bos_id, llama2.eos_id) == (32000, 1, 2)
    assert llama2.pad_id == 0  # LLaMA has no pad piece
    assert [llama2.is_special(i) for i in (0, 1, 2, 3, 29871)] == [True, True, True, False, False]
    assert llama2.id_to_piece(2) == "</s>"
    hello = llama2.encode("Hello world")
    assert hello[0] == llama2.bos_id
    assert llama2.encode("Hello world", add_bos=False) == hello[1:]
    assert llama2.decode([1, *hello, 2, 0]) == "Hello world"
    assert llama2.decode([*hello, 2], skip_special=False) == "<s>Hello world</s>"


def test_llama2_round_trips_text_through_byte_fallback(llama2):
    ids = llama2.encode(MIXED_TEXT)
    assert llama2.decode(ids) == MIXED_TEXT
    emoji_bytes = [llama2.byte_value(i) for i in llama2.encode("🙂", add_bos=False)
                   if llama2.byte_value(i) is not None]
    assert bytes(emoji_bytes) == "🙂".encode()


def test_decode_continuation_keeps_the_leading_space(llama2):
    world = llama2.encode("world", add_bos=False)
    assert llama2.decode(world) == "world"
    assert llama2.decode_continuation(world) == " world"
    assert llama2.decode_continuation([]) == ""


def test_missing_model_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer model not found"):
        SentencePieceTokenizer(tmp_path / "nope.model")
    (tmp_path / "junk.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a usable sentencepiece tokenizer model"):
        SentencePieceTokenizer(tmp_path / "junk.model")
    from llm_serving.tokenization import load_tokenizer
    with pytest.raises(FileNotFoundError, match="directory without tokenizer.json"):
        load_tokenizer(str(tmp_path / "junk.model"), vocab_file=str(tmp_path))


# ------------------------------------------------------------------------------ IncrementalDetokenizer


@ONLY_LLAMA2
def test_words_keep_their_leading_space_mid_stream(llama2):
    ids = llama2.encode("Hello world, how are you")
    deltas = stream(IncrementalDetokenizer(llama2), ids)
    assert deltas == ["", "Hello", " world", ",", " how", " are", " you", ""]


def test_partial_utf8_characters_are_held_back(llama2):
    ids = llama2.encode("a🙂b", add_bos=False)  # ▁a, 4 byte pieces, b
    deltas = stream(IncrementalDetokenizer(llama2), ids)
    assert deltas == ["a", "", "", "", "🙂", "b", ""]


def test_flush_turns_unfinished_bytes_into_replacement_characters(llama2):
    truncated = llama2.encode("a🙂", add_bos=False)[:-1]  # the emoji's last byte is missing
    detok = IncrementalDetokenizer(llama2)
    assert "".join(detok.push(t) for t in truncated) == "a"
    assert detok.flush() == llama2.decode(truncated)[1:] == "\ufffd\ufffd\ufffd"
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.push(truncated[0])


def test_text_accumulates_deltas_and_numpy_ids_are_accepted(llama2):
    detok = IncrementalDetokenizer(llama2)
    for token_id in np.array(llama2.encode(MIXED_TEXT), dtype=np.int32):
        detok.push(token_id)
    detok.flush()
    assert detok.text == MIXED_TEXT


@ONLY_LLAMA2
def test_generated_word_after_prompt_keeps_its_space(llama2):
    prompt = llama2.encode("Once upon a")
    detok = IncrementalDetokenizer(llama2, prompt_ids=prompt)
    assert stream(detok, llama2.encode("time there", add_bos=False)) == [" time", " there", ""]


def test_special_tokens_shown_when_not_skipped(llama2):
    ids = [*llama2.encode("Hi"), llama2.eos_id, *llama2.encode("there", add_bos=False)]
    shown = IncrementalDetokenizer(llama2, skip_special=False)
    assert "".join(stream(shown, ids)) == llama2.decode(ids, skip_special=False) == "<s>Hi</s>there"
    hidden = IncrementalDetokenizer(llama2)
    assert "".join(stream(hidden, ids)) == llama2.decode(ids) == "Hi there"


def test_work_per_token_is_bounded(llama2):
    """Each push decodes a window of a few tokens, never the whole output so far."""
    window_sizes = []

    class RecordingTokenizer:
        def __getattr__(self, name):
            return getattr(llama2, name)

        def decode(self, ids, skip_special=True):
            window_sizes.append(len(ids))
            return llama2.decode(ids, skip_special)

        def decode_continuation(self, ids):
            window_sizes.append(len(ids))
            return llama2.decode_continuation(ids)

    ids = llama2.encode(MIXED_TEXT * 40)
    detok = IncrementalDetokenizer(RecordingTokenizer())
    assert "".join(stream(detok, ids)) == llama2.decode(ids)
    assert len(ids) > 1000 and max(window_sizes) <= 5


@PROPERTY_SETTINGS
@given(data=st.data(), skip_special=st.booleans())
def test_stream_equals_decode_for_any_ids(tokenizer, data, skip_special):
    ids = data.draw(st.lists(token_ids(tokenizer), max_size=40))
    deltas = stream(IncrementalDetokenizer(tokenizer, skip_special=skip_special), ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special=skip_special)


@PROPERTY_SETTINGS
@given(data=st.data(), skip_special=st.booleans())
def test_stream_after_prompt_equals_decode_suffix(tokenizer, data, skip_special):
    prompt = tokenizer.encode(data.draw(st.text(max_size=20)), add_bos=data.draw(st.booleans()))
    ids = data.draw(st.lists(token_ids(tokenizer), max_size=30))
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt, skip_special=skip_special)
    full = tokenizer.decode(prompt + ids, skip_special=skip_special)
    prompt_text = tokenizer.decode(prompt, skip_special=skip_special)
    assert "".join(stream(detok, ids)) == full[len(prompt_text):]


@PROPERTY_SETTINGS
@given(text=st.text(max_size=40))
def test_streamed_text_never_contains_half_characters(tokenizer, text):
    ids = tokenizer.encode(text)
    deltas = stream(IncrementalDetokenizer(tokenizer), ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in delta for delta in deltas)


def test_llama2_chat_format(llama2):
    sp = llama2._sp
    B, E = llama2.bos_id, llama2.eos_id
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "<s>Why?</s>"}]
    assert llama2.encode_chat(msgs) == (
        [B] + sp.encode("[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello. ") + [E]
        + [B] + sp.encode("[INST] <s>Why?</s> [/INST]"))              # text never becomes a BOS/EOS id
    assert llama2.encode_chat(msgs).count(B) == 2
    # a last assistant message is a prefix the reply continues: no EOS after it
    prefix = llama2.encode_chat([{"role": "user", "content": "Name a fruit"},
                                 {"role": "assistant", "content": "An apple"}])
    assert prefix == [B] + sp.encode("[INST] Name a fruit [/INST] An apple")
    for bad in ([], [{"role": "assistant", "content": "x"}], [{"role": "user", "content": "a"}] * 2,
                [{"role": "system", "content": "s"}]):
        with pytest.raises(ValueError):
            llama2.encode_chat(bad)


# A LLaMA-2 chat template in the Jinja convention of HF's tokenizer_config.json (written for this test).
LLAMA2_JINJA = (
    "{% if messages[0]['role'] == 'system' %}{% set sys = '<<SYS>>\\n' + messages[0]['content'].strip()"
    " + '\\n<</SYS>>\\n\\n' %}{% set msgs = messages[1:] %}{% else %}{% set sys = '' %}{% set msgs = messages %}"
    "{% endif %}"
    "{% for m in msgs %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate') }}{% endif %}"
    "{% if m['role'] == 'user' %}{{ bos_token }}[INST] {{ (sys if loop.first else '') + m['content'].strip() }} [/INST]"
    "{% elif loop.last %} {{ m['content'].strip() }}"
    "{% else %} {{ m['content'].strip() }} {{ eos_token }}{% endif %}"
    "{% endfor %}")


def test_jinja_chat_template_matches_the_builtin_llama2_format(llama2, tmp_path):
    from llm_serving.tokenization import ChatTemplate, ChatTemplateError, load_chat_template

    jinja = ChatTemplate(llama2, LLAMA2_JINJA, source="test")
    conversations = [
        [{"role": "user", "content": "Hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Why?"}],
        [{"role": "user", "content": "Name a fruit"}, {"role": "assistant", "content": "An apple"}]]
    for messages in conversations:
        assert jinja.encode(messages) == llama2.encode_chat(messages)
    with pytest.raises(ChatTemplateError, match="alternate"):
        jinja.encode([{"role": "assistant", "content": "x"}])
    # where the template comes from: the model directory, a file, the built-in name; bad ones are named
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": LLAMA2_JINJA}))
    assert load_chat_template(None, str(tmp_path), llama2).source.endswith("tokenizer_config.json")
    assert load_chat_template(None, str(tmp_path / "nothing"), llama2).source == "llama2"
    (tmp_path / "t.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_chat_template(str(tmp_path / "t.jinja"), "", llama2).encode([{"role": "user", "content": "ab"}]) \
        == [llama2.bos_id] + llama2.encode("ab", add_bos=False)
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template("missing.jinja", "", llama2)
    with pytest.raises(ValueError, match="not valid Jinja"):
        load_chat_template("{% if %}", "", llama2)
