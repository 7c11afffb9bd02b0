"""Authentication of internal gRPC calls: one bearer token per caller, checked by every server.

Each caller (a service, or an operator using `exa`) has a name and a secret token. A server accepts
the `name=token` pairs of EXAMLOPS_INTERNAL_TOKENS (or of the file EXAMLOPS_INTERNAL_TOKENS_FILE);
a client sends its own token (EXAMLOPS_SERVICE_TOKEN for a service, EXAMLOPS_OPERATOR_TOKEN for
`exa`) as `authorization: Bearer <token>` metadata on every call. The server (ServerAuth.check) compares
in constant time, refuses a missing or unknown token with UNAUTHENTICATED, a caller its access rules
do not name with PERMISSION_DENIED, and hands the caller's name to the handler (`current_caller()`),
so what is audited is who holds the credential, never what a request claims.

Bearer tokens rather than mTLS: rotating one is editing a list (no certificates to reissue), they
pass through any proxy or port-forward, and dev needs no CA. grpc.health.v1 and reflection stay
open, for probes. Names starting with `cli:` are operators; every other name is a service.
"""

from __future__ import annotations

import contextvars
import hmac
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import grpc

from ._wire import PARAM_KEY, REASON_KEY

TOKENS_VAR = "EXAMLOPS_INTERNAL_TOKENS"
TOKENS_FILE_VAR = "EXAMLOPS_INTERNAL_TOKENS_FILE"
SERVICE_TOKEN_VAR = "EXAMLOPS_SERVICE_TOKEN"
OPERATOR_TOKEN_VAR = "EXAMLOPS_OPERATOR_TOKEN"
MIN_TOKEN_CHARS = 32
OPERATOR_PREFIX = "cli:"
#: Access-rule key that stands for every operator (`cli:*`).
OPERATORS = "cli:*"
#: Open without a token: probes and tooling must reach them.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                        "/grpc.reflection.v1.ServerReflection/")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@:-]{0,63}$")
_FIX = (f"set {SERVICE_TOKEN_VAR} (a service) or {OPERATOR_TOKEN_VAR} (exa; `exa dev env` prints it) to a "
        f"token listed in this server's {TOKENS_VAR} or {TOKENS_FILE_VAR}")


class TokenError(ValueError):
    """A token list or token that cannot be used; the message names the variable."""


def token_problem(token: str) -> str | None:
    """Why `token` is unusable, or None."""
    if len(token) < MIN_TOKEN_CHARS:
        return (f"is {len(token)} characters; use at least {MIN_TOKEN_CHARS} "
                "(python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    if any(c.isspace() or c in ",=" for c in token):
        return "contains whitespace, ',' or '='"
    return None


def parse_tokens(text: str, source: str) -> dict[str, str]:
    """`name=token` pairs, one per line or comma-separated (# comments) -> {name: token}."""
    out: dict[str, str] = {}
    for raw in re.split(r"[,\n]", text):
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        name, sep, token = (part.strip() for part in entry.partition("="))
        if not sep or not _NAME_RE.match(name):
            raise TokenError(f"{source}: expected name=token pairs (names of letters, digits, '.', '_', '@', ':', "
                             f"'-'); got an entry named {name!r}")
        problem = token_problem(token)
        if problem:
            raise TokenError(f"{source}: the token of {name!r} {problem}")
        if name in out:
            raise TokenError(f"{source}: {name!r} is listed twice")
        if token in out.values():
            raise TokenError(f"{source}: {name!r} has the same token as another caller")
        out[name] = token
    return out


def load_accepted_tokens(inline: str, path: str, required: bool = True) -> dict[str, str]:
    """The callers a server accepts, from EXAMLOPS_INTERNAL_TOKENS and/or EXAMLOPS_INTERNAL_TOKENS_FILE.

    `required`: an empty list is an error (a server must accept someone).
    """
    tokens = parse_tokens(inline, TOKENS_VAR)
    if path:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise TokenError(f"{TOKENS_FILE_VAR}: cannot read {path}: {exc.strerror}") from None
        for name, token in parse_tokens(text, f"{TOKENS_FILE_VAR} ({path})").items():
            if name in tokens:
                raise TokenError(f"{name!r} is listed in both {TOKENS_VAR} and {TOKENS_FILE_VAR}")
            tokens[name] = token
    if required and not tokens:
        raise TokenError(f"{TOKENS_VAR} or {TOKENS_FILE_VAR} must list the callers this server accepts as "
                         "name=token pairs (`make up` generates them into .run/internal-tokens)")
    return tokens


@dataclass(frozen=True, slots=True)
class Caller:
    """Who made the current call, as its credential says."""

    name: str

    @property
    def operator(self) -> bool:
        return self.name.startswith(OPERATOR_PREFIX)

    def attribute(self, claimed: str) -> tuple[str, str]:
        """(actor, on_behalf_of) to audit for a request that claims `claimed` as its actor.

        The actor is always the credential's name. A service (the gateway's admin API, the
        launcher acting for an operator) has authenticated its own user, so what it names is kept
        as on_behalf_of; what an operator's request claims is not evidence of anything.
        """
        if self.operator or not claimed or claimed == self.name:
            return self.name, ""
        return self.name, claimed


_CALLER: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("examlops_caller", default=None)


def current_caller() -> Caller:
    """The authenticated caller of the call being handled (set by ServerAuth.check)."""
    caller = _CALLER.get()
    if caller is None:
        raise RuntimeError("no authenticated caller: the handler runs outside an authenticated gRPC call")
    return caller


@dataclass(frozen=True)
class Access:
    """Which callers may call which RPCs of one server.

    Keys are caller names, or OPERATORS for every `cli:` caller; a value is the set of RPC names
    that caller may call, or None for every RPC. A caller not named is refused everything.
    """

    rules: Mapping[str, frozenset[str] | None]

    def allows(self, caller: Caller, rpc: str) -> bool:
        key = OPERATORS if caller.operator else caller.name
        if key not in self.rules:
            return False
        allowed = self.rules[key]
        return allowed is None or rpc in allowed

    def callers_of(self, rpc: str) -> list[str]:
        return sorted(k for k, v in self.rules.items() if v is None or rpc in v)


@dataclass(frozen=True)
class ServerAuth:
    """What one server accepts: its callers' tokens and its access rules."""

    service: str
    tokens: Mapping[str, str]
    access: Access

    def identify(self, token: str) -> Caller | None:
        """The caller holding `token`; every entry is compared, in constant time each."""
        found: str | None = None
        presented = token.encode()
        for name, secret in self.tokens.items():
            if hmac.compare_digest(presented, secret.encode()):
                found = name
        return Caller(found) if found is not None else None

    def check(self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> Refusal | None:
        """Admit a call of `method` (/package.Service/Rpc) carrying `metadata`, or say why not.

        An admitted caller is current_caller() for the rest of the call: each call is handled in a
        task of its own, so the caller is visible to that call's handler only.
        """
        token = _bearer(metadata)
        if not token:
            return Refusal(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated",
                           f"{self.service}: the call carries no bearer token; {_FIX}")
        caller = self.identify(token)
        if caller is None:
            return Refusal(grpc.StatusCode.UNAUTHENTICATED, "unauthenticated",
                           f"{self.service}: the bearer token is not one this server accepts; {_FIX}")
        rpc = method.rsplit("/", 1)[-1]
        if not self.access.allows(caller, rpc):
            allowed = ", ".join(self.access.callers_of(rpc)) or "nobody"
            return Refusal(grpc.StatusCode.PERMISSION_DENIED, "caller_not_allowed",
                           f"{self.service}: caller {caller.name!r} may not call {rpc} (allowed: {allowed})")
        _CALLER.set(caller)
        return None


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else value
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else ""
    return ""


def open_method(method: str) -> bool:
    """Whether `method` (/package.Service/Rpc) is served without a token (probes, reflection)."""
    return method.startswith(OPEN_METHOD_PREFIXES)


class Refusal(NamedTuple):
    """Why a call is refused: its status code, machine-readable reason and message."""

    code: grpc.StatusCode
    reason: str
    message: str

    async def send(self, context: grpc.aio.ServicerContext) -> NoReturn:
        """End the call with this refusal (raises, as context.abort does)."""
        context.set_trailing_metadata(((REASON_KEY, self.reason), (PARAM_KEY, "authorization")))
        await context.abort(self.code, self.message)
        raise AssertionError("unreachable")  # context.abort raises


# --- client side -------------------------------------------------------------------------------

def bearer_metadata(token: str) -> tuple[str, str]:
    """The metadata entry that carries `token` on a call."""
    return ("authorization", f"Bearer {token}")


class _SyncDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _SyncBearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _details(self, d: Any) -> Any:
        return _SyncDetails(d.method, d.timeout, [*(d.metadata or ()), self.header], d.credentials,
                            d.wait_for_ready, getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(client_call_details), request_iterator)


def blocking_channel(addr: str, token: str) -> grpc.Channel:
    """A blocking (non-aio) channel that sends `token` on every call: the CLI, make up, the tests."""
    return grpc.intercept_channel(grpc.insecure_channel(addr), _SyncBearer(token))
