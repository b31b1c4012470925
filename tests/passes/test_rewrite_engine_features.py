"""The pattern-engine features raising relies on: declared refusal reasons, then=/out= (follow a
sole user downward), where=, keep=, P.scalar, per-rule order, subgraph edits with several (old, new) pairs."""

from __future__ import annotations

from zlc.ir import parse_graph, verify_graph
from zlc.passes.pattern import Uses
from zlc.passes.rewrite import Match, P, Rule, RuleSet, SubgraphEdits

G = """
graph "g" {
  input %x: f32[4]
  const %two: f32[] = 2.0
  const %eps: f32[] = 1e-06
  %sq: f32[4] = Pow(%x, %two) @sq
  %m: f32[4] = Exp(%sq) @m
  %a: f32[4] = Add(%m, %eps) @a
  %s: f32[4] = Sqrt(%a) @s
  output %s
}"""

CHAIN = P.op("Exp", P.op("Pow", P.var("x"), P.scalar(value=2.0, why="not x**2"), why="not x**2"), out="e",
             then=P.op("Add", P.var("e"), P.scalar("eps", why="no + eps"), out="a", why="no + eps",
                       then=P.op("Sqrt", P.var("a"), why="no sqrt")))


def test_then_follows_sole_users_and_binds_outputs():
    g = parse_graph(G)
    m = Rule("chain", CHAIN, None, lambda m, g: None).match(g, g.nodes[1])
    assert isinstance(m, Match)
    assert [n.name for n in m.matched] == ["m", "sq", "a", "s"] and abs(m.scalar("eps") - 1e-06) < 1e-12


def test_declared_reasons_furthest_wins_and_where_keeps_order():
    g = parse_graph(G.replace("Sqrt(%a)", "Exp(%a)"))
    assert Rule("chain", CHAIN, None, lambda m, g: None).match(g, g.nodes[1]) == "no sqrt"
    g = parse_graph(G.replace("%two: f32[] = 2.0", "%two: f32[] = 3.0"))
    assert Rule("chain", CHAIN, None, lambda m, g: None).match(g, g.nodes[1]) == "not x**2"
    guarded = P.op("Exp", P.op("Pow", P.var("x"), P.scalar()), where=lambda m: "guard", then=CHAIN.then)
    g = parse_graph(G.replace("Sqrt(%a)", "Exp(%a)"))
    assert Rule("g", guarded, None, lambda m, g: None).match(g, g.nodes[1]) == "guard"
    # a pattern part without a reason: the rule's own `why` is the fallback
    fallback = Rule("f", P.op("Exp", P.op("Neg", P.any())), None, lambda m, g: None, why="no Neg")
    assert fallback.attempt(g.nodes[1], Uses(g)) == "no Neg"


def test_keep_marks_context_not_consumed():
    g = parse_graph(G)
    pat = P.op("Exp", P.op("Pow", P.var("x"), P.any(), keep=True))
    m = Rule("k", pat, None, lambda m, g: None).match(g, g.nodes[1])
    assert isinstance(m, Match) and [n.name for n in m.consumed] == ["m"]
    m.cover(g.nodes[2])
    assert [n.name for n in m.consumed] == ["m", "a"]


def test_subgraph_edits_count_refusals_and_keep_output_names():
    g = parse_graph(G)

    def rw(m: Match, g):
        return [(m.root.output, g.add_node("Neg", [m["x"]], name="neg").output),
                (m.node("s").output, g.add_node("Abs", [m["x"]], name="abs").output)]

    rule = Rule("both", P.op("Exp", P.op("Pow", P.var("x"), P.any()), out="e",
                             then=P.op("Add", P.var("e"), P.any(), out="a",
                                       then=P.op("Sqrt", P.var("a"), name="s"))), None, rw)
    never = Rule("never", P.op("Sqrt", P.any()), lambda m: "nope", lambda m, g: None)
    rs = RuleSet("r", [never, rule], max_iters=4, per_rule=True, edits=SubgraphEdits)
    st = rs.apply(g)
    verify_graph(g)
    assert st.applied == {"both": 1} and st.refused == {"never": {"nope": 1}}
    assert [n.op for n in g.nodes] == ["Abs"] and g.outputs[0].name == "s"
