"""Concurrent requests on one model: their passes merge into one forward pass.

Each request runs its own decode loop (engine.py) on its own thread, over its own slot of a shared model
(a sequence of one llama.cpp context: backends/llamacpp.py). A slot's pass is handed to the `Gatherer`,
which holds it until every busy request has a pass waiting (or `gather_s` has passed since the oldest
one), then runs the waiting passes of one model as a single forward pass. Requests in step (draft, verify,
draft, ...) therefore share each weight read, which is what a CPU pass costs: two requests' 1-token passes
cost 1.2 target steps, not 2.

One gatherer serves every shared model of the process (target and draft), so one pass runs at a time: two
concurrent passes would only fight over the same cores, and a request waiting on the draft model counts as
waiting, not as late, for the target's pass. When passes of both wait, the cheaper model's go first (the
draft's): a request still drafting then reaches its verify pass, which merges with the others' instead of
running alone. Every pass runs on one thread of its own: ggml's OpenMP keeps a team of threads per calling
thread, and passes called from each request's thread in turn left idle teams competing with the working
one (a merged pass took ~20% longer).

Nothing here can change a request's output: a merged pass computes each sequence's logits with the same
bits as a pass of that sequence alone (the batch-invariant kernels, and a KV stream per sequence:
tests/test_batching.py), so which passes merge is only a question of speed.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


DECODE_TOKENS = 8  # passes of at most this many tokens a sequence time a model's decode steps


@dataclass
class Job:
    """One pass of one sequence, waiting to run: `run(group)` of its model computes it."""

    model: Any  # the shared model (an object with run_group(jobs) -> None that sets each job's result)
    seq: int
    start: int  # position of tokens[0]
    tokens: list[int]
    n_logits: int
    thread: int = field(default_factory=threading.get_ident)
    since: float = field(default_factory=time.perf_counter)
    result: Any = None
    error: Optional[BaseException] = None
    done: bool = False


class Gatherer:
    """Holds passes until every busy request has one waiting, then runs one model's waiting passes together."""

    def __init__(self, gather_s: float = 0.02):
        self.gather_s = gather_s  # the longest a pass waits for the other busy requests' passes
        self._cond = threading.Condition()
        self._pending: list[Job] = []
        self._busy: dict[int, int] = {}  # thread id -> requests it has open (a request is one thread's loop)
        self._running = False
        self._runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="speculant-pass")
        self._pass_s: dict[int, float] = {}  # id(model) -> its recent pass time, seconds (which goes first)
        self._free_since = 0.0  # when the last pass ended: a pass waits for the others from then on
        self.passes = 0  # forward passes run (merged or alone): how well requests were kept in step
        self.jobs = 0

    def busy(self, on: bool, key: Optional[int] = None) -> None:
        """A thread (key; default: the calling one) starts (on) or ends a request: while it is busy, its
        passes are waited for."""
        with self._cond:
            me = key if key is not None else threading.get_ident()
            n = self._busy.get(me, 0) + (1 if on else -1)
            if n > 0:
                self._busy[me] = n
            else:
                self._busy.pop(me, None)
            self._cond.notify_all()

    def busy_count(self) -> int:
        """Requests in progress (threads that called busy(True) and not yet busy(False))."""
        with self._cond:
            return len(self._busy)

    def submit(self, job: Job, choose: Callable[[list[Job]], list[Job]]) -> Any:
        """Run `job` (merged with others of its model that `choose` picks from the waiting ones); its result."""
        with self._cond:
            self._pending.append(job)
            self._cond.notify_all()
            while not job.done:
                wait = self._wait_s()
                if not self._running and wait <= 0:
                    # the cheapest model's oldest waiting pass goes, with whatever merges with it
                    head = min(self._pending, key=lambda j: self._pass_s.get(id(j.model), 0.0))
                    group = choose([j for j in self._pending if j.model is head.model])
                    assert head in group
                    for j in group:
                        self._pending.remove(j)
                    self._running = True
                    self._cond.release()
                    t = time.perf_counter()
                    future = self._runner.submit(head.model.run_group, group)
                    try:
                        future.result()
                    except BaseException as e:  # every job of the failed pass hears of it
                        for j in group:
                            j.error = j.error or e
                    finally:
                        # Ctrl-C while the pass ran: it still writes these sequences' caches, so it ends before
                        # anything (a rewind of the interrupted request's sequence, the next pass) may go on
                        while not future.done():
                            try:
                                wait_for([future])
                            except KeyboardInterrupt:  # another Ctrl-C: the pass still has to end
                                pass
                        self._cond.acquire()
                        self._running = False
                        seconds = time.perf_counter() - t
                        if max(len(j.tokens) for j in group) <= DECODE_TOKENS:  # a prompt's pass says nothing
                            self._pass_s[id(head.model)] = 0.8 * self._pass_s.get(id(head.model), seconds) \
                                + 0.2 * seconds
                        self._free_since = time.perf_counter()
                        self.passes += 1
                        self.jobs += len(group)
                        for j in group:
                            j.done = True
                        self._cond.notify_all()
                else:
                    self._cond.wait(timeout=None if self._running else wait)
        if job.error is not None:
            raise job.error
        return job.result

    def run_alone(self, fn: Callable[[], Any]) -> Any:
        """fn() on the pass thread while no pass runs (a change to several sequences' caches at once, e.g. a
        KV stream copied from one slot to another); its result."""
        with self._cond:
            while self._running:
                self._cond.wait()
            self._running = True
        try:
            return self._runner.submit(fn).result()
        finally:
            with self._cond:
                self._running = False
                self._cond.notify_all()

    def _wait_s(self) -> float:
        """How much longer the oldest pass should wait for the other busy requests (<= 0: run now)."""
        if not self._pending:
            return 1.0
        waiting = {j.thread for j in self._pending}
        if all(t in waiting for t in self._busy):
            return 0.0
        return max(self._pending[0].since, self._free_since) + self.gather_s - time.perf_counter()


GATHERER = Gatherer()  # the process's one gatherer (see the module docstring)
