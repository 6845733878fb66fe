"""Limits that protect the shared serving fleet ("cost as an attack"): a context ceiling, an output
token cap and per-team rate limits, from params.yaml block `limits`, checked by the router
(gateway.router.Router(limits=...)) before a backend is chosen.

Per request, in this order (the first that fails answers; the backends never see the request):
1. Rate (429): a token bucket per team, `rps` requests per second sustained and `burst` at once
   after a quiet spell. The answer carries `Retry-After` (whole seconds, rounded up, >= 1): the
   time until the bucket holds a request again. Every request that gets past this step spends one,
   a 400 below included.
2. Output cap (400): `max_tokens` / `max_completion_tokens` above `max_output_tokens`, or not a
   positive integer. A request that gives neither gets `max_tokens` set for it (the body is
   changed in place) to the cap, or to what the context ceiling leaves after its prompt if that
   is less.
3. Context ceiling (400): prompt tokens + the output tokens it may get above `max_context_tokens`
   (null in params = evaluate.serve.max_model_len). Prompt tokens come from the injected
   `count_prompt_tokens(path, body)`; `tokenizer_counter(model_dir)` makes one from the served
   build's Hugging Face tokenizer. A prompt it cannot count (a malformed body) is a 400 too.

Teams: with `team_keys_file` null, the team is the `team_header` request header (default
`x-team`), trusted as given: set it in an authenticating proxy in front. With a keys file, the
team is the one whose API key the request's `Authorization: Bearer <key>` carries; the file holds
only SHA-256 digests of the keys (`printf %s "$KEY" | sha256sum`), as YAML {team: [digest, ...]},
so no secret is stored. A request naming no team, or a team without its own entry in
`rate_limits.teams`, or an unknown key, shares the `default` bucket under the team name
"anonymous". Neither header is forwarded to the backends (the router forwards no client header).

Not thread-safe: the router calls `check` from its event loop only.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field, ValidationInfo, field_validator

from quantgate.errors import QuantgateError
from quantgate.files import not_a_file
from quantgate.params import PARAMS_FILE, Frozen, key_lines, load_block, read_yaml, where
from quantgate.serving import ServeParams

ANONYMOUS = "anonymous"  # the team of requests that name none, or none with its own rate limit
OUTPUT_KEYS = ("max_tokens", "max_completion_tokens")


class Rate(Frozen):
    rps: float = Field(gt=0)  # requests per second, sustained
    burst: int = Field(ge=1)  # requests at once after a quiet spell (the bucket's size)


class RateLimits(Frozen):
    default: Rate = Rate(rps=5, burst=10)  # the "anonymous" bucket, shared by every team not listed
    teams: dict[str, Rate] = {}  # team name -> its own bucket

    @field_validator("teams")
    @classmethod
    def _not_anonymous(cls, teams: dict[str, Rate]) -> dict[str, Rate]:
        if ANONYMOUS in teams:
            raise ValueError(f"'{ANONYMOUS}' is the name of the default bucket; set rate_limits.default instead")
        return teams


class Limits(Frozen):
    """Per-request limits of the fleet; see the module docstring for what a client gets."""

    max_context_tokens: int | None = Field(default=None, ge=2)  # prompt + output; None = served max_model_len
    max_output_tokens: int = Field(default=512, ge=1)  # cap on max_tokens / max_completion_tokens
    team_header: str = Field(default="x-team", min_length=1)  # request header naming the team
    team_keys_file: str | None = None  # YAML {team: [sha256 hex of an API key]}: team from the bearer key
    rate_limits: RateLimits = RateLimits()

    @field_validator("max_output_tokens")
    @classmethod
    def _room_for_a_prompt(cls, v: int, info: ValidationInfo) -> int:
        ceiling = info.data.get("max_context_tokens")
        if ceiling is not None and v >= ceiling:
            raise ValueError(f"must be below max_context_tokens ({ceiling}) to leave room for a prompt, got {v}")
        return v

    @field_validator("team_header")
    @classmethod
    def _header_name(cls, v: str) -> str:
        if why := header_name_problem(v):
            raise ValueError(why)
        return v.lower()

    def rate(self, team: str) -> tuple[Rate, str]:
        """(the team's rate, its params key, e.g. "rate_limits.teams.billing")."""
        if team in self.rate_limits.teams:
            return self.rate_limits.teams[team], f"rate_limits.teams.{team}"
        return self.rate_limits.default, "rate_limits.default"

    def gauges(self) -> list[tuple[str, str, float]]:
        """(team, limit, value) of every configured limit, for /metrics; each team shows all it gets."""
        rows = []
        for team in (ANONYMOUS, *self.rate_limits.teams):
            rate = self.rate(team)[0]
            rows += [(team, "rps", rate.rps), (team, "burst", rate.burst)]
            rows += [(team, "max_output_tokens", self.max_output_tokens)]
            if self.max_context_tokens is not None:
                rows += [(team, "max_context_tokens", self.max_context_tokens)]
        return rows


# headers HTTP or the gateway give a meaning of their own: a team name there breaks every request (content-length,
# content-type, host, ...) or is read as something else (authorization: the API key, limits.team_keys_file)
RESERVED_HEADERS = frozenset(
    ("authorization", "connection", "content-length", "content-type", "host", "te", "trailer", "transfer-encoding")
)


def header_name_problem(name: str) -> str | None:
    """Why `name` cannot name a request's team: not an HTTP header name (an RFC 9110 token), or one HTTP itself
    uses (RESERVED_HEADERS); or None."""
    if not re.fullmatch(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+", name):
        return f"{name!r} is not an HTTP header name (letters, digits and !#$%&'*+-.^_`|~; no spaces or colons)"
    if name.lower() in RESERVED_HEADERS:
        return f"{name!r} is a header HTTP itself uses; name the team in a header of its own, e.g. x-team"
    return None


def load_limits(path: Path = PARAMS_FILE) -> Limits:
    """Block `limits` of params.yaml, max_context_tokens null resolved to evaluate.serve.max_model_len
    (the tokens a served build's vLLM server accepts).

    Raises QuantgateError naming params.yaml:<line> and the field that is wrong: limits.<field>, or
    evaluate.serve.max_model_len when the ceiling comes from it. A max_context_tokens above
    max_model_len is refused (vLLM would refuse those requests itself, with its own 400); with
    max_model_len -1 (vLLM fits the length at start, unknown here) max_context_tokens must be set.
    """
    limits = load_block("limits", Limits, path)
    model_len = load_block("evaluate.serve", ServeParams, path).max_model_len
    lines = key_lines(path)

    def refuse(key: tuple[str, ...], message: str) -> QuantgateError:
        line = lines.get(key) or lines.get(key[:-1])
        return QuantgateError(f"{path}{f':{line}' if line else ''}: {'.'.join(key)}: {message}")

    known = model_len >= 2  # vLLM: -1 = fit to memory at start; 0 and 1 leave no room for a prompt
    ceiling = limits.max_context_tokens
    if ceiling is None:
        if not known:
            raise refuse(
                ("limits", "max_context_tokens"),
                f"null takes evaluate.serve.max_model_len, which is {model_len}"
                + (" (vLLM's own length, known only once a server runs)" if model_len == -1 else "")
                + "; set limits.max_context_tokens to the tokens a request may use, e.g. 2048",
            )
        if limits.max_output_tokens >= model_len:
            raise refuse(
                ("limits", "max_output_tokens"),
                f"{limits.max_output_tokens} leaves no room for a prompt under the context ceiling, "
                f"evaluate.serve.max_model_len {model_len} (limits.max_context_tokens is null); lower it",
            )
        return limits.model_copy(update={"max_context_tokens": model_len})
    if known and ceiling > model_len:
        raise refuse(
            ("limits", "max_context_tokens"),
            f"{ceiling} is over evaluate.serve.max_model_len {model_len}, the most a served build accepts; "
            f"lower it to at most {model_len}, or null to use max_model_len",
        )
    return limits


class TokenBucket:
    """`rate` tokens per second up to `capacity`; starts full. `clock` is monotonic seconds."""

    def __init__(self, rate: float, capacity: int, clock: Callable[[], float] = time.monotonic):
        self.rate, self.capacity, self._clock = rate, capacity, clock
        self.tokens, self._t = float(capacity), clock()

    def take(self) -> float:
        """Spend one token: 0.0 if there was one, else the seconds until there is (nothing spent)."""
        now = self._clock()
        self.tokens = min(self.capacity, self.tokens + (now - self._t) * self.rate)
        self._t = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


@dataclass(frozen=True)
class Rejection:
    """Why a request is refused: the HTTP status, an OpenAI-style message, the team and the reason
    ("rate_limit", "max_output_tokens", "max_context_tokens", "bad_request") for /metrics."""

    status: int
    message: str
    team: str
    reason: str
    retry_after_s: int | None = None  # 429 only

    @property
    def headers(self) -> dict[str, str]:
        return {"retry-after": str(self.retry_after_s)} if self.retry_after_s is not None else {}


def read_team_keys(path: Path, teams: Mapping[str, Rate]) -> dict[str, str]:
    """{sha256 hex digest: team} from a keys file {team: [digest, ...]}; each team must have its own
    rate limit (rate_limits.teams), each digest one team. Raises QuantgateError naming the file; where it is no
    file to read (quantgate.files.not_a_file: a broken link or a FIFO named as one, never opened), naming
    params.yaml's limits.team_keys_file line too."""
    if (bad := not_a_file(path)) is not None:
        raise QuantgateError(
            f"{where(PARAMS_FILE, 'limits.team_keys_file')}: limits.team_keys_file: {path} is {bad[0]}; {bad[1]}give "
            "the YAML of API-key digests per team, or null"
        )
    doc = read_yaml(path)
    if not isinstance(doc, dict):
        raise QuantgateError(f"{path}: must be a mapping {{team: [sha256 hex of an API key, ...]}}")
    teams_of: dict[str, str] = {}
    for team, digests in doc.items():
        if team not in teams:
            raise QuantgateError(f"{path}: team {team!r} has no limits.rate_limits.teams entry in params; add one")
        if not isinstance(digests, list) or not all(
            isinstance(d, str) and re.fullmatch(r"[0-9a-fA-F]{64}", d) for d in digests
        ):
            raise QuantgateError(
                f"{path}: {team}: must be a list of SHA-256 hex digests, 64 hex digits each (printf %s KEY | sha256sum)"
            )
        for d in (d.lower() for d in digests):  # hexdigest() is lower-case; a tool may print upper
            if teams_of.setdefault(d, team) != team:
                raise QuantgateError(f"{path}: digest {d[:12]}... is listed for {teams_of[d]} and {team}; keep one")
    return teams_of


class Limiter:
    """Checks requests against `limits`; one bucket per team with its own rate, one shared "anonymous".

    `count_prompt_tokens(path, body)` (path "/completions" or "/chat/completions") is needed when
    limits.max_context_tokens is set; `clock` (monotonic seconds) drives the buckets.
    """

    def __init__(
        self,
        limits: Limits,
        count_prompt_tokens: Callable[[str, dict], int] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ):
        if limits.max_context_tokens is not None and count_prompt_tokens is None:
            raise QuantgateError("limits.max_context_tokens is set: the limiter needs count_prompt_tokens")
        self.limits = limits
        self._count = count_prompt_tokens
        keys_file = limits.team_keys_file
        self._teams_of_key = read_team_keys(Path(keys_file), limits.rate_limits.teams) if keys_file else None
        self._buckets = {
            team: TokenBucket(limits.rate(team)[0].rps, limits.rate(team)[0].burst, clock)
            for team in (ANONYMOUS, *limits.rate_limits.teams)
        }

    def team(self, headers: Mapping[str, str]) -> str:
        """The request's team (header names lower-case in a plain dict; starlette's Headers ignore case)."""
        if self._teams_of_key is None:
            name = headers.get(self.limits.team_header)
        else:
            scheme, _, key = (headers.get("authorization") or "").partition(" ")
            digest = hashlib.sha256(key.strip().encode()).hexdigest() if scheme.lower() == "bearer" else None
            name = self._teams_of_key.get(digest)
        return name if name in self._buckets else ANONYMOUS

    def check(self, path: str, body: dict, headers: Mapping[str, str]) -> Rejection | None:
        """None if the request may go on (max_tokens set in `body` if it gave no output limit), else why not."""
        team = self.team(headers)
        return self._over_rate(team) or self._over_tokens(path, body, team)

    def _over_rate(self, team: str) -> Rejection | None:
        wait_s = self._buckets[team].take()
        if not wait_s:
            return None
        rate, key = self.limits.rate(team)
        retry = max(1, math.ceil(wait_s))
        why = f"rate limit of team {team} exceeded: {rate.rps:g} requests/s, burst {rate.burst} (limits.{key})"
        return Rejection(429, f"{why}; retry after {retry} s", team, "rate_limit", retry)

    def _over_tokens(self, path: str, body: dict, team: str) -> Rejection | None:
        cap = self.limits.max_output_tokens
        asked = {k: body[k] for k in OUTPUT_KEYS if body.get(k) is not None}
        for k, v in asked.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                return Rejection(400, f"{k} must be a positive integer, got {v!r}", team, "bad_request")
            if v > cap:
                why = f"{k} {v} is over the output cap of {cap} tokens (limits.max_output_tokens)"
                return Rejection(400, f"{why}; ask for at most {cap}", team, "max_output_tokens")
        ceiling = self.limits.max_context_tokens
        if ceiling is None:
            prompt, ceiling = 0, math.inf
        else:
            try:
                prompt = self._count(path, body)
            except Exception as exc:  # the counter runs client data through a tokenizer and chat template
                why = f"cannot count the prompt's tokens: {type(exc).__name__}: {exc}"[:300]
                return Rejection(400, why, team, "bad_request")
        output = min(asked.values()) if asked else max(1, min(cap, ceiling - prompt))
        if prompt + output > ceiling:
            why = f"prompt of {prompt} tokens + {output} output tokens is over the context ceiling of {ceiling} tokens"
            fix = "shorten the prompt or ask for fewer output tokens"
            return Rejection(400, f"{why} (limits.max_context_tokens); {fix}", team, "max_context_tokens")
        if not asked:
            body["max_tokens"] = output
        return None


def tokenizer_counter(model_dir: Path) -> Callable[[str, dict], int]:
    """count_prompt_tokens from the Hugging Face tokenizer in `model_dir`, counted as vLLM does:
    chat messages through the chat template (no special tokens added after it), a completions
    prompt with them; token-id prompts by length; a batch of prompts by its longest."""
    from transformers import AutoTokenizer  # heavy: imported only when a limited router is built

    tok = AutoTokenizer.from_pretrained(model_dir)

    def one(prompt) -> int:
        if isinstance(prompt, str):
            return len(tok(prompt)["input_ids"])
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def count(path: str, body: dict) -> int:
        if path.endswith("/chat/completions"):
            text = tok.apply_chat_template(
                body["messages"],
                tools=body.get("tools"),
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False),
                tokenize=False,
            )
            return len(tok(text, add_special_tokens=False)["input_ids"])
        prompt = body["prompt"]
        batch = isinstance(prompt, list) and bool(prompt) and not all(isinstance(t, int) for t in prompt)
        return max(map(one, prompt)) if batch else one(prompt)

    return count
