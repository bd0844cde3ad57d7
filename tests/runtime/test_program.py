"""The step engine's launch sequence is data: phase k of every launch group before phase
k + 1 of any, with the shards' collective between phases."""

from fuser.runtime.engine import CollectiveStep, KernelStep, program


class Group:
    def __init__(self, name, n_phases):
        self.kernels = [f"{name}{k}" for k in range(n_phases)]


def order(steps):
    return [s.kernel if isinstance(s, KernelStep) else f"collective{s.phase}" for s in steps]


def test_phases_of_every_group_run_in_order():
    a, b = Group("a", 2), Group("b", 2)
    assert order(program([a, b], shards=None)) == ["a0", "b0", "a1", "b1"]


def test_collectives_sit_between_phases_only():
    a, b = Group("a", 3), Group("b", 3)
    steps = program([a, b], shards=object())
    assert order(steps) == ["a0", "b0", "collective0", "a1", "b1", "collective1", "a2", "b2"]
    assert all(isinstance(s, CollectiveStep) for s in steps if not isinstance(s, KernelStep))


def test_one_phase_needs_no_collective():
    assert order(program([Group("a", 1)], shards=object())) == ["a0"]
