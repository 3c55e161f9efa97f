"""The loopback package index the GPU-enable tests download from (testkit/pyindex.py):
it must speak enough HTTP for a resumable client (HEAD, Range, 416) and break exactly
as asked, or those tests would prove nothing."""

from __future__ import annotations

import hashlib
import urllib.error
import urllib.request

import pytest

from testkit.pyindex import SimpleIndex, build_wheel


def _get(url, **headers):
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
        return r.status, dict(r.headers), r.read()


def test_pages_ranges_and_faults(tmp_path):
    wheel = build_wheel(tmp_path, "torch", "2.13.0+cu999", {"torch/big.bin": bytes(range(256)) * 400},
                        tag="cp311-cp311-manylinux_2_28_x86_64")
    data = wheel.read_bytes()
    with SimpleIndex() as ix:
        name = ix.add(wheel)
        status, _, page = _get(ix.url + "/torch/")
        assert status == 200 and f'#sha256={hashlib.sha256(data).hexdigest()}' in page.decode()
        assert "torch-2.13.0%2Bcu999-cp311" in page.decode() and "data-core-metadata=" in page.decode()
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(ix.url + "/numpy/")
        assert e.value.code == 404

        url = ix.url.rsplit("/", 1)[0] + "/files/" + name.replace("+", "%2B")
        status, headers, body = _get(url, Range="bytes=100-")
        assert status == 206 and body == data[100:]
        assert headers["Content-Range"] == f"bytes 100-{len(data) - 1}/{len(data)}"
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(url, Range=f"bytes={len(data)}-")
        assert e.value.code == 416
        assert b"Requires-Dist" not in _get(url + ".metadata")[2] and b"Name: torch" in _get(url + ".metadata")[2]

        ix.fault(name, ignore_range=True)
        assert _get(url, Range="bytes=100-")[0:3:2] == (200, data)
        ix.fault(name, corrupt=True)
        body = _get(url)[2]
        assert len(body) == len(data) and body != data
        ix.fault(name, drop_after=1000, times=2)
        for _ in range(2):
            with urllib.request.urlopen(url, timeout=10) as r:
                assert r.read(1000) == data[:1000]
                with pytest.raises(Exception):
                    r.read()          # the rest never comes: IncompleteRead
        assert _get(url)[2] == data   # healed after `times` requests
        assert [s.sent for s in ix.requests(name)][-3:] == [1000, 1000, len(data)]
