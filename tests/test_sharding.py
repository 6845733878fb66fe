"""Data-parallel scoring (quantgate/sharding.py): how one build's teams are split over replicas, and merged."""

import pytest

from quantgate.errors import QuantgateError
from quantgate.results import Sample, TaskScore, TeamScores
from quantgate.sharding import Piece, merge, plan, scored_docs, splittable
from quantgate.teams import load_teams


@pytest.fixture
def teams(example_evals):
    """billing (generation, zero-shot), search (zero-shot), support (4-shot): the repo's example sets."""
    return {t.name: t for t in load_teams(example_evals)}


def sizes(shares):
    return [sorted((p.team, p.size) for p in share) for share in shares]


def test_teams_go_whole_to_the_least_loaded_replica_biggest_first(teams):
    n = {name: sum(t.n_docs for t in team.tasks) for name, team in teams.items()}
    shares = plan(list(teams.values()), 2, None)
    assert all(p.docs is None for share in shares for p in share)  # whole teams: scored as on one server
    assert sorted(p.team for share in shares for p in share) == sorted(teams)
    loads = sorted(sum(p.size for p in share) for share in shares)
    biggest = max(n.values())
    assert loads == sorted([biggest, sum(n.values()) - biggest])  # 3 teams: the biggest alone, the others together
    assert plan(list(teams.values()), 1, None) == [[Piece(name, n[name]) for name in sorted(n, key=lambda k: -n[k])]]


def test_with_more_replicas_than_teams_a_zero_shot_team_is_split_by_documents_in_contiguous_halves(teams):
    search = teams["search"]
    shares = plan([search], 2, 12)
    assert sizes(shares) == [[("search", 6)], [("search", 6)]]
    (task,) = scored_docs(search, 12)
    assert [share[0].docs for share in shares] == [{task: list(range(6))}, {task: list(range(6, 12))}]
    # a few-shot team is never split: its share would draw other examples than the whole run (one seeded stream)
    assert not splittable(teams["support"]) and splittable(search) and splittable(teams["billing"])
    assert plan([teams["support"]], 3, 12) == [[Piece("support", 12)], [], []]


def test_the_limit_caps_the_documents_split(teams):
    shares = plan([teams["search"], teams["billing"]], 3, 5)
    assert sorted(p.size for share in shares for p in share) == [2, 3, 5]
    assert sum(p.size for share in shares for p in share) == 10


def part(task: str, ids: list[int], scores: list[float]) -> TeamScores:
    rows = [Sample(task=task, doc_id=i, doc_hash=None, score=s) for i, s in zip(ids, scores, strict=True)]
    mean = sum(scores) / len(scores)
    return TeamScores(
        status="ok",
        metric="acc",
        tasks={task: TaskScore(filter="none", n=len(ids), score=mean)},
        samples=rows,
        elapsed_s=float(len(ids)),
    )


def test_merged_shares_are_the_team_scored_once_each_document_in_order(teams):
    search = teams["search"]
    (task,) = scored_docs(search, 4)
    merged = merge(search, [part(task, [2, 3], [0.0, 1.0]), part(task, [0, 1], [1.0, 1.0])], 4)
    assert [s.doc_id for s in merged.samples] == [0, 1, 2, 3]
    assert merged.tasks[task] == TaskScore(filter="none", n=4, score=0.75) and merged.elapsed_s == 2.0
    with pytest.raises(QuantgateError, match=f"task {task}: its shares scored 3 documents, not each of the 4 once"):
        merge(search, [part(task, [0, 1], [1.0, 1.0]), part(task, [1], [1.0])], 4)
    with pytest.raises(QuantgateError, match="its shares scored 5 documents"):
        merge(search, [part(task, [0, 1, 2], [1.0, 1.0, 0.0]), part(task, [2, 3], [0.0, 1.0])], 4)
