"""Where an allowed media host points: refuse hosts that resolve to private addresses.

An allow-listed domain is a statement about names, but vLLM fetches from addresses. A name under an
allowed domain that resolves to a loopback, private, link-local or otherwise non-global address
(an internal name under a split-horizon zone, a wildcard record, this machine's own host name)
would let a prompt make the engine fetch from inside the network. So, unless the endpoint's policy
says `allow_private_addresses`, every remote media host is resolved, and a host with any
non-global address is refused. Mediaguard still never fetches anything; it only asks DNS.

Answers are cached for `ttl_s` (a small cache, so a burst of requests costs one lookup) and each
lookup is bounded by `timeout_s`; a resolver that does not answer in time refuses the part (fail
closed). A name that does not exist passes: there is no address to judge, and the fetch fails too.

The limit, honestly: this is a check at validation time, and vLLM resolves the name again when it
fetches. Whoever controls the DNS of an allowed domain can answer a public address here and a
private one to vLLM a moment later (DNS rebinding), and no check outside the fetcher can stop that.
Allow only domains whose DNS you trust, and give the engines an egress policy that keeps them off
internal networks (vLLM follows no redirects: the launchers render VLLM_MEDIA_URL_ALLOW_REDIRECTS=0).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from ._errors import PRIVATE_ADDRESS, MediaRejected

#: Part fields that hold a URL, by part type, in the normalised messages `validate_messages` returns.
_URL_FIELDS = {"image_url": "image_url", "audio_url": "audio_url", "video_url": "video_url"}
#: getaddrinfo's answers for "this name has no address" (no such name, or no A/AAAA record).
_NO_ADDRESS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def non_global(address: str) -> bool:
    """True for an address a prompt must not reach: loopback, private, link-local, reserved, multicast."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # IPv4-mapped IPv6 is judged by its IPv4 part
    return not ip.is_global or ip.is_multicast  # Python calls multicast global


def remote_hosts(messages: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
    """(host, param) of every http(s) media URL in already validated (canonical) messages."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            field = _URL_FIELDS.get(str(part.get("type"))) if isinstance(part, dict) else None
            url = str(part[field]["url"]) if field else ""
            if url.startswith(("http://", "https://")):
                yield urlsplit(url).hostname or "", f"messages[{i}].content[{j}]"


class AddressCheck:
    """Refuses media hosts that resolve to non-global addresses; answers cached briefly."""

    def __init__(self, *, ttl_s: float = 30.0, timeout_s: float = 1.0, max_entries: int = 1024) -> None:
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.max_entries = max_entries
        self._cache: OrderedDict[str, tuple[float, list[str]]] = OrderedDict()

    async def check(self, messages: list[dict[str, Any]]) -> None:
        """Raise `MediaRejected` for the first part whose host resolves to a non-global address."""
        first: dict[str, str] = {}
        for host, param in remote_hosts(messages):
            first.setdefault(host, param)
        if not first:
            return
        answers = await asyncio.gather(*(self._addresses(host) for host in first))
        for (host, param), addresses in zip(first.items(), answers, strict=True):
            if addresses is None:
                raise MediaRejected(PRIVATE_ADDRESS, f"cannot tell where host {host!r} points: DNS did not "
                                    f"answer within {self.timeout_s:g} s", param, _part_index(param))
            private = sorted(a for a in addresses if non_global(a))
            if private:
                raise MediaRejected(PRIVATE_ADDRESS, f"host {host!r} resolves to the non-public address "
                                    f"{private[0]}; the policy does not allow private addresses",
                                    param, _part_index(param))

    async def _addresses(self, host: str) -> list[str] | None:
        """The host's addresses ([] when it has none), or None when DNS did not answer in time."""
        now = time.monotonic()
        cached = self._cache.get(host)
        if cached is not None and cached[0] > now:
            return cached[1]
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(loop.getaddrinfo(host, None, type=socket.SOCK_STREAM), self.timeout_s)
            addresses = sorted({str(info[4][0]) for info in infos})
        except socket.gaierror as exc:
            if exc.errno not in _NO_ADDRESS:
                return None
            addresses = []
        except (TimeoutError, OSError):
            return None
        self._cache[host] = (now + self.ttl_s, addresses)
        self._cache.move_to_end(host)
        while len(self._cache) > self.max_entries:
            self._cache.popitem(last=False)
        return addresses


def _part_index(param: str) -> int:
    return int(param.rsplit("[", 1)[1].rstrip("]"))
