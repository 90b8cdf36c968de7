"""model_config.batch_invariant through the real server, as it starts by default ('auto': on, where the CPU layer
kernel serves every step): one greedy request's tokens and log-probabilities are the same to the bit alone, among
40 others at once, and on another server whose KV cache is too small for the load
(preemption and recompute), whose prompts go in 16-token chunks and whose n-gram speculation is off; there every
one of the 41 requests gets the bits it got on the first server. Seeded sampling likewise, alone or among
others. The kernel
side (every step kind, cache type and weight type) is tests/unit/test_batch_invariance.py's."""
import asyncio

import aiohttp

from tests.integration.server_harness import http, leftovers, parse_sse
from tests.integration.test_scheduling import serve, workload

PROBE = "Once upon a time, there was a little dog named Max. He"
NEW_TOKENS = 32


SEEDED = {"do_sample": True, "temperature": 0.8, "top_k": 40, "seed": 7}


async def _stream_all(url, prompts, sampling=None):
    async def one(session, prompt, params):
        body = {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS, "ignore_eos": True, **params},
                "stream": True}
        async with session.post(f"{url}/models/hf/generate", json=body) as resp:
            text = await resp.text()
            assert resp.status == 200, text
            return [(e["token"]["id"], e["token"]["logprob"]) for e in parse_sse(text)]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return await asyncio.gather(*(one(session, p, (sampling or {}).get(i, {})) for i, p in enumerate(prompts)))


def test_a_greedy_requests_bits_do_not_depend_on_what_else_runs(tmp_path):
    with serve(tmp_path, "invariant") as server:
        assert http("GET", server.url + "/info")[1]["batch_invariant"] is True
        alone = asyncio.run(_stream_all(server.url, [PROBE]))[0]
        crowd = asyncio.run(_stream_all(server.url, workload()[:20] + [PROBE] + workload()[20:40]))
        # seeded sampling too: the probe sampled alone, and among the others (some of them sampled as well)
        seeded_alone = asyncio.run(_stream_all(server.url, [PROBE], {0: SEEDED}))[0]
        seeded_crowd = asyncio.run(_stream_all(server.url, workload()[:20] + [PROBE] + workload()[20:40],
                                               {20: SEEDED, 3: SEEDED, 30: {**SEEDED, "seed": 11}}))
    assert len(alone) == NEW_TOKENS
    assert crowd[20] == alone                       # tokens and log-probabilities, bit for bit
    assert seeded_crowd[20] == seeded_alone and seeded_alone != alone
    assert leftovers(server) == []
    # 24 blocks of 8 tokens for 41 requests: constant preemption; prompts in chunks of 16; no speculation
    with serve(tmp_path, "invariant-tight", "pa_config.num_blocks=24",
               "pa_config.block_size=8", "model_config.max_generate_length=128",
               "scheduler_config.enable_prefix_caching=false", "scheduler_config.kv_watermark=0",
               "scheduler_config.chunked_prefill=true", "scheduler_config.max_chunk_tokens=16",
               "serving_config.max_num_batched_tokens=40", "spec_config.method=off") as server:
        tight = asyncio.run(_stream_all(server.url, workload()[:20] + [PROBE] + workload()[20:40]))
        preemptions = http("GET", server.url + "/stats")[1]["num_preemptions"]
    assert leftovers(server) == []
    assert preemptions > 10
    assert tight[20] == alone
    assert tight == crowd                           # every one of the 41, not only the probe
