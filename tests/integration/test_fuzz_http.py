"""Property-based fuzzing of the HTTP API on a live server: hundreds of generated bodies, headers and
paths; none may get a 5xx or break the server, and every 4xx is a JSON error naming a problem."""
import json
import string
import urllib.error
import urllib.request

from hypothesis import HealthCheck, given, settings, strategies as st

from llm_serving.server.api.tgi import TGIParameters
from tests.integration.server_harness import http, parse_sse
from tests.integration.test_serving import generate

KNOWN_PARAMETERS = set(TGIParameters.model_fields)

JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                         st.text(max_size=20))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
# parameter values near the edges of what is valid, as well as anything at all
EDGES = st.one_of(st.integers(-2, 40), st.sampled_from([0, 255, 256, 2**31, 2**63, 10**30, 0.0, 0.5, 1.0, 1.5, 100.0,
                                                       -0.0, 1e308, "4", "", [], {}, True, False, None]),
                  st.floats(-2, 3))
PARAMETERS = st.dictionaries(st.sampled_from(sorted(KNOWN_PARAMETERS) + ["unknown"]),
                             st.one_of(EDGES, EDGES, JSON_VALUES), max_size=4)
PROMPTS = st.one_of(st.text(max_size=60), st.sampled_from(["Once upon a time", " ", "\x00", "\ud7ff" * 3]),
                    JSON_VALUES)
# bodies a client might plausibly send (often valid), and anything at all
NEAR_VALID = st.fixed_dictionaries({"inputs": st.text(min_size=1, max_size=40)},
                                   optional={"parameters": PARAMETERS, "stream": st.booleans()})
BODIES = st.fixed_dictionaries({}, optional={"inputs": PROMPTS, "parameters": st.one_of(PARAMETERS, JSON_VALUES),
                                             "stream": st.one_of(st.booleans(), JSON_VALUES),
                                             "extra": JSON_VALUES})
RAW = st.one_of(NEAR_VALID.map(lambda b: json.dumps(b).encode()),
                BODIES.map(lambda b: json.dumps(b).encode()),          # NaN/Infinity included
                BODIES.map(lambda b: json.dumps(b).encode()[:-1]),     # truncated
                JSON_VALUES.map(lambda v: json.dumps(v).encode()),     # not an object
                st.binary(max_size=80))                                # not JSON, not UTF-8
SERVED = ["/generate", "/generate_stream", "/models/hf/generate", "/models/hf/generate_stream"]
PATHS = st.sampled_from(SERVED * 3 + ["/models/other/generate", "/models/%2e%2e/generate_stream", "/models//generate"])
HEADERS = st.dictionaries(st.sampled_from(["X-Request-Id", "Content-Type"]),
                          st.text(string.printable.strip(), max_size=20), max_size=2)


def _post(url: str, raw: bytes, headers: dict):
    req = urllib.request.Request(url, data=raw, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.headers.get("Content-Type", ""), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type", ""), err.read()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(path=PATHS, raw=RAW, headers=HEADERS)
def _fuzz(url, path, raw, headers):
    status, ctype, body = _post(url + path, raw, headers)
    assert status < 500, (status, path, raw, body)
    if status >= 400:
        error = json.loads(body)
        assert isinstance(error["error"], str) and error["error"] and error["error_type"], error
    elif ctype.startswith("text/event-stream"):
        final = parse_sse(body.decode())[-1]
        assert final["details"]["finish_reason"] in ("length", "stop"), final
    else:
        assert json.loads(body)["details"]["finish_reason"] in ("length", "stop")


def test_fuzzed_requests_never_get_a_5xx_and_the_server_keeps_serving(stories_server):
    _fuzz(stories_server.url)
    status, body = generate(stories_server.url, "Once upon a time", max_new_tokens=8)
    assert status == 200 and body["generated_text"] == ", there was a little girl"
    stats = http("GET", stories_server.url + "/stats")[1]
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]


def test_oversized_body_gets_413_naming_the_limit(stories_server):
    status, body = http("POST", stories_server.url + "/generate", raw=b'{"inputs": "' + b"a" * (33 << 20) + b'"}')
    assert status == 413 and "too large" in body["error"].lower()
