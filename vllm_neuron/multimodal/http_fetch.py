"""http(s) media fetches that a request cannot turn against the server's own network (SSRF).

* `--allowed-media-domains` (vLLM's flag): when given, the only hosts a media URL may name.
* Loopback, link-local (cloud metadata at 169.254.169.254), private, shared, reserved and multicast
  addresses are refused, whatever name resolves to them, unless that host is listed in
  `--allowed-media-domains` (`--allowed-media-domains localhost 10.0.0.5` allows exactly those).
* The connection goes to the address that was checked (the URL's host is resolved once, and the request
  is sent to that IP with the host in its Host header and TLS name), so a DNS answer that changes
  between the check and the connection (rebinding) is not followed.
* Redirects are followed by hand, at most MAX_REDIRECTS, and every hop is checked like the first URL;
  `VLLM_MEDIA_URL_ALLOW_REDIRECTS=0` (vLLM's variable) refuses them.
* One deadline for the whole fetch (`VLLM_IMAGE_FETCH_TIMEOUT`) and a size limit (`VLLM_MEDIA_MAX_BYTES`);
  proxies from the environment are not used (the proxy would connect to addresses not checked here).

Every refusal is a ValueError naming the URL and the reason (the server answers 400).
"""
from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Collection
from urllib.parse import urljoin, urlsplit

MAX_REDIRECTS = 5
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT (not `is_private` in every Python)


def _blocked(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why an address is not a public one (None: it is)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for name in ("unspecified", "loopback", "link_local", "private", "multicast", "reserved"):
        if getattr(ip, f"is_{name}"):
            return name.replace("_", "-")
    if ip in _SHARED or not ip.is_global:
        return "non-public"
    return None


def _resolve(host: str, port: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"the media host {host!r} does not resolve ({e.strerror})") from None
    return list(dict.fromkeys(ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos))


def check_url(url: str, allowed_domains: Collection[str] | None) -> tuple[str, str, int, str]:
    """(pinned URL with the checked IP as its host, the Host header, port, host name) of an allowed http(s)
    URL; ValueError naming why it is refused."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise ValueError(f"media URL {url[:200]!r}: only http(s) may be fetched from the network")
    host = (parts.hostname or "").rstrip(".").lower()
    if not host:
        raise ValueError(f"media URL {url[:200]!r} names no host")
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        raise ValueError(f"media URL {url[:200]!r} has an invalid port") from None
    listed = allowed_domains is not None and host in {d.strip("[]").rstrip(".").lower() for d in allowed_domains}
    if allowed_domains is not None and not listed:
        raise ValueError(f"media URL {url[:200]!r}: the host {host!r} is not in --allowed-media-domains")
    addresses = _resolve(host, port)
    if not listed:
        for ip in addresses:
            why = _blocked(ip)
            if why is not None:
                raise ValueError(f"media URL {url[:200]!r}: {host!r} is a {why} address ({ip}); the server fetches "
                                 "media from public hosts only, unless --allowed-media-domains lists the host")
    ip = addresses[0]
    netloc = f"[{ip}]" if ip.version == 6 else str(ip)
    default_port = port == (443 if scheme == "https" else 80)
    host_header = parts.netloc.rsplit("@", 1)[-1]
    pinned = parts._replace(netloc=netloc if default_port else f"{netloc}:{port}").geturl()
    return pinned, host_header, port, host


def fetch(url: str, *, allowed_domains: Collection[str] | None, timeout_s: float, max_bytes: int,
          allow_redirects: bool = True) -> bytes:
    """The body of a 200 answer to GET `url` (see the module docstring for what is refused)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    current = url
    for hop in range(MAX_REDIRECTS + 1):
        pinned, host_header, _, host = check_url(current, allowed_domains)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ValueError(f"fetching {url!r} timed out after {timeout_s:g} s")
        try:
            with httpx.Client(timeout=remaining, follow_redirects=False, trust_env=False) as client:
                request = client.build_request("GET", pinned, headers={"Host": host_header},
                                               extensions={"sni_hostname": host})
                r = client.send(request, stream=True)
                try:
                    if r.is_redirect:
                        location = r.headers.get("location", "")
                        if not allow_redirects:
                            raise ValueError(f"fetching {url!r}: the server redirects to {location[:200]!r}, and "
                                             "redirects are refused (VLLM_MEDIA_URL_ALLOW_REDIRECTS=0)")
                        current = urljoin(current, location)
                        continue
                    if r.status_code != 200:
                        raise ValueError(f"fetching {url!r} failed with HTTP status {r.status_code}")
                    data = bytearray()
                    for chunk in r.iter_bytes():
                        data += chunk
                        if len(data) > max_bytes:
                            raise ValueError(f"the media at {url!r} is larger than {max_bytes} bytes")
                        if time.monotonic() > deadline:
                            raise httpx.ReadTimeout("deadline")
                    return bytes(data)
                finally:
                    r.close()
        except httpx.TimeoutException:
            raise ValueError(f"fetching {url!r} timed out after {timeout_s:g} s") from None
        except httpx.HTTPError as e:
            raise ValueError(f"fetching {url!r} failed: {e}") from None
    raise ValueError(f"fetching {url!r}: more than {MAX_REDIRECTS} redirects")
