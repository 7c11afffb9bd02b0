"""Running the stack as local processes: used by `make up` and by the tests' fixtures alike."""

from ._procs import Proc, free_port, spawn, stop_pid, wait_grpc, wait_http
from ._stack import SERVICES, StackPorts, service_env

__all__ = ["SERVICES", "Proc", "StackPorts", "free_port", "service_env", "spawn", "stop_pid",
           "wait_grpc", "wait_http"]
