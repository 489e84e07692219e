"""The on-disk traced-graph cache of load_graph (shardc.frontends.graph_cache)."""

from __future__ import annotations

import gzip
import os
import shutil

import pytest
from traced_examples import EXAMPLES

import shardc.frontends as frontends
from shardc.frontends import graph_cache, load_graph
from shardc.ir.graph import Graph


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    """A copy of tiny_llama.py and its sibling llama3_70b.py, and an empty cache folder."""
    d = tmp_path / "models"
    d.mkdir()
    for name in ("tiny_llama.py", "llama3_70b.py"):
        shutil.copy(EXAMPLES / name, d / name)
    monkeypatch.setenv(graph_cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(graph_cache.NO_CACHE_ENV, raising=False)
    return d


@pytest.fixture
def traces(monkeypatch):
    """Counts the traces load_graph runs (the real tracer underneath)."""
    calls = []
    real = frontends.graph_from_module

    def counting(*args, **kwargs):
        calls.append(kwargs.get("name"))
        return real(*args, **kwargs)

    monkeypatch.setattr(frontends, "graph_from_module", counting)
    return calls


@pytest.fixture
def fake_traces(monkeypatch):
    """Counts traces; the tracer is replaced by a small stand-in graph (the cache logic
    under test does not depend on what was traced; the real trace is tested above)."""
    calls = []

    def fake(model, inputs, name="", source=""):
        calls.append(name)
        return Graph(name=name, source=source, tokens=int(inputs[0].numel()),
                     warnings=[f"params {sum(p.numel() for p in model.parameters())}"])

    monkeypatch.setattr(frontends, "graph_from_module", fake)
    return calls


def _entries():
    return sorted(graph_cache.cache_dir().glob("*.json.gz"))


def test_second_load_is_served_from_cache_and_equal(model_dir, traces):
    path = model_dir / "tiny_llama.py"
    first = load_graph(path, tiny=True)
    assert len(traces) == 1 and len(_entries()) == 1
    second = load_graph(path, tiny=True)
    assert len(traces) == 1  # no second trace
    assert second == first and second is not first
    assert second.layer_kinds and second.num_params == first.num_params
    # another path string to the same file: a hit, with that path as the source
    again = load_graph(str(model_dir / ".." / "models" / "tiny_llama.py"), tiny=True)
    assert len(traces) == 1 and again.source.endswith("../models/tiny_llama.py")


def test_edits_invalidate(model_dir, fake_traces):
    path = model_dir / "tiny_llama.py"
    load_graph(path, tiny=True)
    path.write_text(path.read_text() + "\n# edited\n")
    load_graph(path, tiny=True)
    assert len(fake_traces) == 2  # the model file changed
    sibling = model_dir / "llama3_70b.py"
    sibling.write_text(sibling.read_text() + "\n# edited\n")
    load_graph(path, tiny=True)
    assert len(fake_traces) == 3  # a sibling it imports changed
    load_graph(path, tiny=True)
    assert len(fake_traces) == 3
    assert graph_cache.cache_key(path, True) != graph_cache.cache_key(path, False)


def test_corrupt_entry_is_ignored_and_rewritten(model_dir, fake_traces):
    path = model_dir / "tiny_llama.py"
    good = load_graph(path, tiny=True)
    (entry,) = _entries()
    entry.write_bytes(b"\x1f\x8b not gzip at all")
    assert load_graph(path, tiny=True) == good
    assert len(fake_traces) == 2
    with gzip.open(entry, "rt") as fh:
        fh.readline()  # the header: the source files the model imported, with digests
        assert Graph.from_json(fh.read()) == good  # rewritten
    with gzip.open(entry, "wt") as fh:
        fh.write('{"truncated": ')
    assert load_graph(path, tiny=True) == good and len(fake_traces) == 3
    assert not list(graph_cache.cache_dir().glob(".tmp-*"))  # no temp files left behind


def test_no_cache_env_and_unwritable_folder(model_dir, fake_traces, monkeypatch, tmp_path):
    path = model_dir / "tiny_llama.py"
    monkeypatch.setenv(graph_cache.NO_CACHE_ENV, "1")
    load_graph(path, tiny=True)
    load_graph(path, tiny=True)
    assert len(fake_traces) == 2 and not graph_cache.cache_dir().exists()
    monkeypatch.delenv(graph_cache.NO_CACHE_ENV)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(graph_cache.CACHE_DIR_ENV, str(blocker / "cache"))
    assert load_graph(path, tiny=True).tokens == 16  # still loads, nothing stored
    assert len(fake_traces) == 3


def test_oldest_entries_pruned(tmp_path, monkeypatch):
    monkeypatch.setenv(graph_cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(graph_cache, "MAX_ENTRIES", 2)
    for i, key in enumerate(("a" * 64, "b" * 64, "c" * 64)):
        path = graph_cache.store_entry(key, Graph(name=key[:1]))
        os.utime(path, (1000 + i, 1000 + i))
    assert [p.name[:1] for p in _entries()] == ["b", "c"]
    assert graph_cache.load_entry("a" * 64) is None
    assert graph_cache.load_entry("c" * 64) == Graph(name="c")
