"""The playground (GET /) and the dashboard (GET /dashboard) in a real headless Chromium driven by Selenium, against
the stories260K server: the pages load with no console error, a chat reply streams into the page, stop aborts the
request (the server's running count returns to zero), completion mode shows top log-probabilities, the model's
text never becomes HTML, and the dashboard's numbers move under load; against SmolLM2 (8,192 tokens), a
conversation past 512 tokens, and one turn refused without ending it. Skipped where Chromium, its driver or
selenium is missing (.ci/run installs them)."""
from __future__ import annotations

import shutil
import threading
import time

import pytest

from tests.integration.server_harness import http

selenium = pytest.importorskip("selenium", reason="selenium is not installed (pip install selenium)")
CHROMIUM, DRIVER = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                                reason="no Chromium or chromedriver on this machine (Debian: apt-get install "
                                       "chromium chromium-driver; .ci/run does)")


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,900", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver, condition, timeout=30, what="condition"):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: condition(d), message=what)


def _errors(driver) -> list:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _open_playground(driver, url):
    from selenium.webdriver.common.by import By
    driver.get(url + "/")
    _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"), what="the model list")
    driver.find_element(By.ID, "clear").click()


def _set(driver, element_id, value):
    from selenium.webdriver.common.by import By
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(str(value))


def test_a_chat_reply_streams_into_the_page(browser, stories_server):
    from selenium.webdriver.common.by import By
    _open_playground(browser, stories_server.url)
    assert [o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#model option")] == ["hf"]
    _set(browser, "temperature", 0)
    _set(browser, "max_tokens", 24)
    _set(browser, "input", "Tell me a story about a cat.")
    browser.find_element(By.ID, "send").click()
    stats = _wait(browser, lambda d: [s.text for s in d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")
                                      if "tokens" in s.text], what="the reply's statistics")[0]
    reply = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .body").text
    n = int(stats.split()[0])
    assert 1 <= n <= 24 and reply.strip() and "TTFT" in stats and "tok/s" in stats, stats
    assert _errors(browser) == []


def test_stop_aborts_the_request_and_the_server_frees_it(browser, stories_server):
    from selenium.webdriver.common.by import By
    _open_playground(browser, stories_server.url)
    _set(browser, "temperature", 0.8)
    _set(browser, "max_tokens", 230)
    _set(browser, "stop", "")
    _set(browser, "input", "Once upon a time")
    browser.find_element(By.ID, "completion").click()            # plain completion: no end-of-turn to stop it early
    browser.find_element(By.ID, "send").click()
    _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .tok"), what="the first token")
    browser.find_element(By.ID, "stop-button").click()
    stats = _wait(browser, lambda d: [s.text for s in d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")
                                      if s.text], what="the reply's statistics")[0]
    assert "stopped" in stats and int(stats.split()[0]) < 230, stats
    deadline = time.monotonic() + 10
    while http("GET", stories_server.url + "/stats")[1]["num_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert http("GET", stories_server.url + "/stats")[1]["num_running"] == 0
    browser.find_element(By.ID, "completion").click()
    assert _errors(browser) == []


def test_completion_mode_shows_top_logprobs_on_hover(browser, stories_server):
    from selenium.webdriver.common.by import By
    _open_playground(browser, stories_server.url)
    browser.find_element(By.ID, "completion").click()
    _set(browser, "temperature", 0)
    _set(browser, "max_tokens", 8)
    _set(browser, "input", "Once upon a time")
    browser.find_element(By.ID, "send").click()
    _wait(browser, lambda d: any("tokens" in s.text for s in d.find_elements(By.CSS_SELECTOR, ".stats")))
    tokens = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .tok")
    assert len(tokens) == 8
    title = tokens[0].get_attribute("title")
    lines = title.splitlines()
    assert len(lines) == 5 and all(0 < float(line.split()[-1]) <= 1 for line in lines), title
    status, want = http("POST", stories_server.url + "/v1/completions", {
        "model": "hf", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
    body = browser.find_element(By.CSS_SELECTOR, ".msg.assistant .body").get_attribute("textContent")
    assert body == want["choices"][0]["text"]
    browser.find_element(By.ID, "completion").click()


def test_the_models_text_never_becomes_html(browser, stories_server):
    browser.get(stories_server.url + "/")
    found = browser.execute_script("""
        const d = document.createElement('div');
        renderMarkdown(d, arguments[0]);
        return [d.querySelectorAll('img, script, a').length, d.querySelector('pre code').textContent,
                d.querySelector('strong').textContent, d.querySelectorAll('p code').length, d.textContent,
                [...d.querySelectorAll('ul li')].map(li => li.textContent), d.querySelectorAll('ol li').length,
                d.querySelector('h3') && d.querySelector('h3').textContent];""",
        "# Title <b>\n<img src=x onerror=alert(1)> **bold** and `x<y`\n\n```python\nif a < b:\n    print('<b>')\n```\n"
        "- one <i>\n- two\n1. first\n2. second\n<script>1</script>")
    assert found[0] == 0
    assert found[1] == "if a < b:\n    print('<b>')\n" and found[2] == "bold" and found[3] == 1
    assert "<img src=x onerror=alert(1)>" in found[4] and "<script>1</script>" in found[4]
    assert found[5] == ["one <i>", "two"] and found[6] == 2 and found[7] == "Title <b>"


def test_the_dashboard_moves_under_load(browser, stories_server):
    from selenium.webdriver.common.by import By
    browser.get(stories_server.url + "/dashboard")
    _wait(browser, lambda d: d.find_element(By.ID, "health").text == "healthy", what="the health line")
    assert browser.find_element(By.ID, "v-agents").text == "1"

    def load():
        for _ in range(4):
            http("POST", stories_server.url + "/generate", {"inputs": "Once upon a time",
                                                           "parameters": {"max_new_tokens": 120, "ignore_eos": True}})
    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        _wait(browser, lambda d: float(d.find_element(By.ID, "v-tok_s").text.replace("-", "0") or 0) > 0,
              what="output tokens/s above zero")
        _wait(browser, lambda d: d.find_element(By.ID, "v-ttft_p50").text != "-", what="a TTFT percentile")
    finally:
        for t in threads:
            t.join(120)
    stats = http("GET", stories_server.url + "/stats")[1]
    _wait(browser, lambda d: d.find_element(By.ID, "v-kv_cached").text == str(stats["num_cached_blocks"]),
          what="the prefix cache's blocks")
    assert stats["num_cached_blocks"] > 0                   # the load's shared prompt is cached
    assert _errors(browser) == []


def _turn(driver, text, max_tokens, replies):
    """Send one chat turn; the new reply's (statistics line, error text) once it has ended."""
    from selenium.webdriver.common.by import By
    _set(driver, "max_tokens", max_tokens)
    driver.find_element(By.ID, "input").send_keys(text)
    driver.find_element(By.ID, "send").click()
    _wait(driver, lambda d: len([s for s in d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats") if s.text])
          == replies, timeout=120, what=f"reply {replies}")
    last = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
    bad = last.find_elements(By.CSS_SELECTOR, ".bad")
    return last.find_element(By.CSS_SELECTOR, ".stats").text, bad[0].text if bad else None


def test_a_conversation_goes_past_512_tokens_and_survives_a_refused_turn(browser, smollm2_server):
    """SmolLM2 at its whole context (8,192 tokens): turns whose conversation passes 512 tokens are answered, the
    page shows the context used; a turn asking for more tokens than the context has left is refused with the
    server's reason, and the next turn goes on from the conversation before it."""
    _open_playground(browser, smollm2_server.url)
    _set(browser, "temperature", 0)
    facts = " ".join(f"Fact {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7} marbles." for i in range(40))
    used = []
    for n, text in enumerate([facts + " Which box holds 21 marbles?", facts.replace("marbles", "pebbles") +
                              " And which holds 14 pebbles?"], start=1):
        stats, error = _turn(browser, text, 24, n)
        assert error is None and f"/ {8192}" in stats, stats
        used.append(int(stats.split("context ")[1].split()[0]))
    assert used[1] > 512 and used[1] > used[0] + 400, used
    assert _errors(browser) == []
    stats, error = _turn(browser, "Tell me everything.", 8000, 3)
    assert error is not None and "8192-token" in error, error
    stats, error = _turn(browser, "Thanks!", 8, 4)
    assert error is None, error
    assert int(stats.split("context ")[1].split()[0]) > used[1], stats     # the refused turn is not in it


def test_with_an_api_key_the_page_asks_for_it_once(browser, stories_dir, tmp_path):
    """The pages load without the key; the first API call that gets a 401 asks for it (window.prompt), and it is
    kept for the tab (sessionStorage), so the model list and a reply come through."""
    import uuid

    from selenium.webdriver.common.by import By

    from tests.integration.server_harness import REPO, serving

    key = "ui-" + uuid.uuid4().hex
    args = ["--config", str(REPO / "configs" / "stories260K.yaml"),
            "--model", str(stories_dir / "hf")]
    with serving(args, tmp_path / "server.log", env={"LLM_SERVING_API_KEY": key}) as server:
        assert http("GET", server.url + "/")[0] == 200 and http("GET", server.url + "/static/playground.js")[0] == 200
        assert http("GET", server.url + "/v1/models")[0] == 401
        browser.get(server.url + "/")
        alert = _wait(browser, lambda d: _alert(d), what="the API key prompt")
        alert.send_keys(key)
        alert.accept()
        _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"), what="the model list")
        _set(browser, "max_tokens", 6)
        _set(browser, "input", "Hello")
        browser.find_element(By.ID, "send").click()
        _wait(browser, lambda d: any("tokens" in s.text for s in d.find_elements(By.CSS_SELECTOR, ".stats")))
        assert browser.execute_script("return sessionStorage.getItem('llm-serving-api-key')") == key
        browser.execute_script("sessionStorage.clear()")


def _alert(driver):
    from selenium.common.exceptions import NoAlertPresentException
    try:
        alert = driver.switch_to.alert
        alert.text                              # noqa: B018 - raises when there is none
        return alert
    except NoAlertPresentException:
        return None


def test_json_output_and_tool_calls_in_the_playground(browser, smollm2_server):
    """SmolLM2: "JSON matching a schema" gives a reply that parses and validates; with a tool and tool choice
    required the reply shows the call, and the next message goes back as the tool's result, which the model
    answers from; a schema that is not JSON is reported in the page and nothing is sent."""
    import json

    import jsonschema
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    _errors(browser)                     # (what earlier tests left in the console: a refused turn's 400)
    _open_playground(browser, smollm2_server.url)
    _set(browser, "temperature", 0)
    schema = {"type": "object", "required": ["city", "country"], "additionalProperties": False,
              "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}}}
    Select(browser.find_element(By.ID, "format")).select_by_value("json_schema")
    assert browser.find_element(By.ID, "schema-box").is_displayed()
    _set(browser, "schema", "{not json")
    _set(browser, "input", "What is the capital of France?")
    browser.find_element(By.ID, "send").click()
    bad = _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant .bad"), what="the schema error")
    assert "JSON schema is not valid JSON" in bad[0].text
    _set(browser, "schema", json.dumps(schema))
    stats, error = _turn(browser, "What is the capital of France? Answer as JSON.", 60, 1)   # (the refused one: none)
    assert error is None and stats.endswith("stop"), stats
    reply = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .body")[-1].text
    jsonschema.validate(json.loads(reply), schema)

    browser.find_element(By.ID, "clear").click()
    Select(browser.find_element(By.ID, "format")).select_by_value("text")
    weather = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 30}}}}}]
    _set(browser, "tools", json.dumps(weather))
    Select(browser.find_element(By.ID, "tool_choice")).select_by_value("required")
    stats, error = _turn(browser, "What is the weather in Paris?", 60, 1)
    assert error is None and stats.endswith("tool_calls"), stats
    call = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .tool-call")[-1].text
    assert call.startswith("get_weather(") and json.loads(call[len("get_weather("):-1])["city"]
    assert browser.find_element(By.ID, "tool-result").is_selected()
    Select(browser.find_element(By.ID, "tool_choice")).select_by_value("auto")
    stats, error = _turn(browser, "It is 41 degrees celsius and sunny.", 40, 2)
    assert error is None and "41" in browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .body")[-1].text
    assert _errors(browser) == []


def test_an_image_attached_in_the_playground_reaches_the_model(browser, tmp_path_factory):
    """A vision-language model (the tiny random Gemma 3 with a tower): the attach control shows for it (and hides
    in completion mode), an image attached by the file input shows in the user's turn, and the reply's context counts
    the image's tokens (its 4 placeholders, their marks and newlines, as transformers' processor makes them)."""
    import io

    import numpy as np
    from PIL import Image
    from selenium.webdriver.common.by import By

    from tests.families import make_gemma3_vl, vision_prompt_ids
    from tests.integration.server_harness import serving

    model = tmp_path_factory.mktemp("gemma3_vl")
    make_gemma3_vl(model, seed=6)
    picture = model / "picture.png"
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(buffer, "PNG")
    picture.write_bytes(buffer.getvalue())
    args = ["--model", str(model), "--set", "model_config.max_generate_length=128"]
    with serving(args, tmp_path_factory.mktemp("log") / "server.log") as server:
        _open_playground(browser, server.url)
        box = _wait(browser, lambda d: d.find_element(By.ID, "image-box").is_displayed() and
                    d.find_element(By.ID, "image-box"), what="the attach control")
        browser.find_element(By.ID, "completion").click()
        assert not box.is_displayed()
        browser.find_element(By.ID, "completion").click()
        _set(browser, "temperature", 0)
        _set(browser, "max_tokens", 4)

        def turn(text, image):
            if image:
                browser.find_element(By.ID, "image").send_keys(str(picture))
                _wait(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#attached img"), what="the thumbnail")
            n = len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats"))
            _set(browser, "input", text)
            browser.find_element(By.ID, "send").click()
            stats = _wait(browser, lambda d: [s.text for s in d.find_elements(By.CSS_SELECTOR, ".msg.assistant .stats")
                                              if "context" in s.text][n:], what="the reply's statistics")[0]
            return int(stats.split("context ")[1].split()[0])

        with_image = turn("What is this?", True)
        assert browser.find_elements(By.CSS_SELECTOR, ".msg.user .thumbs img")
        assert not browser.find_elements(By.CSS_SELECTOR, "#attached img")       # (sent: the next turn has none)
        browser.find_element(By.ID, "clear").click()
        without = turn("What is this?", False)
        # (the prompts as transformers' processor makes them, tokenized apart from the server)
        want = (len(vision_prompt_ids(model, [("user", "<start_of_image>What is this?")]))
                - len(vision_prompt_ids(model, [("user", "What is this?")])))
        assert want > 4 and with_image - without == want, (with_image, without, want)
        assert _errors(browser) == []
