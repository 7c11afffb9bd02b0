"""Write the secrets `docker compose` reads into `.env` beside compose.yaml (`make compose-env`).

compose.yaml carries no secret and no default for one: the gateway's admin key, the internal
gRPC tokens (one per calling service and one for the operator) and the vLLM servers' API key come
from this file. Each value is a fresh `secrets.token_urlsafe(32)` (43 characters). An existing
`.env` keeps every value it has; only missing variables are added, so running it again is safe and
upgrades an older file. The file is created readable by its owner only (0600) and is gitignored.

    python3 scripts/compose_env.py [--path .env] [--operator cli:$USER]
    set -a; . ./.env; set +a     # then `exa` on this host sends EXAMLOPS_OPERATOR_TOKEN
"""

from __future__ import annotations

import argparse
import getpass
import os
import secrets
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Calling service -> the compose variable holding its own token (compose.yaml passes it on as
#: that service's EXAMLOPS_SERVICE_TOKEN).
SERVICE_TOKEN_VARS = {"gateway": "EXAMLOPS_GATEWAY_TOKEN", "launcher": "EXAMLOPS_LAUNCHER_TOKEN",
                      "engine-proxy": "EXAMLOPS_ENGINE_PROXY_TOKEN"}
#: Plain secrets: the gateway's admin key, and the key every compose vLLM server requires.
PLAIN_SECRETS = ("EXAMLOPS_ADMIN_KEY", "VLLM_API_KEY")


def read_env(path: Path) -> dict[str, str]:
    """NAME=value lines of an env file (comments and blank lines skipped)."""
    if not path.exists():
        return {}
    pairs = (line.split("=", 1) for line in path.read_text().splitlines()
             if "=" in line and not line.lstrip().startswith("#"))
    return {name.strip(): value.strip() for name, value in pairs}


def missing_values(current: dict[str, str], operator: str) -> dict[str, str]:
    """The variables `current` lacks, each with a fresh secret."""
    new = {name: secrets.token_urlsafe(32) for name in PLAIN_SECRETS if not current.get(name)}
    tokens = {svc: current.get(var) or secrets.token_urlsafe(32) for svc, var in SERVICE_TOKEN_VARS.items()}
    new |= {var: tokens[svc] for svc, var in SERVICE_TOKEN_VARS.items() if not current.get(var)}
    if not current.get("EXAMLOPS_INTERNAL_TOKENS"):
        operator_token = current.get("EXAMLOPS_OPERATOR_TOKEN") or secrets.token_urlsafe(32)
        new["EXAMLOPS_INTERNAL_TOKENS"] = ",".join([*(f"{s}={t}" for s, t in tokens.items()),
                                                    f"{operator}={operator_token}"])
        if not current.get("EXAMLOPS_OPERATOR_TOKEN"):
            new["EXAMLOPS_OPERATOR_TOKEN"] = operator_token
    return new


def write_env(path: Path, operator: str) -> list[str]:
    """Add the missing secrets to `path` (0600); returns the names added."""
    new = missing_values(read_env(path), operator)
    text = path.read_text() if path.exists() else ""
    unterminated = bool(text) and not text.endswith("\n")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "a") as handle:
        handle.write("\n" if unterminated else "")
        handle.writelines(f"{name}={value}\n" for name, value in new.items())
    return list(new)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", type=Path, default=ROOT / ".env", help="the env file (default: ./.env)")
    parser.add_argument("--operator", default="cli:" + (os.environ.get("USER") or getpass.getuser()),
                        help="the operator's name in EXAMLOPS_INTERNAL_TOKENS (default: cli:$USER)")
    args = parser.parse_args()
    added = write_env(args.path, args.operator)
    print(f"{args.path}: added {', '.join(added)}" if added else f"{args.path}: every secret already set")


if __name__ == "__main__":
    main()
