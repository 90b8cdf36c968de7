"""Chat templates (tokenization/chat_template.py) through every kind of tokenizer: the model's own template is
found, rendered with the Jinja features HuggingFace templates use, and its special-token strings become their ids.
The LLaMA-2 format itself (built-in and as Jinja) is tested in test_tokenizer.py. No MindSpore.
"""
import json
import shutil
from datetime import datetime

import pytest

from llm_serving.tokenization import ChatTemplateError, check_variables, load_chat_template, load_tokenizer
from tests.unit.test_tokenizer_hf import train_byte_level

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_SERVING_CACHE", str(tmp_path / "cache"))


def test_chatml_template_of_a_gguf_gives_special_ids(tmp_path):
    from tests.unit.test_tokenizer_gguf import gguf_of_tokenizer_json

    folder = train_byte_level(tmp_path / "hf", "digits", CHATML_SPECIALS, config={"eos_token": "<|im_end|>"})
    path = gguf_of_tokenizer_json(folder, tmp_path / "smol.gguf", "smollm", chat_template=SMOLLM2_TEMPLATE)
    tok = load_tokenizer(str(path))
    template = load_chat_template(None, str(tmp_path), tok)
    assert template.source == str(path)                                   # the GGUF's own template
    ids = template.encode(USER)
    expected = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
                "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(ids, skip_special=False) == expected
    assert [i for i in ids if tok.is_special(i)] == [1, 2, 1, 2, 1]       # each marker is one special id
    tail = tok.encode("assistant\n", add_bos=False)                       # text between markers: plain encode
    assert ids[:1] == [1] and ids[-len(tail) - 1:] == [1, *tail]
    # a conversation that ends with the assistant's words is continued: no generation prompt
    ids = template.encode([*USER, {"role": "assistant", "content": "4"}])
    assert tok.decode(ids, skip_special=False).endswith("<|im_start|>assistant\n4<|im_end|>\n")


LLAMA3_LIKE = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}{% if m.role == 'system' %}{% set ns.system = m.content %}{% endif %}{% endfor %}"
    "<|start_header_id|>system<|end_header_id|>\n\nYear: {{ strftime_now('%Y') }}. {{ ns.system }}<|eot_id|>"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
    "<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}"
    "{% if loop.last %} {{ {'n': loop.length, 'word': 'café'} | tojson }}{% endif %}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def test_hf_template_features_and_one_bos(tmp_path):
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    folder = train_byte_level(tmp_path, "llama3", specials, config={
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": True,
        "chat_template": LLAMA3_LIKE})
    tok = load_tokenizer(str(folder))
    template = load_chat_template(None, str(folder), tok)
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    text = template.render(messages)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                    f"Year: {datetime.now().year}. Be brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2? {\"n\": 2, \"word\": \"café\"}<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = template.encode(messages)
    assert tok.add_bos and ids[0] == 0 and ids.count(0) == 1              # the template's BOS, no second one
    assert ids.count(2) == 3 and ids.count(4) == 2 and tok.decode(ids, skip_special=False) == text
    with pytest.raises(ChatTemplateError, match="no tools here"):
        template.encode([*USER, {"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="empty"):
        template.encode([])


def test_builtin_format_needs_a_bos(tmp_path):
    tok = load_tokenizer(str(train_byte_level(tmp_path, "gpt2", ["<|im_end|>"], config={"eos_token": "<|im_end|>"})))
    assert tok.bos_id is None and tok.chat_template is None
    template = load_chat_template(None, str(tmp_path), tok)
    assert template.source == "llama2"
    with pytest.raises(ChatTemplateError, match="no BOS"):
        template.encode(USER)


def test_sentencepiece_model_takes_the_default_named_template_beside_it(llama_tokenizer_standin, tmp_path):
    shutil.copy(llama_tokenizer_standin, tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "rag", "template": "unused"},
        {"name": "default", "template": "{{ bos_token }}[INST] {{ messages[0].content }} [/INST]{{ eos_token }}"}]}))
    tok = load_tokenizer(str(tmp_path))
    template = load_chat_template(None, str(tmp_path), tok)
    assert template.source == str(tmp_path / "tokenizer.model")
    assert template.encode(USER) == [1, *tok.encode("[INST] What is 2+2? [/INST]", add_bos=False), 2]
    assert load_chat_template("llama2", str(tmp_path), tok).encode(USER) == tok.encode_chat(USER)


# Qwen3's thinking switch, in a template of our own: thinking on (the default) leaves the generation prompt open,
# the model writes <think> itself; `enable_thinking` false appends an empty reasoning block so it answers at once.
# Earlier assistant turns are shown without their reasoning.
QWEN3_LIKE = (
    "{% for m in messages %}"
    "{% set content = m.content.split('</think>')[-1].lstrip('\\n') if m.role == 'assistant' else m.content %}"
    "<|im_start|>{{ m.role }}\n{{ content }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}")


@pytest.fixture
def qwen3_like(tmp_path):
    folder = train_byte_level(tmp_path, "qwen2", CHATML_SPECIALS, config={"eos_token": "<|im_end|>",
                                                                          "chat_template": QWEN3_LIKE})
    tok = load_tokenizer(str(folder))
    return tok, load_chat_template(None, str(folder), tok)


def test_request_variables_reach_the_template(qwen3_like):
    tok, template = qwen3_like
    history = [*USER, {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\n4"},
               {"role": "user", "content": "And 3+3?"}]
    turns = ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
             "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n")
    assert template.reasons
    assert template.render(history) == turns                                   # thinking on by default
    assert template.render(history, variables={"enable_thinking": True}) == turns
    assert template.render(history, variables={"enable_thinking": False}) == turns + "<think>\n\n</think>\n\n"
    on, off = template.encode(history), template.encode(history, variables={"enable_thinking": False})
    assert off[:len(on)] == on and tok.decode(off[len(on):], skip_special=False) == "<think>\n\n</think>\n\n"
    # a variable the template never reads changes nothing (a client may send Qwen3's switch to any model)
    assert template.encode(history, variables={"reasoning_effort": "low"}) == on


def test_variables_the_render_sets_itself_are_refused_by_name(qwen3_like):
    _, template = qwen3_like
    for key in ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception",
                "strftime_now", "namespace", "range"):
        with pytest.raises(ChatTemplateError, match=rf"chat_template_kwargs\.{key}: the chat template's render sets '{key}' itself"):
            template.encode(USER, variables={"enable_thinking": False, key: []})
        with pytest.raises(ChatTemplateError, match=rf"chat_template_kwargs\.{key}\b"):
            check_variables({key: True})
    for value in (float("nan"), [1.0, float("inf")], {"deep": {"x": -float("inf")}}):
        with pytest.raises(ChatTemplateError, match=r"chat_template_kwargs\.v must be a JSON value"):
            check_variables({"v": value})
    nested = {"enable_thinking": False, "v": {"a": [1, 2.5, None, "x", {"b": True}]}}
    assert check_variables(nested) is nested and check_variables(None) == {}


def test_the_builtin_format_ignores_variables(llama_tokenizer_standin, tmp_path):
    shutil.copy(llama_tokenizer_standin, tmp_path / "tokenizer.model")
    tok = load_tokenizer(str(tmp_path))
    template = load_chat_template("llama2", str(tmp_path), tok)
    assert template.encode(USER, variables={"enable_thinking": False}) == tok.encode_chat(USER)
    with pytest.raises(ChatTemplateError, match="chat_template_kwargs.messages"):
        template.encode(USER, variables={"messages": USER})
