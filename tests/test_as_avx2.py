"""benchmarks/as_avx2.py: torch.cpu rewritten to report an AVX2-only CPU (the AVX2 rehearsal on a bigger CPU)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import as_avx2
from quantgate.errors import QuantgateError

REPO = Path(__file__).resolve().parents[1]
SAPPHIRE_RAPIDS = {
    "avx2": True,
    "avx512_f": True,
    "avx512_bf16": True,
    "amx_tile": True,
    "avx10_1": False,
    "fma3": True,
}


def fake_venv(tmp_path: Path, body: str) -> Path:
    f = tmp_path / "v" / "lib" / "python3.11" / "site-packages" / "torch" / "cpu" / "__init__.py"
    f.parent.mkdir(parents=True)
    f.write_text("from types import MappingProxyType\n\n\ndef get_capabilities():\n" + body)
    return tmp_path / "v"


def test_the_rewritten_capabilities_read_avx2_only(tmp_path):
    path = as_avx2.hide_avx512(fake_venv(tmp_path, as_avx2.ORIGINAL))
    stub = SimpleNamespace(_C=SimpleNamespace(_cpu=SimpleNamespace(_get_cpu_capability=lambda: SAPPHIRE_RAPIDS)))
    scope = {"torch": stub}
    exec(path.read_text(), scope)
    assert dict(scope["get_capabilities"]()) == {
        "avx2": True,
        "avx512_f": False,
        "avx512_bf16": False,
        "amx_tile": False,
        "avx10_1": False,
        "fma3": True,
    }


def test_another_torch_or_no_torch_is_refused(tmp_path):
    with pytest.raises(QuantgateError, match="get_capabilities is not torch 2.13's"):
        as_avx2.hide_avx512(fake_venv(tmp_path, "    return {}\n"))
    with pytest.raises(QuantgateError, match="no torch/cpu/__init__.py; run `make setup` there first"):
        as_avx2.hide_avx512(tmp_path / "nothing")


@pytest.mark.skipif(not (REPO / ".venv-serve").is_dir(), reason="serving env not set up (make setup)")
def test_the_installed_torch_is_the_one_it_rewrites():
    """A torch upgrade that changes get_capabilities fails here, not an hour into a rehearsal."""
    for venv in (".venv", ".venv-serve"):
        found = next((REPO / venv).glob("lib/python3*/site-packages/torch/cpu/__init__.py"), None)
        if found is None:
            pytest.skip(f"{venv} has no torch")
        text = found.read_text()
        assert text.count(as_avx2.ORIGINAL) + text.count(as_avx2.PATCHED) == 1, venv


def test_a_clone_that_fails_is_one_line_and_leaves_no_folder(tmp_path, monkeypatch):
    """A failed `git clone` was a CalledProcessError traceback."""
    import tempfile

    monkeypatch.setattr(as_avx2, "cpuinfo", lambda: "flags : sse avx2 avx512f")
    monkeypatch.setattr(as_avx2, "REPO", tmp_path / "no-repo")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["benchmarks.as_avx2", "test"])
    with pytest.raises(QuantgateError) as err:
        as_avx2.main()
    work = str(err.value).split(" into ")[1].split(" failed")[0]
    assert str(err.value) == f"git clone of {tmp_path / 'no-repo'} into {work} failed; see git's message above"
    assert list(tmp_path.iterdir()) == []  # the scratch folder went with it
