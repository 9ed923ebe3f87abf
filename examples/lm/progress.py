"""A one-line text progress bar: step, loss, tokens/s. No dependency beyond the stdlib.

On a terminal it redraws in place a few times a second; in a log (CI, a pipe) it prints a
line at every tenth of the run instead, so the log stays short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

REDRAW_SECONDS = 0.25
LOG_LINES_PER_RUN = 10
BAR_WIDTH = 24


class ProgressBar:
  def __init__(self, label: str, total_steps: int, stream: TextIO = sys.stdout):
    self._label = label
    self._total = total_steps
    self._stream = stream
    self._interactive = stream.isatty()
    self._last_draw = 0.0
    self._last_logged_tenth = -1

  def update(self, step: int, loss: float, tokens_per_second: float) -> None:
    """step counts completed steps, 1..total_steps."""
    bar = "#" * (BAR_WIDTH * step // self._total)
    line = (
      f"{self._label:>12} [{bar:<{BAR_WIDTH}}] {step:>5}/{self._total} "
      f"loss {loss:6.3f}  {tokens_per_second:9,.0f} tok/s"
    )
    if self._interactive:
      now = time.monotonic()
      if now - self._last_draw >= REDRAW_SECONDS or step == self._total:
        self._stream.write("\r" + line)
        self._stream.flush()
        self._last_draw = now
    else:
      tenth = LOG_LINES_PER_RUN * step // self._total
      if tenth > self._last_logged_tenth:
        self._stream.write(line + "\n")
        self._last_logged_tenth = tenth

  def close(self) -> None:
    if self._interactive:
      self._stream.write("\n")
    self._stream.flush()
