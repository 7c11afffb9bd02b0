"""Guardrails: detectors that scan prompts and answers (pii, secrets, regex, model) and the policies
that apply them in both directions. See services/gateway/GUARDRAILS.md.
"""

from ._detectors import Detector, DetectorConfigError, Finding, build_detector, known_entities, redact
from ._judge import Ask, JudgeError, ModelJudge

__all__ = [
    "Ask", "Detector", "DetectorConfigError", "Finding", "JudgeError", "ModelJudge", "build_detector",
    "known_entities", "redact",
]
