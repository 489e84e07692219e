"""IR: JSON round-trip of real traced graphs, parameter accounting."""

from __future__ import annotations

import json

import pytest
from traced_examples import TINY, tiny_graph, tiny_module

from shardc.ir.graph import Graph, LayerKind, Param


@pytest.mark.parametrize("name", TINY)
def test_json_round_trip_is_exact(name):
    g = tiny_graph(name)
    text = g.to_json()
    back = Graph.from_json(text)
    assert back == g
    assert back.to_json() == text
    assert json.loads(text)["layer_kinds"][0]["attrs"]["other_params"] >= 0


def test_layer_kind_attrs_default_and_round_trip():
    g = Graph(name="x", layer_kinds=[LayerKind("dense_block", 2, [0, 1], attrs={"other_params": 7})])
    assert Graph.from_json(g.to_json()).layer_kinds[0].attrs == {"other_params": 7}
    assert LayerKind("k", 1).attrs == {}


@pytest.mark.parametrize("name", TINY)
def test_param_count_matches_module(name):
    g, m = tiny_graph(name), tiny_module(name)
    assert g.num_params == sum(p.numel() for p in m.parameters())
    assert len({p.fqn for p in g.params}) == len(g.params)


@pytest.mark.parametrize("name", TINY)
def test_param_accounting_identity(name):
    """layer kinds x count x (op params + other) + global ops + other globals == num_params."""
    g = tiny_graph(name)
    total = sum(k.count * (sum(o.params for o in k.ops) + k.attrs["other_params"])
                for k in g.layer_kinds)
    total += sum(o.params for o in g.global_ops) + g.config["other_global_params"]
    assert total == g.num_params
    h = g.config["hidden"]
    assert g.config["other_global_params"] in (h, 2 * h)  # final norm weight (+ bias)


def test_every_param_is_attached_to_a_node():
    g = tiny_graph("tiny_mixtral")
    used = {p.fqn for n in g.nodes for p in n.params}
    assert used == {p.fqn for p in g.params}


def test_param_numel():
    assert Param("w", [3, 4, 5]).numel == 60


def _asdict_json(g: Graph) -> str:
    """Graph.to_json's former body: the deep copy dataclasses.asdict makes, encoded."""
    from dataclasses import asdict

    return json.dumps(asdict(g), sort_keys=True, separators=(",", ":"))


@pytest.mark.parametrize("name", TINY)
def test_to_json_is_the_asdict_encoding_byte_for_byte(name):
    from dataclasses import replace

    g = tiny_graph(name)
    assert g.to_json() == _asdict_json(g)
    # nested dataclasses, tuples, None and a namedtuple inside attrs / config encode as asdict
    # makes them
    from collections import namedtuple

    pair = namedtuple("pair", "a b")
    odd = replace(g, config={**g.config, "p": Param("w", [2, 3]), "t": (1, (2, None)),
                             "nt": pair(1, [Param("v", [4])])})
    odd.layer_kinds = [replace(odd.layer_kinds[0], attrs={"k": LayerKind("x", 1)})]
    assert odd.to_json() == _asdict_json(odd)


def test_to_json_refuses_what_json_cannot_encode_as_before():
    g = Graph(name="g", config={"bad": {1, 2}})
    with pytest.raises(TypeError):
        _asdict_json(g)
    with pytest.raises(TypeError):
        g.to_json()
