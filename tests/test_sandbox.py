"""The template sandbox (quantgate/sandbox.py) at evaluation: the lm-eval internals it relies on,
known Jinja escapes through the evaluate stage's own rendering, and unchanged prompts for the
shipped teams."""

import copy
import dataclasses
import json
from pathlib import Path

import pytest
from jinja2 import UndefinedError
from jinja2.sandbox import SecurityError
from lm_eval.api.model import LM

from quantgate import sandbox
from quantgate.errors import QuantgateError
from quantgate.scoring import HarnessParams, run_team
from quantgate.teams import load_team, load_teams
from quantgate.templates import lm_eval_value

# Known ways out of a plain Jinja environment: each runs `touch MARKER` there (the first is the
# issue's). {marker} is filled in with a path under the test's tmp_path.
ESCAPES = [
    "{{{{ cycler.__init__.__globals__.os.popen('touch {marker}').read() }}}}",
    "{{{{ self.__init__.__globals__['__builtins__']['__import__']('os').popen('touch {marker}').read() }}}}",
    "{{{{ lipsum.__globals__['os'].popen('touch {marker}').read() }}}}",
    "{{{{ joiner.__init__.__globals__.os.popen('touch {marker}').read() }}}}",
    "{{{{ namespace.__init__.__globals__.os.popen('touch {marker}').read() }}}}",
    "{{{{ (cycler|attr('__init__')|attr('__globals__'))['os'].popen('touch {marker}').read() }}}}",
    "{{{{ question['_' ~ '_class__'].__mro__[1].__subclasses__() }}}}{{{{ '{marker}' }}}}",
]


class NoModel(LM):
    """Stands in for lm-eval's client: the requests are never sent (rendering fails first)."""

    def loglikelihood(self, requests):
        return [(0.0, False) for _ in requests]

    def loglikelihood_rolling(self, requests):
        return [0.0 for _ in requests]

    def generate_until(self, requests):
        return ["" for _ in requests]


def with_template(team, key: str, template: str):
    """`team` with its first task's `key` set to `template`, not validated (as if it had got past)."""
    task = team.tasks[0]
    config = copy.deepcopy(task.config)
    config[key] = template
    return dataclasses.replace(team, tasks=(dataclasses.replace(task, config=config),))


@pytest.fixture(scope="module")
def search():
    return next(t for t in load_teams(Path(__file__).resolve().parents[1] / "evals") if t.name == "search")


@pytest.mark.parametrize("escape", ESCAPES)
def test_escapes_run_nothing_through_the_evaluate_stage_rendering(search, escape, tmp_path):
    marker = tmp_path / "MARKER"
    team = with_template(search, "doc_to_text", escape.format(marker=marker) + "Question: {{question}}\nAnswer:")
    with pytest.raises((SecurityError, UndefinedError)):  # UndefinedError: a Jinja global the sandbox lacks
        run_team(NoModel(), team, HarnessParams(limit=2))
    assert not marker.exists()


def test_escapes_do_run_in_lm_eval_without_the_sandbox(tmp_path):
    """The control: lm-eval's own rendering still runs them, so the tests above mean something
    (if a new lm-eval sandboxes its templates itself, this fails: revisit quantgate/sandbox.py)."""
    from lm_eval.utils import apply_template

    for i, escape in enumerate(ESCAPES[:6]):
        marker = tmp_path / f"MARKER{i}"
        apply_template(escape.format(marker=marker), {"question": "q"})
        assert marker.exists(), escape


def test_escapes_through_lm_eval_task_methods_inside_the_sandbox(search, tmp_path):
    """ConfigurableTask.doc_to_text/doc_to_target/doc_to_choice render through the swapped env."""
    from lm_eval.api.task import ConfigurableTask

    task = ConfigurableTask(config=copy.deepcopy(search.tasks[0].config))
    doc = next(iter(task.test_docs()))
    marker = tmp_path / "MARKER"
    for key in ("doc_to_text", "doc_to_target", "doc_to_choice"):
        with sandbox.lm_eval_sandboxed(), pytest.raises(SecurityError):
            getattr(task, key)(doc, ESCAPES[1].format(marker=marker))
    assert not marker.exists()


def test_lm_eval_renders_with_the_module_env_that_the_sandbox_replaces():
    """Pins what lm_eval_sandboxed relies on in lm-eval (0.4.13)."""
    import lm_eval.api.task
    import lm_eval.utils

    assert "env" in lm_eval.utils.apply_template.__code__.co_names
    assert lm_eval.utils.apply_template.__globals__ is vars(lm_eval.utils)
    assert lm_eval.api.task.utils is lm_eval.utils
    for method in ("doc_to_text", "doc_to_target", "doc_to_choice", "doc_to_prefix", "resolve_field"):
        code = getattr(lm_eval.api.task.ConfigurableTask, method).__code__
        assert {"utils", "apply_template"} <= set(code.co_names), method  # utils.apply_template, looked up per call
    with sandbox.lm_eval_sandboxed():
        assert lm_eval.utils.env is sandbox.ENV
        with pytest.raises(SecurityError):
            lm_eval.utils.apply_template("{{ ''.__class__ }}", {})
    assert lm_eval.utils.env is not sandbox.ENV


def test_the_sandbox_keeps_lm_eval_settings_filters_and_tests():
    import lm_eval.utils

    plain = lm_eval.utils.env
    assert sandbox.ENV.undefined is plain.undefined and sandbox.ENV.keep_trailing_newline == plain.keep_trailing_newline
    assert set(sandbox.ENV.filters) == set(plain.filters) and set(sandbox.ENV.tests) == set(plain.tests)
    for args in [("a-b-c", "-", "+"), ("a1b22", r"\d+", "#", 1), ("x", "y", "z")]:
        assert sandbox.regex_replace(*args) == plain.filters["regex_replace"](*args)
    assert sorted(sandbox.ENV.globals) == ["dict", "range"]


def test_shipped_teams_get_exactly_the_prompts_lm_eval_gives_them(example_evals):
    """Every document of every shipped task: the requests lm-eval builds (prompt and answer
    choices) and doc_to_* are the same with and without the sandbox, and validation's own
    rendering (templates.lm_eval_value on the JSON as written) gives the same values."""
    from lm_eval.tasks import TaskManager

    for team in load_teams(example_evals):
        for t in team.tasks:
            [task] = TaskManager(include_defaults=False).load([t.config])["tasks"].values()
            docs = list(task.test_docs())
            keys = [k for k in ("doc_to_text", "doc_to_choice", "doc_to_target") if t.config.get(k) is not None]

            def rendered():  # called in this iteration only
                task.build_all_requests(rank=0, world_size=1)  # noqa: B023
                return [i.arguments for i in task.instances], [[getattr(task, k)(d) for k in keys] for d in docs]  # noqa: B023

            plain = rendered()
            with sandbox.lm_eval_sandboxed():
                boxed = rendered()
            assert boxed == plain and len(plain[1]) == t.n_docs
            data = Path(t.config["dataset_kwargs"]["data_files"]["test"])
            raw = [json.loads(line) for line in data.read_text().splitlines()]
            features = {f for d in raw for f in d}
            assert [[lm_eval_value(t.config, k, d, features) for k in keys] for d in raw] == plain[1]


def test_a_list_method_the_arc_format_uses_works_and_mutation_does_not():
    doc = {"choices": {"label": ["A", "B", "C"], "text": ["x", "y", "z"]}, "answerKey": "C"}
    assert sandbox.render("{{choices.label.index(answerKey)}}", doc) == "2"
    assert sandbox.render("{{choices.text}}", doc) == "['x', 'y', 'z']"
    with pytest.raises(SecurityError):
        sandbox.render("{{ choices.label.append('D') }}", doc)


@pytest.mark.parametrize(
    "template",
    [
        "{{ range(5000)|list }}",
        "{{ 'a' * 10**8 }}",
        "{{ 2 ** 1000 }}",
        "{{ x * 2000000 }}",
        # sizes asked of filters and str methods, before they allocate
        "{{ (x|center(400000000))|length }}",
        "{{ '%0500000000d'|format(1) }}",
        "{{ '{:>500000000}'.format('') }}",
        "{{ ('a' * 500)|replace('', 'b' * 100000) }}",
        "{{ ('a' * 500).replace('', 'b' * 100000) }}",
        "{{ [1]|batch(100000000, 'x') }}",
        "{{ ('{0:999999}' * 100).format(1) }}",
        "{{ (('x' * 10000)|join('y' * 10000))|length }}",
        "{{ ('y' * 10000).join('x' * 10000) }}",
        "{{ ('%(a)999999s' * 100) % dict(a=1) }}",
        "{{ (((7 ** 100) ** 100) ** 100) > 1 }}",
    ],
)
def test_sizes_are_bounded(template):
    with pytest.raises(SecurityError, match="the sandbox's"):
        sandbox.render(template, {"x": "ab"})


@pytest.mark.parametrize(
    "template",
    [
        "{{ '{:>500000000}'.format('') }}",
        "{{ ('{0:999999}' * 100).format(1) }}",
        "{{ '{a:>500000000}'.format_map(dict(a=1)) }}",
        # nested widths read from the arguments (a fresh-user check made 1 GB with the first)
        "{{ '{0:{1}{2}}'.format(x, 1000, 100000) }}",
        "{{ '{0:{w}}'.format(x, w=100000000) }}",
        "{{ '{0:{1}}'.format(x, '100000000') }}",
        "{{ '{:{}}'.format(x, 100000000) }}",
        "{{ '{a:{w}}'.format_map(dict(a=1, w=100000000)) }}",
        "{{ '%*s' % (100000000, x) }}",
        "{{ '%.*f' % (100000000, 1.5) }}",
        "{{ '{0:" + "9" * 5000 + "}'.format(x) }}",  # int() of 4300+ digits raises: not a traceback here
    ],
)
def test_format_widths_are_refused_before_the_text_is_made(template):
    # it was refused only after str.format had made 500 million characters (the rendered text's length check),
    # and past the time limit on a busy machine
    with pytest.raises(SecurityError, match="format widths"):
        sandbox.render(template, {"x": "ab"})


def test_a_nested_format_index_of_thousands_of_digits_is_refused_naming_it(example_evals):
    """'{0:{999...9}}' with 5000 digits: int() raised "Exceeds the limit (4300 digits) ... use
    sys.set_int_max_str_digits()", reported for every document of the set."""
    template = "{{ '{0:{" + "9" * 5000 + "}}'.format(x) }}"
    with pytest.raises(SecurityError) as err:
        sandbox.render(template, {"x": "ab"})
    assert str(err.value) == (
        "a nested format field index of 5000 digits ({999999999999...}): give the index of one of the format's "
        "arguments"
    )
    task = example_evals / "search" / "capitals.yaml"
    task.write_text(task.read_text().replace("{{question}}", template.replace("(x)", "(question)")))
    with pytest.raises(QuantgateError) as err:
        load_team(example_evals / "search")
    assert "team search: 1 problem(s):" in str(err.value)
    assert "(a nested format field index of 5000 digits ({999999999999...}): give the index" in str(err.value)
    assert "set_int_max_str_digits" not in str(err.value)


@pytest.mark.parametrize(
    "template, text",
    [
        # digits in the literal text are no widths (the first check summed every digit: this was refused)
        ("{{ 'Exam 2024, form 20250101: {0}'.format(x) }}", "Exam 2024, form 20250101: ab"),
        ("{{ 'Total %d of 20250101' % 3 }}", "Total 3 of 20250101"),
        ("{{ '{0:>5}|{1:.2f}'.format(x, 2.5) }}", "   ab|2.50"),
        ("{{ '{:{}}|'.format(x, 4) }}", "ab  |"),
        ("{{ '%-4s|%5.1f'|format(x, 2.25) }}", "ab  |  2.2"),
    ],
)
def test_format_fields_within_the_limits_render(template, text):
    assert sandbox.render(template, {"x": "ab"}) == text


def test_dict_is_a_constructor_only_so_documents_cannot_be_changed():
    doc = {"choices": {"text": ["a"]}}
    assert sandbox.render("{{ dict(a=1) }}", doc) == "{'a': 1}"
    with pytest.raises(UndefinedError):
        sandbox.render("{{ dict.update(choices, {'slow': 1}) }}", doc)
    assert doc == {"choices": {"text": ["a"]}}


def test_lm_eval_renders_at_evaluation_are_bounded_in_time_too(monkeypatch):
    monkeypatch.setattr(sandbox, "RENDER_SECONDS", 0.3)
    loop = (
        "{% set x = range(1000)|list %}"
        "{% for a in x %}{% for b in x %}{% for c in x %}{% endfor %}{% endfor %}{% endfor %}"
    )
    from lm_eval.utils import apply_template

    with sandbox.lm_eval_sandboxed(), pytest.raises(sandbox.RenderTimeout, match="over 0.3 s"):
        apply_template(loop, {})  # as lm-eval renders a team's prompt, no time_limit around it


def test_a_render_that_runs_too_long_is_stopped():
    loop = (
        "{% set x = range(1000)|list %}"
        "{% for a in x %}{% for b in x %}{% for c in x %}{% endfor %}{% endfor %}{% endfor %}"
    )
    with pytest.raises(sandbox.RenderTimeout, match="over 0.2 s"), sandbox.time_limit(0.2):
        sandbox.render(loop, {})


@pytest.mark.parametrize(
    "pattern, verdict",
    [
        (r"(-?[0-9]+)", None),
        (r"#### (\-?[0-9\.\,]+)", None),
        (r"(?i)answer:\s*([A-D])", None),
        (r".*?(\d+)", None),
        (r"(a+)+$", "takes over"),
        (r"(\d+\.?\d*)*$", "takes over"),
        (r"x(\w+\s?)+y", "takes over"),
        (r"((ab)+)+$", "takes over"),
        (r"(a|b|ab)*c", "takes over"),  # repeated units of two characters
        (r"([0-9]", "is not a valid regular expression"),
    ],
)
def test_slow_regex(pattern, verdict):
    got = sandbox.slow_regex(pattern)
    assert got is None if verdict is None else verdict in got
