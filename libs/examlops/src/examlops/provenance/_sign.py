"""Ed25519 signing of BOMs: key files, key ids, sign and verify.

A signature covers the BOM's exact UTF-8 bytes, so a BOM is stored and shipped as the string that
was signed, never re-serialised. A key id is the first 16 hex digits of SHA-256 over the raw
32-byte public key.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

SIGNING_KEY_ENV = "EXAMLOPS_SIGNING_KEY"


class SigningError(ValueError):
    """A key that cannot be read or used; the message names the file and the fix, never the key."""


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def public_pem(public: Ed25519PublicKey) -> str:
    return public.public_bytes(serialization.Encoding.PEM,
                               serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def load_public_pem(pem: str | bytes, source: str = "public key") -> Ed25519PublicKey:
    data = pem.encode() if isinstance(pem, str) else pem
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError):
        raise SigningError(f"{source}: not a PEM public key") from None
    if not isinstance(key, Ed25519PublicKey):
        raise SigningError(f"{source}: not an Ed25519 public key")
    return key


def generate_keypair(out_dir: Path) -> tuple[Path, Path, str]:
    """Write out_dir/signing.key (PKCS#8 PEM, mode 0600) and signing.pub; return both paths and the key id.
    Refuses to overwrite an existing key."""
    out_dir.mkdir(parents=True, exist_ok=True)
    priv_path, pub_path = out_dir / "signing.key", out_dir / "signing.pub"
    for p in (priv_path, pub_path):
        if p.exists():
            raise SigningError(f"{p} exists: keys are never overwritten; choose another --out")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub_path.write_text(public_pem(key.public_key()))
    return priv_path, pub_path, key_id(key.public_key())


def load_signing_key(path: str | Path | None = None) -> Ed25519PrivateKey:
    """The private key from `path`, else from the file named by EXAMLOPS_SIGNING_KEY."""
    where = path or os.environ.get(SIGNING_KEY_ENV, "")
    if not where:
        raise SigningError(f"no signing key: set {SIGNING_KEY_ENV} to the path of a signing.key "
                           "(create one with `exa models keygen --out DIR`)")
    p = Path(where)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise SigningError(f"{SIGNING_KEY_ENV}={p}: cannot read the key file ({exc.strerror})") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise SigningError(f"{SIGNING_KEY_ENV}={p}: not an unencrypted PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningError(f"{SIGNING_KEY_ENV}={p}: not an Ed25519 key (`exa models keygen` writes one)")
    return key


def sign(key: Ed25519PrivateKey, payload: str) -> str:
    return base64.b64encode(key.sign(payload.encode())).decode()


def verify(public: Ed25519PublicKey, payload: str, signature_b64: str) -> bool:
    try:
        sig = base64.b64decode(signature_b64, validate=True)
        public.verify(sig, payload.encode())
    except (InvalidSignature, ValueError):
        return False
    return True
