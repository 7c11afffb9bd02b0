"""Running the stack as local processes: used by `make up` and by the tests' fixtures alike.

Developer tooling: installed in the development environment, never in a service image.
"""

from ._procs import Proc, free_port, group_members, http_ok, spawn, stop_group, wait_grpc, wait_http
from ._stack import SERVICES, StackPorts, StackTokens, service_argv, service_env, stack_tokens

__all__ = ["SERVICES", "Proc", "StackPorts", "StackTokens", "free_port", "group_members", "http_ok", "service_argv",
           "service_env", "spawn", "stack_tokens", "stop_group", "wait_grpc", "wait_http"]
