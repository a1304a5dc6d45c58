"""A soak of `jaxlm serve`: many requests of every kind, and what the server holds after them.

The script starts `jaxlm serve` on the `--model` and sends `--warmup` requests from `--clients`
threads (the server's memory settles after a few thousand, as allocators and caches fill):
plain completions, chat completions, streams left after their first event and hostile bodies,
in turn. It reads the server's resident memory (VmRSS), then sends `--batches` batches of
`--requests` more, reading it after each. One batch measures the allocator as much as the server
(its arenas grow and shrink by hundreds of KiB at a time, see `docs/performance.md`), so the
verdict is the growth over all the batches per request. It exits 1 if a KV page is still in use
or that growth is above `--max-kib-per-request`.

Usage: python benchmarks/serve_soak.py [--model PATH] [--requests 600] [--batches 5]
    [--warmup 2400] [--clients 8] [--max-num-seqs 8] [--max-seq-len 512]
    [--max-kib-per-request 1]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import http_client
import httpx

# One request of each kind, in turn; a hostile body must answer 4xx.
KINDS = [
    ("plain", {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
    ("chat", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
    ("left", {"prompt": "Count to a hundred:", "max_tokens": 64, "stream": True}),
    ("hostile", b'{"prompt": "\\ud800", "stop": ["a", "b", "c", "d", "e"]}'),
    ("hostile", b"[" * 10_000),
]


def send(client: httpx.Client, i: int) -> None:
    kind, body = KINDS[i % len(KINDS)]
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    if kind == "left":
        with client.stream("POST", path, json=body) as r:
            next(r.iter_lines())
        return
    if kind == "hostile":
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        ok = 400 <= r.status_code < 500
    else:
        r = client.post(path, json=body)
        ok = r.status_code == 200
    if not ok:
        raise http_client.ServerError(r.status_code, r.text)


def soak(url: str, requests: int, clients: int) -> None:
    def run(c: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as client:
            for i in range(c, requests, clients):
                send(client, i)

    threads = [threading.Thread(target=run, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def pages_in_use(url: str) -> float:
    deadline = time.monotonic() + 60
    while True:
        metrics = {
            line.split()[0]: float(line.split()[1])
            for line in httpx.get(url + "/metrics").text.splitlines()
            if line.startswith("jaxlm_")
        }
        busy = metrics["jaxlm_requests_running"] + metrics["jaxlm_requests_waiting"]
        if not busy or time.monotonic() > deadline:
            return metrics["jaxlm_kv_pages_in_use"]
        time.sleep(0.1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--batches", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2400)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--max-kib-per-request", type=float, default=1.0)
    args = p.parse_args()
    port = http_client.free_port()
    server = http_client.jaxlm_server(args.model, port, args.max_num_seqs, args.max_seq_len, 16)
    with server:
        soak(server.url, args.warmup, args.clients)
        rss = [rss_kib(server.proc.pid)]
        for _ in range(args.batches):
            start = time.perf_counter()
            soak(server.url, args.requests, args.clients)
            seconds = time.perf_counter() - start
            rss.append(rss_kib(server.proc.pid))
            grown = rss[-1] - rss[-2]
            print(
                f"{args.requests} requests in {seconds:.1f} s from {args.clients} clients: "
                f"RSS {grown:+d} KiB, {grown / args.requests:+.2f} KiB a request"
            )
        pages = pages_in_use(server.url)
    per_request = (rss[-1] - rss[0]) / (args.requests * args.batches)
    print(
        f"server RSS over {args.requests * args.batches} requests: {rss[-1] - rss[0]:+d} KiB, "
        f"{per_request:+.2f} KiB a request"
    )
    print(f"KV pages in use after: {pages:g}")
    return int(pages > 0 or per_request > args.max_kib_per_request)


if __name__ == "__main__":
    sys.exit(main())
