"""A thinking model's reply (vLLM's reasoning_content): the stories260K model served with a chat template whose
generation prompt opens <think>, its reply forced by a regular expression to reason, close the tag and answer;
the reasoning and the answer come apart, whole and streamed. A grammar that does not spell the reasoning out (a
JSON schema) constrains the answer: the whole reply is content."""
from __future__ import annotations

import json

from tests.integration.server_harness import REPO, http, serving

THINKING = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: <think>\n{% endif %}")
REGEX = r"[a-z]{2,8}( [a-z]{2,8}){1,3}\n</think>\n\n[a-z]{2,8}( [a-z]{2,8}){0,2}\."


def test_reasoning_and_answer_come_apart_whole_and_streamed(stories_dir, tmp_path):
    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING)
    args = ["--config", str(REPO / "configs" / "stories260K.yaml"), "--model", str(stories_dir / "hf"),
            "--set", f"tokenizer.chat_template={template}"]
    with serving(args, tmp_path / "server.log") as server:
        body = {"model": "hf", "temperature": 0, "max_tokens": 60, "guided_regex": REGEX,
                "messages": [{"role": "user", "content": "Once upon a time"}]}
        status, whole = http("POST", server.url + "/v1/chat/completions", body)
        assert status == 200, whole
        message = whole["choices"][0]["message"]
        thought, answer = message["reasoning_content"], message["content"]
        assert thought and "</think>" not in thought and "\n" not in thought.strip()
        assert answer.endswith(".") and "think" not in answer and not answer.startswith("\n"), message
        status, text = http("POST", server.url + "/v1/chat/completions", {**body, "stream": True})
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in text.splitlines()
                  if line.startswith("data: {") and json.loads(line[6:])["choices"]]
        streamed_thought = "".join(d.get("reasoning_content") or "" for d in deltas)
        streamed_answer = "".join(d.get("content") or "" for d in deltas)
        assert streamed_thought.strip() == thought and streamed_answer == answer
        # the reasoning comes first: no content delta before the last reasoning delta
        kinds = ["r" if d.get("reasoning_content") else "c" for d in deltas if d.get("reasoning_content") or d.get("content")]
        assert kinds == sorted(kinds, reverse=True), kinds
        status, body = http("POST", server.url + "/v1/chat/completions", {
            **body, "guided_regex": None, "max_tokens": 20, "structured_outputs": {"choice": ["yes", "no"]}})
        assert status == 200 and body["choices"][0]["message"]["content"] in ("yes", "no"), body
        assert "reasoning_content" not in body["choices"][0]["message"]
