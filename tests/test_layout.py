"""The import graph matches the layout (README "Layout", quantgate/README.md): the kernel quantgate/
imports no other project folder, nothing imports the composition root cli/, registry/, gateway/ and canary/
never import pipeline/,
gateway/ imports nothing from canary/ (the data plane knows nothing of rollouts), canary/ carries no HTTP
traffic itself, there are no cycles between folders, no stage imports another stage, and every stage's
`deps` in dvc.yaml are exactly the project modules it imports, transitively, so editing a module re-runs
exactly the stages that run it. No function in gateway/ or canary/ is longer than 60 lines or takes more than
7 parameters."""

import ast
import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("quantgate", "pipeline", "registry", "gateway", "canary", "cli")


def module_file(name: str) -> str | None:
    """The repo-relative file of dotted module `name` in a project package (None for a package
    __init__, which holds only a docstring, and for anything outside the project)."""
    parts = name.split(".")
    if parts[0] not in PACKAGES or len(parts) == 1:
        return None
    path = Path(*parts).with_suffix(".py")
    return str(path) if (REPO / path).is_file() else None


def imports(rel: str) -> set[str]:
    """Project modules (files) that `rel` imports anywhere in its body, lazy imports included."""
    found = set()
    for node in ast.walk(ast.parse((REPO / rel).read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {f for f in map(module_file, names) if f}
    return found - {rel}


def closure(rel: str) -> set[str]:
    seen, todo = {rel}, [rel]
    while todo:
        for dep in imports(todo.pop()) - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def project_files(package: str) -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in (REPO / package).glob("*.py") if p.name != "__init__.py")


def dvc_stages() -> dict[str, tuple[str, set[str]]]:
    """{stage: (module file its cmd runs, its deps that are project modules)}; a foreach stage once."""
    stages = {}
    for name, stage in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"].items():
        body = stage.get("do", stage)
        module = re.match(r"python -m ([\w.]+)", body["cmd"]).group(1)
        deps = {d for d in body["deps"] if d.endswith(".py")}
        stages[name] = (module_file(module), deps)
    return stages


def test_every_stage_declares_exactly_the_project_modules_it_imports():
    for name, (module, deps) in dvc_stages().items():
        assert module and module.startswith("pipeline/"), (name, module)
        want = closure(module)
        assert deps == want, f"dvc.yaml stage {name}: missing {sorted(want - deps)}, not imported {sorted(deps - want)}"


def test_no_stage_imports_another_stage():
    stages = {module for module, _ in dvc_stages().values()}
    for module in stages:
        assert not (closure(module) - {module}) & stages, (module, sorted(closure(module) & stages))


def test_every_pipeline_module_is_a_stage_or_a_helper_of_one():
    used = set().union(*(closure(module) for module, _ in dvc_stages().values()))
    assert set(project_files("pipeline")) <= used


def test_dependencies_point_one_way():
    for rel in project_files("quantgate"):  # the kernel imports no folder above it
        assert all(d.startswith("quantgate/") for d in closure(rel)), (rel, sorted(closure(rel)))
    for package in PACKAGES:  # the composition root sits on top: nothing imports it
        for rel in project_files(package):
            assert rel.startswith("cli/") or not any(d.startswith("cli/") for d in closure(rel)), rel
    for package in ("registry", "gateway", "canary"):
        for rel in project_files(package):
            assert not any(d.startswith("pipeline/") for d in closure(rel)), (rel, sorted(closure(rel)))


def test_the_gateway_knows_nothing_of_canaries():
    for rel in project_files("gateway"):
        assert not any(d.startswith("canary/") for d in closure(rel)), (rel, sorted(closure(rel)))


# a proxy answers requests: it needs a server framework (a client, like canary/load.py's, is no proxy)
PROXYING = re.compile(r"^\s*(from|import) (starlette|uvicorn)\b", re.M)


def test_the_canary_carries_no_traffic():
    for rel in project_files("canary"):
        assert not PROXYING.search((REPO / rel).read_text()), f"{rel}: proxying code belongs in gateway/"


def test_no_cycles_between_folders():
    edges = {
        (rel.split("/")[0], dep.split("/")[0])
        for package in PACKAGES
        for rel in project_files(package)
        for dep in imports(rel)
    }
    for start in PACKAGES:  # no folder reaches itself through the folders it imports
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            for a, b in edges - {(p, p) for p in PACKAGES}:
                if a == node and b not in seen:
                    seen.add(b)
                    todo.append(b)
        assert start not in seen, f"{start}/ reaches itself through the folders it imports: {sorted(edges)}"


def test_evals_holds_team_data_only():
    assert not list((REPO / "evals").rglob("*.py"))


MAX_LINES, MAX_PARAMS = 60, 7  # issue 30: a function reads on one screen and is called without a keyword soup


def test_no_long_function_and_no_long_parameter_list_in_gateway_or_canary():
    offenders = []
    for package in ("gateway", "canary"):
        for rel in project_files(package):
            for node in ast.walk(ast.parse((REPO / rel).read_text())):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                args = node.args  # self and cls count; *args and **kwargs do not
                params = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs)
                lines = node.end_lineno - node.lineno + 1  # from `def` (decorators apart) to its last line
                if lines > MAX_LINES or params > MAX_PARAMS:
                    offenders.append(f"{rel}:{node.lineno} {node.name}: {lines} lines, {params} parameters")
    assert not offenders, f"longer than {MAX_LINES} lines or more than {MAX_PARAMS} parameters: {offenders}"


def test_params_blocks_are_the_blocks_the_code_reads_and_the_shipped_params_yaml_has():
    from quantgate.params import BLOCKS

    read = {"builds"}  # load_builds
    for path in (REPO / d for d in ("quantgate", "pipeline", "canary", "gateway", "registry", "cli")):
        for py in path.rglob("*.py"):
            read |= {m.split(".")[0] for m in re.findall(r'load_block\(\s*"([a-z_.]+)"', py.read_text())}
    assert set(BLOCKS) == read == set(yaml.safe_load((REPO / "params.yaml").read_text()))
