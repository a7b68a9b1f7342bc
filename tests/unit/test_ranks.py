"""hpcring.ranks: the one way messages name ranks and their hosts."""
import pytest
from hpcring import ranks as R


def test_ranges_and_labels():
    assert R.rank_ranges([6, 0, 1, 2, 3, 4, 4]) == "0-4,6"
    assert R.ranks_label([5]) == "rank 5" and R.ranks_label([5, 5]) == "rank 5"
    assert R.ranks_label([3, 1, 2, 7]) == "ranks 1-3,7"


def test_who_with_plain_and_compressed_hosts():
    hosts = ("node1", "node1", "node2", "node3", "gpu7")
    assert R.who([0, 1, 2], hosts) == "ranks 0-2 (node1, node2)"
    assert R.who([0, 2, 3], hosts, compress=True) == "ranks 0,2-3 (node[1-3])"
    assert R.who([4, 9], hosts) == "ranks 4,9 (gpu7)"          # a rank beyond the host table: skipped


def test_runs_of_equal_values():
    assert R.runs(["a", "a", "b", "a"]) == [(0, 1, "a"), (2, 2, "b"), (3, 3, "a")]
    assert R.runs([]) == []


def test_expand_ranges_inverts_rank_ranges_and_checks_bounds():
    import random
    from hpcring.ranks import expand_ranges, rank_ranges
    rng = random.Random(7)
    for _ in range(200):
        ranks = sorted(rng.sample(range(500), rng.randint(0, 60)))
        assert expand_ranges(rank_ranges(ranks)) == ranks
        assert expand_ranges(rank_ranges(ranks), 500) == ranks
    for bad in ("5-300", "-1", "3-2", "x", "1-y"):
        with pytest.raises(ValueError):
            expand_ranges(bad, 200)
