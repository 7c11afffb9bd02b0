"""A host name that resolves, on this machine and without root or network, to a non-public address.

The static rules of the engine block already refuse `localhost` and `*.localhost` as media domains.
Other names point at this machine too: its own host name (Debian maps it to 127.0.1.1, Docker and
Kubernetes to the container's private address, cloud images to the VM's private address) and
Debian's `ip6-localhost`. They are exactly what mediaguard's address check must catch.
"""

from __future__ import annotations

import ipaddress
import socket

from examlops.engine import EngineBlockError, MultimodalPolicy


def _addresses(name: str) -> set[str]:
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)}
    except OSError:
        return set()


def _allowable(name: str) -> bool:
    """Whether the engine block's static rules accept `name` as a media domain."""
    try:
        MultimodalPolicy(modality="vision", limit_mm_per_prompt={"image": 1}, allowed_media_domains=[name])
    except (EngineBlockError, ValueError):
        return False
    return True


def private_host_name() -> tuple[str, set[str]]:
    """(name, its addresses): a name a media allow-list accepts that resolves only to non-global addresses."""
    candidates = [socket.gethostname().lower(), socket.getfqdn().lower(), "ip6-localhost", "ip6-loopback"]
    for name in candidates:
        if not _allowable(name):
            continue
        addresses = _addresses(name)
        if addresses and not any(ipaddress.ip_address(a.split("%")[0]).is_global for a in addresses):
            return name, addresses
    raise RuntimeError(f"none of {candidates} resolves here to a non-public address only; "
                       "add this machine's host name to /etc/hosts")
