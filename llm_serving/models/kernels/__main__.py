"""`python -m llm_serving.models.kernels`: build the CPU kernels an agent of the default settings loads (once per
machine: kept in the cache directory), and print their paths. Needs only the standard library and a C++ compiler,
so scripts/_venv.sh runs it while pip installs the rest: a fresh machine's first start then finds them built."""
from __future__ import annotations

import sys
import time

from . import KernelBuildError, build_libraries, libraries_for


def main() -> int:
    started = time.perf_counter()
    try:
        paths = build_libraries(libraries_for("CPU", "auto", "auto"))
    except KernelBuildError as e:
        print(f"llm-serving: the CPU kernels did not build (the agents will say so again): {e}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    print(f"llm-serving: CPU kernels ready in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
