#!/usr/bin/env bash
# Create (or reuse) the venv with the real clients that tests/server/test_real_clients.py drives:
#   .ci/install_clients.sh VENV
# then run the tests with INFERSCALE_CLIENTS_VENV=VENV.  Pinned versions; idempotent: a VENV that
# already holds bin/lm_eval and bin/guidellm at these versions is left as it is.
# torch is installed first and pinned: lm-eval needs torch, and left to itself pip would pull the
# newest (multi-GB, CUDA) build.  This machine's pip configuration finds a local CPU wheel of the pin;
# elsewhere pass e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu".
set -euo pipefail

LM_EVAL_VERSION=0.4.13
GUIDELLM_VERSION=0.8.1
LANGCHAIN_OPENAI_VERSION=1.8.1
TORCH_VERSION=2.13.0

if [ $# -ne 1 ]; then
    echo "usage: $0 VENV" >&2
    exit 2
fi
VENV=$1
PYTHON=${PYTHON:-python3}

installed() {
    [ -x "$VENV/bin/lm_eval" ] && [ -x "$VENV/bin/guidellm" ] && [ -x "$VENV/bin/python" ] || return 1
    "$VENV/bin/python" - "$LM_EVAL_VERSION" "$GUIDELLM_VERSION" "$LANGCHAIN_OPENAI_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
want = tuple(sys.argv[1:4])
sys.exit(0 if (version("lm_eval"), version("guidellm"), version("langchain-openai")) == want else 1)
PY
}

if installed; then
    echo "clients already installed in $VENV (lm-eval $LM_EVAL_VERSION, guidellm $GUIDELLM_VERSION," \
        "langchain-openai $LANGCHAIN_OPENAI_VERSION)"
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
# shellcheck disable=SC2086  # TORCH_PIP_ARGS is a list of pip options
"$VENV/bin/pip" install --quiet "torch==$TORCH_VERSION" ${TORCH_PIP_ARGS:-}
"$VENV/bin/pip" install --quiet "lm-eval[api]==$LM_EVAL_VERSION" "guidellm==$GUIDELLM_VERSION" \
    "langchain-openai==$LANGCHAIN_OPENAI_VERSION"
installed || { echo "install_clients: $VENV does not hold lm-eval $LM_EVAL_VERSION, guidellm $GUIDELLM_VERSION" \
    "and langchain-openai $LANGCHAIN_OPENAI_VERSION" >&2; exit 1; }
echo "clients installed in $VENV (lm-eval $LM_EVAL_VERSION, guidellm $GUIDELLM_VERSION," \
    "langchain-openai $LANGCHAIN_OPENAI_VERSION)"
