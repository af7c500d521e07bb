"""One progress bar for everything a run computes: every request type, every grid cell, on every worker.

lm-eval hands requests over one type at a time, so the bar's total grows as each type arrives; cached results
are counted apart (in the postfix) so the rate and the ETA are those of the work left. The postfix shows each
worker's requests/s and share, which is what a user watches on a cluster of uneven Macs.
"""

from __future__ import annotations

import time
from collections import Counter

from tqdm import tqdm

from driver.lm.quiet import end_when_finished


class Progress:
    def __init__(self, names: list[str] | None = None, unit: str = "worker") -> None:
        self.names = names or []  # the workers; the bar shows once they are known (hold the model)
        self.unit = unit  # what a worker is: "worker", or "group" (K nodes holding one model)
        self.bar: tqdm | None = None
        self.total = 0  # requests to compute, this bar
        self.cached = 0
        self.done: Counter = Counter()  # requests computed per worker, this bar
        self.started = 0.0
        self.note = ""
        self.what = ""
        end_when_finished(self.close_if_finished)

    def close_if_finished(self) -> None:
        """A phase line follows: a bar whose work is done ends above it (the next `expect` starts a new one)."""
        if self.bar is not None and sum(self.done.values()) >= self.total:
            self.close()

    def expect(self, n: int, cached: int, what: str) -> None:
        """`n` more requests are on their way, `cached` of them already answered from the cache. A grid (a sweep's
        pass) counts on a bar of its own once the work before it is done; lm-eval's request types share one."""
        if self.bar is not None and what != self.what and "grid" in what and sum(self.done.values()) >= self.total:
            self.close()
        self.total += n - cached
        self.cached += cached
        self.what = what
        self._show()

    def workers(self, names: list[str]) -> None:
        """The workers hold the model: the bar appears (a run whose every result is cached never shows one, and
        an error while they load is not preceded by an empty bar)."""
        self.names = names
        self._show()

    def advance(self, w: int, n: int, note: str = "") -> None:
        self.done[self.names[w]] += n
        self.note = note
        self._show()
        self.bar.update(n)

    def _show(self) -> None:
        if not self.names or (self.bar is None and not self.total):
            return  # no worker holds the model yet, or nothing to compute yet
        label = f"{self.what} on {len(self.names)} {self.unit}{'s' * (len(self.names) != 1)}"
        if self.bar is None:  # labelled from its first line on; TQDM_DISABLE=1 silences it
            self.bar = tqdm(total=self.total, desc=label, unit="req", dynamic_ncols=True)
            self.started = time.monotonic()
        self.bar.total = self.total
        seconds = max(time.monotonic() - self.started, 1e-9)
        total = sum(self.done.values()) or 1
        rates = [f"{name.split('@')[0]} {self.done[name] / seconds:.1f}/s {self.done[name] / total:.0%}" for name in self.names]
        parts = [self.note] if self.note else []
        parts += [f"{self.cached} cached"] if self.cached else []
        self.bar.set_description_str(label, refresh=False)
        self.bar.set_postfix_str(" | ".join(parts + rates), refresh=False)

    def close(self) -> None:
        """End this bar (before printing results); the next `expect` starts counting a new one."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.total, self.cached, self.done, self.note = 0, 0, Counter(), ""
