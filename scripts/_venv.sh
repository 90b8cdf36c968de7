# Sourced by start.sh and test.sh: create ./.venv and install the package when missing or out of date.
# MindSpore 2.10 needs numpy<2, so the project lives in its own virtualenv.
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.llm-serving-installed${LLM_SERVING_EXTRAS:-}
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  python -m pip install --quiet --upgrade pip
  python -m pip install --quiet -e ".${LLM_SERVING_EXTRAS:-}"
  touch "$stamp"
fi
