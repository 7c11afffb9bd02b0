"""python -m examlops_devstack up|down|status — see _up.py."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ._stack import StackPorts
from ._up import RunDir, down, status, up


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m examlops_devstack",
                                     description="Run the ExaMLOps stack as local background processes.")
    parser.add_argument("--run-dir", type=Path, default=Path(".run"), help="State, pid files and logs.")
    parser.add_argument("--port-offset", type=int, default=None,
                        help="Shift every port (Redis 6379 and 6380, gRPC 50051-50054 and their metrics 50061-50064, "
                             "gateway 8080, vLLM 8000, MiniLM 8001, Prometheus 9099) by N (default: "
                             "EXAMLOPS_DEV_PORT_OFFSET, else the offset of the stack running "
                             "from --run-dir, else 0).")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="Start what is down, register the default model, check an answer.")
    p_up.add_argument("--engine", choices=["vllm", "echo"], default="vllm")
    p_up.add_argument("--vllm-venv", type=Path)
    p_up.add_argument("--model-dir", type=Path, help="The SmolLM2 folder (scripts/vllm-env.sh's SMOL_MODEL_DIR).")
    p_up.add_argument("--minilm-dir", type=Path,
                      help="The all-MiniLM-L6-v2 folder (scripts/vllm-env.sh's MINILM_MODEL_DIR).")
    sub.add_parser("down", help="Stop exactly what `up` started.")
    p_st = sub.add_parser("status", help="Each part: pid, health, address.")
    p_st.add_argument("--json", action="store_true")
    args = parser.parse_args()
    run = RunDir(args.run_dir.resolve())
    offset = args.port_offset
    if offset is None:
        env = os.environ.get("EXAMLOPS_DEV_PORT_OFFSET", "")
        offset = int(env) if env else run.port_offset()
    ports = StackPorts.with_offset(offset)
    if args.cmd == "up":
        run.record_port_offset(offset)  # `exa` and later `down`/`status` find this stack by it
        up(run, ports, args.engine, args.vllm_venv, args.model_dir, args.minilm_dir)
    elif args.cmd == "down":
        down(run)
    else:
        return status(run, ports, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
