"""An editor's /infill requests while the user types a line, through two real servers: plain decoding against
prompt lookup then the draft model. What the user waits for per request, and where it goes.

Like llama.vim: as the user types the first line of a 3-line gap (infill_bench.cases), a request every 4
characters with the text before the cursor's line as input_prefix, the line up to the cursor as prompt, the text
after the gap as input_suffix, the other sample files of the language as input_extra, n_indent = the line's
indentation, n_predict 32, greedy. The two servers get each request in turn (which goes first alternates); their
answers must be identical. Prints per server the wall time per request, the prompt tokens evaluated (not
cached) and their time, the tokens written and the decoding time.
With --spm-infill both servers get that flag (the suffix before the prefix: only the cursor's line is new).
Usage: python docs/bench/infill/typing_bench.py [cases (default 4)] [--spm-infill]
"""
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from infill_bench import cases  # noqa: E402

from speculant import models  # noqa: E402
from speculant.server import spawn_local  # noqa: E402

SERVE = ["-m", models.DEFAULT_TARGET, "-c", "4096", "-t", "2", "-np", "1"]


def main(n_cases=4, flags=()):
    exe = str(Path(sys.executable).with_name("speculant"))
    servers = {}
    for name, extra in (("plain", []), ("lookup+draft", ["-md", models.DEFAULT_DRAFT, "--lookup"])):
        proc, url = spawn_local(SERVE + list(flags) + extra, timeout=300, exe=exe, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        servers[name] = (proc, url)
    totals = {name: {"wall": 0.0, "prompt_n": 0, "prompt_ms": 0.0, "predicted_n": 0, "predicted_ms": 0.0}
              for name in servers}
    n_requests = 0
    first = {}  # the servers' first request: (wall s, prompt ms)
    try:
        # cases with other files and a cursor after some text, spread over the files
        picked = [c for c in cases(3) if c[4] and c[2].strip()][::2][:n_cases]
        for case_name, prefix, middle, suffix, extra in picked:
            line = middle  # the cursor is halfway into the line: the user types it from its indentation on
            indent = len(line) - len(line.lstrip())
            for k in sorted(set(range(indent + 1, len(line), 4)) | {len(line)}):
                body = {"input_prefix": prefix, "input_suffix": suffix, "prompt": line[:k],
                        "input_extra": [{"filename": f, "text": t} for f, t in extra], "n_predict": 32,
                        "n_indent": indent, "temperature": 0}
                order = list(servers) if n_requests % 2 == 0 else list(servers)[::-1]
                got = {}
                for name in order:
                    t = time.perf_counter()
                    r = httpx.post(servers[name][1] + "/infill", json=body, timeout=600).json()
                    wall = time.perf_counter() - t
                    got[name] = r["content"]
                    first.setdefault(name, (wall, r["timings"]["prompt_ms"]))
                    tot = totals[name]
                    tot["wall"] += wall
                    for key in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms"):
                        tot[key] += r["timings"][key]
                assert got["plain"] == got["lookup+draft"], f"{case_name}: answers differ"
                n_requests += 1
            print(f"{case_name}: {n_requests} requests so far", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    for name, t in totals.items():
        print(f"{name:13s} {t['wall'] / n_requests:6.2f} s per request: {t['prompt_n'] / n_requests:6.0f} prompt "
              f"tokens evaluated in {t['prompt_ms'] / n_requests / 1000:5.2f} s, {t['predicted_n'] / n_requests:5.1f} "
              f"written in {t['predicted_ms'] / n_requests / 1000:5.2f} s "
              f"({t['predicted_n'] / (t['predicted_ms'] / 1000):5.2f} tokens/s)")
    print("first request (the server's policy has timed nothing yet): " + ", ".join(
        f"{name} {w:.2f} s ({p / 1000:.2f} s prompt processing)" for name, (w, p) in first.items()))
    plain, spec = totals["plain"], totals["lookup+draft"]
    print(f"{n_requests} requests, answers identical; lookup+draft over plain: wall {plain['wall'] / spec['wall']:.2f}x, "
          f"decoding {plain['predicted_ms'] / spec['predicted_ms']:.2f}x")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:] if not a.startswith("-")),
         flags=[a for a in sys.argv[1:] if a.startswith("-")])
