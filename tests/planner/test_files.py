"""Output files: written atomically (a failed write keeps the old file whole), and bad paths named before any work."""

from __future__ import annotations

import numpy as np
import pytest

from ds_cobalt.planner import files
from ds_cobalt.planner.layout import contiguous_layout, load_layout, save_layout
from ds_cobalt.planner.trace import Trace, load_trace, save_trace


def _trace(tokens: int) -> Trace:
    rng = np.random.default_rng(tokens)
    return Trace(rng.integers(0, 8, size=(1, tokens, 2)), 8, np.zeros(tokens, dtype=np.int64))


def test_a_failed_write_keeps_the_old_file_whole(tmp_path, monkeypatch) -> None:
    path = tmp_path / "t.npz"
    save_trace(_trace(16), path)

    def full_disk(fh, **fields) -> None:
        fh.write(b"PK\x03\x04 half a zip")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez_compressed", full_disk)
    with pytest.raises(OSError, match=r"could not write .*t\.npz: No space left on device"):
        save_trace(_trace(64), path)
    monkeypatch.undo()
    assert load_trace(path).num_tokens == 16  # the old trace, readable
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.npz"]  # no temporary file left

    layout_path = tmp_path / "layout.json"
    save_layout(contiguous_layout(8, 2, 2), layout_path)
    monkeypatch.setattr(files.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(5, "I/O error")))
    with pytest.raises(OSError, match="could not write"):
        save_layout(contiguous_layout(8, 2, 2), layout_path)
    monkeypatch.undo()
    assert load_layout(str(layout_path)).num_experts == 8
    assert not (tmp_path / "layout.json.tmp").exists()


def test_output_paths_are_checked_before_any_work(tmp_path) -> None:
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match=r"--out .*a_file/t\.npz: the directory .* does not exist"):
        files.check_output_file(str(tmp_path / "a_file" / "t.npz"), "--out")
    with pytest.raises(ValueError, match="is a directory"):
        files.check_output_file(str(tmp_path), "--out")
    files.check_output_file(str(tmp_path / "new.npz"), "--out")  # writable: no error
