"""Unit tests of the benchmark helpers (the benchmarks themselves print figures; see benchmarks/)."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from benchmarks.common import measure, stages
from benchmarks.incremental import add_team, reword, set_margin, set_param
from benchmarks.numbers import markdown
from quantgate.teams import inspect_team, load_teams

REPO = Path(__file__).resolve().parents[1]


def test_measure_sees_the_peak_memory_of_a_child_process(tmp_path):
    code = "import time; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.0); print('done')"
    m = measure([sys.executable, "-c", code], tmp_path)
    assert m.rc == 0 and m.output.strip() == "done"
    assert 0.29 < m.peak_rss_gib < 1.0 and 1.0 <= m.wall_s < 10


def test_measure_reports_the_exit_code(tmp_path):
    assert measure([sys.executable, "-c", "import sys; sys.exit(3)"], tmp_path).rc == 3


def test_an_interrupted_measure_stops_the_command_and_its_children(tmp_path, monkeypatch):
    # the command runs in a session of its own: Ctrl-C at the terminal (or run_main's SIGTERM) reaches only the
    # benchmark, so measure itself must stop `dvc repro` and the vLLM server under it
    import psutil

    import benchmarks.common as common

    pidfile = tmp_path / "child.pid"
    real_sleep = common.time.sleep

    def interrupted(seconds):
        if pidfile.is_file() and pidfile.read_text().strip():
            raise KeyboardInterrupt
        real_sleep(seconds)

    monkeypatch.setattr(common.time, "sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        measure(f"sleep 60 & echo $! > {pidfile}; wait", tmp_path, interval=0.05)
    child = int(pidfile.read_text())
    real_sleep(0.2)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_stages_are_dvcs_own_order_with_foreach_expanded(tmp_path):
    # the repo's dvc.yaml and params.yaml in a project of their own: DVC takes a project's lock to plan
    for name in ("dvc.yaml", "params.yaml", ".dvc/config"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    names = stages(tmp_path)
    builds = yaml.safe_load((REPO / "params.yaml").read_text())["builds"]
    assert names[0] == "validate" and names[-1] == "register" and len(names) == len(set(names))
    assert sorted(n for n in names if n.startswith("profile@")) == sorted(f"profile@{b}" for b in builds)
    assert [n for n in names if n.startswith("evaluate@")] == [
        "evaluate@fp16",
        "evaluate@fp8",
        "evaluate@int8",
        "evaluate@int4",
        "evaluate@int4-mixed",
    ]
    # the search reads fp16's and int4's profiles, so those run before it (dvc.yaml lists them after)
    assert names.index("profile@fp16") < names.index("search") and names.index("quantize@int4") < names.index("search")
    assert names.index("profile@int4") < names.index("search") < names.index("quantize@int4-mixed")
    assert names.index("quantize@int4") < names.index("evaluate@fp16") < names.index("gate")


def test_synthetic_and_changed_teams_stay_valid(tmp_path):
    from benchmarks.common import commit

    root = tmp_path / "project"
    shutil.copytree(REPO / "evals", root / "evals", ignore=shutil.ignore_patterns("README.md"))
    before = {t.name: t.digest for t in load_teams(root / "evals")}
    add_team(root, "synth_04", rotate=28)
    commit(root, "x")
    reword(root, 2)
    team, problems = inspect_team(root / "evals" / "synth_04")
    assert problems == [] and team.tasks[0].name == "synth_04_capitals"
    teams = {t.name: t.digest for t in load_teams(root / "evals")}
    assert set(teams) == set(before) | {"synth_04"}
    assert teams["search"] != before["search"] and teams["billing"] == before["billing"]
    lines = (root / "evals" / "search" / "data.jsonl").read_text().splitlines()
    assert json.loads(lines[2])["question"].endswith("? (rev 1)") and "(rev" not in lines[3]
    first = (root / "evals" / "synth_04" / "data.jsonl").read_text().splitlines()[0]
    assert first == (REPO / "evals" / "search" / "data.jsonl").read_text().splitlines()[28]


def test_set_margin_changes_the_policy_but_not_what_is_scored(tmp_path):
    root = tmp_path / "project"
    shutil.copytree(REPO / "evals", root / "evals", ignore=shutil.ignore_patterns("README.md"))
    before = {t.name: t for t in load_teams(root / "evals")}
    set_margin(root, "search", 0.061)
    after = {t.name: t for t in load_teams(root / "evals")}
    assert after["search"].policy.margin.absolute == 0.061 and after["search"].digest != before["search"].digest
    assert after["search"].scores_digest == before["search"].scores_digest  # benchmark (e): nothing re-scored


def test_set_param_changes_one_nested_value(tmp_path):
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    set_param(tmp_path, "quantize.int4.calibration", "samples", 32)
    import yaml

    doc = yaml.safe_load((tmp_path / "params.yaml").read_text())
    assert doc["quantize"]["int4"]["calibration"] == {"samples": 32, "seq_len": 512, "pipeline": "basic"}
    assert doc["quantize"]["int4"]["recipe"] == "recipes/int4.yaml"


def test_markdown_renders_title_command_machine_and_rows():
    doc = {
        "title": "T",
        "command": "python -m benchmarks.x --limit 2",
        "measured_at": "2026-11-29T10:00:00+00:00",
        "machine": {
            "cpu": "CPU X",
            "cores": 2,
            "isa": "avx2",
            "memory_gib": 24.0,
            "gpu": None,
            "serving": {"vllm": "0.32.0"},
        },
        "rows": [{"stage": "prepare", "cold s": 12.5, "note": None}],
        "notes": ["n1"],
    }
    text = markdown(doc)
    assert (
        "`python -m benchmarks.x --limit 2` — 2026-11-29, CPU X (2 cores, avx2), 24.0 GiB, no GPU, vLLM 0.32.0" in text
    )
    assert "| stage | cold s | note |" in text and "| prepare | 12.5 |  |" in text and text.rstrip().endswith("- n1")


def test_scratch_project_refuses_an_existing_folder_and_only_scratch_projects_are_recognised(tmp_path):

    from benchmarks.common import commit, is_scratch_project, scratch_project
    from quantgate.errors import QuantgateError

    (tmp_path / "taken").mkdir()
    with pytest.raises(QuantgateError, match="taken already exists; give another --work folder"):
        scratch_project(tmp_path / "taken")
    assert not is_scratch_project(REPO)
    other = tmp_path / "other"
    other.mkdir()
    (other / "dvc.yaml").write_text("stages: {}\n")
    commit(other, "someone's real work")  # a message with a quote: git gets it as one argument
    assert not is_scratch_project(other)
    commit(other, "(d') changed back")
    log = subprocess.run(["git", "log", "--format=%s"], cwd=other, capture_output=True, text=True).stdout
    assert log.splitlines() == ["(d') changed back", "someone's real work"]


def test_numbers_names_a_malformed_result_in_one_line(tmp_path, monkeypatch):

    import benchmarks.numbers as numbers
    from quantgate.errors import QuantgateError

    monkeypatch.setattr(numbers, "RESULTS", tmp_path)
    (tmp_path / "serving.json").write_text('{"benchmark": "serving"}')
    with pytest.raises(QuantgateError, match=r"serving.json: not a benchmark result \(KeyError"):
        numbers.render(["serving"])
    with pytest.raises(QuantgateError, match="no such result; run python -m benchmarks.quality first"):
        numbers.render(["quality"])


def test_numbers_renders_every_result_it_holds_not_only_the_readme_ones(tmp_path, monkeypatch, capsys):
    """`benchmarks.numbers search_estimate` said "unknown result" of the results gateway, search_estimate,
    ray_evaluate and quality_*_avx512, though its docstring says it renders results/*.json."""
    import benchmarks.numbers as numbers
    from quantgate.errors import QuantgateError

    doc = {
        "title": "Search estimate",
        "command": "python -m benchmarks.search_estimate",
        "measured_at": "2026-12-03T10:00:00+00:00",
        "machine": {"cpu": "CPU X", "cores": 2, "isa": "avx2", "memory_gib": 24.0},
        "rows": [{"screens": 2, "s": 91.5}],
        "notes": [],
    }
    monkeypatch.setattr(numbers, "RESULTS", tmp_path)
    (tmp_path / "search_estimate.json").write_text(json.dumps(doc))
    assert numbers.available() == [*numbers.ORDER, "search_estimate"]
    monkeypatch.setattr(sys, "argv", ["benchmarks.numbers", "search_estimate"])
    numbers.main()
    out = capsys.readouterr().out
    assert out.startswith("**Search estimate**\n") and "| screens | s |\n|---|---|\n| 2 | 91.5 |" in out
    assert numbers.render([]).startswith("**Search estimate**")  # the ORDER ones missing: skipped, named on stderr
    with pytest.raises(QuantgateError, match="no results in"):
        numbers.render([], readme=True)  # the README view holds ORDER's results only
    monkeypatch.setattr(sys, "argv", ["benchmarks.numbers", "nope"])
    with pytest.raises(
        QuantgateError, match=r"^unknown result 'nope'; give one of pipeline_cost, .*, search_estimate$"
    ):
        numbers.main()


@pytest.mark.parametrize("flag, example", [("--out", "benchmarks/results/numbers.md"), ("--readme", "README.md")])
def test_numbers_refuses_an_empty_file_option_naming_it(tmp_path, monkeypatch, flag, example):
    """`--out ''` said ".: is a folder" (Path("") is the working directory); `--readme ''` "cannot read"."""
    import benchmarks.numbers as numbers
    from quantgate.errors import QuantgateError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["benchmarks.numbers", flag, ""])
    with pytest.raises(QuantgateError) as err:
        numbers.main()
    assert str(err.value) == f"{flag} is empty; give a file, e.g. {flag} {example}, or drop {flag}"
    assert list(tmp_path.iterdir()) == []


def test_reword_changes_the_data_every_time(tmp_path):
    from benchmarks.common import commit

    shutil.copytree(REPO / "evals" / "search", tmp_path / "evals" / "search")
    path = tmp_path / "evals" / "search" / "data.jsonl"
    states = [path.read_text()]
    for _ in range(3):
        commit(tmp_path, "change")
        reword(tmp_path, 0)
        states.append(path.read_text())
    assert len(set(states)) == 4  # never back to an earlier state: no cache can hold its results
    first = json.loads(states[3].splitlines()[0])
    assert first["question"] == "What is the capital of France? (rev 3)"


def test_readme_section_is_replaced_between_the_markers_only(tmp_path, monkeypatch):

    import benchmarks.numbers as numbers
    from quantgate.errors import QuantgateError

    doc = {
        "title": "T",
        "command": "python -m benchmarks.serving",
        "measured_at": "2026-11-29T10:00:00+00:00",
        "machine": {"cpu": "CPU X", "cores": 2, "isa": "avx2", "memory_gib": 24.0},
        "rows": [{"build": "fp8", "C": 1, "n": 2, "tok/s": 0.59, "note": None}],
        "notes": ["ratios", "extra"],
    }
    monkeypatch.setattr(numbers, "RESULTS", tmp_path)
    (tmp_path / "serving.json").write_text(json.dumps(doc))
    readme = tmp_path / "README.md"
    readme.write_text(f"# P\n\n{numbers.START}\nold table\n{numbers.END}\n\nkept\n")
    new = numbers.replace_section(readme, numbers.render([], readme=True))
    assert new.startswith(f"# P\n\n{numbers.START}\n**4. T**") and new.endswith(f"{numbers.END}\n\nkept\n")
    assert "old table" not in new and "| build | C | disk MiB | mem GiB | KV tokens | tok/s |" in new  # README_VIEW
    assert "| fp8 | 1 |  |  |  | 0.59 |  |" in new and "- ratios" in new and "- extra" not in new
    readme.write_text(f"{numbers.END}\n{numbers.START}\n")
    with pytest.raises(
        QuantgateError, match=r"README.md: needs the lines <!-- numbers:start --> and <!-- numbers:end -->"
    ):
        numbers.replace_section(readme, "x")


def test_incremental_refuses_unknown_scenarios(monkeypatch):
    from benchmarks import incremental
    from quantgate.errors import QuantgateError

    for bad in ("x", "", "abf"):
        monkeypatch.setattr("sys.argv", ["incremental", "--scenarios", bad])
        with pytest.raises(QuantgateError, match=rf"--scenarios '{bad}': give letters from abcde"):
            incremental.main()


def test_stage_timing_reads_the_stage_that_started_the_builds_server(tmp_path):
    from benchmarks.common import stage_timing

    (tmp_path / "results/eval/int8").mkdir(parents=True)
    (tmp_path / "results/logs").mkdir()
    evaluate = {"build": "int8", "server_start_s": 31.0, "profile_s": 12.5, "scoring_s": {"billing": 20.0}}
    profile = {"build": "fp16", "server_start_s": 29.5, "profile_s": 11.0, "scoring_s": {"billing": 19.0}}
    (tmp_path / "results/eval/int8/timing.json").write_text(json.dumps(evaluate))
    (tmp_path / "results/logs/profile@fp16.timing.json").write_text(json.dumps(profile))
    assert stage_timing(tmp_path, "evaluate@int8") == evaluate
    assert stage_timing(tmp_path, "profile@fp16") == profile
    assert stage_timing(tmp_path, "profile@int8") is None and stage_timing(tmp_path, "gate") is None


def _no_work(*args, **kwargs):
    raise AssertionError("the benchmark went past its arguments into work")


@pytest.mark.parametrize(
    ("module", "argv", "said"),
    [
        ("pipeline_cost", ["--work", ""], "argument --work: empty; give a path"),
        ("incremental", ["--work", ""], "argument --work: empty; give a path"),
        ("quality", ["--work", " "], "argument --work: empty; give a path"),
        ("eval_engine", ["--models", ""], "argument --models: empty; give a path"),
        ("search_estimate", ["--work", ""], "argument --work: empty; give a path"),
        ("serving", ["--cpu-cores", "abc"], "argument --cpu-cores: 'abc' is not a core list"),
        ("eval_engine", ["--cpu-cores", "1-0"], "argument --cpu-cores: '1-0': the range '1-0' is empty"),
        ("quality", ["--cpu-cores", "4096"], "argument --cpu-cores: '4096': core 4096 is not one this machine"),
        ("quality", ["--engine", "vlm"], "argument --engine: invalid choice: 'vlm'"),
    ],
)
def test_benchmark_options_are_refused_by_argparse_before_any_work(module, argv, said, monkeypatch, capsys):
    # an empty path ('', an unset shell variable) is Path("."): pipeline_cost made its scratch project in the
    # working directory and ran the pipeline there; a --cpu-cores typo reached vLLM only (model_copy runs no
    # validator), where eval_engine went on without vLLM and wrote a result with its columns empty
    import importlib

    bench = importlib.import_module(f"benchmarks.{module}")
    for name in ("scratch_project", "load_teams", "stages", "read_search", "load_block"):
        if hasattr(bench, name):
            monkeypatch.setattr(bench, name, _no_work)
    monkeypatch.setattr("sys.argv", [module, *argv])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2 and said in capsys.readouterr().err


def test_serving_refuses_a_load_with_no_tpot_to_measure(monkeypatch):
    # one generated token has no time per output token: vLLM's benchmark reports TPOT 0 for it
    from benchmarks import serving
    from quantgate.errors import QuantgateError

    monkeypatch.setattr(serving, "load_block", _no_work)
    monkeypatch.setattr("sys.argv", ["serving", "--output-len", "1"])
    with pytest.raises(QuantgateError, match=r"^--output-len must be >= 2, got 1$"):
        serving.main()


def test_ray_evaluate_checks_its_options_and_project_before_starting_ray(tmp_path, monkeypatch, capsys):
    # it started a Ray cluster first: --replicas x failed after the start, --nodes 0 divided by zero after the runs
    from benchmarks import ray_evaluate
    from quantgate.errors import QuantgateError

    monkeypatch.setattr(ray_evaluate, "local_ray", _no_work)
    for bad, said in (("--nodes=0", "argument --nodes: '0': give whole numbers >= 1"), ("--replicas=x", "'x'")):
        monkeypatch.setattr("sys.argv", ["ray_evaluate", "--project", str(tmp_path), bad])
        with pytest.raises(SystemExit) as exit_:
            ray_evaluate.main()
        assert exit_.value.code == 2 and said in capsys.readouterr().err
    monkeypatch.setattr("sys.argv", ["ray_evaluate", "--project", str(tmp_path)])
    with pytest.raises(QuantgateError, match=r"no models/int8/config.json; give a project after `dvc repro evaluate"):
        ray_evaluate.main()
    # --build '' was told "no models//config.json; give a project after `dvc repro evaluate@`"
    for build in ("", "../int8"):
        (tmp_path / "models" / build / "config.json").parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "models" / build / "config.json").write_text("{}")
        monkeypatch.setattr("sys.argv", ["ray_evaluate", "--project", str(tmp_path), "--build", build])
        with pytest.raises(QuantgateError, match=rf"^--build '{re.escape(build)}': give a build of the project's"):
            ray_evaluate.main()


@pytest.mark.parametrize(
    ("health", "said"),
    [
        ([1, 2], r"http://gw/health names no warm serving build: \[1, 2\]"),
        (
            {"stable": "v2", "pid": 1, "fleet": {"2": {"url": "http://127.0.0.1:9/v1", "pid": 1, "why": "serving"}}},
            r"http://127.0.0.1:9/v1/models: ConnectError: .*; is every server up\?",
        ),
    ],
)
def test_gateway_benchmark_names_a_bad_health_answer_or_a_dead_server_in_one_line(health, said, monkeypatch):
    # a /health that is no object, or a warm server that does not answer, ended in a traceback
    from benchmarks import gateway
    from quantgate.errors import QuantgateError

    class Answer:
        def json(self):
            return health

    monkeypatch.setattr(gateway.httpx, "get", lambda *a, **kw: Answer())
    monkeypatch.setattr(gateway, "report", _no_work)
    monkeypatch.setattr("sys.argv", ["gateway", "--url", "http://gw", "--n", "2"])
    with pytest.raises(QuantgateError, match=said):
        gateway.main()


BENCHMARKS = sorted(
    p.stem
    for p in (REPO / "benchmarks").glob("*.py")
    if p.stem not in ("__init__", "common") and "main" in p.read_text()
)


@pytest.mark.parametrize("module", BENCHMARKS)
def test_every_benchmark_help_says_what_it_measures_in_whole_sentences(module, monkeypatch, capsys):
    # the description was the docstring's first line: serving's ended "KV-cache capacity, and", canary_sim's
    # "how often does an identical build"; pipeline_cost's and canary_sim's usage named pipeline_cost.py, not -m
    import importlib

    bench = importlib.import_module(f"benchmarks.{module}")
    monkeypatch.setattr("sys.argv", [module, "--help"])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    out = capsys.readouterr().out
    description = " ".join(out.split("\n\n")[1].split())
    assert exit_.value.code == 0 and out.startswith(f"usage: {'python -m ' * (module == 'serving')}benchmarks.{module}")
    assert description.endswith((".", "?")), description


def test_canary_sim_refuses_a_number_of_canaries_below_1(monkeypatch, capsys):
    # --canaries 0 or -5 ran 20 canaries per scenario and recorded the number given
    from benchmarks import canary_sim

    monkeypatch.setattr(canary_sim, "simulate", _no_work)
    for bad in ("0", "-5", "x"):
        monkeypatch.setattr("sys.argv", ["canary_sim", "--canaries", bad])
        with pytest.raises(SystemExit) as exit_:
            canary_sim.main()
        assert exit_.value.code == 2 and f"argument --canaries: '{bad}': give a whole number" in capsys.readouterr().err


def test_quality_refuses_a_work_file_and_a_missing_calibration_before_any_build(tmp_path, monkeypatch):
    """A --work file and a missing --calibration failed each build that calibrates at its quantization (recorded as
    a note) or the scores' write after fp16 was scored; the sweep then wrote its result without those builds."""
    from benchmarks import quality
    from quantgate.errors import QuantgateError

    (tmp_path / "models/fp16").mkdir(parents=True)
    (tmp_path / "models/fp16/config.json").write_text("{}")
    (tmp_path / "a-file").write_text("")
    monkeypatch.setattr(quality, "load_teams", _no_work)
    common = ["quality", "--models", str(tmp_path / "models")]
    monkeypatch.setattr("sys.argv", [*common, "--work", str(tmp_path / "a-file")])
    with pytest.raises(QuantgateError, match=r"^--work .*a-file: not a folder; give a folder \(made when missing\)$"):
        quality.main()
    missing = tmp_path / "none.jsonl"
    monkeypatch.setattr("sys.argv", [*common, "--calibration", str(missing), "--only", "int8,fp8"])
    with pytest.raises(QuantgateError) as err:
        quality.main()
    assert str(err.value).startswith(f"--calibration {missing}: no such file, and int8 calibrates on it; run `dvc")
    monkeypatch.setattr("sys.argv", [*common, "--calibration", str(missing), "--only", "fp8"])
    with pytest.raises(AssertionError, match="went past its arguments"):  # fp8 calibrates on nothing: it goes on
        quality.main()
    # a trailing comma was a build named '' ("--only : not a build"); a list of commas alone, no build at all
    monkeypatch.setattr("sys.argv", [*common, "--calibration", str(missing), "--only", "fp8,"])
    with pytest.raises(AssertionError, match="went past its arguments"):
        quality.main()
    for bad in (",", ""):
        monkeypatch.setattr("sys.argv", [*common, "--only", bad])
        with pytest.raises(QuantgateError, match=rf"^--only '{bad}': name at least one build, comma-separated"):
            quality.main()
