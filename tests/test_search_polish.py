"""The row polisher (shardc.search.polish): branch groups, joint branch best responses,
row expansion, no repeated evaluation, and the agent's use of it."""

import numpy as np

from shardc.ir.space import megatron_op_choices
from shardc.search import run_search
from shardc.search.legal import BATCH, N_DEG, TP, LegalSampler
from shardc.search.objective import Budget, BudgetExhausted
from shardc.search.polish import Archive, RowPolisher, branch_groups
from shardc.search.rl import RLConfig
from shardc.search.synthetic import toy_space

ATTN = [N_DEG + i for i in range(3)]  # the toy's qkv, attn_core, out_proj columns


class NeedleInBranch:
    """value = 100 * (1 + batch index / 100), times 2 when the attention branch is exactly
    ``target`` and times (1 - 0.1 * slots differing from ``start``) otherwise: every single
    op change from ``start`` loses, only the joint change of the branch wins. Records every
    action evaluated."""

    op_choices_free_at_tp1 = False

    def __init__(self, start, target):
        self.start, self.target = np.array(start), np.array(target)
        self.log = []

    def __call__(self, actions):
        a = np.atleast_2d(actions)
        self.log.extend(a.tolist())
        attn = a[:, ATTN]
        hit = (attn == self.target).all(axis=1)
        off = (attn != self.start).sum(axis=1)
        v = 100.0 * (1 + a[:, BATCH] / 100.0) * np.where(hit, 2.0, 1.0 - 0.1 * off)
        return v, np.ones(len(a), bool)


def _start(space, tp_value=2):
    s = LegalSampler(space)
    a = np.zeros(s.n_comp, dtype=np.int64)
    a[TP] = space.values["tp"].index(tp_value)
    a[N_DEG:] = megatron_op_choices(space, int(a[TP]))
    assert s.legal(a[None])[0]
    return s, a


def test_branch_groups_follow_the_ir_branches():
    space = toy_space()
    groups = [[space.op_slots[c - N_DEG].split(".")[-1] for c in g] for g in branch_groups(space)]
    assert groups == [["qkv", "attn_core", "out_proj"], ["router"],
                      ["expert_ffn1", "expert_ffn2"], ["embedding"], ["lm_head"]]


def test_polish_makes_a_joint_branch_change_single_changes_cannot():
    space = toy_space()
    sampler, start = _start(space)
    target = (2, 2, 2)  # everything replicated: legal at any tp, differs in all three slots
    assert (start[ATTN] != target).all()
    obj = NeedleInBranch(start[ATTN], target)
    budget = Budget(obj, 1000)
    archive = Archive(space)
    v, f = budget(start[None])
    archive.record(start[None], v, f)
    best, best_v = RowPolisher(sampler, budget, archive).polish(start, float(v[0]))
    assert tuple(best[ATTN]) == target
    assert (best[:N_DEG] == start[:N_DEG]).all()  # same degree row
    assert best_v == budget.best_value > 1.9 * v[0]
    assert len({tuple(a) for a in obj.log}) == len(obj.log)  # nothing evaluated twice


def test_expansion_carries_the_polished_choices_to_neighbouring_rows():
    space = toy_space()
    sampler, start = _start(space)
    start[BATCH] = 3
    polisher = RowPolisher(sampler, Budget(lambda a: (np.ones(len(a)), np.ones(len(a), bool)),
                                           100), Archive(space))
    seeds = polisher.neighbour_rows(start)
    assert sampler.legal(seeds).all()
    same_degrees = (seeds[:, [0, 1, 2, 3]] == start[[0, 1, 2, 3]]).all(axis=1)
    assert set(seeds[same_degrees, BATCH].tolist()) == {2, 4}  # batch one step down / up
    moved = seeds[~same_degrees]
    assert len(moved) > 0
    ops_kept = (moved[:, N_DEG:] == polisher._ops_at(start[N_DEG:], 0)[None]).all(axis=1) | \
        (moved[:, TP] != start[TP])
    assert ops_kept.all()


def test_polisher_stops_when_every_row_is_polished_and_the_agent_spends_the_rest():
    space = toy_space(mesh="1x1")  # 13 rows (the batch sizes): the polisher runs out of rows
    sampler, start = _start(space, tp_value=1)
    obj = NeedleInBranch(start[ATTN], (2, 2, 2))
    result = run_search("rl", space, obj, budget=1500, seed=0,
                        cfg=RLConfig(batch=32, polish_frac=0.9))
    assert result.evaluations == 1500
    assert len({tuple(a) for a in obj.log}) < 1500  # the agent, not the polisher, repeats
    top = space.values["batch"].index(max(space.values["batch"]))
    assert result.best_action[BATCH] == top and tuple(result.best_action[ATTN]) == (2, 2, 2)


def test_with_nothing_feasible_known_the_polisher_screens_every_row_with_megatrons_choices():
    space = toy_space()  # 8x1: a needle of one feasible row, neither the smallest batch nor tp 1
    sampler, start = _start(space, tp_value=4)
    start[BATCH] = 5

    def needle(actions):
        a = np.atleast_2d(actions)
        hit = (a[:, :N_DEG] == start[:N_DEG]).all(axis=1) & (a[:, ATTN] == start[ATTN]).all(axis=1)
        return 100.0 + (a[:, ATTN] == 2).sum(axis=1), hit

    budget = Budget(needle, 2000)
    RowPolisher(sampler, budget, Archive(space)).run()
    assert budget.best_action is not None
    assert (budget.best_action[:N_DEG] == start[:N_DEG]).all()


class HbmCliff:
    """value = 100 * (1 + batch index / 100) * (3 at tp = 2, 1 elsewhere); at tp = 2 a
    strategy fits only with its attention branch fully replicated (2, 2, 2) -- ``last_violation``
    = 0.05 per other attention slot, as an HBM overshoot (CostModel.violation's shape); every
    other tp fits. With ``signal=False`` the objective has no ``last_violation``."""

    op_choices_free_at_tp1 = False

    def __init__(self, space, signal=True):
        self.tp2 = space.values["tp"].index(2)
        self.signal = signal

    def __call__(self, actions):
        a = np.atleast_2d(actions)
        at2 = a[:, TP] == self.tp2
        off = (a[:, ATTN] != 2).sum(axis=1)
        ok = ~at2 | (off == 0)
        if self.signal:
            self.last_violation = np.where(ok, -0.1, 0.05 * off)
        return 100.0 * (1 + a[:, BATCH] / 100.0) * np.where(at2, 3.0, 1.0), ok


def test_repair_brings_a_near_tuple_under_its_limit_and_finds_its_batches():
    space = toy_space()
    sampler, start = _start(space, tp_value=4)  # a feasible row elsewhere
    _, near = _start(space, tp_value=2)  # Megatron's choices at tp = 2: over the limit
    assert (near[ATTN] != 2).any()
    found = {}
    for signal in (True, False):
        obj = HbmCliff(space, signal)
        budget = Budget(obj, 2000)
        archive = Archive(space)
        rows = np.stack([start, near])
        v, f = budget(rows)
        archive.record(rows, v, f, getattr(obj, "last_violation", None))
        assert f.tolist() == [True, False]
        try:
            RowPolisher(sampler, budget, archive).run()
        except BudgetExhausted:
            pass
        found[signal] = budget.best_action
    best = found[True]
    assert best[TP] == near[TP] and tuple(best[ATTN]) == (2, 2, 2)
    assert best[BATCH] == sampler.nvec[BATCH] - 1  # the repaired choices at every batch
    assert found[False][TP] != near[TP]  # without the violation signal the tuple stays out


class KvCliff:
    """A model that barely fits: memory (``last_memory``, model bytes / usable HBM) =
    0.3 per attention slot not replicated + batch / 64, so Megatron's choices fit only a
    token batch and the fully replicated attention (the lean choices here) fits up to batch
    64; value = batch, x2 at tp = 2. With ``memory=False`` the objective reports no memory."""

    op_choices_free_at_tp1 = False

    def __init__(self, space, memory=True):
        self.space, self.memory = space, memory
        self.tp2 = space.values["tp"].index(2)

    def __call__(self, actions):
        a = np.atleast_2d(actions)
        batch = np.asarray(self.space.values["batch"])[a[:, BATCH]]
        mem = 0.3 * (a[:, ATTN] != 2).sum(axis=1) + batch / 64.0
        if self.memory:
            self.last_memory = mem
        return batch * np.where(a[:, TP] == self.tp2, 2.0, 1.0), mem <= 1.0


def test_lean_screen_takes_unfit_tuples_to_their_largest_batch_with_lean_choices():
    from shardc.search.lean_screen import lean_screen

    space = toy_space()
    sampler, start = _start(space, tp_value=4)  # a feasible row at tp = 4, batch 1
    assert (start[ATTN] != 2).any()
    found = {}
    for memory in (True, False):
        obj = KvCliff(space, memory)
        budget = Budget(obj, 4000)
        archive = Archive(space)
        v, f = budget(start[None])
        archive.record(start[None], v, f, None, getattr(obj, "last_memory", None))
        assert f[0]
        polisher = RowPolisher(sampler, budget, archive)
        lean_screen(polisher)
        found[memory] = (archive, budget.evaluations)
    archive, spent = found[True]
    at64 = [key for key, (val, a) in archive.rows.items()
            if key[0] == 2 and key[4] == 64 and tuple(a[ATTN]) == (2, 2, 2)]
    assert at64  # a tp = 2 tuple at batch 64 (the largest that fits), attention replicated
    assert all(key[4] <= 64 for key in archive.rows)
    assert spent <= 2000  # half the budget at most
    assert found[False][1] == 1  # no memory reported: nothing screened
