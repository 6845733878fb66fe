"""The cost budget: what validate estimates a team's set costs per build (documents, prompt tokens at
budget.CHARS_PER_TOKEN characters each, generated tokens at most), the one-line refusal over budget, the release
side's per-team override, and the estimate on validate's ok line, in results/teams.json and in the gate report."""

import json
import math

import pytest
from click.testing import CliRunner

from cli.main import cli
from pipeline.gate import report
from pipeline.validate import summary
from quantgate.budget import CHARS_PER_TOKEN, Budget, ValidateParams, check_budget_teams, load_budgets
from quantgate.errors import QuantgateError
from quantgate.results import GateResult
from quantgate.teams import load_team, load_teams
from tests.conftest import REPO


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_generation_set_costs_its_rendered_prompts_and_max_gen_toks_per_document(example_evals):
    docs = lines(example_evals / "billing" / "data.jsonl")
    chars = sum(len(f"{d['question']} Reply with the number only.") + len(" ") for d in docs)  # + target delimiter
    cost = load_team(example_evals / "billing").cost
    assert (cost.documents, cost.generated_tokens) == (289, 289 * 24)  # max_gen_toks: 24
    assert cost.prompt_tokens == math.ceil(chars / CHARS_PER_TOKEN)


def test_a_multiple_choice_set_costs_one_request_per_choice(example_evals):
    docs = lines(example_evals / "search" / "data.jsonl")
    chars = sum(4 * (len(f"Question: {d['question']}\nAnswer:") + 1) + sum(map(len, d["choices"])) for d in docs)
    cost = load_team(example_evals / "search").cost
    assert (cost.documents, cost.prompt_tokens, cost.generated_tokens) == (216, math.ceil(chars / 2.5), 0)


def test_few_shot_examples_count_in_every_prompt(example_evals):
    shots = lines(example_evals / "support" / "fewshot.jsonl")
    labels = ["positive", "negative"]
    per_shot = [len(f"Customer message: {s['message']}\nSentiment:") + 1 + len(labels[s["label"]]) + 2 for s in shots]
    context = 4 * sum(per_shot) // len(per_shot)  # num_fewshot 4 x the mean example
    docs = lines(example_evals / "support" / "data.jsonl")
    chars = sum(2 * (context + len(f"Customer message: {d['message']}\nSentiment:") + 1) + 16 for d in docs)
    assert load_team(example_evals / "support").cost.prompt_tokens == math.ceil(chars / CHARS_PER_TOKEN)


def test_the_default_budget_holds_the_shipped_teams_five_times_over():
    budget = Budget()
    for team in load_teams(REPO / "evals"):
        cost = team.cost
        assert 5 * cost.documents <= budget.documents and 5 * cost.prompt_tokens <= budget.prompt_tokens
        assert 5 * cost.generated_tokens <= budget.generated_tokens
    assert load_budgets(REPO / "params.yaml") == ValidateParams()  # params.yaml states the defaults


def test_a_set_over_budget_is_refused_in_one_line_naming_file_count_budget_and_the_limit_that_fits(example_evals):
    data = example_evals / "billing" / "data.jsonl"
    small = ValidateParams(budget=Budget(documents=250, generated_tokens=6000))
    with pytest.raises(QuantgateError) as err:
        load_team(example_evals / "billing", small)
    problems = str(err.value).splitlines()[1:]
    assert [p.strip() for p in problems] == [
        f"{data}: 289 documents per build (estimated: {load_team(example_evals / 'billing').cost.line()}) is over "
        "the budget of 250 (params.yaml validate.budget.documents); evaluate fewer with `limit: 250` in "
        f"{example_evals / 'billing' / 'team.yaml'} (documents per task), or ask the release side for "
        "validate.teams.billing.documents",
        f"{data}: 6,936 generated tokens per build (estimated: {load_team(example_evals / 'billing').cost.line()}) "
        "is over the budget of 6,000 (params.yaml validate.budget.generated_tokens); evaluate fewer with "
        f"`limit: 250` in {example_evals / 'billing' / 'team.yaml'} (documents per task), or ask the release side for "
        "validate.teams.billing.generated_tokens",
    ]
    with open(example_evals / "billing" / "team.yaml", "a") as f:
        f.write("limit: 250\n")  # the suggested limit fits: 250 docs x 24 tokens = 6,000
    assert load_team(example_evals / "billing", small).cost.documents == 250


def test_a_limit_that_fits_but_leaves_too_few_documents_to_pass_is_not_suggested(example_evals):
    billing = load_team(example_evals / "billing")  # 289 docs, 24 generated tokens each, PASS needs 32 docs
    with pytest.raises(QuantgateError) as err:
        load_team(example_evals / "billing", ValidateParams(budget=Budget(generated_tokens=500)))
    assert (
        "is over the budget of 500 (params.yaml validate.budget.generated_tokens); no set that can PASS fits: "
        f"`limit: 20` in {example_evals / 'billing' / 'team.yaml'} would score 20 documents, fewer than the 32 its "
        "margin needs, or ask the release side for validate.teams.billing.generated_tokens"
    ) in str(err.value)
    assert billing.cost.generated_tokens == 289 * 24
    with pytest.raises(QuantgateError) as err:  # not even one document: the generation length is what costs
        load_team(example_evals / "billing", ValidateParams(budget=Budget(generated_tokens=10)))
    assert (
        "(params.yaml validate.budget.generated_tokens); lower generation_kwargs.max_gen_toks in its task YAML, "
        in str(err.value)
    )


def test_one_team_folder_is_checked_against_the_budget_keys_and_says_which_budget(example_evals, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(cli, ["evals", "validate", str(example_evals / "billing")])
    assert (
        res.exit_code == 0
        and f"budget: the defaults (no params.yaml with a `validate` block in {tmp_path})" in res.output
    )
    (tmp_path / "params.yaml").write_text("validate:\n  teams:\n    biling: {generated_tokens: 20000}\n")
    res = CliRunner().invoke(cli, ["evals", "validate", str(example_evals / "billing")])
    assert res.exit_code != 0 and "params.yaml:3: validate.teams.biling: not a team under evals/" in res.output
    (tmp_path / "params.yaml").write_text("validate:\n  teams:\n    billing: {generated_tokens: 20000}\n")
    res = CliRunner().invoke(cli, ["evals", "validate", str(example_evals / "billing")])
    assert res.exit_code == 0 and f"budget: {tmp_path / 'params.yaml'} `validate`" in res.output


def test_the_release_side_overrides_a_teams_budget_in_params_not_the_team(example_evals, tmp_path):
    tight = ValidateParams(budget=Budget(documents=100), teams={"billing": {"documents": 500}})
    assert tight.for_team("billing") == Budget(documents=500) and tight.for_team("search") == Budget(documents=100)
    with pytest.raises(QuantgateError) as err:
        load_teams(example_evals, budgets=tight)
    assert "team billing:" not in str(err.value) and "team search:" in str(err.value)
    assert "(params.yaml validate.budget.documents); " in str(err.value)
    own = ValidateParams(budget=Budget(documents=100), teams={"billing": {"documents": 200}})
    with pytest.raises(QuantgateError) as err:  # over its own budget: the key named is the team's own
        load_teams(example_evals, budgets=own, only="billing")
    assert "is over the budget of 200 (params.yaml validate.teams.billing.documents); evaluate fewer with" in str(
        err.value
    ) and str(err.value).rstrip().endswith("or ask the release side to raise it")
    policy = example_evals / "billing" / "team.yaml"  # a team cannot raise its own budget
    policy.write_text(policy.read_text() + "budget: {documents: 500}\n")
    with pytest.raises(QuantgateError, match=r"team.yaml:10: budget: unknown key \(the keys here: owner,"):
        load_team(example_evals / "billing")
    params = tmp_path / "params.yaml"
    params.write_text("validate:\n  teams:\n    biling: {documents: 500}\n")
    with pytest.raises(QuantgateError, match=r"params.yaml:3: validate.teams.biling: not a team under evals/"):
        check_budget_teams(load_budgets(params), ["billing", "search", "support"], params)


def test_the_estimate_is_on_the_ok_line_in_teams_json_and_in_the_gate_report(example_evals):
    res = CliRunner().invoke(cli, ["evals", "validate", str(example_evals / "billing")])
    cost = load_team(example_evals / "billing").cost
    assert res.exit_code == 0 and f"metric exact_match; per build {cost.line()}" in res.output
    assert cost.line() == f"289 docs, ~{cost.prompt_tokens:,} prompt tokens, <= 6,936 generated tokens"
    teams = load_teams(example_evals)
    billing = summary(teams, ValidateParams())["billing"].dump()
    assert billing["cost"] == {"documents": 289, "prompt_tokens": cost.prompt_tokens, "generated_tokens": 6936}
    assert billing["budget"] == {"documents": 4000, "prompt_tokens": 1_000_000, "generated_tokens": 100_000}
    md = report(GateResult(baseline="fp16", precision=None, builds={}), costs={t.name: t.cost for t in teams})
    assert f"- billing: {cost.line()}" in md and "## What each team's set costs per build" in md


def test_evals_readme_states_the_default_budget_and_dates_the_rules_that_refuse_sets_that_passed():
    readme = (REPO / "evals" / "README.md").read_text()
    b = Budget()
    stated = f"{b.documents:,} documents, {b.prompt_tokens:,} prompt tokens, {b.generated_tokens:,} generated tokens"
    assert f"by default **{stated}**" in readme and "## Rules added 2026-12-03" in readme
    assert f"divided by {CHARS_PER_TOKEN:g} " in readme
