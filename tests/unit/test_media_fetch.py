"""http(s) media fetches cannot reach the server's own network: non-public addresses refused unless the host
is allow-listed, --allowed-media-domains as the only hosts, every redirect hop checked, the checked address
is the one connected to, size and time limits. A local HTTP server plays the media host."""
from __future__ import annotations

import time

import pytest

from vllm_neuron.multimodal.http_fetch import check_url, fetch

from tests.media_host import media_host

BODY = b"\x89PNG fake image bytes"


@pytest.fixture(scope="module")
def host():
    with media_host(BODY) as h:
        yield h


@pytest.fixture
def port(host):
    host.requests.clear()
    host.hosts.clear()
    return host.port


def _fetch(url, domains=("localhost",), **kw):
    return fetch(url, allowed_domains=domains, timeout_s=kw.pop("timeout_s", 2.0), max_bytes=kw.pop("max_bytes", 4096),
                 **kw)


@pytest.mark.parametrize("url, why", [
    ("http://127.0.0.1:9/x.png", "loopback"),
    ("http://localhost:9/x.png", "loopback"),
    ("http://[::1]:9/x.png", "loopback"),
    ("http://[::ffff:127.0.0.1]:9/x.png", "loopback"),
    ("http://169.254.169.254/latest/meta-data/", "link-local"),  # cloud metadata
    ("http://10.1.2.3/x.png", "private"),
    ("https://192.168.0.1/x.png", "private"),
    ("http://100.64.0.1/x.png", "non-public"),
    ("http://0.0.0.0:9/x.png", "unspecified"),
])
def test_non_public_addresses_are_refused_by_default(url, why):
    with pytest.raises(ValueError, match=f"is a {why} address"):
        check_url(url, None)


def test_only_listed_hosts_when_a_list_is_given():
    with pytest.raises(ValueError, match="'example.com' is not in --allowed-media-domains"):
        check_url("https://example.com/cat.png", ["upload.wikimedia.org"])
    with pytest.raises(ValueError, match="only http"):
        check_url("ftp://example.com/cat.png", None)


def test_a_listed_host_is_fetched_from_the_checked_address(host, port):
    assert _fetch(f"http://localhost:{port}/cat.png") == BODY
    assert host.hosts == [f"localhost:{port}"]  # the name travels in Host; the connection went to its IP
    pinned, host_header, _, host = check_url(f"http://LOCALHOST:{port}/a?b=1", ["localhost"])
    assert pinned.startswith(("http://127.0.0.1:", "http://[::1]:")) and pinned.endswith("/a?b=1")
    assert host == "localhost"


def test_every_redirect_hop_is_checked(port):
    hop = "/to/http://localhost:PORT"
    assert _fetch(f"http://localhost:{port}{hop}/cat.png") == BODY  # a hop to a listed host
    with pytest.raises(ValueError, match="'127.0.0.1' is not in --allowed-media-domains"):
        _fetch(f"http://localhost:{port}/to/http://127.0.0.1:PORT/cat.png")  # a listed host sends us elsewhere
    with pytest.raises(ValueError, match="is a loopback address"):
        _fetch(f"http://localhost:{port}/to/http://127.0.0.1:PORT/cat.png", domains=None)
    with pytest.raises(ValueError, match="redirects are refused"):
        _fetch(f"http://localhost:{port}{hop}/cat.png", allow_redirects=False)
    with pytest.raises(ValueError, match="more than 5 redirects"):
        _fetch(f"http://localhost:{port}{hop * 6}/cat.png")


def test_size_and_time_limits(port):
    with pytest.raises(ValueError, match="larger than 4096 bytes"):
        _fetch(f"http://localhost:{port}/big")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="timed out after 0.5 s"):
        _fetch(f"http://localhost:{port}/slow", timeout_s=0.5)
    assert time.monotonic() - t0 < 2.5
