"""Validation of a team's templates (quantgate/templates.py) and filters (quantgate/checks.py): unsafe
templates refused with file:line and the expression before anything runs, and every document
rendered in the sandbox and its choices and target checked. More cases: tests/bad_evals/."""

import json
import shutil
import subprocess
import sys

import pytest

from quantgate import sandbox
from quantgate.errors import QuantgateError
from quantgate.teams import load_team, load_teams
from tests.conftest import REPO, checkout_view
from tests.test_sandbox import ESCAPES

# The escapes of tests/test_sandbox.py, and forms that only read (Jinja's and Flask's objects).
READERS = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ config.items() }}",
    "{{ request|attr('__class__') }}",
    "{% include 'secrets.txt' %}",
    "{{ question|regex_replace('(a+)+$', '') }}",
]
KEYS = ["doc_to_text", "doc_to_target", "doc_to_choice", "description", "gen_prefix"]


def set_key(task_yaml, key: str, value: str) -> int:
    """Set `key` of a task YAML to `value` (a string), in place; return its line."""
    lines = task_yaml.read_text().splitlines()
    at = next((i for i, line in enumerate(lines) if line.startswith(f"{key}:")), None)
    if at is None:
        lines.append("")
        at = len(lines) - 1
    lines[at] = f"{key}: {json.dumps(value)}"
    task_yaml.write_text("\n".join(lines) + "\n")
    return at + 1


@pytest.mark.parametrize("i, template", list(enumerate(ESCAPES + READERS)))
def test_unsafe_templates_are_refused_with_file_line_and_expression(example_evals, tmp_path, i, template):
    marker = tmp_path / "MARKER"
    template = template.format(marker=marker) if "{marker}" in template else template
    key = KEYS[i % len(KEYS)]
    task = example_evals / "search" / "capitals.yaml"
    line = set_key(task, key, f"Question: {template} {{{{question}}}}")
    with pytest.raises(QuantgateError) as err:
        load_teams(example_evals)
    msg = str(err.value)
    assert f"{task}:{line}: {key}: unsafe template `" in msg, msg
    assert (
        "reach" in msg
        or "not a document field" in msg
        or "`attr` filter" in msg
        or "loads other templates" in msg
        or "takes over" in msg
    ), msg
    assert not marker.exists()


def test_the_sandbox_verdict_refuses_what_no_static_rule_names(example_evals):
    task = example_evals / "search" / "capitals.yaml"
    line = set_key(task, "doc_to_text", "{{ question['_' ~ '_' ~ 'class' ~ '_' ~ '_'] }}Question: {{question}}")
    with pytest.raises(QuantgateError) as err:
        load_team(example_evals / "search")
    assert (
        f"{task}:{line}: doc_to_text: unsafe template `{{{{ question['_' ~ '_' ~ 'class' ~ '_' ~ '_'] }}}}Question: "
        f"{{{{question}}}}`: the sandbox refused it rendering {example_evals / 'search' / 'data.jsonl'}:1 "
        "(access to attribute '__class__' of 'str' object is unsafe.)"
    ) in str(err.value)
    assert "1 problem(s)" in str(err.value)  # reported once, not per document


def test_validate_command_and_dvc_stage_refuse_the_issue_template_and_run_nothing(example_evals, tmp_path):
    from click.testing import CliRunner

    from cli.main import cli

    marker = tmp_path / "MARKER"
    task = example_evals / "search" / "capitals.yaml"
    line = set_key(task, "doc_to_text", ESCAPES[0].format(marker=marker) + "Question: {{question}}\nAnswer:")
    where = f"{task}:{line}: doc_to_text: unsafe template `{{{{ cycler.__init__.__globals__.os.popen('touch {marker}')"
    res = CliRunner().invoke(cli, ["evals", "validate", str(example_evals / "search")])
    assert res.exit_code == 1 and where in res.output, res.output
    stage = subprocess.run(  # dvc.yaml's validate stage
        [sys.executable, "-m", "pipeline.validate", str(example_evals), str(tmp_path / "teams.json")],
        cwd=checkout_view(tmp_path / "view"),  # its log goes there, not into the checkout
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert stage.returncode == 2 and where in stage.stderr, stage.stderr
    assert not marker.exists() and not (tmp_path / "teams.json").exists()


@pytest.fixture
def arc(tmp_path):
    """tests/arc_evals/arcteam: lm-eval's ARC task format with local data; arc.jsonl lines 17 and
    41 are bad (answerKey "E" is not among the labels; no choices.text)."""
    shutil.copytree(REPO / "tests" / "arc_evals", tmp_path / "evals")
    return tmp_path / "evals" / "arcteam"


def test_arc_format_documents_are_rendered_and_both_bad_ones_named(arc):
    with pytest.raises(QuantgateError) as err:
        load_team(arc)
    data = arc / "arc.jsonl"
    assert str(err.value).splitlines() == [
        "team arcteam: 2 problem(s):",
        f"  {data}:17: doc_to_target: `{{{{choices.label.index(answerKey)}}}}` cannot be rendered for this document: "
        "'E' is not in list; fix the document or the template",
        f"  {data}:41: doc_to_choice: `{{{{choices.text}}}}` cannot be rendered for this document: 'dict object' has "
        "no attribute 'text'; fix the document or the template",
    ]


def test_arc_format_without_the_bad_documents_validates(arc):
    data = arc / "arc.jsonl"
    lines = data.read_text().splitlines()
    data.write_text("".join(line + "\n" for n, line in enumerate(lines, 1) if n not in (17, 41)))
    team = load_team(arc)
    assert [(t.name, t.n_docs) for t in team.tasks] == [("arc_easy_local", 60)]


@pytest.mark.parametrize(
    "step, expected",
    [
        ({"function": "regex", "regex_pattern": "(a|aa)+$"}, "regex_pattern: '(a|aa)+$' takes over 2 s"),
        (
            {"function": "regex", "regex_pattern": "(unclosed"},
            "regex_pattern: '(unclosed' is not a valid regular expression",
        ),
        (
            {"function": "regex", "regex": "x"},
            "filter[0]: regex takes no argument 'regex'; it takes ['fallback', 'group_select', 'regex_pattern']",
        ),
        (
            {"function": "multi_choice_regex", "regexes_to_ignore": [",", "(x+x+)+y"]},
            "filter[0].regexes_to_ignore[1]: '(x+x+)+y' takes over 2 s",
        ),
        ({"function": "decontaminate"}, "function 'decontaminate' is not one of lm-eval's filters a team may use"),
    ],
)
def test_filters_are_checked(example_evals, step, expected):
    import yaml

    task = example_evals / "billing" / "arithmetic.yaml"
    config = yaml.safe_load(task.read_text())
    config["filter_list"][0]["filter"][0] = step
    task.write_text(yaml.safe_dump(config, sort_keys=False))
    with pytest.raises(QuantgateError) as err:
        load_team(example_evals / "billing")
    assert "arithmetic.yaml:" in str(err.value) and expected in str(err.value), str(err.value)


def test_a_regex_the_metric_ignores_is_checked(example_evals):
    import yaml

    task = example_evals / "billing" / "arithmetic.yaml"
    config = yaml.safe_load(task.read_text())
    config["metric_list"][0]["regexes_to_ignore"] = ["(a+)+b"]
    task.write_text(yaml.safe_dump(config, sort_keys=False))
    with pytest.raises(QuantgateError, match=r"metric_list\[0\].regexes_to_ignore\[0\]: '\(a\+\)\+b' takes over"):
        load_team(example_evals / "billing")


def test_a_template_that_runs_too_long_stops_validation_of_that_file(example_evals, monkeypatch):
    monkeypatch.setattr(sandbox, "RENDER_SECONDS", 0.2)
    task = example_evals / "search" / "capitals.yaml"
    set_key(
        task,
        "doc_to_text",
        "{% set x = range(1000)|list %}{% for a in x %}{% for b in x %}{% for c in x %}"
        "{% endfor %}{% endfor %}{% endfor %}{{question}}",
    )
    with pytest.raises(QuantgateError) as err:
        load_team(example_evals / "search")
    assert str(err.value).splitlines()[1:] == [
        f"  {example_evals / 'search' / 'data.jsonl'}:1: rendering this document's templates took over 0.2 s; simplify "
        "the templates (no more documents of this file were rendered)"
    ]


def test_fields_are_the_documents_not_the_sandbox_globals():
    from quantgate.checks import template_fields

    assert template_fields({"doc_to_text": "{% for i in range(n) %}{{ dict(a=i) }}{{ cycler }}{% endfor %}"}) == {
        "doc_to_text": {"n"}
    }


def edit_task(task_yaml, **changes):
    """Set top-level keys of a task YAML (any YAML values), in place."""
    import yaml

    config = yaml.safe_load(task_yaml.read_text())
    config.update(changes)
    task_yaml.write_text(yaml.safe_dump(config, sort_keys=False))


@pytest.mark.parametrize(
    "changes, expected",
    [
        (
            {"generation_kwargs": {"until": ["\n"], "n": 1000, "max_tokens": 1000000}},
            "generation_kwargs.max_tokens: not allowed (it reaches the server as is); use only until, max_gen_toks",
        ),
        ({"repeats": 100000}, "repeats must be 1"),
        (
            {"num_fewshot": 1, "fewshot_config": {"sampler": "first_n", "samples": [{"question": "q"}]}},
            "fewshot_config.samples: not allowed; put few-shot examples in a data file",
        ),
        ({"num_fewshot": 1, "fewshot_config": {"sampler": "nosuch"}}, "fewshot_config.sampler 'nosuch' is not one of"),
        (
            {"num_fewshot": 1, "fewshot_config": {"sampler": "first_n", "doc_to_text": "{{ nosuchfield }}"}},
            "(as a few-shot example): doc_to_text: `{{ nosuchfield }}` cannot be rendered",
        ),
        ({"description": {"a": 1}}, "description must be a template string, got dict"),
        (
            {"doc_to_text": "{% if false %}{{ question['__cla' ~ 'ss__'] }}{% endif %}Q: {{question}}"},
            "attributes 'ss__', '__cla' reach Python internals",
        ),
        (
            {"doc_to_text": "{% if false %}{{ question|map(attribute='__class__') }}{% endif %}Q: {{question}}"},
            "attribute '__class__' reaches Python internals",
        ),
    ],
)
def test_settings_and_templates_that_would_fail_or_overload_evaluation_are_refused(example_evals, changes, expected):
    task = example_evals / "search" / "capitals.yaml"
    edit_task(task, **changes)
    with pytest.raises(QuantgateError) as err:
        load_team(example_evals / "search")
    msg = str(err.value)  # the task file's line, or the data file's line a template fails on
    assert (f"{task}:" in msg or f"{task.parent / 'data.jsonl'}:1 " in msg) and expected in msg, msg


@pytest.mark.parametrize(
    "changes",
    [
        {"doc_to_text": "{% raw %}{{ x.__class__ }}{% endraw %}{# {{ x.__class__ }} #}Q: {{question}}"},
        {"doc_to_target": 0},  # a fixed index, as lm-eval's blimp tasks write it
        {
            "num_fewshot": 1,
            "fewshot_split": "train",
            "dataset_kwargs": {"data_files": {"test": "data.jsonl", "train": "shots.jsonl"}},
            "fewshot_config": {"sampler": "first_n", "doc_to_text": "Example: {{ question }}"},
        },
    ],
)
def test_safe_forms_people_write_are_accepted(example_evals, changes):
    shot = {"id": "shot", "question": "What is the capital of Peru?", "choices": ["Lima", "Quito"], "answer": 0}
    (example_evals / "search" / "shots.jsonl").write_text(json.dumps(shot) + "\n")  # read only where named
    edit_task(example_evals / "search" / "capitals.yaml", **changes)
    assert load_team(example_evals / "search").tasks[0].n_docs == 216


def test_a_direction_contradicting_lm_eval_is_refused(example_evals):
    policy = example_evals / "search" / "team.yaml"
    policy.write_text(policy.read_text().replace("higher_is_better: true", "higher_is_better: false"))
    with pytest.raises(QuantgateError, match="team.yaml says higher_is_better: false for 'acc', but lm-eval scores"):
        load_team(example_evals / "search")


def test_hostile_files_get_one_line_each_not_a_traceback(example_evals, tmp_path):
    team = example_evals / "search"
    data = (team / "data.jsonl").read_text().splitlines()
    data[1] = json.dumps({**json.loads(data[1]), "deep": []}).replace("[]", "[" * 2000 + "]" * 2000)
    data[2] = data[2].replace('"question": "', '"question": "\\ud800')
    (team / "data.jsonl").write_text("\n".join(data) + "\n")
    laughs = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 9))
    (team / "zz_laughs.yaml").write_text("l0: &l0 [lol]\n" + laughs + "task: zz\n")
    (tmp_path / "outside.yaml").write_text((team / "capitals.yaml").read_text())
    (team / "linked.yaml").symlink_to(tmp_path / "outside.yaml")
    with pytest.raises(QuantgateError) as err:
        load_team(team)
    msg = str(err.value)
    assert f"{team / 'data.jsonl'}:2: JSON nested too deeply (quantgate's nesting rule); flatten the document" in msg
    assert f"{team / 'data.jsonl'}:3: a string holds an unpaired surrogate" in msg
    assert f"{team / 'zz_laughs.yaml'}: expands to over 100000 YAML values" in msg
    assert f"{team / 'linked.yaml'}: is a symlink (to {tmp_path / 'outside.yaml'}); a task YAML must be a" in msg
