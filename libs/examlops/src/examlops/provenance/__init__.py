"""Provenance of model versions: file digests, CycloneDX 1.6 ML-BOMs, Ed25519 signatures.

Shared by the CLI (which hashes, builds and signs) and the registry (which verifies before it
records a version).
"""

from ._bom import BomClaims, BomError, Dataset, Tool, VersionSpec, build_bom, dump_bom, read_claims, validate_bom
from ._card import ModelFacts, model_facts
from ._digest import DigestMismatch, FileDigest, compare, digest_folder, sha256_file
from ._methods import (
    METHODS,
    QUANT_VENV_ENV,
    QuantizeError,
    QuantMethod,
    QuantResult,
    choose_group_size,
    degraded_reason,
    quantizer_python,
    run_quantizer,
    servable_here,
)
from ._sign import (
    SIGNING_KEY_ENV,
    SigningError,
    generate_keypair,
    key_id,
    load_public_pem,
    load_signing_key,
    public_pem,
    sign,
    verify,
)

__all__ = [
    "METHODS", "QUANT_VENV_ENV", "SIGNING_KEY_ENV", "BomClaims", "BomError", "Dataset", "DigestMismatch", "FileDigest",
    "ModelFacts", "QuantMethod", "QuantResult", "QuantizeError", "SigningError", "Tool", "VersionSpec", "build_bom",
    "choose_group_size", "compare", "degraded_reason", "digest_folder", "dump_bom", "generate_keypair", "key_id",
    "load_public_pem", "load_signing_key", "model_facts", "public_pem", "quantizer_python", "read_claims",
    "run_quantizer", "servable_here", "sha256_file", "sign", "validate_bom", "verify",
]
