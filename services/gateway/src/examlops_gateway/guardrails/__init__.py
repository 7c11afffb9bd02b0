"""Guardrails: detectors that scan prompts and answers (pii, secrets, regex, model) and the policies
that apply them in both directions. See services/gateway/GUARDRAILS.md.
"""

from ._ask import engine_proxy_ask
from ._detectors import Detector, DetectorConfigError, Finding, build_detector, known_entities, redact
from ._judge import Ask, JudgeError, ModelJudge
from ._policy import Entry, Policy, PolicyError, check_name, parse_policy
from ._stage import HEADER, Guard, GuardrailBlocked, GuardStage
from ._store import GuardrailBook, GuardrailStore, build_rules, names_field, split_names
from ._stream import GuardedCall

__all__ = [
    "HEADER", "Ask", "Detector", "DetectorConfigError", "Entry", "Finding", "Guard", "GuardStage", "GuardedCall",
    "GuardrailBlocked", "GuardrailBook", "GuardrailStore", "JudgeError", "ModelJudge", "Policy", "PolicyError",
    "build_detector", "build_rules", "check_name", "engine_proxy_ask", "known_entities", "names_field",
    "parse_policy", "redact", "split_names",
]
