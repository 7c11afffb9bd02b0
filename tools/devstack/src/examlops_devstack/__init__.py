"""Running the stack as local processes: used by `make up` and by the tests' fixtures alike.

Developer tooling: installed in the development environment, never in a service image.
"""

from ._procs import Proc, free_port, group_members, http_ok, spawn, stop_group, wait_grpc, wait_http
from ._prometheus import (
    OBSERVABILITY_DIR,
    PROMETHEUS_INSTALL_HINT,
    local_targets,
    prometheus_argv,
    render_local_config,
    wait_prometheus_ready,
)
from ._stack import SERVICES, StackPorts, StackTokens, redis_argv, service_argv, service_env, stack_tokens

__all__ = ["OBSERVABILITY_DIR", "PROMETHEUS_INSTALL_HINT", "SERVICES", "Proc", "StackPorts", "StackTokens", "free_port",
           "group_members", "http_ok", "local_targets", "prometheus_argv", "redis_argv", "render_local_config",
           "service_argv", "service_env", "spawn", "stack_tokens", "stop_group", "wait_grpc", "wait_http",
           "wait_prometheus_ready"]
