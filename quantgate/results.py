"""The documents stages hand each other under results/, as typed models, each read and written here.

- results/teams.json: `TeamSummary` per team (validate writes it; register reads it).
- results/eval/<build>/<team>/scores.json: `TeamScores` (evaluate writes it; gate and register read it).
- results/gate.json: `GateResult` (gate writes it; register and `quantgate report` read it).
- results/search/search.json: `SearchResult` (search writes it; the gate reads whether it found a
  passing candidate).
- results/profile/<build>.json: `BuildProfile` (profile writes it; the gate prices it with the cost model).

Names: a *build* (fp16, fp8, int4) is judged against the *baseline* build, per *team*; one
(build, team) judgement is a `TeamComparison` with a *verdict*. A document is dumped with the
fields it was built or read with (exclude_unset), so the JSON keeps its shape and the registry's
evidence digests stay the same.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from quantgate.errors import QuantgateError
from quantgate.files import write_whole
from quantgate.stats import BASELINE, SEVERITY, Verdict, verdict_of

SEARCH_RESULT = Path("results/search/search.json")  # the search stage's metrics (dvc.yaml)
SCORES = "scores.json"  # the team's status, per-sample scores and aggregates for one build
SAMPLES = "samples.jsonl"  # lm-eval's per-sample log, one JSON object per line


def rounded(x: float | None, nd: int) -> float | None:
    """`x` rounded to `nd` decimals; None (a figure that could not be measured) stays None."""
    return None if x is None else round(x, nd)


class Document(BaseModel):
    """Base of the results documents: immutable, no unknown keys, verdicts stored as their strings."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=True)

    def dump(self) -> dict:
        """The document as JSON data (lists, not tuples), with only the fields it was built or read with."""
        return self.model_dump(mode="json", exclude_unset=True)


# results/teams.json


class TeamSummary(Document):
    """One team of results/teams.json: its policy, document counts and eval-set digest."""

    owner: str
    contact: str
    metric: str
    higher_is_better: bool
    margin: dict[str, float]  # {"absolute": points} or {"relative": percent}
    confidence: float
    n_docs: int
    min_docs: int | None  # fewest docs with which identical builds can PASS (0/1 metrics), else None
    tasks: dict[str, int]  # {task: docs}
    sha256: str  # digest of the team folder
    # estimated cost of scoring the set once, per build (quantgate/budget.py): documents, prompt_tokens,
    # generated_tokens; and the budget it was checked against (params validate)
    cost: dict[str, int] | None = None
    budget: dict[str, int] | None = None


def _write(path: Path, text: str) -> None:
    """Write one results document whole (quantgate.files.write_whole: a reader, DVC or the gate never sees half
    of it), its folders made first. Raises QuantgateError naming the path when it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise QuantgateError(f"{path}: cannot make its folder ({exc.strerror or type(exc).__name__})") from None
    write_whole(path, text + "\n")


_TEAMS = TypeAdapter(dict[str, TeamSummary])


def write_teams(path: Path, teams: dict[str, TeamSummary]) -> None:
    """Write results/teams.json ({team: TeamSummary})."""
    _write(path, json.dumps({name: t.dump() for name, t in teams.items()}, indent=2))


def read_teams(path: Path) -> dict[str, TeamSummary]:
    """Read results/teams.json; raises QuantgateError if it is missing or not a team summary."""
    return _read(path, _TEAMS, "team summary", "validate")


# results/eval/<build>/<team>/scores.json


class Sample(Document):
    """One scored document: the gate pairs builds by (task, doc_id) and checks doc_hash."""

    task: str
    doc_id: int
    doc_hash: str | None = None
    score: float | None = None  # the team metric; the gate fails closed on None, NaN or inf


class TaskScore(Document):
    """One task's aggregate: the filter scored, documents and mean score."""

    filter: str
    n: int
    score: float


class ServingRecord(Document):
    """The serving config a build was scored with (part of the evaluation cache key)."""

    versions: dict[str, str | None]
    dtype: str
    max_model_len: int
    extra_args: list[str]
    endpoint: str | None = None  # the remote vLLM deployment (evaluate.endpoints) it was scored on


class Placement(Document):
    """Where one team (or a share of it) was scored: the executor, the machine (a Ray node's id and IP), its
    device and machine kind (quantgate/precision.py) and the vLLM version that served it."""

    executor: Literal["local", "ray"]
    host: str
    node_id: str | None = None
    ip: str | None = None
    device: str | None = None
    machine_kind: str | None = None
    vllm: str | None = None


class TeamScores(Document):
    """results/eval/<build>/<team>/scores.json: status "ok" with per-sample scores, or "error"
    with a one-line reason (the gate FAILs it)."""

    team: str | None = None
    build: str | None = None
    cache_key: str | None = None
    weights_digest: str | None = None
    scores_digest: str | None = None
    serving: ServingRecord | None = None
    status: Literal["ok", "error"]
    reason: str | None = None
    metric: str | None = None
    tasks: dict[str, TaskScore] = {}
    samples: list[Sample] = []
    elapsed_s: float | None = None
    placement: list[Placement] = []  # one per server that scored a share of the team (issue 31)


def write_scores(folder: Path, scores: TeamScores) -> None:
    """Write `folder`/scores.json."""
    _write(folder / SCORES, json.dumps(scores.dump(), indent=1))


def read_scores(path: Path) -> TeamScores:
    """Read a scores.json; raises QuantgateError if it is missing or not a scores document."""
    return _read(path, TypeAdapter(TeamScores), "scores document", "evaluate")


# results/gate.json


class ServedPrecision(Document):
    """The activation precision every compared build was served at (from precision.json)."""

    dtype: str
    requested: str | None = None
    why: str = ""
    machine_kind: str | None = None  # docs/machines.md's kind the figures come from; None: recorded before it was


class TeamComparison(Document):
    """The gate's judgement of one (build, team). A comparison that could not be made (missing
    or failed scores) has only verdict FAIL, metric and reason.

    Signs: `drop` (and its bounds `lower`, `upper`) is how much worse the build is, in metric
    units, positive = worse, whatever the metric's direction: the margin bounds it. `delta` is
    candidate - baseline, kept for the registry's gate.<team>.delta tag and run metrics."""

    verdict: Verdict
    metric: str
    higher_is_better: bool | None = None
    n: int | None = None
    baseline: float | None = None  # the baseline build's mean score
    candidate: float | None = None  # this build's mean score
    delta: float | None = None
    margin: float | None = None  # in metric units
    recovery_pct: float | None = None
    confidence: float | None = None
    method: str | None = None
    drop: float | None = None
    lower: float | None = None
    upper: float | None = None
    p_value: float | None = None  # one-sided p of non-inferiority
    p_difference: float | None = None
    n_required: int | None = None
    discordant: tuple[int, int] | None = None
    reason: str

    @property
    def compared(self) -> bool:
        """True when the scores were paired and judged (the statistics fields are set)."""
        return self.upper is not None


class BuildGate(Document):
    """The gate's judgement of one build: the worst team verdict, and one comparison per team.
    `recommended` (None before the gate priced builds) is a separate field from the verdict: non-inferior
    for every team AND cheaper to serve than the baseline on the measured platform; `recommendation` says why.
    `same_weights_as` names another build whose weights digest is this one's (a search that kept no layer, a
    W4A8 build of int4's weights); it is a fact for release managers, not evidence: the verdict stays this
    build's own. `served_with` is what its servers set that that build's do not (quantgate.manifest.serving_tags)."""

    verdict: Verdict
    shippable: bool
    teams: dict[str, TeamComparison]
    reason: str | None = None  # why the build FAILs whatever its teams' verdicts (its search found nothing)
    same_weights_as: str | None = None  # the first build of this run (params.yaml order) with the same weights
    served_with: dict[str, str] | None = None  # serving settings it differs from that build in ({"w4a8": "true"})
    # the probe's answer for the int8 kernel it was served through, where that kernel is inexact here and
    # evaluate.serve.inexact_int8 served it anyway: its scores hold the kernel's error (quantgate.precision)
    inexact_kernel: str | None = None
    recommended: bool | None = None
    recommendation: str | None = None


class BuildCost(Document):
    """What one build buys when served (pipeline/buys.py): the profile priced by the `cost` params block.

    Units: USD per 1M output tokens; output tokens/s of one device at `concurrency` requests in flight;
    KV tokens (vLLM's report); requests of cost.context_tokens that fit in the KV cache of one device;
    requests in flight for cost.qps (Little's law); devices for that load (memory / batch-cap bound,
    `devices` the larger). `*_x` fields are this build / the baseline's (None where either is missing).
    An unprofiled build has status "unprofiled", its reason, and no figures."""

    status: Literal["profiled", "unprofiled"]
    reason: str | None = None
    weights_mib: float | None = None
    kv_cache_dtype: str = "auto"
    kv_tokens: int | None = None
    requests_per_device: int | None = None
    concurrency: int | None = None
    output_tokens_per_s: float | None = None
    ttft_ms_p50: float | None = None
    tpot_ms_p50: float | None = None
    usd_per_mtok: float | None = None
    in_flight: float | None = None
    devices_memory: int | None = None
    devices_batch: int | None = None
    devices: int | None = None
    bound: str | None = None
    usd_per_mtok_x: float | None = None
    devices_x: float | None = None
    weights_x: float | None = None
    kv_tokens_x: float | None = None


class GateResult(Document):
    """results/gate.json: every candidate build judged against the baseline build, per team, and what
    each build (the baseline too) buys when served (`buys`, empty when the gate ran without profiles)."""

    baseline: str
    precision: ServedPrecision | None  # the baseline's record (the compared builds' too); None when it has none
    builds: dict[str, BuildGate]
    buys: dict[str, BuildCost] = {}


def write_gate(path: Path, result: GateResult) -> None:
    """Write results/gate.json (also DVC's metrics file)."""
    _write(path, json.dumps(result.dump(), indent=2))


def read_gate(path: Path) -> GateResult:
    """Read results/gate.json; raises QuantgateError if it is missing or not a gate result."""
    return _read(path, TypeAdapter(GateResult), "gate result", "gate")


def check_consistent(result: GateResult, path: Path) -> None:
    """Raise QuantgateError naming the build and team when a build's verdict is milder than one of its teams'
    (PASS with a team FAIL), or a compared team's verdict is not the one its own drop bounds and margin give
    (quantgate.stats.verdict_of; a bound that is not a finite number gives none): the gate gives a build its
    worst team's verdict, or FAIL (pipeline/gate.py), and a team the verdict of its interval, so such a file
    was not written by the gate as it stands, and its verdicts cannot be shown or registered."""
    redo = "so this file is not the gate's: re-run `dvc repro gate`"
    for build, b in result.builds.items():
        for team, c in b.teams.items():
            if b.verdict != BASELINE and SEVERITY.index(Verdict(c.verdict)) > SEVERITY.index(Verdict(b.verdict)):
                raise QuantgateError(
                    f"{path}: build {build} is {b.verdict} but its team {team} is {c.verdict}; the gate gives a "
                    f"build its worst team's verdict, {redo}"
                )
            if c.compared and (found := _interval_verdict(c)) != c.verdict:
                raise QuantgateError(
                    f"{path}: build {build}, team {team} is {c.verdict}, but its drop bounds [{c.lower}, {c.upper}] "
                    f"and margin {c.margin} give {found}; {redo}"
                )


def _interval_verdict(c: TeamComparison) -> str:
    """The verdict of `c`'s stored drop bounds and margin, or "no verdict" when one is missing or not finite."""
    bounds = (c.lower, c.upper, c.margin)
    if any(x is None or not math.isfinite(x) for x in bounds):
        return "no verdict (a bound or the margin is not a finite number)"
    return verdict_of(*bounds).value


# results/profile/<build>.json


class LoadPoint(Document):
    """vLLM's serving benchmark at one concurrency (quantgate/loadgen.py): output tokens/s, requests/s,
    TTFT and TPOT percentiles in ms over the requests sent (`prompts`)."""

    concurrency: int
    prompts: int
    output_tokens_per_s: float
    requests_per_s: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    tpot_ms_p50: float
    tpot_ms_p99: float


class BuildProfile(Document):
    """results/profile/<build>.json: what one build costs to hold and how fast it serves, measured on the
    serving engine at the run's precision (pipeline/profile.py). An unprofiled build (no server, failed
    benchmark) has status "unprofiled" and the one-line reason; its figures are None.

    Units: MiB of weights on disk; GiB of weights as vLLM reports them (`weights_source`: its "model
    loading" or "checkpoint size" line); KV tokens as vLLM reports them (`kv_tokens`) and from the
    arithmetic (`kv_tokens_arithmetic` = KV space / `kv_bytes_per_token`, quantgate/cost.py; CPU only,
    where the KV space is evaluate.serve.kv_cache_gib); `max_concurrency`: vLLM's requests of
    `max_concurrency_at` tokens that fit; `server_rss_gib`: the server's process tree after start-up."""

    build: str
    status: Literal["profiled", "unprofiled"]
    reason: str | None = None
    dtype: str | None = None  # activation precision served at
    kv_cache_dtype: str = "auto"
    input_len: int
    output_len: int
    seed: int
    weights_mib: float | None = None
    weights_gib: float | None = None
    weights_source: str | None = None
    kv_tokens: int | None = None
    kv_tokens_arithmetic: int | None = None
    kv_bytes_per_token: int | None = None
    kv_shape: dict[str, int | None] | None = None  # quantgate.cost.KVShape of config.json (layers, kv_heads, ...)
    max_concurrency: float | None = None
    max_concurrency_at: int | None = None
    server_rss_gib: float | None = None
    loads: dict[str, LoadPoint] = {}  # "c<concurrency>" -> its figures (named keys: `dvc metrics show` reads them)
    placement: Placement | None = None  # where it was measured (executor, node); None in records before issue 31
    measured_as: str | None = None  # the other build these figures were measured as, when they came from the
    # content cache under its name (the same weights, config, serving settings and machine; pipeline/measuring.py
    # cache_key); None when measured as this build (a cache hit of its own figures included)
    measured_on: str | None = None  # "evaluate@<build>": measured on the server that stage started, before it
    # scored there (pipeline/measuring.py profile_on_evaluate_server); None: on profile@<build>'s own

    def top_load(self) -> LoadPoint | None:
        """The load at the largest profiled concurrency (the one closest to a full batch, which the cost model
        prices), or None when no load was measured."""
        return max(self.loads.values(), key=lambda p: p.concurrency) if self.loads else None


def write_profile(path: Path, profile: BuildProfile) -> None:
    """Write results/profile/<build>.json (a DVC metrics file)."""
    _write(path, json.dumps(profile.model_dump(mode="json"), indent=2))


def read_profile(path: Path) -> BuildProfile:
    """Read results/profile/<build>.json; raises QuantgateError if it is missing or not a profile."""
    return _read(path, TypeAdapter(BuildProfile), "build profile", "profile")


# results/search/search.json


class Screen(Document):
    """One candidate the search screened: `kept` layers in 16-bit, its per-team screening judgements."""

    kept: int  # layers kept 16-bit: those of the top units of the ranking (pipeline.search.units)
    outcome: Literal["pass", "fail", "undecided"] = "undecided"  # quantgate.screening.Outcome
    passed: bool  # outcome "pass": every team's interval decided within its margin
    worst_slack: float  # min over the teams looked at of (margin - upper bound of the drop), metric units
    teams: dict[str, TeamComparison]  # each team's comparison at its last look
    effective_bits: float  # bits per weight of the targeted Linear layers
    size_mib: float | None = None  # estimated weights of the whole build (pipeline.search.size_mib)
    seconds: float
    docs: int = 0  # candidate documents scored, every look
    looks: list[str] = []  # one line per look: "<docs per task>: team VERDICT, ..."
    est_ratio: float | None = None  # estimated cost per output token / the 16-bit build's (pipeline.search.Pricing);
    # None: priced by bits
    layers: list[str] = []  # the layers it kept 16-bit, most sensitive unit first


class SearchResult(Document):
    """results/search/search.json: the mixed-precision fallback search behind one build's recipe."""

    build: str  # the build whose recipe the search wrote (params search.build)
    recipe: str  # the recipe it fell back from (search.recipe)
    skipped: str | None = None  # why no search ran (the build is not in params.yaml `builds`)
    passed: bool = False  # a screened candidate passed every team
    chosen: int | None = None  # layers kept 16-bit in the recipe
    kept_layers: list[str] = []  # their module names, most sensitive unit first (a fused module's together)
    evaluations: int = 0  # candidates screened
    docs_spent: int = 0  # candidate documents scored over every screen (<= doc_budget)
    doc_budget: int = 0  # search.doc_budget
    ranked_on: str = ""  # the text the KL ranking read (calibration conversations and their sources)
    effective_bits: float | None = None  # bits per weight of the targeted Linear layers, chosen candidate
    size_mib: float | None = None  # estimated weights of the whole build, chosen candidate
    layers: int = 0  # Linear layers the base recipe quantizes
    max_bits_per_weight: float | None = None  # search.max_bits_per_weight: the bound every candidate was held to
    max_kept: int | None = None  # the most layers a candidate could keep 16-bit within it (None: no bound)
    priced_by: str = ""  # the profiles the candidates' cost was estimated from, or why they were priced by bits
    kept_is_cheaper: bool = False  # the quantized kernel measured slower: the most layers kept is the cheapest
    est_ratio: float | None = None  # the chosen candidate's estimated cost per output token / the 16-bit build's
    sensitivity: dict[str, float] = {}  # KL per layer (nats/token), most sensitive first
    screens: list[Screen] = []


def write_search(path: Path, result: SearchResult) -> None:
    """Write results/search/search.json (also DVC's metrics file)."""
    _write(path, json.dumps(result.model_dump(mode="json"), indent=2))


def read_search(path: Path) -> SearchResult:
    """Read results/search/search.json; raises QuantgateError if it is missing or not a search result."""
    return _read(path, TypeAdapter(SearchResult), "search result", "search")


T = TypeVar("T")


def _read(path: Path, adapter: TypeAdapter[T], what: str, stage: str) -> T:
    """`path` parsed and validated by `adapter`; QuantgateError saying which stage re-writes it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise QuantgateError(f"{path} not found: run `dvc repro` (the {stage} stage writes it)") from None
    except IsADirectoryError:
        raise QuantgateError(
            f"{path} is a folder, not the {what} file; give the file the {stage} stage writes"
        ) from None
    except UnicodeDecodeError:
        raise QuantgateError(f"{path}: not UTF-8 JSON, so not a {what}; re-run `dvc repro {stage}`") from None
    except json.JSONDecodeError as exc:
        raise QuantgateError(f"{path}:{exc.lineno}: invalid JSON; re-run `dvc repro {stage}`") from None
    try:
        return adapter.validate_python(data)
    except ValidationError as exc:
        e = exc.errors()[0]
        where = ".".join(str(p) for p in e["loc"])
        if where:
            why = f"{where}: {e['msg']}"
        elif e["type"] in ("model_type", "dict_type"):  # the whole document: "Input should be a valid dictionary"
            why = f"not a JSON object: {json.dumps(data)[:40]}"
        else:
            why = e["msg"]
        raise QuantgateError(f"{path}: not a {what} ({why}); re-run `dvc repro {stage}`") from None
