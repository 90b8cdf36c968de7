"""Chat templates (tokenization/chat_template.py) through every kind of tokenizer: the model's own template is
found, rendered with the Jinja features HuggingFace templates use, and its special-token strings become their ids.
The LLaMA-2 format itself (built-in and as Jinja) is tested in test_tokenizer.py. No MindSpore.
"""
import json
import shutil
from datetime import datetime

import pytest

from llm_serving.tokenization import ChatTemplateError, load_chat_template, load_tokenizer
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
