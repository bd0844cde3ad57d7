"""The step engine's launch sequence is data: phase k of every launch group before phase
k + 1 of any, with the shards' collective between phases and each matrix function's
products after the phase that writes its matrices."""

from types import SimpleNamespace

from fuser.runtime.engine import CollectiveStep, KernelStep, MatrixStep, program


class Group:
    def __init__(self, name, n_phases, matrix_phases=()):
        self.kernels = [f"{name}{k}" for k in range(n_phases)]
        self.matrices = [SimpleNamespace(name=f"{name}-ns{k}", phase=k) for k in matrix_phases]
        self.combine = None


def order(steps):
    out = []
    for s in steps:
        if isinstance(s, KernelStep):
            out.append(s.kernel)
        elif isinstance(s, MatrixStep):
            out.append(s.work.name)
        else:
            out.append(f"collective{s.phase}")
    return out


def test_matrix_products_follow_the_phase_that_writes_their_matrices():
    a, b = Group("a", 3, matrix_phases=(1,)), Group("b", 3)
    assert order(program([a, b], shards=object())) == [
        "a0",
        "b0",
        "collective0",
        "a1",
        "b1",
        "collective1",
        "a-ns1",
        "a2",
        "b2",
    ]


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
