"""Probe the planner's HTTP health endpoints from inside its container: exit 0 if healthy.

    python healthcheck.py [/healthz | /readyz] [--timeout SECONDS]

Used by the image's HEALTHCHECK and by Kubernetes exec probes where the planner binds
127.0.0.1 (a sidecar): kubelet's httpGet probes connect to the pod IP, which a localhost
bind does not answer. Reads the same ``PLANNER_HOST`` and ``PLANNER_HTTP_PORT`` as the
service; a wildcard bind (0.0.0.0, ::) is probed on loopback. Standard library only, so it
runs in the slim image without curl. Exit 1 on any non-200 answer or connection failure.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping

DEFAULT_HOST = "127.0.0.1"
DEFAULT_HTTP_PORT = 8000
PATHS = ("/healthz", "/readyz")
_WILDCARDS = {"", "0.0.0.0", "::", "[::]"}


def probe_url(path: str, env: Mapping[str, str] | None = None) -> str:
    """The URL to probe for ``path`` given the service's environment.

    Raises ValueError if ``path`` is not a health path or PLANNER_HTTP_PORT is not a port.
    """
    env = os.environ if env is None else env
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    host = env.get("PLANNER_HOST", DEFAULT_HOST).strip()
    if host in _WILDCARDS:
        host = DEFAULT_HOST
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"  # a bare IPv6 literal needs brackets in a URL
    raw_port = env.get("PLANNER_HTTP_PORT", str(DEFAULT_HTTP_PORT)).strip()
    if not raw_port.isdigit() or not 1 <= int(raw_port) <= 65535:
        raise ValueError(f"PLANNER_HTTP_PORT must be an integer in [1, 65535], got {raw_port!r}")
    return f"http://{host}:{int(raw_port)}{path}"


def check(url: str, timeout_s: float) -> tuple[bool, str]:
    """GET ``url``; (True, reason) on HTTP 200, (False, reason) otherwise. Never raises."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200, f"{url}: HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        return False, f"{url}: HTTP {exc.code}"
    except (OSError, ValueError) as exc:  # refused, timed out, reset, bad URL
        return False, f"{url}: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default="/healthz", choices=PATHS)
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds (default 3)")
    args = parser.parse_args(argv)
    try:
        url = probe_url(args.path)
    except ValueError as exc:
        print(f"healthcheck: {exc}", file=sys.stderr)
        return 1
    ok, reason = check(url, args.timeout)
    print(f"healthcheck: {reason}", file=sys.stderr if not ok else sys.stdout)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
