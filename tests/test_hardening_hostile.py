"""Hostile input against a real server.

A million docs, lengths near 2^63, floats, NaN, nested garbage, a 100 MB body, slow
clients: each answered with a 4xx within a second, other clients keep being served, and
the server's resident memory (VmRSS of the server process, from /proc) stays bounded.
Also the solver's own limits: time limits above PLANNER_MAX_TIME_LIMIT_S and models too
large to build are refused up front with a message.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import httpx
import pytest

from planner_service.service.testing import ServerProcess

ANSWER_S = 1.0
"""Every hostile request is answered within this."""
BODY_TIMEOUT_S = 2.0
"""PLANNER_BODY_TIMEOUT_S of the test server."""
HEADER_TIMEOUT_S = 2.0
"""PLANNER_HEADER_TIMEOUT_S of the test server."""
MAX_BODY = 4 * 2**20
RSS_GROWTH_MIB = 64
"""Bound on the server's RSS growth over the whole suite (a 100 MB body never lands)."""
JSON = {"Content-Type": "application/json"}
GOOD = {"doc_lengths": [4099, 37, 1023, 8191, 1, 511, 2047, 3001], "cp_size": 4}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class RssWatch:
    """Samples a process's RSS every 10 ms in a thread; ``peak`` is the largest seen."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, rss_mib(pid), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, rss_mib(self.pid))

    def __enter__(self) -> RssWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def server():
    env = {"PLANNER_MAX_TIME_LIMIT_S": "2", "PLANNER_MAX_BODY_BYTES": str(MAX_BODY),
           "PLANNER_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
           "PLANNER_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S)}
    with ServerProcess(workers=1, grpc=False, env=env) as s:
        yield s


@pytest.fixture(scope="module")
def baseline(server):
    """The server's RSS after a few ordinary requests, and a check at the end of the module
    that it stayed bounded through every hostile request."""
    with httpx.Client(base_url=server.http_url, timeout=10, headers=JSON) as c:
        for i in range(20):
            assert c.post("/v1/plan", json={**GOOD, "cp_size": 2 + i % 6}).status_code == 200
    before = rss_mib(server.proc.pid)
    with RssWatch(server.proc.pid) as watch:
        yield watch
    after = rss_mib(server.proc.pid)
    print(f"server RSS: {before:.0f} MiB before, peak {watch.peak:.0f}, {after:.0f} after")
    assert watch.peak - before < RSS_GROWTH_MIB + 32, (before, watch.peak)
    assert after - before < RSS_GROWTH_MIB, (before, after)


@pytest.fixture
def client(server, baseline):
    with httpx.Client(base_url=server.http_url, timeout=10, headers=JSON) as c:
        yield c


def timed(c: httpx.Client, method: str, path: str, **kw) -> httpx.Response:
    start = time.monotonic()
    r = c.request(method, path, **kw)
    elapsed = time.monotonic() - start
    assert elapsed < ANSWER_S, (path, r.status_code, elapsed)
    return r


def assert_4xx(r: httpx.Response, field: str | None = None) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code in (413, 422):
        data = r.json()
        assert isinstance(data["detail"], str) and data["detail"]
        if field is not None:
            assert data["field"].startswith(field), data


def raw(**fields) -> bytes:
    return json.dumps({**GOOD, **fields}).encode()


# ---- a million docs -----------------------------------------------------------------------

@pytest.mark.parametrize("method,path", [("POST", "/v1/plan"), ("POST", "/v1/compare"),
                                         ("PUT", "/v1/jobs/j/batches/b")])
def test_a_million_docs_is_refused_within_a_second(client, method, path):
    body = b'{"cp_size": 8, "doc_lengths": [' + b",".join([b"1"] * 1_000_000) + b"]}"
    assert len(body) < MAX_BODY  # so it reaches the validator, not the size limit
    r = timed(client, method, path, content=body)
    assert r.status_code == 422 and "PLANNER_MAX_DOCS" in r.json()["detail"]


def test_a_million_long_docs_is_refused_by_size(client):
    body = b'{"cp_size": 8, "doc_lengths": [' + b",".join([b"1000000"] * 1_000_000) + b"]}"
    r = timed(client, "POST", "/v1/plan", content=body)
    assert r.status_code == 413 and "PLANNER_MAX_BODY_BYTES" in r.json()["detail"]


def test_a_million_sequences_to_schedule_is_refused(client):
    body = b'{"num_ranks": 8, "memory_tokens": 4096, "sequences": [' + \
        b",".join([b"[1]"] * 1_000_000) + b"]}"
    r = timed(client, "POST", "/v1/schedule", content=body)
    assert_4xx(r)


# ---- numbers ------------------------------------------------------------------------------

BIG = [2**63 - 1, 2**63, 2**64 + 1, -(2**63), 10**400]


@pytest.mark.parametrize("value", BIG, ids=str)
def test_lengths_near_2_63_are_refused(client, value):
    for body in (raw(doc_lengths=[value]), raw(doc_lengths=[1, value, 1]), raw(cp_size=value),
                 raw(context_length=value), raw(doc_lengths=[2**62, 2**62])):
        assert_4xx(timed(client, "POST", "/v1/plan", content=body))
    assert_4xx(timed(client, "GET", "/v1/jobs/j/batches/b", params={"wait_ms": str(value)}))
    assert_4xx(timed(client, "GET", "/v1/sample", params={"context_length": str(value)}))
    assert_4xx(timed(client, "POST", "/v1/plan", content=raw(),
                     headers={"X-Planner-Deadline-Ms": str(value)}))


def test_token_sum_beyond_the_limit_is_refused_with_its_setting(client):
    r = timed(client, "POST", "/v1/plan", content=raw(doc_lengths=[2**24] * 64))
    assert r.status_code == 422 and "PLANNER_MAX_TOKENS" in r.json()["detail"]


@pytest.mark.parametrize("fields,field", [
    ({"doc_lengths": [1.5]}, "doc_lengths"), ({"doc_lengths": [4.0]}, "doc_lengths"),
    ({"doc_lengths": [1e308]}, "doc_lengths"), ({"cp_size": 4.5}, "cp_size"),
    ({"cp_size": 1e-320}, "cp_size"), ({"imbalance_target": 1e308}, "imbalance_target"),
    ({"imbalance_target": -0.0}, "imbalance_target"), ({"context_length": 0.5}, "context_length"),
    ({"options": {"time_limit_s": 1e308}, "strategy": "ilp"}, "options.time_limit_s"),
])
def test_floats_are_refused_naming_the_field(client, fields, field):
    assert_4xx(timed(client, "POST", "/v1/plan", content=raw(**fields)), field)


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e99999", "-1e99999"])
def test_nan_and_infinity_are_refused(client, token):
    template = json.dumps({**GOOD, "imbalance_target": "X"}).replace('"X"', token)
    assert_4xx(timed(client, "POST", "/v1/plan", content=template.encode()))
    for place in ('"doc_lengths": [X]', '"cp_size": X'):
        body = "{" + place.replace("X", token) + ', "strategy": "flashcp"}'
        assert_4xx(timed(client, "POST", "/v1/plan", content=body.encode()))
    ilp = json.dumps({**GOOD, "strategy": "ilp", "options": {"time_limit_s": "X"}})
    assert_4xx(timed(client, "POST", "/v1/plan", content=ilp.replace('"X"', token).encode()),
               "options")
    assert_4xx(timed(client, "POST", "/v1/plan",
                     headers={"X-Planner-Deadline-Ms": token}, content=raw()))


# ---- garbage ------------------------------------------------------------------------------

DEEP = 100_000
GARBAGE = [
    b"", b"null", b"[]", b"42", b'"plan"', b"{", b"}", b"\xff\xfe\x00garbage", b"\x00" * 1000,
    b"[" * DEEP + b"]" * DEEP, b'{"a":' * DEEP + b"1" + b"}" * DEEP,
    b'{"doc_lengths": ' + b"[" * DEEP + b"1" + b"]" * DEEP + b', "cp_size": 4}',
    raw(doc_lengths=[[1, 2], [3]]), raw(doc_lengths="1,2,3"), raw(doc_lengths=None),
    raw(doc_lengths={"0": 1}), raw(doc_lengths=[True, False]), raw(cp_size="4"),
    raw(strategy=["flashcp"]), raw(strategy="x" * 10_000), raw(model={"num_heads": {}}),
    raw(model="llama"), raw(options=[1, 2]), raw(options={"x" * 1000: 1}),
    raw(unknown_field={"a": [1, {"b": None}]}), raw(comm_mode="🙂" * 100),
    json.dumps({**GOOD, "options": {"time_limit_s": 1}}).encode()[:-7],
    b'{"doc_lengths": [1], "cp_size": 4, "doc_lengths": [2, "x"]}',
]


def test_nested_garbage_is_refused(client):
    for body in GARBAGE:
        for path in ("/v1/plan", "/v1/compare", "/v1/schedule"):
            assert_4xx(timed(client, "POST", path, content=body))
        assert_4xx(timed(client, "PUT", "/v1/jobs/j/batches/b", content=body))


def test_deep_options_of_a_real_strategy_are_refused(client):
    for depth in (200, 20_000):
        deep = '{"k": [' * depth + "1" + "]}" * depth
        for strategy, option in (("ilp", "objective"), ("fcp", "intra"), ("fcp", "profile")):
            body = json.dumps({**GOOD, "strategy": strategy, "options": {option: "X"}})
            r = timed(client, "POST", "/v1/plan", content=body.replace('"X"', deep).encode())
            assert_4xx(r)


def test_fcp_profile_cannot_read_server_files(client):
    for path in ("file:/etc/passwd", "file:/proc/self/environ", "../../etc/passwd"):
        r = timed(client, "POST", "/v1/plan",
                  content=raw(strategy="fcp", options={"profile": path}))
        assert_4xx(r, "options")


def test_bad_ids_headers_and_queries_are_refused(client):
    for job, batch in (("x" * 129, "b"), ("j", "-b"), ("j", "b%20c"), ("%00", "b")):
        assert_4xx(timed(client, "PUT", f"/v1/jobs/{job}/batches/{batch}", content=raw()))
        assert_4xx(timed(client, "GET", f"/v1/jobs/{job}/batches/{batch}"))
    for params in ({"wait_ms": "-1"}, {"wait_ms": "1.5"}, {"wait_ms": "NaN"}):
        assert_4xx(timed(client, "GET", "/v1/jobs/j/batches/b", params=params))
    for params in ({"dataset": "file:/etc/passwd"}, {"seed": "-1"}, {"context_length": "0"}):
        assert_4xx(timed(client, "GET", "/v1/sample", params=params))
    for value in ("-1", "0", "1.5", "abc"):
        assert_4xx(timed(client, "POST", "/v1/plan", content=raw(),
                         headers={"X-Planner-Deadline-Ms": value}))
    # Junk in the fallback report is ignored, never an error.
    for value in ("NaN", str(2**70), "-5", "x" * 1000):
        r = timed(client, "POST", "/v1/plan", content=raw(),
                  headers={"X-Planner-Fallbacks": value})
        assert r.status_code == 200


# ---- 100 MB -------------------------------------------------------------------------------

def _connect(server) -> socket.socket:
    host, port = server.http_url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def _read_status(sock: socket.socket, timeout_s: float) -> int:
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1])


def test_a_100_mb_body_is_refused_without_reading_it(server, baseline):
    hundred_mb = 100 * 2**20
    # Declared length: refused on the headers alone.
    with _connect(server) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/plan HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % hundred_mb)
        assert _read_status(sock, ANSWER_S) == 413
        assert time.monotonic() - start < ANSWER_S
    # Chunked, no length: refused once the limit is passed; the rest is never read.
    with _connect(server) as sock:
        start = time.monotonic()
        sock.sendall(b"PUT /v1/jobs/j/batches/big HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n" % 2**20 + b"1," * 2**19 + b"\r\n"
        sent = 0
        sock.settimeout(0.2)
        while sent < hundred_mb:
            if select.select([sock], [], [], 0)[0]:
                break  # the server answered
            try:
                sock.sendall(chunk)
            except OSError:  # it stopped reading (timeout) or closed
                break
            sent += 2**20
        status = _read_status(sock, ANSWER_S)
        assert time.monotonic() - start < ANSWER_S, sent
        assert status == 413 and sent < 32 * 2**20, (status, sent)
    # httpx, as a client library sends it.
    with httpx.Client(base_url=server.http_url, timeout=10, headers=JSON) as c:
        start = time.monotonic()
        try:
            r = c.post("/v1/compare", content=b"[" + b"1," * (hundred_mb // 2) + b"1]")
            assert r.status_code == 413
        except httpx.HTTPError:
            pass  # the server may close before the client finished sending: also a refusal
        assert time.monotonic() - start < 5  # most of it is the client building the body
    assert baseline.peak - rss_mib(server.proc.pid) < RSS_GROWTH_MIB + 32


# ---- slow clients -------------------------------------------------------------------------

def test_slow_clients_do_not_block_others(server, client):
    stop = threading.Event()
    socks: list[socket.socket] = []
    for i in range(48):
        sock = _connect(server)
        if i % 2:  # slowloris: headers that never end
            sock.sendall(b"POST /v1/plan HTTP/1.1\r\nHost: x\r\n")
        else:  # a body that trickles in
            sock.sendall(b"POST /v1/plan HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                         b"\r\nContent-Length: 100000\r\n\r\n{")
        socks.append(sock)

    def trickle() -> None:
        while not stop.wait(0.05):
            for i, sock in enumerate(socks):
                try:
                    sock.send(b"X-a: b\r\n"[:1] if i % 2 else b" ")
                except OSError:
                    pass

    feeder = threading.Thread(target=trickle, daemon=True)
    feeder.start()
    try:
        time.sleep(0.3)
        for i in range(30):
            r = timed(client, "POST", "/v1/plan", json={**GOOD, "cp_size": 2 + i % 7})
            assert r.status_code == 200
            assert_4xx(timed(client, "POST", "/v1/plan", content=raw(cp_size=0)), "cp_size")
        assert timed(client, "GET", "/readyz").status_code == 200
    finally:
        stop.set()
        feeder.join()
        for sock in socks:
            sock.close()


def test_a_trickling_body_is_cut_off_at_the_body_timeout(server, client):
    with _connect(server) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/plan HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Length: 100\r\n\r\n{")
        for _ in range(5):  # a byte now and then, never the whole body
            time.sleep(0.2)
            sock.send(b" ")
        assert _read_status(sock, BODY_TIMEOUT_S + ANSWER_S) == 408
        assert BODY_TIMEOUT_S <= time.monotonic() - start < BODY_TIMEOUT_S + ANSWER_S
        sock.settimeout(ANSWER_S)
        while sock.recv(4096):
            pass  # the rest of the answer; then the server closes the connection
    assert timed(client, "GET", "/readyz").status_code == 200


def _trickle_until_closed(sock: socket.socket, piece: bytes, within_s: float) -> float | None:
    """Send ``piece`` every 0.1 s until the server closes the connection; the seconds that
    took, or None if it stayed open ``within_s``."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        try:
            sock.send(piece)
            if select.select([sock], [], [], 0.1)[0] and sock.recv(4096) == b"":
                return time.monotonic() - start
        except OSError:  # reset: closed too
            return time.monotonic() - start
    return None


def test_headers_trickling_in_are_cut_off_at_the_header_timeout(server, client):
    # A new connection whose headers never end.
    with _connect(server) as sock:
        sock.sendall(b"POST /v1/plan HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        closed = _trickle_until_closed(sock, b"a", HEADER_TIMEOUT_S + ANSWER_S)
        assert closed is not None and HEADER_TIMEOUT_S - 0.2 <= closed < HEADER_TIMEOUT_S + ANSWER_S
    # A kept-alive connection: one request answered, then the next one's headers trickle.
    with _connect(server) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_status(sock, ANSWER_S) == 200
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        closed = _trickle_until_closed(sock, b"a", HEADER_TIMEOUT_S + ANSWER_S)
        assert closed is not None and closed < HEADER_TIMEOUT_S + ANSWER_S
    # Headers that take a while but end within the timeout are served.
    with _connect(server) as sock:
        for piece in (b"GET /healthz HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n"):
            sock.sendall(piece)
            time.sleep(HEADER_TIMEOUT_S / 4)
        assert _read_status(sock, ANSWER_S) == 200
    assert timed(client, "GET", "/readyz").status_code == 200


# ---- the solver's own limits (item 6) ----------------------------------------------------

def test_time_limit_above_the_server_cap_is_refused_with_its_setting(client):
    r = timed(client, "POST", "/v1/plan",
              content=raw(strategy="ilp", options={"time_limit_s": 2.5}))
    assert r.status_code == 422 and r.json()["field"] == "options.time_limit_s"
    assert "PLANNER_MAX_TIME_LIMIT_S" in r.json()["detail"] and "2" in r.json()["detail"]
    for bad in (0, -1, True, "1", [1]):
        r = timed(client, "POST", "/v1/plan",
                  content=raw(strategy="ilp", options={"time_limit_s": bad}))
        assert r.status_code == 422 and r.json()["field"] == "options.time_limit_s"


def test_a_model_too_large_to_build_is_refused_up_front(client):
    # granularity 1 on 1M tokens over 64 ranks: ~64M placement variables.
    body = raw(doc_lengths=[2**14] * 64, cp_size=64, strategy="ilp",
               options={"granularity": 1, "time_limit_s": 1})
    r = timed(client, "POST", "/v1/plan", content=body)
    assert r.status_code == 422, r.text
    assert "granularity" in r.json()["detail"]


def test_ilp_answers_within_its_capped_time_limit(client):
    body = raw(doc_lengths=[9000, 5000, 3000, 1200, 800, 400], cp_size=4, strategy="ilp",
               options={"time_limit_s": 0.5})
    start = time.monotonic()
    r = client.post("/v1/plan", content=body, timeout=30)
    assert r.status_code == 200, r.text
    assert time.monotonic() - start < 10
