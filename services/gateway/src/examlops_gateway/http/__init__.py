"""The HTTP surface: OpenAI routes, admin routes, their dependencies, body reading, protocol
models and the one error shape (with governance's refusals mapped onto it)."""

from ._admin import router as admin_router
from ._admin_cache import router as cache_admin_router
from ._admin_guardrails import router as guardrails_admin_router
from ._audit import block_auditor
from ._denials import install_error_handlers
from ._deps import CallerDep, StateDep, require_admin
from ._errors import ErrorResponse, OpenAIError
from ._fastlane import FastLaneApp
from ._openai import router as openai_router
from ._openapi import install_openapi
from ._protocol import ChatCompletionRequest, CompletionRequest

__all__ = [
    "CallerDep", "ChatCompletionRequest", "CompletionRequest", "ErrorResponse", "FastLaneApp", "OpenAIError",
    "StateDep",
    "admin_router", "block_auditor", "cache_admin_router", "guardrails_admin_router", "install_error_handlers",
    "install_openapi", "openai_router", "require_admin",
]
