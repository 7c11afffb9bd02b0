"""Shared test support of the ExaMLOps serving plane: real servers as fixtures (Redis, the services,
Slurm, sshd, vLLM), a recording OpenAI backend, a fake `vllm` binary for job scripts, and the
hostile media corpus. Loaded by pytest through the repository's root conftest.py."""

from pathlib import Path

# The checkout this package is installed from (editable): tests read the repository's own files.
REPO_ROOT = Path(__file__).resolve().parents[4]

__all__ = ["REPO_ROOT"]
