"""Download progress for hub shard files: huggingface_hub's progress-bar hook turned into
progress(done, total, what), through huggingface_hub's own bar plumbing (no network)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine.model.download import describe, progress_bar_class

pytest.importorskip("huggingface_hub")


def test_http_path_reports_bytes_through_huggingface_hubs_bar_factory():
    from huggingface_hub.utils.tqdm import _get_progress_bar_context

    seen = []
    bar_cls = progress_bar_class(lambda d, t, w: seen.append((d, t, w)), "model-00001-of-00002.safetensors",
                                 every_s=0)
    with _get_progress_bar_context(desc="x", log_level=logging.INFO, total=3_000_000_000, initial=0,
                                   name="huggingface_hub.http_get", tqdm_class=bar_cls) as bar:
        for _ in range(3):
            bar.update(1_000_000_000)
            bar.update_transfer(1_000_000_000)   # http_get calls it when the bar has one
            bar.set_postfix_str("12 MB/s", refresh=False)
    assert [d for d, _, _ in seen] == [0, 1_000_000_000, 2_000_000_000, 3_000_000_000]
    assert all(t == 3_000_000_000 for _, t, _ in seen)
    assert seen[-1][2] == "downloading the model, part 1 of 2 (3.0 of 3.0 GB)"


def test_xet_path_keeps_one_bar_counted_on_disk():
    from types import SimpleNamespace

    from huggingface_hub.utils._xet_progress_reporting import XetDownloadProgressReporter

    seen = []
    bar_cls = progress_bar_class(lambda d, t, w: seen.append((d, t)), "model.safetensors", every_s=0)
    with XetDownloadProgressReporter(reconstruction_desc="r", transfer_desc="t", total=1000, log_level=logging.INFO,
                                     name="huggingface_hub.xet_get", tqdm_class=bar_cls) as rep:
        assert rep.transfer_bar is rep.reconstruction_bar  # one bar: our class has update_transfer
        for done, sent in ((300, 200), (1000, 600)):
            rep.update_progress(SimpleNamespace(total_bytes_completed=done, total_transfer_bytes_completed=sent,
                                                total_bytes_completion_rate=None,
                                                total_transfer_bytes_completion_rate=None, total_bytes=1000))
    assert seen == [(0, 1000), (300, 1000), (1000, 1000)]


def test_reports_are_throttled_but_the_end_always_comes():
    seen = []
    bar = progress_bar_class(lambda d, t, w: seen.append(d), "f", every_s=3600)(total=100)
    for _ in range(99):
        bar.update(1)
    assert seen == [0]
    bar.update(1)
    bar.close()
    assert seen == [0, 100]


def test_a_failing_display_never_breaks_the_download():
    def broken(*a):
        raise RuntimeError("display gone")

    bar = progress_bar_class(broken, "f", every_s=0)(total=10)
    bar.update(5)
    bar.close()
    assert bar.n == 5


def test_unknown_size():
    assert describe("f.safetensors", 5_000_000, 0) == "downloading f.safetensors (5 MB)"
    assert describe("model.safetensors", 5_000_000, 0) == "downloading the model (5 MB)"
    assert describe("model-00003-of-00030.safetensors", 0, 2 * 10**9) == "downloading the model, part 3 of 30 (0.0 of 2.0 GB)"
    seen = []
    bar = progress_bar_class(lambda d, t, w: seen.append((d, t)), "f", every_s=0)(total=None)
    bar.update(7)
    assert seen[-1] == (7, 0)


def test_fetch_hands_the_callers_progress_to_the_hub_download(tmp_path, monkeypatch):
    """ModelSource.fetch passes a bar class to hf_hub_download when the caller set
    `on_download`, and nothing extra when it did not; a shard already there is not fetched."""
    import huggingface_hub
    from huggingface_hub.utils.tqdm import _get_progress_bar_context

    from engine.model.sources import ModelSource

    calls = []

    def fake_download(repo_id, filename, **kw):
        calls.append((repo_id, filename, sorted(kw)))
        out = tmp_path / "cache" / filename
        out.parent.mkdir(exist_ok=True)
        if "tqdm_class" in kw:
            with _get_progress_bar_context(desc=filename, log_level=logging.INFO, total=4, name="x",
                                           tqdm_class=kw["tqdm_class"]) as bar:
                for _ in range(4):
                    bar.update(1)
        out.write_bytes(b"1234")
        return str(out)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    root = tmp_path / "snapshot"
    root.mkdir()
    (root / "present.safetensors").write_bytes(b"x")
    src = ModelSource(spec="org/model", name="org/model", root=root, hub_id="org/model")
    assert src.fetch("a.safetensors") == tmp_path / "cache" / "a.safetensors"
    seen = []
    src.on_download = lambda d, t, w: seen.append((d, t, w))
    assert Path(src.fetch("b.safetensors")).read_bytes() == b"1234"
    assert src.fetch("present.safetensors") == root / "present.safetensors"
    assert calls == [("org/model", "a.safetensors", []), ("org/model", "b.safetensors", ["tqdm_class"])]
    assert seen[0][:2] == (0, 4) and seen[-1] == (4, 4, "downloading b.safetensors (0 of 0 MB)")
