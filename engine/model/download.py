"""Download progress for a hub model's shard files, as progress(done, total, what) calls.

huggingface_hub draws its progress with a tqdm class that hf_hub_download accepts as
`tqdm_class`; `progress_bar_class` builds a stand-in that draws nothing and reports
the bytes written so far instead (plain HTTP and Xet downloads alike: given a class
with `update_transfer`, the Xet path keeps one bar for the file, counted in bytes on
disk). Reports come at most every `every_s` seconds, and always at the start and end.
"""

from __future__ import annotations

import logging
import re
import threading
import time

log = logging.getLogger("potluck.download")


def _size(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


_SHARD = re.compile(r"model-(\d+)-of-(\d+)\.safetensors")


def describe(filename: str, done: int, total: int) -> str:
    """'downloading the model, part 1 of 4 (1.2 of 4.9 GB)': what a person reads under a
    progress bar (a shard's file name means nothing to them; its place among the parts
    says why the bar starts again)."""
    shard = _SHARD.fullmatch(filename)
    what = ("the model" if filename == "model.safetensors" else
            f"the model, part {int(shard[1])} of {int(shard[2])}" if shard else filename)
    if not total:
        return f"downloading {what} ({_size(done)})"
    if total >= 1e9:
        return f"downloading {what} ({done / 1e9:.1f} of {total / 1e9:.1f} GB)"
    return f"downloading {what} ({done / 1e6:.0f} of {total / 1e6:.0f} MB)"


def progress_bar_class(report, filename: str, every_s: float = 0.5):
    """A tqdm stand-in for hf_hub_download(..., tqdm_class=...) that calls
    report(done_bytes, total_bytes, what) as the file `filename` downloads."""

    class DownloadBar:
        def __init__(self, *args, total=None, initial=0, **kwargs):
            self.total = total
            self.n = int(initial or 0)  # a download resumed within the call starts past zero
            self._lock = threading.Lock()
            self._last_t = 0.0
            self._last = None
            self._emit(force=True)

        def update(self, n=1):
            with self._lock:
                self.n += int(n or 0)
            self._emit()

        def update_transfer(self, n=1):
            """Network bytes (Xet): the bar counts what reached the disk."""

        def close(self):
            self._emit(force=True)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()
            return False

        def __getattr__(self, name):  # set_postfix_str, refresh, reset, set_description...
            if name.startswith("__"):
                raise AttributeError(name)
            return lambda *args, **kwargs: None

        def _emit(self, force: bool = False):
            now = time.monotonic()
            total = int(self.total or 0)
            done = min(self.n, total) if total else self.n
            finished = bool(total) and done >= total
            if (done, total) == self._last or not (force or finished or now - self._last_t >= every_s):
                return
            self._last_t, self._last = now, (done, total)
            try:
                report(done, total, describe(filename, done, total))
            except Exception:  # a progress display must never break the download
                log.exception("download progress report failed")

    return DownloadBar
