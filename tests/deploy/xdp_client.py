"""UDP frame client for the XDP tests, run inside the client network namespace:

    python xdp_client.py HOST PORT JOBS.json  ->  prints one JSON object: replies per request id

JOBS.json: {"frames": [hex of each datagram, sent in order], "expect_replies": [request ids that
must end with a LAST frame], "timeout_s": 30, "pace_us": 0}
"""

from __future__ import annotations

import json
import socket
import sys
import time

from zlc.runtime.serve.ingress import frames


def main() -> None:
    host, port, jobs_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    jobs = json.loads(open(jobs_path).read())
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.connect((host, port))
    pending = set(jobs["expect_replies"])
    replies: dict[int, list[list[int]]] = {}
    pace = jobs.get("pace_us", 0) * 1e-6
    for h in jobs["frames"]:
        s.send(bytes.fromhex(h))
        if pace:
            time.sleep(pace)
    deadline = time.monotonic() + jobs.get("timeout_s", 30)
    s.settimeout(0.5)
    while pending and time.monotonic() < deadline:
        try:
            data = s.recv(65536)
        except TimeoutError:
            continue
        for f in frames.decode_results(bytearray(data)):
            replies.setdefault(f.request_id, []).append([f.flags, *f.tokens])
            if f.flags & frames.FrameFlag.LAST:
                pending.discard(f.request_id)
    try:  # stragglers, e.g. answers to frames that expect none
        s.settimeout(jobs.get("linger_s", 0.3))
        while True:
            for f in frames.decode_results(bytearray(s.recv(65536))):
                replies.setdefault(f.request_id, []).append([f.flags, *f.tokens])
    except TimeoutError:
        pass
    print(json.dumps({"replies": replies, "missing": sorted(pending)}))


if __name__ == "__main__":
    main()
