"""The load client (`llm-serving bench`, tools/performance_serving.py): replays a dataset against a
running server and measures it with vLLM's metric definitions.

- `workload.py`  datasets (alpaca, ShareGPT, synthetic) and arrival schedules (fixed, Poisson, gamma)
- `backends.py`  one streaming request against llm-serving, TGI or an OpenAI-compatible server
- `metrics.py`   TTFT / TPOT / ITL / E2EL statistics, throughput, goodput, the printed table
- `plots.py`     latency CDFs, throughput and running requests over time (PNG, matplotlib)
- `client.py`    the command line and the run loop
"""
