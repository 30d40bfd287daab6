"""The speed report's writers (tables, plots, the generated RESULTS.md section) on synthetic numbers;
the timing itself needs a GPU and runs from benchmarks/speed.py."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
speed = pytest.importorskip("speed")
pytest.importorskip("matplotlib")


def test_report_writes_section_and_plots(tmp_path):
    out = tmp_path / "RESULTS.md"
    out.write_text("# Results\n\nhand-written text\n")
    series = {"turboquant_4bit_nc": [10.0, 20.0], "sdpa_bf16": [30.0, 60.0]}
    results = {"context": series, "batch": series, "store": {"turboquant_4bit_nc": [1.0, 2.0]},
               "axes": {"context": [1024, 4096], "batch": [1, 4], "store": [1, 64]}}
    speed.report(results, str(out), "test GPU", "abc1234")
    speed.report(results, str(out), "test GPU", "abc1234")  # regenerating replaces, not appends
    text = out.read_text()
    assert text.count("<!-- speed:begin") == 1 and "hand-written text" in text
    assert "| 4096 | 20.0 | 60.0 |" in text
    for png in ("decode_vs_context.png", "decode_vs_batch.png", "store_vs_tokens.png"):
        assert (tmp_path / png).stat().st_size > 1000
