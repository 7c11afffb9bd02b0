"""What the registry checks of a version's BOM: it validates, and the record says what the BOM says."""

from __future__ import annotations

import hashlib
import re

import grpc

from examlops.provenance import BomClaims, BomError, DigestMismatch, FileDigest, compare, read_claims, validate_bom
from examlops.registry.v1 import registry_pb2 as pb

from ._checks import Refused

Code = grpc.StatusCode
FAILED = Code.FAILED_PRECONDITION
REF_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}@[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


def read_bom(text: str) -> BomClaims:
    """What a BOM claims, once it validates against CycloneDX 1.6 (CPU work: run it in a thread)."""
    try:
        validate_bom(text)
    except BomError:
        raise
    except ValueError as exc:  # the validator reads the text as JSON first
        raise BomError(f"the BOM is not JSON: {exc}") from None
    return read_claims(text)


def check_against_bom(mv: pb.ModelVersion, claims: BomClaims) -> None:
    """Refuse a record whose name, files, parent, quantization or degraded mode differ from its BOM's."""
    ref = f"{mv.name}@{mv.version}"
    if (claims.name, claims.version) != (mv.name, mv.version):
        raise Refused(FAILED, "bom_mismatch", f"the BOM describes {claims.name}@{claims.version}, not {ref}: "
                                              "a BOM is signed for one version only", "bom_json")
    if claims.parent and not REF_RE.match(claims.parent):
        raise Refused(Code.INVALID_ARGUMENT, "bom_invalid", f"the BOM's parent {claims.parent!r} is not NAME@V",
                      "bom_json")
    if len({d.path for d in claims.files}) != len(claims.files):
        raise Refused(Code.INVALID_ARGUMENT, "bom_invalid", "the BOM lists a file twice", "bom_json")
    if not claims.files and not claims.degraded_reason:
        raise Refused(Code.INVALID_ARGUMENT, "bom_invalid", f"the BOM of {ref} lists no files", "bom_json")
    try:
        compare(claims.files, [FileDigest(f.path, f.sha256, f.size) for f in mv.files], "the files listed")
    except DigestMismatch as exc:
        raise Refused(FAILED, "files_mismatch", f"the files of {ref} differ from its BOM's: {exc}", "files") from None
    for field, given, claimed in [("parent", mv.parent, claims.parent),
                                  ("quantization", mv.quantization, claims.quantization),
                                  ("degraded_reason", mv.degraded_reason, claims.degraded_reason),
                                  ("degraded", str(mv.degraded).lower(), str(bool(claims.degraded_reason)).lower())]:
        if given != claimed:
            raise Refused(FAILED, "bom_mismatch", f"{field} {given!r} of {ref} differs from its BOM's {claimed!r}",
                          field)


def check_stored(mv: pb.ModelVersion) -> None:
    """A stored record still matches its (signed) BOM: its digest, its name, its files and claims."""
    if hashlib.sha256(mv.bom_json.encode()).hexdigest() != mv.bom_sha256:
        raise Refused(FAILED, "bom_mismatch", f"the BOM of {mv.name}@{mv.version} no longer has the SHA-256 "
                                              "recorded at registration", "bom_json")
    try:
        claims = read_claims(mv.bom_json)
    except BomError as exc:
        raise Refused(FAILED, "bom_invalid", str(exc), "bom_json") from None
    check_against_bom(mv, claims)
