#!/usr/bin/env python
"""Write a randomly initialised LLaMA: the same as `llm-serving make-model` (see its --help)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llm_serving.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["make-model", *sys.argv[1:]]))
