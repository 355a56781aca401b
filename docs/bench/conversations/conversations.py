"""Two chat conversations in turn on `speculant serve -np 2` (plain Qwen 1.5B, so prompt processing is what is
timed): each turn is the conversation so far (a ~600-token document, the questions and the answers) plus a new
question, turns alternating A1 B1 A2 B2 A3 B3. Prints each turn's prompt tokens, cached prompt tokens and time
to first token (a streamed request, measured by the client). One source tree per run:

    .venv/bin/python docs/bench/conversations/conversations.py [TREE]   # TREE: a speculant checkout (default: this one)
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

TREE = sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).resolve().parents[3])
PORT = 8093
DOCS = {
    "A": "The lighthouse at Kerran Point was built in 1871 by the engineer Thomas Avery. " * 40,
    "B": "Sourdough bread needs flour, water, salt and a starter kept alive with daily feedings. " * 40,
}
QUESTIONS = ["Summarize the text in one sentence.", "What is the main subject?", "Give one more detail."]


def main() -> None:
    env = {**os.environ, "PYTHONPATH": TREE}
    server = subprocess.Popen([sys.executable, "-m", "speculant", "serve", "-m", "qwen2.5-coder-1.5b-instruct",
                               "-np", "2", "-c", "4096", "-t", "2", "--port", str(PORT), "--log-level", "warning"],
                              env=env, cwd=TREE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{PORT}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        chats = {k: [{"role": "user", "content": f"{doc}\n\n{QUESTIONS[0]}"}] for k, doc in DOCS.items()}
        for turn in range(len(QUESTIONS)):
            for k in DOCS:
                if turn:
                    chats[k].append({"role": "user", "content": QUESTIONS[turn]})
                body = {"messages": chats[k], "max_tokens": 24, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}
                t0, ttft, text, usage = time.perf_counter(), None, "", None
                with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                        for c in chunk.get("choices", []):
                            piece = c.get("delta", {}).get("content")
                            if piece:
                                ttft = ttft or time.perf_counter() - t0
                                text += piece
                chats[k].append({"role": "assistant", "content": text})
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                print(f"{k}{turn + 1}: prompt {usage['prompt_tokens']} tokens, cached {cached}, "
                      f"time to first token {ttft:.2f} s", flush=True)
    finally:
        server.terminate()
        server.wait(60)


if __name__ == "__main__":
    main()
