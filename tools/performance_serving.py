#!/usr/bin/env python
"""The load client, as a script: the same as `llm-serving bench` (see llm_serving/loadgen/client.py).

    python tools/performance_serving.py --url http://127.0.0.1:8000 --dataset alpaca \
        --dataset-path ../shared/datasets/alpaca_5000.json --request-rate 10 --duration 30
"""
import sys

from llm_serving.loadgen.client import main

if __name__ == "__main__":
    sys.exit(main())
