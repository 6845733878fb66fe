"""Fleet limits (gateway/limits.py) through the router, against the fake backends of test_canary_router:
output cap and context ceiling (400), per-team rate limits (429 + Retry-After, on an injected clock),
/metrics, params validation, API-key teams and the Hugging Face token counter."""

import hashlib
import re
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.limits import ANONYMOUS, Limiter, Limits, TokenBucket, load_limits, tokenizer_counter
from quantgate.errors import QuantgateError
from quantgate.params import key_lines
from tests import test_canary_router as fake_backends
from tests.test_canary_analysis import write_params
from tests.test_canary_router import Fake, complete, fleet, metric_values, running
from tests.tiny import tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
fakes = fake_backends.fakes  # the fixtures: started fake backends, and their behaviour reset per test (autouse)
reset = fake_backends.reset
CAP = 16  # max_output_tokens in these tests
CEILING = 40  # max_context_tokens


class Clock:
    """Monotonic seconds that move only when told."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def words(path: str, body: dict) -> int:
    """A stand-in prompt counter: one token per whitespace-separated word."""
    if path == "/chat/completions":
        return sum(len(m["content"].split()) for m in body["messages"])
    return len(body["prompt"].split())


def limiter(clock=None, keys_file=None, **rate_limits) -> Limiter:
    rates = {"default": {"rps": 1, "burst": 2}, "teams": {"billing": {"rps": 2, "burst": 3}}, **rate_limits}
    limits = Limits(max_context_tokens=CEILING, max_output_tokens=CAP, team_keys_file=keys_file, rate_limits=rates)
    return Limiter(limits, words, clock=clock or Clock())


def ask(client, headers=None, **extra) -> httpx.Response:
    """A non-streaming completions request within the limits unless `extra` says otherwise."""
    return client.post("/v1/completions", json={"prompt": "2+2?", "max_tokens": 4, **extra}, headers=headers)


def refused(r: httpx.Response, status: int) -> str:
    """The OpenAI-style error message of a refused request."""
    assert r.status_code == status, r.text
    return r.json()["error"]["message"]


# --- output cap and context ceiling ---------------------------------------------------------------
def test_a_request_within_limits_is_proxied_unchanged(fakes):
    with running(fleet(fakes), limits=limiter()) as (router, client):
        r, text, _ = complete(client, max_tokens=CAP, user="u1")
    assert r.status_code == 200 and text == fakes["stable"].default_text
    sent = {"model": "stable-served", "max_tokens": CAP, "temperature": 0, "stream": False, "prompt": "2+2?"}
    assert fakes["stable"].seen == [{**sent, "user": "u1"}]


@pytest.mark.parametrize("chat", [False, True])
def test_no_output_limit_gets_the_cap_or_what_the_ceiling_leaves(fakes, chat):
    long = " ".join(["word"] * (CEILING - 5))  # leaves 5 tokens of the ceiling
    with running(fleet(fakes), limits=limiter()) as (router, client):
        for prompt in ("2+2?", long):
            body = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
            assert complete(client, chat=chat, max_tokens=None, **body)[0].status_code == 200
    assert [b["max_tokens"] for b in fakes["stable"].seen] == [CAP, 5]


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
def test_over_the_output_cap_is_a_400_naming_the_limit(fakes, key):
    with running(fleet(fakes), limits=limiter()) as (router, client):
        message = refused(complete(client, chat=True, **{key: CAP + 1})[0], 400)
    assert message == (
        f"{key} {CAP + 1} is over the output cap of {CAP} tokens (limits.max_output_tokens); ask for at most {CAP}"
    )
    assert fakes["stable"].seen == []


@pytest.mark.parametrize("value", ["8", 0, True, 2.5])
def test_an_output_limit_that_is_not_a_positive_integer_is_a_400(fakes, value):
    with running(fleet(fakes), limits=limiter()) as (router, client):
        message = refused(complete(client, max_tokens=value)[0], 400)
    assert message == f"max_tokens must be a positive integer, got {value!r}" and fakes["stable"].seen == []


def test_over_the_context_ceiling_is_a_400_naming_the_limit(fakes):
    prompt = " ".join(["word"] * (CEILING - CAP + 1))  # + CAP output tokens = CEILING + 1
    too_long = " ".join(["word"] * CEILING)  # no room for even one output token
    with running(fleet(fakes), limits=limiter(default={"rps": 1, "burst": 10})) as (router, client):
        message = refused(complete(client, prompt=prompt, max_tokens=CAP)[0], 400)
        assert complete(client, prompt=prompt, max_tokens=CAP - 1)[0].status_code == 200  # exactly the ceiling
        no_room = refused(complete(client, prompt=too_long, max_tokens=None)[0], 400)
        unreadable = refused(complete(client, chat=True, messages="not a list")[0], 400)
    assert message == (
        f"prompt of {CEILING - CAP + 1} tokens + {CAP} output tokens is over the context ceiling of {CEILING} "
        "tokens (limits.max_context_tokens); shorten the prompt or ask for fewer output tokens"
    )
    assert no_room.startswith(f"prompt of {CEILING} tokens + 1 output tokens is over the context ceiling")
    assert unreadable.startswith("cannot count the prompt's tokens: TypeError")
    assert len(fakes["stable"].seen) == 1


# --- rate limits ----------------------------------------------------------------------------------
def test_over_rate_is_a_429_with_retry_after_and_the_next_request_after_it_passes(fakes):
    clock = Clock()
    team = {"x-team": "billing"}  # rps 2, burst 3
    with running(fleet(fakes), limits=limiter(clock)) as (router, client):
        assert [ask(client, team).status_code for _ in range(3)] == [200] * 3
        r = ask(client, team)
        message = refused(r, 429)
        retry = r.headers["retry-after"]
        clock.t += 0.4  # 0.8 of a request: still refused, Retry-After still rounded up to 1 s
        assert ask(client, team).headers["retry-after"] == "1"
        clock.t += int(retry) - 0.4
        assert ask(client, team).status_code == 200
    assert retry == "1" and message == (
        "rate limit of team billing exceeded: 2 requests/s, burst 3 (limits.rate_limits.teams.billing); retry after 1 s"
    )
    assert len(fakes["stable"].seen) == 4


def test_retry_after_rounds_up_to_whole_seconds():
    clock = Clock()
    lim = limiter(clock, default={"rps": 0.3, "burst": 1})
    assert lim.check("/completions", {"prompt": "hi"}, {}) is None
    no = lim.check("/completions", {"prompt": "hi"}, {})
    assert (no.status, no.retry_after_s, no.headers, no.team) == (429, 4, {"retry-after": "4"}, ANONYMOUS)  # 3.33 s
    clock.t += 3.34
    assert lim.check("/completions", {"prompt": "hi"}, {}) is None


def test_teams_have_independent_buckets_and_unknown_teams_share_the_default(fakes):
    with running(fleet(fakes), limits=limiter()) as (router, client):

        def status(team):
            return ask(client, {"x-team": team} if team else {}).status_code

        assert [status("billing") for _ in range(4)] == [200, 200, 200, 429]
        # the default bucket (burst 2) is untouched by billing, and shared by every team without its own
        assert [status(None), status("no-such-team"), status("Billing"), status("billing")] == [200, 200, 429, 429]
        m = metric_values(client.get("/metrics").text)
    assert m[("canary_rejected_requests_total", (("reason", "rate_limit"), ("team", "billing")))] == 2
    assert m[("canary_rejected_requests_total", (("reason", "rate_limit"), ("team", ANONYMOUS)))] == 1


@pytest.mark.parametrize("over", ["cap", "rate"])
def test_streaming_requests_are_limited_too(fakes, over):
    with running(fleet(fakes), limits=limiter(default={"rps": 1, "burst": 1})) as (router, client):
        if over == "rate":
            assert complete(client, stream=True)[0].status_code == 200
        body = {"prompt": "2+2?", "stream": True, "max_tokens": CAP + 1 if over == "cap" else 4}
        r = client.post("/v1/completions", json=body)
    assert r.status_code == (400 if over == "cap" else 429) and r.headers["content-type"] == "application/json"
    assert len(fakes["stable"].seen) == (over == "rate")


def test_metrics_show_every_limit_per_team_and_the_rejections(fakes):
    with running(fleet(fakes), limits=limiter()) as (router, client):
        ask(client, {"x-team": "billing"}, max_tokens=CAP + 1)
        ask(client, max_tokens=CAP + 1)
        ask(client, max_tokens=None, prompt=" ".join(["w"] * CEILING))
        ask(client)  # the third anonymous request: over the default burst of 2 (a 400 spends its request too)
        m = metric_values(client.get("/metrics").text)
    limit = {
        (dict(labels)["team"], dict(labels)["limit"]): v for (name, labels), v in m.items() if name == "canary_limit"
    }
    assert limit == {
        **{(t, "max_context_tokens"): CEILING for t in (ANONYMOUS, "billing")},
        **{(t, "max_output_tokens"): CAP for t in (ANONYMOUS, "billing")},
        (ANONYMOUS, "rps"): 1,
        (ANONYMOUS, "burst"): 2,
        ("billing", "rps"): 2,
        ("billing", "burst"): 3,
    }
    rejected = {
        tuple(v for _, v in labels): n for (name, labels), n in m.items() if name == "canary_rejected_requests_total"
    }
    assert rejected == {
        ("max_output_tokens", "billing"): 1,
        ("max_output_tokens", ANONYMOUS): 1,
        ("max_context_tokens", ANONYMOUS): 1,
        ("rate_limit", ANONYMOUS): 1,
    }


def test_without_limits_nothing_is_refused_or_shown(fakes):
    with running(fleet(fakes)) as (router, client):
        assert complete(client, max_tokens=100_000)[0].status_code == 200
        text = client.get("/metrics").text
    assert "canary_limit{" not in text and "canary_rejected_requests_total{" not in text


def test_token_bucket_refills_at_its_rate_up_to_its_capacity():
    clock = Clock()
    bucket = TokenBucket(rate=4, capacity=2, clock=clock)
    assert [bucket.take(), bucket.take()] == [0.0, 0.0]
    assert bucket.take() == pytest.approx(0.25)
    clock.t += 0.125  # half a token back: the wait is for the other half (a wait of 1 / rate passed before)
    assert bucket.take() == pytest.approx(0.125)
    clock.t += 0.125
    assert bucket.take() == 0.0
    clock.t += 10  # refills to 2, not 40
    assert [bucket.take(), bucket.take(), bucket.take()] == [0.0, 0.0, pytest.approx(0.25)]


# --- teams by API key -----------------------------------------------------------------------------
class HeaderFake(Fake):
    """A fake backend that keeps the headers it received."""

    def __init__(self, name, text):
        super().__init__(name, text)
        self.headers = []

    async def answer(self, request):
        self.headers.append(dict(request.headers))
        return await super().answer(request)


def keys_file(tmp_path, **teams) -> str:
    path = tmp_path / "team-keys.yaml"
    path.write_text(
        yaml.safe_dump({t: [hashlib.sha256(k.encode()).hexdigest() for k in ks] for t, ks in teams.items()})
    )
    return str(path)


def test_teams_by_api_key_and_neither_header_reaches_the_backend(tmp_path):
    backend = HeaderFake("stable", "an answer")
    backend.server.start()
    lim = limiter(keys_file=keys_file(tmp_path, billing=["sk-billing-1"]))
    try:
        with running(lambda: {"stable": backend.backend}, limits=lim) as (router, client):

            def status(headers):
                return ask(client, headers).status_code

            billing = {"authorization": "Bearer sk-billing-1", "x-team": "billing"}
            assert [status(billing) for _ in range(4)] == [200, 200, 200, 429]
            # the header names no team when keys are used: unknown keys and no key are anonymous (burst 2)
            assert [status({"x-team": "billing"}), status({"authorization": "Bearer sk-other"})] == [200, 200]
            assert status({}) == 429
    finally:
        backend.server.stop()
    assert len(backend.headers) == 5
    assert not any({"authorization", "x-team"} & set(h) for h in backend.headers)


def test_an_upper_case_digest_names_the_same_key(tmp_path):
    """sha256sum prints lower case, other tools upper; once refused as "not SHA-256 hex"."""
    from gateway.limits import read_team_keys

    path = tmp_path / "keys.yaml"
    digest = hashlib.sha256(b"sk-billing-1").hexdigest()
    path.write_text(yaml.safe_dump({"billing": [digest.upper()]}))
    assert read_team_keys(path, {"billing": None}) == {digest: "billing"}


@pytest.mark.parametrize(
    "doc,problem",
    [
        ({"search": ["0" * 64]}, "team 'search' has no limits.rate_limits.teams entry"),
        ({"billing": ["sk-plain-key"]}, "billing: must be a list of SHA-256 hex digests"),
        (["0" * 64], "must be a mapping {team: [sha256 hex of an API key, ...]}"),
    ],
)
def test_a_bad_keys_file_is_named(tmp_path, doc, problem):
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(QuantgateError, match=re.escape(f"{path}: {problem}")):
        limiter(keys_file=str(path))


def no_keys_files(tmp_path: Path) -> dict[str, str]:
    """Paths under `tmp_path` that are no keys file to read (a FIFO, with a guard should one be opened, a broken
    symlink, a loop, a link to the FIFO: test_canary_gateway's _token_files; a folder, a link to it, nothing there),
    each name -> what quantgate.files.not_a_file says it is, and the start of the fix ("fix the link or ")."""
    from tests.test_canary_gateway import _token_files

    files = {name: what.removesuffix("give the file") for name, what in _token_files(tmp_path).items()}
    (tmp_path / "folder").mkdir()
    (tmp_path / "to_folder").symlink_to("folder")
    return files | {
        "folder": "a folder, not a file; ",
        "to_folder": "a symlink to a folder at folder, not a file; ",
        "none.yaml": f"missing (no such file in {tmp_path}); ",
    }


def test_a_keys_file_that_is_no_file_is_named_as_what_it_is_at_its_params_line(tmp_path, monkeypatch):
    """limits.team_keys_file said only "limits.team_keys_file: <path> is not a file" of a broken symlink, a FIFO, a
    loop, a folder or nothing there; each is named as --team-keys and --token-file name it (quantgate.files), a
    FIFO never opened, at the params.yaml line that sets it, as the other params errors are."""
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path, "limits", team_keys_file="keys.yaml")
    line = key_lines(Path("params.yaml"))[("limits", "team_keys_file")]
    for name, what in no_keys_files(tmp_path).items():
        with pytest.raises(QuantgateError) as exc:
            limiter(keys_file=name)
        assert str(exc.value) == (
            f"params.yaml:{line}: limits.team_keys_file: {name} is {what}give the YAML of API-key digests per team, "
            "or null"
        )


# --- params ---------------------------------------------------------------------------------------
def test_params_defaults_load_and_a_null_ceiling_is_the_served_max_model_len(tmp_path):
    limits = load_limits(REPO / "params.yaml")
    serve = yaml.safe_load((REPO / "params.yaml").read_text())["evaluate"]["serve"]
    assert limits.max_context_tokens == serve["max_model_len"] and limits.max_output_tokens < serve["max_model_len"]
    assert limits.team_header == "x-team" and limits.rate_limits.default.burst >= 1
    assert load_limits(write_params(tmp_path, "limits", max_context_tokens=1024)).max_context_tokens == 1024


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"max_output_tokens": 0}, "limits.max_output_tokens"),
        ({"max_context_tokens": 100, "max_output_tokens": 100}, "limits.max_output_tokens"),
        ({"max_context_tokens": None, "max_output_tokens": 4096}, "limits.max_output_tokens"),  # > max_model_len
        ({"max_context_tokens": "2k"}, "limits.max_context_tokens"),
        ({"rate_limits__default__rps": 0}, "limits.rate_limits.default.rps"),
        ({"rate_limits__teams": {"billing": {"rps": 1}}}, "limits.rate_limits.teams.billing.burst"),
        ({"rate_limits__teams": {"anonymous": {"rps": 1, "burst": 1}}}, "limits.rate_limits.teams"),
        ({"api_keys": ["sk-1"]}, "limits.api_keys"),
    ],
)
def test_bad_limits_name_the_params_line_and_field(tmp_path, changes, field):
    with pytest.raises(QuantgateError) as exc:
        load_limits(write_params(tmp_path, "limits", **changes))
    assert re.search(rf"params.yaml:\d+: {re.escape(field)}: ", str(exc.value)), str(exc.value)


@pytest.mark.parametrize(
    "model_len, limits, message",
    [
        (
            2048,
            {"max_context_tokens": 4096},
            "limits.max_context_tokens: 4096 is over evaluate.serve.max_model_len 2048, the most a served build "
            "accepts; lower it to at most 2048, or null to use max_model_len",
        ),
        (
            -1,
            {"max_context_tokens": None},
            "limits.max_context_tokens: null takes evaluate.serve.max_model_len, which is -1 (vLLM's own length, "
            "known only once a server runs); set limits.max_context_tokens to the tokens a request may use, e.g. 2048",
        ),
        (
            256,
            {"max_context_tokens": None, "max_output_tokens": 512},
            "limits.max_output_tokens: 512 leaves no room for a prompt under the context ceiling, "
            "evaluate.serve.max_model_len 256 (limits.max_context_tokens is null); lower it",
        ),
        (
            2048,
            {"team_header": "x team:"},
            "limits.team_header: 'x team:' is not an HTTP header name (letters, digits and "
            "!#$%&'*+-.^_`|~; no spaces or colons)",
        ),
        (
            2048,
            {"team_header": "Content-Length"},
            "limits.team_header: 'Content-Length' is a header HTTP itself uses; name the team in a header of its "
            "own, e.g. x-team",
        ),
    ],
)
def test_the_ceiling_is_checked_against_the_served_length_and_errors_name_the_right_field(
    tmp_path, model_len, limits, message
):
    doc = yaml.safe_load((REPO / "params.yaml").read_text())
    doc["evaluate"]["serve"]["max_model_len"] = model_len
    doc["limits"].update(limits)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(QuantgateError) as exc:
        load_limits(path)
    field = message.split(":")[0]
    line = next(
        i
        for i, text in enumerate(path.read_text().splitlines(), 1)
        if text.strip().startswith(field.split(".")[1] + ":")
    )
    assert str(exc.value) == f"{path}:{line}: {message}"


def test_an_explicit_ceiling_with_vllms_own_length_is_taken_as_given(tmp_path):
    doc = yaml.safe_load((REPO / "params.yaml").read_text())
    doc["evaluate"]["serve"]["max_model_len"] = -1
    doc["limits"].update(max_context_tokens=8192, team_header="X-Team_2")
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(doc))
    limits = load_limits(path)
    assert (limits.max_context_tokens, limits.team_header) == (8192, "x-team_2")


def test_a_ceiling_without_a_counter_is_refused():
    with pytest.raises(QuantgateError, match="needs count_prompt_tokens"):
        Limiter(Limits(max_context_tokens=100, max_output_tokens=10))
    assert Limiter(Limits()).limits.max_context_tokens is None  # no ceiling: no counter needed


# --- the Hugging Face token counter ----------------------------------------------------------------
def test_tokenizer_counter_counts_as_vllm_does(tmp_path):
    tiny_tokenizer().save_pretrained(tmp_path)
    count = tokenizer_counter(tmp_path)
    chat = {"messages": [{"role": "user", "content": "what is the capital"}]}
    assert count("/chat/completions", chat) == 6  # "user" ":" "what" "is" "the" "capital" (template included)
    assert count("/completions", {"prompt": "what is the capital"}) == 4
    assert count("/completions", {"prompt": [5, 6, 7]}) == 3
    assert count("/completions", {"prompt": ["what", "what is the capital of france"]}) == 6  # the longest
    with pytest.raises(ValueError, match="prompt must be a string or a list of token ids"):
        count("/completions", {"prompt": {"text": "what"}})
