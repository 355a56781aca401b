"""Step traces of real runs, and their replay on random weights of bigger architectures.

`speculant bench --trace FILE` writes every decoding step of every run; `speculant replay FILE --shape
qwen2.5-32b --draft-shape qwen2.5-0.5b --device cuda` re-runs exactly those passes (same pass sizes, same
positions, same number of draft steps) with random weights of the named architectures, so a machine without
our model weights (a rented GPU) can measure what speculation would gain there.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import SettingsError

TRACE_FORMAT = "speculant-trace/1"
STEP_FIELDS = ["source", "k", "accepted", "target_pass", "draft_steps", "draft_catchup"]


def write_trace(result: dict, path: str | Path) -> Path:
    """A bench result (run with trace=True) -> a small JSON file of its runs' steps."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": TRACE_FORMAT, "models": result.get("models"), "machine": result.get("machine", {}).get("cpu"),
           "settings": {k: result["settings"].get(k) for k in ("n_predict", "temps", "top_k", "top_p", "min_p",
                                                               "seed", "suite")},
           "step_fields": STEP_FIELDS, "runs": result.get("trace", [])}
    path.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    return path


def read_trace(path: str | Path) -> dict:
    """A trace file -> its dict; a clear SettingsError for anything else."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise SettingsError(f"trace file {path} does not exist (write one with `speculant bench --trace FILE`)") from None
    except (OSError, ValueError) as e:
        raise SettingsError(f"trace file {path} is not readable JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != TRACE_FORMAT or not isinstance(doc.get("runs"), list):
        raise SettingsError(f"{path} is not a speculant trace (expected format {TRACE_FORMAT!r})")
    return doc
