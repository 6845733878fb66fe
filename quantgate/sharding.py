"""Data-parallel scoring (issue 31, item 2): one build's teams, and a big team's documents, split over
`executor.replicas` servers, and the shares merged back into one team's scores.

Split by team, every team is scored whole by one server, exactly as on one server: each document's score and
each verdict equal the one-server run's. A team is split by documents only when there are fewer teams than
replicas, and only if every task of it is zero-shot: lm-eval draws few-shot examples from one seeded random
stream per task (`fewshot_random_seed`), so a share of the documents would show other examples than the
whole run does. Split by documents, requests batch differently, and CPU inference is not bit-stable across
batch shapes; tests/test_ray_e2e.py states the tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantgate.errors import QuantgateError
from quantgate.results import TaskScore, TeamScores
from quantgate.teams import Team


@dataclass(frozen=True)
class Piece:
    """A team, or the documents `docs` ({task: doc indices}) of it, scored on one server; `size` documents."""

    team: str
    size: int
    docs: dict[str, list[int]] | None = None


def scored_docs(team: Team, limit: int | None) -> dict[str, list[int]]:
    """{task: the indices of the documents the gate sees}: the first min(n_docs, limit) of its test split
    (Task.n_docs is already after the team's own limit)."""
    return {t.name: list(range(min(t.n_docs, limit) if limit else t.n_docs)) for t in team.tasks}


def splittable(team: Team) -> bool:
    """True if every task of `team` is zero-shot, so a share of its documents sees the prompts the whole
    run sees."""
    return all(not t.config.get("num_fewshot") for t in team.tasks)


def _halves(piece: Piece) -> tuple[Piece, Piece]:
    first, second = {}, {}
    for task, ids in piece.docs.items():
        cut = (len(ids) + 1) // 2
        first[task], second[task] = ids[:cut], ids[cut:]
    a = sum(map(len, first.values()))
    return Piece(piece.team, a, first), Piece(piece.team, piece.size - a, second)


def plan(teams: list[Team], replicas: int, limit: int | None) -> list[list[Piece]]:
    """The pieces each of `replicas` servers scores (some lists may be empty when there is little to do).

    Whole teams first, biggest to the least-loaded server; while there are fewer pieces than servers, the
    biggest piece of a splittable team is cut in two (each task's documents in two contiguous halves).
    `limit` is the harness limit (evaluate.harness.limit), applied with each team's own.
    """
    docs = {t.name: scored_docs(t, limit) for t in teams}
    pieces = [Piece(t.name, sum(map(len, docs[t.name].values()))) for t in teams]
    cuttable = {t.name for t in teams if splittable(t)}
    while len(pieces) < replicas:
        candidates = [p for p in pieces if p.team in cuttable and p.size > 1]
        if not candidates:
            break
        big = max(candidates, key=lambda p: p.size)
        pieces.remove(big)
        whole = big if big.docs is not None else Piece(big.team, big.size, docs[big.team])
        pieces += _halves(whole)
    shares: list[list[Piece]] = [[] for _ in range(replicas)]
    for piece in sorted(pieces, key=lambda p: -p.size):
        min(shares, key=lambda s: sum(p.size for p in s)).append(piece)
    return shares


def merge(team: Team, parts: list[TeamScores], limit: int | None) -> TeamScores:
    """One team's scores from the scores of its pieces (each a TeamScores of status ok).

    Raises QuantgateError unless the pieces together scored each of the team's documents exactly once
    (a verdict must not rest on documents never scored, or scored twice).
    """
    want = scored_docs(team, limit)
    samples = sorted((s for p in parts for s in p.samples), key=lambda s: (s.task, s.doc_id))
    tasks = {}
    for name, ids in want.items():
        rows = [s for s in samples if s.task == name]
        if [s.doc_id for s in rows] != ids:
            raise QuantgateError(
                f"task {name}: its shares scored {len(rows)} documents, not each of the {len(ids)} once"
            )
        flt = next(p.tasks[name].filter for p in parts if name in p.tasks)
        tasks[name] = TaskScore(filter=flt, n=len(rows), score=sum(s.score for s in rows) / len(rows))
    return TeamScores(
        status="ok",
        metric=parts[0].metric,
        tasks=tasks,
        samples=samples,
        elapsed_s=max(p.elapsed_s or 0.0 for p in parts),
    )
