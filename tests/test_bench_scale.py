"""bench.scale's quick mode end to end (no timing asserted)."""

from __future__ import annotations

import json

from bench import scale


def test_quick_mode_writes_the_table_the_plot_and_the_figures(tmp_path):
    out = tmp_path / "scale.md"
    scale.main(["--quick", "--out", str(out)])
    text = out.read_text()
    assert "python -m bench.scale --quick" in text and "load average" in text
    for section in ("## Against N", "## Against the number of documents", "## Adversarial inputs",
                    "## Quality"):
        assert section in text
    figures = json.loads(out.with_suffix(".json").read_text())
    assert figures["n_sweep"] and figures["doc_sweep"] and figures["adversarial"]
    assert set(figures["exponents"]) == {"n", "docs"}
    for cell in figures["quality"]:
        assert cell["allgather_saving_mean"] >= cell["paper_allgather_saving_mean"] - 1e-12
    assert out.with_suffix(".png").stat().st_size > 0
