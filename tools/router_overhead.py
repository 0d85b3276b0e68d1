"""The latency a router adds per request: the same one-token chat request, alternately through the
router and straight to one instance, sequentially (one request in flight), N times each.

    python tools/router_overhead.py --router http://127.0.0.1:30000 --direct http://127.0.0.1:8001 \
        --model smollm2-135m --n 60

Prints the median and p90 wall time of each path and the median difference. Alternating the two
paths request by request lets drift of a shared machine hit both alike; every request carries its
own session key, so none reuses a prefix the other path left in a slot.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time
from urllib.parse import urlsplit


def one(base: str, model: str, session: str) -> float:
    """Seconds for one complete non-streamed one-token chat completion (a fresh connection)."""
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1,
                       "temperature": 0})
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"Content-Type": "application/json", "X-SMG-Routing-Key": session})
    resp = conn.getresponse()
    resp.read()
    dt = time.perf_counter() - t0
    conn.close()
    if resp.status != 200:
        raise SystemExit(f"{base}: HTTP {resp.status}")
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", required=True)
    ap.add_argument("--direct", required=True, help="one instance behind the router")
    ap.add_argument("--model", required=True)
    ap.add_argument("--n", type=int, default=60)
    args = ap.parse_args()
    for _ in range(3):  # warm both paths (connection pools, compiled shapes)
        one(args.router, args.model, "warm")
        one(args.direct, args.model, "warm")
    routed, direct = [], []
    for i in range(args.n):  # a session of its own for every request: each one is a prefix-cache miss
        routed.append(one(args.router, args.model, f"routed-{i}"))
        direct.append(one(args.direct, args.model, f"direct-{i}"))
    q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    for name, xs in (("router", routed), ("direct", direct)):
        print(f"{name:7s} median {statistics.median(xs) * 1000:7.1f} ms   p90 {q(xs, 0.9) * 1000:7.1f} ms")
    diffs = [a - b for a, b in zip(routed, direct)]
    print(f"added   median {statistics.median(diffs) * 1000:7.1f} ms per request (n={args.n})")


if __name__ == "__main__":
    main()
