"""In-process vLLM for offline batch scoring. Runs as a script in the vLLM venv.

Executed by the python of the CPU vLLM environment (stdlib and vLLM only, never imported by
examlops). Its arguments are the `vllm serve` argv from `render_vllm_command`, parsed by vLLM's
own parser (the one renderer stays the one source of truth), and turned into `vllm.LLM(...)`.

Protocol (JSON lines): first answer `{"ready": true, "load_s": …}`; then each request line
`{"batch": [{"id", "messages" | "prompt", "max_tokens"?, "temperature"?, "top_p"?, "seed"?}, …]}`
is answered with one line `{"results": [{"id", "text", "prompt_tokens", "completion_tokens",
"finish_reason"} | {"id", "error"}, …]}` in the same order. The whole batch goes to vLLM at once,
so continuous batching has something to schedule.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, TextIO

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _vllm_parse import _Parser

_ENGINE_ARG_SKIP = {"model", "model_tag", "subparser", "dispatch_function", "host", "port", "api_key"}


def _llm_kwargs(parser: _Parser, argv: list[str]) -> tuple[str, dict[str, Any]]:
    """The model and the engine arguments the argv sets (only those that differ from the defaults)."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    args = parser._root.parse_args(argv[1:])
    parser._command.validate(args)
    model = getattr(args, "model_tag", None) or args.model
    defaults = vars(parser._root.parse_args(["serve", model]))
    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    kwargs = {k: v for k, v in vars(args).items()
              if k in fields and k not in _ENGINE_ARG_SKIP and v != defaults.get(k)}
    return model, kwargs


def _sampling(req: dict[str, Any]) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=int(req.get("max_tokens") or 256),
                          temperature=float(req.get("temperature", 0.0)),
                          top_p=float(req.get("top_p", 1.0)), seed=req.get("seed"))


def _result(req: dict[str, Any], out: Any) -> dict[str, Any]:
    choice = out.outputs[0]
    return {"id": req.get("id"), "text": choice.text, "prompt_tokens": len(out.prompt_token_ids or []),
            "completion_tokens": len(choice.token_ids), "finish_reason": choice.finish_reason or "stop"}


def _run_batch(llm: Any, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results: list[dict[str, Any] | None] = [None] * len(batch)
    chats = [(i, r) for i, r in enumerate(batch) if isinstance(r.get("messages"), list)]
    prompts = [(i, r) for i, r in enumerate(batch) if isinstance(r.get("prompt"), str)]
    for i, r in enumerate(batch):
        if not isinstance(r.get("messages"), list) and not isinstance(r.get("prompt"), str):
            results[i] = {"id": r.get("id"), "error": "each line needs 'messages' (a list) or 'prompt' (a string)"}
    if chats:
        outs = llm.chat([r["messages"] for _, r in chats], [_sampling(r) for _, r in chats], use_tqdm=False)
        for (i, r), out in zip(chats, outs, strict=True):
            results[i] = _result(r, out)
    if prompts:
        outs = llm.generate([r["prompt"] for _, r in prompts], [_sampling(r) for _, r in prompts], use_tqdm=False)
        for (i, r), out in zip(prompts, outs, strict=True):
            results[i] = _result(r, out)
    return [r for r in results if r is not None]


def main(argv: list[str]) -> int:
    answers: TextIO = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # vLLM's own prints go to stderr; stdout carries only answers
    started = time.monotonic()
    from vllm import LLM

    model, kwargs = _llm_kwargs(_Parser(), argv)
    llm = LLM(model=model, **kwargs)
    answers.write(json.dumps({"ready": True, "load_s": round(time.monotonic() - started, 1)}) + "\n")
    answers.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            batch = json.loads(line)["batch"]
            answer: dict[str, Any] = {"results": _run_batch(llm, batch)}
        except Exception as exc:  # answer, don't die: the caller decides
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
