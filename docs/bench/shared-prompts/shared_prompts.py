"""A prompt one slot processed, taken by another (Backend.copy_prefix), on `speculant serve` (plain Qwen 1.5B,
so prompt processing is what is timed). Two cases, one source tree per run:

  n=4: one request for 4 sampled choices of a ~900-token document's summary (-np 4). Before, each choice's slot
       processed the document itself; now the first does and the other three copy its cache.
  busy: request A streams a long answer about a document; once A's first token arrives, request B asks another
       question about the same document (-np 2). Before, B processed the document beside A's decoding; now it
       copies it from A's busy slot.

Prints each request's (or choice's) prompt tokens, cached tokens and time to first token (streamed, measured
by the client), and the total time.

    .venv/bin/python docs/bench/shared-prompts/shared_prompts.py [TREE]   # TREE: a speculant checkout (default: this one)
"""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

TREE = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[3])
PORT = 8094
DOC = "The lighthouse at Kerran Point was built in 1871 by the engineer Thomas Avery. " * 60


def serve(np_: int):
    env = {**os.environ, "PYTHONPATH": TREE}
    proc = subprocess.Popen([sys.executable, "-m", "speculant", "serve", "-m", "qwen2.5-coder-1.5b-instruct",
                             "-np", str(np_), "-c", "2048", "-t", "2", "--port", str(PORT), "--log-level", "warning"],
                            env=env, cwd=TREE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{PORT}"
    for _ in range(300):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError("the server did not start")


def stream(url: str, body: dict, first=None) -> dict:
    """One streamed chat request: per choice the time to its first token; usage; total seconds."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0, ttft, usage = time.perf_counter(), {}, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=900) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk.get("choices", []):
                if c.get("delta", {}).get("content") and c["index"] not in ttft:
                    ttft[c["index"]] = time.perf_counter() - t0
                    if first is not None:
                        first.set()
    return {"ttft": ttft, "usage": usage, "total": time.perf_counter() - t0}


def cached_of(usage) -> list:
    spec = usage.get("speculative")
    return [s.get("cached_prompt_tokens") for s in (spec if isinstance(spec, list) else [spec])]


def main() -> None:
    proc, url = serve(4)
    try:
        got = stream(url, {"messages": [{"role": "user", "content": DOC + "\n\nSummarize the text in one sentence."}],
                           "max_tokens": 16, "temperature": 0.8, "seed": 1, "n": 4})
        print(f"n=4: prompt {got['usage']['prompt_tokens']} tokens, cached per choice {cached_of(got['usage'])}, "
              f"first token per choice {[round(got['ttft'][i], 2) for i in sorted(got['ttft'])]} s, "
              f"total {got['total']:.2f} s", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    proc, url = serve(2)
    try:
        first = threading.Event()
        out = {}
        a = threading.Thread(target=lambda: out.update(a=stream(url, {
            "messages": [{"role": "user", "content": DOC + "\n\nWrite a long story about this lighthouse."}],
            "max_tokens": 200, "temperature": 0}, first)))
        a.start()
        first.wait(600)
        b = stream(url, {"messages": [{"role": "user", "content": DOC + "\n\nWho built the lighthouse?"}],
                         "max_tokens": 16, "temperature": 0})
        a.join()
        print(f"busy: A prompt {out['a']['usage']['prompt_tokens']} tokens, first token {out['a']['ttft'][0]:.2f} s; "
              f"B (sent at A's first token) prompt {b['usage']['prompt_tokens']} tokens, cached {cached_of(b['usage'])}, "
              f"first token {b['ttft'][0]:.2f} s, total {b['total']:.2f} s", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
