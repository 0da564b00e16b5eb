"""traces/record.py --out: a missing directory is made; one that cannot be is named, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from .test_sample_traces import TRACES, recorder


def test_a_missing_out_directory_is_made(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "new" / "traces"
    assert recorder(monkeypatch).main(["mlp", "--out", str(out)]) == 0
    assert (out / "mlp.b64.trace.csv").read_bytes() == (TRACES / "mlp.b64.trace.csv").read_bytes()


def test_an_out_that_is_a_file_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(SystemExit) as exited:
        recorder(monkeypatch).main(["mlp", "--out", str(afile / "sub")])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"traces/record.py: error: --out {afile}/sub cannot be a directory: Not a directory"
    )
