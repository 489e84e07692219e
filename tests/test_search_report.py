"""Bench plumbing: suites as data, the markdown tables, search.png."""

import pytest

from shardc.commands.suites import load_suite
from shardc.errors import InputError
from shardc.search import plot_search_curve
from shardc.search.report import figure3, markdown, table1


def rows():
    out = []
    for pol, mean, best in [("rw", 10.0, 12.0), ("sa", 15.0, 18.0), ("ga", 19.0, 20.0),
                            ("rl", 19.8, 20.0), ("megatron", 19.0, 19.0), ("exact", 20.0, 20.0)]:
        out.append({"case": "c1", "policy": pol, "seeds": 1, "mean": mean, "best": best,
                    "evaluations": 4000, "wall_s": 1.0, "complete": True})
    return out


def test_suites_match_the_spec():
    paper = load_suite("paper")
    assert len(paper) == 6
    assert {c["context"] for c in paper} == {16384, 32768, 65536}
    assert all(c["mesh"] == "8x128" and c["phase"] == "decode" and c["budget"] == 4000
               and c["seeds"] == 10 and c["tpot_slo_ms"] == 50.0 for c in paper)
    zoo = load_suite("zoo")
    assert len(zoo) == 10 and {c["phase"] for c in zoo} == {"decode", "prefill"}
    with pytest.raises(InputError):
        load_suite("nope")


def test_tables_normalise_to_random_walk_and_megatron():
    t1 = table1(rows())
    line = [x.strip() for x in t1.splitlines()[2].split("|")[1:-1]]
    # case, RW abs, RW, SA, GA, RL, Megatron, exact, RL/SA, RL/RW, RL/exact
    assert line[2:8] == ["1.000", "1.500", "1.900", "1.980", "1.900", "2.000"]
    assert line[8] == "1.320" and line[10] == "99.00%"
    f3 = figure3(rows())
    line = [x.strip() for x in f3.splitlines()[2].split("|")[1:-1]]
    assert line[2:] == ["0.632", "0.947", "1.053", "1.053", "1.042", "1.053"]
    assert "Table 1" in markdown("paper", rows(), "shardc bench --suite paper")


def test_plot_search_curve_writes_a_png(tmp_path):
    path = tmp_path / "search.png"
    plot_search_curve(path, {"rl": [(64, 1.0), (128, 3.0)], "sa": [(8, 2.0)]},
                      megatron=2.5, exact=3.0)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rewrites_tables_and_keeps_hand_written_notes(tmp_path, monkeypatch):
    """`shardc bench` end to end on one zoo case: JSON rows per policy, the markdown tables,
    the plot; a second run replaces the tables but keeps the notes under NOTES_MARKER."""
    import json

    from shardc.cli import main
    from shardc.commands.bench import NOTES_MARKER

    monkeypatch.chdir(tmp_path.parent)
    argv = ["bench", "--suite", "zoo", "--cases", "mixtral-8x7b 8x1 decode", "--seeds", "1",
            "--budget", "128", "--policies", "rl,megatron", "--out", str(tmp_path),
            "--json", str(tmp_path / "zoo.json")]
    assert main(argv) == 0
    md = tmp_path / "zoo.md"
    first = md.read_text()
    assert "Table 1 shape" in first and first.rstrip().endswith(NOTES_MARKER)
    md.write_text(first.replace("mixtral-8x7b 8x1 decode", "STALE", 1) + "\nmy findings\n")
    assert main(argv) == 0
    second = md.read_text()
    assert "STALE" not in second
    assert second.endswith(NOTES_MARKER + "\n\nmy findings\n")
    rows = json.loads((tmp_path / "zoo.json").read_text())["rows"]
    assert {r["policy"] for r in rows} == {"rl", "megatron"}
    assert (tmp_path / "zoo_search.png").stat().st_size > 1000
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left
