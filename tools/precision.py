#!/usr/bin/env python
"""The precision gate as a script: the same as `llm-serving precision` (llm_serving/precision.py)."""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llm_serving import precision  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=precision.__doc__.split("\n")[0])
    precision.add_arguments(parser)
    sys.exit(precision.run_cli(parser.parse_args()))
