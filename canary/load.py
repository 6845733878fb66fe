"""Open-loop load through the router, with prompts rendered from the team eval sets.

`replay` sends requests at scheduled times whatever is still in flight (open loop, so a
slow backend shows up as latency, not as a lower request rate). Arrivals are Poisson
(exponential gaps with mean 1/rps, seeded) or a fixed 1/rps interval. Requests rotate
through completions / completions streaming / chat / chat streaming, all greedy
(temperature 0) with short max_tokens, so the router's shadow comparison applies to them.
Each request names the team whose eval set its prompt comes from in the `team_header` (params.yaml
limits.team_header, x-team by default), so a gateway whose limits list that team judges its shadow
agreement per team (canary/analysis.py shadow_check). A gateway that tells teams by API key
(limits.team_keys_file) ignores that header: `team_keys` (read_team_keys: a YAML file {team: key}, the keys
whose SHA-256 digests that file holds) sends each team's prompts with `Authorization: Bearer <its key>`.
End-to-end latency = request sent to last byte; TTFT (streaming only) = to the first SSE event.
A request fails on an HTTP error, a timeout, a stream without [DONE] or with an error (the gateway's `error` event, or
vLLM's in-stream `{"error": ...}` chunk, which it follows with [DONE]), and a 200 that
is no answer (NO_ANSWER: no choice with text or a finish_reason); the report names each failure's count and, once,
the server's words or what was missing.
"""

from __future__ import annotations

import asyncio
import html
import json
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import jinja2
import numpy as np
import yaml
from httpx_sse import aconnect_sse

from gateway.admin import token_problem
from gateway.payloads import chunk_text, first_choice, response_text
from gateway.router import error_message
from quantgate.errors import QuantgateError
from quantgate.files import not_a_file
from quantgate.jsonl import read_jsonl
from quantgate.params import key_lines, read_yaml
from quantgate.teams import TEAM_NAME, load_teams

KINDS = (("completions", False), ("completions", True), ("chat", False), ("chat", True))
# --api choices. Raw completions of an instruct model vary more under quantization than chat
# answers (fp8 shadow agreement 0.25 vs 0.86 measured), so canary demo traffic is chat.
APIS = {"both": KINDS, "chat": KINDS[2:], "completions": KINDS[:2]}
PERCENTILES = (50, 95, 99)
MAX_KEYS_FILE = 1 << 20  # bytes of a --team-keys file: a key per team is a few KB
MAX_KEY = 4096  # characters of an API key: servers refuse headers much past 8-16 KB (h11: 16 KB in all)
NO_ANSWER = "200 without an answer"  # the outcome of a 200 with no choice of text or a finish_reason (missing_answer)
EXCERPT = 200  # characters of a body in a report line (body_excerpt)
EXCERPT_READ = 1 << 16  # bytes of a body read for it: an HTML page's <title> is near its top
TITLE = re.compile(r"<title[^>]*>(.*?)</title", re.I | re.S)
TAGS = re.compile(r"<(script|style)\b.*?</\1\s*>|<!--.*?-->|<[^>]*>", re.I | re.S)


class Prompt(str):
    """A prompt's text (a str, so it goes wherever text goes) and the `team` whose eval set it comes from."""

    team: str

    def __new__(cls, text: str, team: str) -> Prompt:
        self = super().__new__(cls, text)
        self.team = team
        return self


@dataclass(frozen=True)
class Result:
    """One request: status 0 = no HTTP response; error names what went wrong, None if ok; detail is the
    server's own message for an answer that was not 200 (an OpenAI-style error body, else a short excerpt of the
    body: body_excerpt) or for a stream it ended with an `error` event, or what a 200 without an answer lacked
    (NO_ANSWER), None if it gave none."""

    kind: str
    stream: bool
    status: int
    latency_s: float
    ttft_s: float | None
    error: str | None
    detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class LoadReport:
    results: tuple[Result, ...]
    duration_s: float  # from the first request sent to the last answer
    rps: float  # offered
    arrivals: str

    @property
    def ok(self) -> int:
        return sum(r.ok for r in self.results)

    @property
    def success_rate(self) -> float:
        return self.ok / len(self.results) if self.results else 0.0

    def percentiles(self, what: str) -> dict[int, float]:
        """{50: p50, 95: p95, 99: p99} in seconds of "latency" or "ttft" over successful requests ({} if none)."""
        values = [v for r in self.results if r.ok and (v := getattr(r, f"{what}_s")) is not None]
        return {q: float(np.percentile(values, q)) for q in PERCENTILES} if values else {}

    def outcomes(self) -> dict[str, int]:
        """Count per outcome: "ok" or the error, e.g. {"ok": 118, "HTTP 502": 1, "timeout": 1}."""
        return dict(Counter("ok" if r.ok else r.error for r in self.results))

    def lines(self) -> list[str]:
        n = len(self.results)
        out = [
            f"sent {n} in {self.duration_s:.1f} s ({self.rps:g} rps offered, {self.arrivals} arrivals): "
            f"{self.ok} ok, {n - self.ok} failed (success {100 * self.success_rate:.1f} %)",
            "outcomes: " + ", ".join(f"{k}={v}" for k, v in sorted(self.outcomes().items())),
        ]
        said = {}  # the server's words for each failure, once: "HTTP 400" alone does not say why
        for r in self.results:
            if r.detail and r.error not in said:
                said[r.error] = r.detail
        out += [f"{error}, e.g.: {detail}" for error, detail in sorted(said.items())]
        for what, title in (("latency", "end-to-end"), ("ttft", "TTFT (streaming)")):
            p = self.percentiles(what)
            n_ok = sum(r.ok and getattr(r, f"{what}_s") is not None for r in self.results)
            values = " ".join(f"p{q} {v:.3f}" for q, v in p.items()) if p else "-"
            out.append(f"{title} s: {values} (n={n_ok})")
        return out


def render(template, doc: dict) -> str:
    """lm-eval's doc_to_text: a bare field name reads that field, anything else is a Jinja template."""
    if not isinstance(template, str):
        raise QuantgateError(
            f"doc_to_text {template!r} is not a string; only field names and Jinja templates can be rendered"
        )
    t = template.strip()
    if t.isidentifier() and t in doc:
        return str(doc[t])
    return jinja2.Template(template, undefined=jinja2.StrictUndefined).render(**doc)


def prompts_from_evals(evals_dir: Path, limit: int | None = None) -> list[Prompt]:
    """doc_to_text of every task's test documents under `evals_dir` (at most `limit` per task), in
    team and file order, each with its team. Raises QuantgateError if the eval sets do not load
    (quantgate.teams.load_teams)."""
    prompts = []
    for team in load_teams(evals_dir):
        for task in team.tasks:
            split = task.config.get("test_split") or task.config.get("validation_split")
            path = Path(task.config["dataset_kwargs"]["data_files"][split])
            fix = "check the eval sets with `quantgate evals validate`"
            docs = [doc for _, doc in read_jsonl(path, fix, loader=True)]  # what lm-eval's loader reads
            try:
                prompts += [Prompt(render(task.config.get("doc_to_text"), d), team.name) for d in docs[:limit]]
            except jinja2.TemplateError as exc:
                raise QuantgateError(f"{task.path}: doc_to_text does not render: {exc}") from None
    if not prompts:
        raise QuantgateError(f"{evals_dir}: no documents to make prompts from")
    return prompts


def base_url(url: str) -> str:
    """http://host:port from a URL given with or without /v1."""
    return url.rstrip("/").removesuffix("/v1")


def request_body(kind: str, stream: bool, prompt: str, model: str, max_tokens: int) -> dict:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if kind == "chat":
        return {**body, "messages": [{"role": "user", "content": prompt}]}
    return {**body, "prompt": prompt}


def body_excerpt(content: bytes | None) -> str | None:
    """A body on one short line for a report: an HTML page's <title> (else its text, tags dropped), anything else as
    it is; runs of whitespace as one space, at most EXCERPT characters; None when that leaves nothing. A proxy's
    `502 Bad Gateway` page reads "502 Bad Gateway", never the page."""
    text = (content or b"")[:EXCERPT_READ].decode("utf-8", "replace")
    if (title := TITLE.search(text)) and title.group(1).strip():
        text = html.unescape(title.group(1))
    elif text.lstrip().startswith("<"):
        text = html.unescape(TAGS.sub(" ", text))
    return " ".join(text.split())[:EXCERPT].rstrip() or None


def error_detail(content: bytes | None) -> str | None:
    """What a server said in an error body: its OpenAI-style message (gateway.router.error_message), else an
    excerpt of the body (body_excerpt: a proxy's HTML page, plain text, JSON of another shape); None if empty."""
    return error_message(content) or body_excerpt(content)


def missing_answer(content: bytes, stream: bool = False) -> str | None:
    """What a 200's body (`stream`: one stream chunk's data) lacks to be an answer, None when its first choice has
    text or a finish_reason (gateway.payloads): "not JSON", 'no "choices"', '"choices" empty', '"choices" not a
    list' or "no text and no finish_reason in choices[0]" (an empty object or a non-object there too)."""
    try:
        doc = json.loads(content)
    except ValueError:
        return "not JSON"
    if not isinstance(doc, dict) or "choices" not in doc:
        return 'no "choices"'
    if not isinstance(choices := doc["choices"], list) or not choices:
        return '"choices" empty' if choices == [] else '"choices" not a list'
    choice = first_choice(doc)  # {} for a choice that is no object: then it has neither text nor a finish_reason
    text = chunk_text(doc) if stream else response_text(doc)
    return None if text or choice.get("finish_reason") else "no text and no finish_reason in choices[0]"


async def _one(
    client: httpx.AsyncClient, url: str, kind: str, stream: bool, body: dict, timeout_s: float, headers: dict
) -> Result:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    t0, ttft, status, detail = time.perf_counter(), None, 0, None
    try:
        async with asyncio.timeout(timeout_s):
            if not stream:
                r = await client.post(url + path, json=body, headers=headers)
                status = r.status_code
                err = None if status == 200 else f"HTTP {status}"
                if status != 200:
                    detail = error_detail(r.content)
                elif missing := missing_answer(r.content):
                    err, detail = NO_ANSWER, f"{missing}: {body_excerpt(r.content) or '(empty)'}"
            else:
                async with aconnect_sse(client, "POST", url + path, json=body, headers=headers) as source:
                    status = source.response.status_code
                    err = f"HTTP {status}" if status != 200 else "no [DONE]"
                    ctype = source.response.headers.get("content-type", "")
                    if status != 200:
                        detail = error_detail(await source.response.aread())
                    elif not ctype.startswith("text/event-stream"):  # httpx_sse raised a bare SSEError on it
                        said = body_excerpt(await source.response.aread()) or "(empty)"
                        err, detail = NO_ANSWER, f"not an event stream ({ctype or 'no content-type'}): {said}"
                    else:
                        first, answered = None, False  # the first chunk's data; whether any chunk answered
                        async for ev in source.aiter_sse():
                            ttft = ttft if ttft is not None else time.perf_counter() - t0
                            if ev.event == "error":  # the gateway's words: why it could not finish the stream
                                err, detail = "stream error event", error_detail(ev.data.encode())
                                break
                            if '"error"' in ev.data and (said := error_message(ev.data.encode())):
                                err, detail = "stream error event", said  # vLLM's engine error, sent in-stream
                                break
                            if ev.data == "[DONE]":
                                err = None
                            elif not answered:
                                first = ev.data if first is None else first
                                answered = missing_answer(ev.data.encode(), stream=True) is None
                        if err is None and not answered:
                            err, detail = NO_ANSWER, _unanswered_stream(first)
    except TimeoutError:
        err = "timeout"
    except (httpx.HTTPError, ValueError) as exc:
        err = type(exc).__name__
    return Result(kind, stream, status, time.perf_counter() - t0, ttft, err, detail)


def _unanswered_stream(first: str | None) -> str:
    """The detail of a stream that ended with [DONE] but no chunk with text or a finish_reason; `first`: the first
    chunk's data, None if none came."""
    if first is None:
        return "no chunk before [DONE]"
    said = body_excerpt(first.encode()) or "(empty)"
    if missing_answer(first.encode(), stream=True) == "not JSON":  # a proxy's text as events: not an empty answer
        return f"the first chunk is not JSON: {said}"
    return f"no text and no finish_reason in any chunk: {said}"


@dataclass(frozen=True)
class LoadOptions:
    """How `replay` sends: max_tokens per request, timeout_s per request (and for the last answers),
    arrivals "poisson" or "fixed", the seed of the arrivals and prompts, `stop` (set: stop sending),
    `api` (APIS: which endpoints), `team_header` (the header that names a Prompt's team; None: none),
    `team_keys` ({team: API key}, read_team_keys: a team's prompts also carry `Authorization: Bearer <key>`)."""

    max_tokens: int = 16
    timeout_s: float = 60.0
    arrivals: str = "poisson"
    seed: int = 0
    stop: threading.Event | None = None
    api: str = "both"
    team_header: str | None = "x-team"  # params.yaml limits.team_header's default
    team_keys: Mapping[str, str] | None = None

    def headers(self, team: str | None) -> dict[str, str]:
        """The headers that name `team` to the gateway: its team header and, where `team_keys` has its key,
        the bearer key (a gateway with limits.team_keys_file reads only that); none for a prompt of no team."""
        if not team:
            return {}
        out = {self.team_header: team} if self.team_header else {}
        if self.team_keys and team in self.team_keys:
            out["authorization"] = f"Bearer {self.team_keys[team]}"
        return out


def unkeyed(prompts: Sequence[str], team_keys: Mapping[str, str] | None) -> list[str]:
    """The teams of `prompts` (Prompt.team) without a key in `team_keys`, sorted; none without `team_keys`. A gateway
    that tells teams by key counts their requests as anonymous."""
    if team_keys is None:
        return []
    return sorted({t for p in prompts if (t := getattr(p, "team", None)) and t not in team_keys})


def read_team_keys(path: Path) -> dict[str, str]:
    """{team: API key} from a YAML file of plain keys, {billing: sk-..., search: sk-...}: the secrets whose SHA-256
    digests the gateway's limits.team_keys_file holds (keep the file private). Raises QuantgateError naming the
    file and line: no file to read (quantgate.files.not_a_file: a broken link, a FIFO, a folder, nothing there),
    invalid YAML, not a mapping of team names (an eval set's folder name: TEAM_NAME, so not 1, true or `Billing`)
    to one non-empty key each, or a key that an HTTP header cannot carry (gateway.admin.token_problem)."""
    if (bad := not_a_file(path)) is not None:
        raise QuantgateError(f"{path} is {bad[0]}; {bad[1]}give a YAML file {{team: API key}} for --team-keys")
    if (size := path.stat().st_size) > MAX_KEYS_FILE:
        raise QuantgateError(f"{path}: {size:,} bytes; a file of one API key per team is far smaller: give that file")
    data = read_yaml(path)
    if not isinstance(data, dict) or not data:
        raise QuantgateError(f"{path}: must be a mapping {{team: API key}}, e.g. `billing: sk-...`")
    lines, teams_of = key_lines(path), {}
    for team, key in data.items():
        at = f"{path}:{line}" if (line := _key_line(lines, team)) else str(path)
        if not isinstance(team, str) or not TEAM_NAME.fullmatch(team):
            raise QuantgateError(
                f"{at}: {team!r} is not a team name (a team folder's under evals/, lower_snake_case); write "
                "`<team>: <its API key>`"
            )
        if isinstance(key, bool | int | float):  # `billing: 0123` is 83 to YAML: the key as written is lost
            what = "a boolean" if isinstance(key, bool) else "a number"
            raise QuantgateError(f"{at}: {team}'s key was read as {what} ({key!r}); quote it: {team}: '<its key>'")
        if not isinstance(key, str) or not key.strip():
            raise QuantgateError(f"{at}: {team}: give its API key as one string (not a list or a digest list)")
        if len(key) > MAX_KEY:
            raise QuantgateError(f"{at}: {team}'s key has {len(key):,} characters; a header takes a few KB at most")
        if why := token_problem(key):
            raise QuantgateError(f"{at}: {team}'s key {why}; give the key as issued")
        if (other := teams_of.setdefault(key.strip(), team)) != team:  # the gateway would read one team
            raise QuantgateError(f"{at}: {team} has the same key as {other}; give each team its own key")
    return {team: key.strip() for team, key in data.items()}


def _key_line(lines: dict[tuple, int], key: object) -> int | None:
    """The line of top-level `key` as read: key_lines has keys as written (`1`, `true`, `null`), read back here."""
    if isinstance(key, str):
        return lines.get((key,))
    for (written, *below), line in lines.items():
        if not below and isinstance(written, str):
            try:
                read = yaml.safe_load(written)
            except yaml.YAMLError:
                continue
            if type(read) is type(key) and read == key:
                return line
    return None


async def replay_async(url: str, prompts: Sequence[str], rps: float, duration_s: float, **options) -> LoadReport:
    """Send requests at `rps` for `duration_s` seconds (or until `stop` is set), then wait (up to
    timeout_s) for the last answers; `options` are LoadOptions' fields. `api` (APIS) picks the endpoints:
    kinds alternate in turn, streaming and not.

    Raises QuantgateError on bad arguments or if `url` does not answer GET /v1/models.
    """
    try:
        o = LoadOptions(**options)
    except TypeError as exc:  # an unknown option
        raise QuantgateError(f"replay: {exc}") from None
    max_tokens, timeout_s, arrivals, seed, stop, api = o.max_tokens, o.timeout_s, o.arrivals, o.seed, o.stop, o.api
    if rps <= 0 or duration_s <= 0 or not prompts or max_tokens < 1:
        raise QuantgateError(
            f"need rps > 0, duration > 0, max_tokens >= 1 and prompts (got rps={rps}, "
            f"duration={duration_s}, max_tokens={max_tokens}, {len(prompts)} prompts)"
        )
    if arrivals not in ("poisson", "fixed"):
        raise QuantgateError(f"arrivals must be poisson or fixed, got {arrivals!r}")
    if api not in APIS:
        raise QuantgateError(f"api must be one of {', '.join(APIS)}, got {api!r}")
    kinds = APIS[api]
    url, rng = base_url(url), random.Random(seed)
    async with httpx.AsyncClient(
        timeout=timeout_s, trust_env=False, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)
    ) as client:
        try:
            r = await client.get(f"{url}/v1/models")
            model = r.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise QuantgateError(
                f"{url}/v1/models did not answer with a model ({type(exc).__name__}); is the router running there?"
            ) from None
        tasks, start, at, i = [], time.perf_counter(), 0.0, 0
        while at < duration_s and not (stop is not None and stop.is_set()):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            kind, stream = kinds[i % len(kinds)]
            prompt = rng.choice(prompts)
            headers = o.headers(getattr(prompt, "team", None))
            body = request_body(kind, stream, prompt, model, max_tokens)
            tasks.append(asyncio.create_task(_one(client, url, kind, stream, body, timeout_s, headers)))
            at += rng.expovariate(rps) if arrivals == "poisson" else 1.0 / rps
            i += 1
        results = await asyncio.gather(*tasks)
    return LoadReport(tuple(results), time.perf_counter() - start, rps, arrivals)


def replay(url: str, prompts: Sequence[str], rps: float, duration_s: float, **kwargs) -> LoadReport:
    """Blocking replay_async (same arguments)."""
    return asyncio.run(replay_async(url, prompts, rps, duration_s, **kwargs))
