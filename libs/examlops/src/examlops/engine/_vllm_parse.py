"""Parse `vllm serve` argvs with vLLM's own CLI parser. Runs as a script in the vLLM venv.

This file is executed by the python of the CPU vLLM environment (see scripts/vllm-env.sh), never
imported by examlops: it must only use the standard library and vLLM itself.

Protocol: one JSON document per stdin line, one JSON answer per stdout line, until EOF.

* ``{"argvs": [["vllm", "serve", "<model>", ...], ...]}`` answers a list with, per argv,
  ``{"ok": true, "namespace": {...}}`` or ``{"ok": false, "error": "..."}``. An argv counts as
  parsed when `vllm serve` itself would get past its CLI stage: the same root parser and
  `serve` sub-parser, the sub-command's `validate` step, and `AsyncEngineArgs.from_cli_args`.
  Values the parser takes as free text are then checked against the tables vLLM checks them
  against when it builds its config (the quantization method, the speculative method, the
  multimodal config), so a name vLLM would refuse at start-up is refused here too.
* ``{"describe": ["dest", ...]}`` answers facts about the parser: option strings and choices of
  each named destination, every option string of `vllm serve`, and vLLM's accepted
  quantization and speculative-decoding methods.

Anything vLLM prints while importing or parsing goes to stderr, so stdout carries only answers.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import sys
import typing
from typing import Any, TextIO


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    return repr(value)


def _literal_values(tp: Any) -> list[str]:
    """Flatten a (possibly nested or Optional) Literal into its string values."""
    out: list[str] = []
    for arg in typing.get_args(tp):
        if isinstance(arg, str):
            out.append(arg)
        elif arg is not type(None):
            out.extend(_literal_values(arg))
    return out


class _Parser:
    def __init__(self) -> None:
        argparse_utils = importlib.import_module("vllm.utils.argparse_utils")
        self._serve = importlib.import_module("vllm.entrypoints.cli.serve")
        self._engine_args = importlib.import_module("vllm.engine.arg_utils").AsyncEngineArgs
        self._root = argparse_utils.FlexibleArgumentParser(prog="vllm", description="vLLM CLI")
        subparsers = self._root.add_subparsers(required=False, dest="subparser")
        self._command = self._serve.ServeSubcommand()
        self.serve_parser = self._command.subparser_init(subparsers)
        quant = importlib.import_module("vllm.model_executor.layers.quantization")
        self.quantization_methods: list[str] = list(quant.QUANTIZATION_METHODS)
        self.deprecated_quantization_methods: list[str] = list(
            getattr(quant, "DEPRECATED_QUANTIZATION_METHODS", [])
        )
        spec = importlib.import_module("vllm.config.speculative")
        self.speculative_methods = _literal_values(spec.SpeculativeMethod)
        self._mm_config = importlib.import_module("vllm.config.multimodal").MultiModalConfig

    def _check_config_values(self, args: argparse.Namespace) -> None:
        """Refuse what vLLM refuses when it turns the namespace into its config objects."""
        if args.quantization is not None and args.quantization not in self.quantization_methods:
            raise ValueError(f"unknown quantization method {args.quantization!r}")
        method = (args.speculative_config or {}).get("method")
        if method is not None and method not in self.speculative_methods:
            raise ValueError(f"unknown speculative decoding method {method!r}")
        if args.limit_mm_per_prompt:
            self._mm_config(
                limit_per_prompt=args.limit_mm_per_prompt,
                mm_processor_cache_gb=args.mm_processor_cache_gb,
            )

    def parse(self, argv: list[str]) -> dict[str, Any]:
        if not argv or os.path.basename(argv[0]) != "vllm" or argv[1:2] != ["serve"]:
            return {"ok": False, "error": f"not a `vllm serve` argv: {argv[:2]!r}"}
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors):
                args = self._root.parse_args(argv[1:])
                self._command.validate(args)
                # What ServeSubcommand.cmd does first: the positional model wins.
                if getattr(args, "model_tag", None) is not None:
                    args.model = args.model_tag
                self._engine_args.from_cli_args(args)
                self._check_config_values(args)
        except SystemExit as exc:
            message = errors.getvalue().strip().splitlines()
            return {"ok": False, "error": message[-1] if message else f"exit {exc.code}"}
        except Exception as exc:  # vLLM raises ValueError/TypeError from its checks
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        return {"ok": True, "namespace": _jsonable(vars(args))}

    def describe(self, dests: list[str]) -> dict[str, Any]:
        actions: dict[str, Any] = {}
        for action in self.serve_parser._actions:
            if action.dest in dests:
                actions[action.dest] = {
                    "option_strings": list(action.option_strings),
                    "choices": None if action.choices is None else list(action.choices),
                    "nargs": _jsonable(action.nargs),
                }
        every_option = sorted(o for a in self.serve_parser._actions for o in a.option_strings)
        return {
            "actions": actions,
            "option_strings": every_option,
            "quantization_methods": self.quantization_methods,
            "deprecated_quantization_methods": self.deprecated_quantization_methods,
            "speculative_methods": self.speculative_methods,
            "vllm_version": importlib.import_module("vllm").__version__,
        }


def _answer(parser: _Parser, request: Any) -> Any:
    if isinstance(request, dict) and isinstance(request.get("argvs"), list):
        return [parser.parse([str(a) for a in argv]) for argv in request["argvs"]]
    if isinstance(request, dict) and isinstance(request.get("describe"), list):
        return parser.describe([str(d) for d in request["describe"]])
    return {"error": "expected {'argvs': [...]} or {'describe': [...]}"}


def main() -> int:
    # Keep the real stdout for answers; everything else written to fd 1 lands on stderr.
    answers: TextIO = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    parser = _Parser()
    answers.write(json.dumps({"ready": True}) + "\n")
    answers.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = _answer(parser, json.loads(line))
        except json.JSONDecodeError as exc:
            answer = {"error": f"bad JSON request: {exc}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
