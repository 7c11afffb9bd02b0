#!/usr/bin/env bash
# Builds (once) the quantizer's virtual environment: llm-compressor with the same CPU torch as the
# vLLM environment, kept apart from it because their pins clash (llm-compressor pins
# compressed-tensors 0.19 and transformers<=5.17; vLLM 0.32 pins compressed-tensors 0.17). Kept
# under the user's cache directory keyed by the versions that made it, like scripts/vllm-env.sh.
# Prints the environment's path as a shell assignment on the last line.
set -euo pipefail

LLMCOMPRESSOR_VERSION="${LLMCOMPRESSOR_VERSION:-0.14.0.1}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0+cpu}"
CACHE_ROOT="${EXAMLOPS_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/examlops}"
VENV="$CACHE_ROOT/llmcompressor-$LLMCOMPRESSOR_VERSION-torch-$TORCH_VERSION"

step() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

if [ ! -f "$VENV/.complete" ]; then
  step "Creating the quantizer environment in $VENV (one time, about a minute)"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --progress-bar on -q --upgrade pip >&2
  # The CPU torch comes from pip's configured local wheel folder on our machines; elsewhere set
  # EXAMLOPS_TORCH_INDEX to the PyTorch CPU wheel index (as for scripts/vllm-env.sh).
  extra=()
  [ -n "${EXAMLOPS_TORCH_INDEX:-}" ] && extra=(--extra-index-url "$EXAMLOPS_TORCH_INDEX")
  "$VENV/bin/pip" install --progress-bar on "${extra[@]}" "torch==$TORCH_VERSION" \
    "llmcompressor==$LLMCOMPRESSOR_VERSION" 2> >(grep -v '^WARNING: Location' >&2) >&2
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >&2 || true
  touch "$VENV/.complete"
fi

echo "QUANT_VENV=$VENV"
