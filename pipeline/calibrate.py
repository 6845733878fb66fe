"""Stage `calibrate`: chat-format calibration conversations for GPTQ, AWQ and SmoothQuant, made without downloads.

Run by DVC: `python -m pipeline.calibrate MODEL_DIR EVALS_DIR OUT_JSONL` (params block `calibrate`). No server:
the stage reads the recorded set (`calibrate.recorded`, quantgate/recorded.py), so that one commit makes one
calibration set, and one build, on every machine.

The recorded set is made on request: `python -m pipeline.calibrate record MODEL_DIR EVALS_DIR` (`make
calibration`; the server runs as `evaluate.serve` says). The 16-bit build, served by vLLM, answers every prompt
of `calibrate.prompts` (each task applied to each topic). The answered turns, in a seeded shuffle, are packed
into multi-turn conversations of at least `min_tokens` tokens under the model's chat template, so calibration
sees the chat traffic the model serves. A team may add its own conversations in
`evals/<team>/calibration.jsonl` (one `{"messages": [...]}` per line); the stage puts them first. Neither may
contain a team's eval document: calibrating on the data that gates the build leaks the test into the build.
The team files are checked here and in the validate stage by one function (quantgate/calibration.py); recorded
answers are checked again here against the teams of the day.

Output: OUT_JSONL, one `{"source", "text", "tokens"}` object per conversation (`text` with the chat
template applied; `tokens` in the 16-bit build's tokenizer).
"""

from __future__ import annotations

import json
import random
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from quantgate.calibrate_params import CalibrateParams, load_prompts, made_with
from quantgate.calibration import eval_strings, overlap, team_conversations
from quantgate.console import LOG_DIR, progress
from quantgate.errors import QuantgateError, run_main
from quantgate.manifest import config_digest, read_manifest
from quantgate.params import load_block
from quantgate.precision import probe, resolve_dtype
from quantgate.recorded import read_record, write_record
from quantgate.serving import ServeParams, vllm_server
from quantgate.teams import load_teams


def check_prompts(prompts: list[str], path: Path, strings: dict[str, str]) -> None:
    """Raise QuantgateError if a prompt contains a team's eval document (names both places)."""
    for prompt in prompts:
        if where := overlap(prompt, strings):
            raise QuantgateError(
                f"{path}: the calibration prompt {prompt[:60]!r} contains the eval document at {where}; calibrating "
                "on eval data leaks the test into the build: reword the topic or task"
            )


def tokens(tokenizer, messages: list[dict]) -> int:
    """Tokens of `messages` with the chat template applied, as quantize tokenizes the text."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def answer(client, base_url: str, name: str, prompt: str, seed: int, p: CalibrateParams) -> str:
    """The served model's answer to one chat prompt at `p.temperature` with a per-prompt `seed`.

    Raises QuantgateError if the server refuses the request (names the prompt and the server's answer).
    """
    body = {
        "model": name,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": p.max_answer_tokens,
        "temperature": p.temperature,
        "seed": seed,
    }
    r = client.post(f"{base_url}/chat/completions", json=body)
    if r.status_code != 200:
        raise QuantgateError(
            f"calibrate: the server refused the prompt {prompt[:60]!r} ({r.status_code}): {r.text[:200]}"
        )
    return r.json()["choices"][0]["message"]["content"].strip()


def generate(tokenizer, base_url: str, name: str, prompts: list[str], strings: dict[str, str], p: CalibrateParams):
    """Conversations of at least `p.min_tokens` tokens, up to `p.samples`, from the served model's answers.

    Prompts are taken in a `p.seed` shuffle, answered `p.concurrency` at a time, and packed in that order
    (each conversation: consecutive turns until it reaches `p.min_tokens`), stopping once there are
    `p.samples`: generation is the stage's cost (about samples x min_tokens tokens). Answers that are empty
    or quote an eval document are left out. Returns [(messages, tokens)] and the number left out.
    """
    import httpx

    order = list(enumerate(prompts))
    random.Random(p.seed).shuffle(order)
    out, messages, left_out = [], [], 0
    bar = progress(total=p.samples, desc="calibrate: conversations", unit="conv")
    with httpx.Client(timeout=600) as client, ThreadPoolExecutor(p.concurrency) as pool:
        # all submitted, `concurrency` in flight; read in order and cancel what is left once there are enough
        futures = [pool.submit(answer, client, base_url, name, prompt, p.seed + i, p) for i, prompt in order]
        try:
            for (_, prompt), future in zip(order, futures, strict=True):
                text = future.result()
                if not text or overlap(text, strings):
                    left_out += 1
                    continue
                messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": text}]
                n = tokens(tokenizer, messages)
                if n >= p.min_tokens:
                    out.append((messages, n))
                    bar.update(1)
                    messages = []
                    if len(out) == p.samples:
                        break
        finally:
            for future in futures:
                future.cancel()
            bar.close()
    return out, left_out


def model_identity(model_dir: Path) -> dict:
    """The 16-bit build a recorded set was answered by: its weights digest (build.json) and config digest
    (tokenizer and chat template included, quantgate.manifest.config_digest)."""
    return {"weights_digest": read_manifest(model_dir)["weights_digest"], "config_digest": config_digest(model_dir)}


def _checked(model_dir: Path, evals: Path, p: CalibrateParams):
    prompts_path = Path(p.prompts)
    prompts = load_prompts(prompts_path)
    teams = load_teams(evals)
    strings = eval_strings(teams)
    check_prompts(prompts, prompts_path, strings)
    return prompts, teams, strings


def calibrate(model_dir: Path, evals: Path, out: Path, p: CalibrateParams) -> int:
    """Write `p.samples` calibration conversations to `out`: every team's own first, then the recorded set's
    in recorded order (answers that now quote an eval document, or are shorter than `p.min_tokens`, left
    out). Return how many.

    Raises QuantgateError on a bad prompt file, a team file that is malformed or overlaps eval data, a
    recorded set that is missing, edited, made with other settings or from another 16-bit build
    (quantgate.recorded.read_record), or too few conversations (names calibrate.samples and the remedy).
    """
    from transformers import AutoTokenizer

    prompts, teams, strings = _checked(model_dir, evals, p)
    recorded = read_record(Path(p.recorded), made_with(p, prompts), model_identity(model_dir))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [(where, messages, tokens(tokenizer, messages)) for where, messages in team_conversations(teams, strings)]
    left_out = 0
    for where, messages in recorded:
        if len(rows) >= p.samples:
            break
        n = tokens(tokenizer, messages)
        if n < p.min_tokens or overlap(" ".join(m["content"] for m in messages), strings):
            left_out += 1
            continue
        rows.append((where, messages, n))
    rows = rows[: p.samples]
    if left_out:
        print(f"calibrate: left out {left_out} recorded conversations quoting an eval document or short", flush=True)
    if len(rows) < p.samples:
        raise QuantgateError(
            f"calibrate: only {len(rows)} conversations (teams' own and {len(recorded)} recorded in "
            f"{p.recorded}.jsonl), calibrate.samples asks {p.samples}; record more with `make calibration`, "
            "or lower calibrate.samples"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for where, messages, n in rows:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            f.write(json.dumps({"source": where, "text": text, "tokens": n}) + "\n")
    return len(rows)


def record(model_dir: Path, evals: Path, p: CalibrateParams, serve: ServeParams) -> dict:
    """Make the recorded set `p.recorded`: `p.samples` conversations answered by the 16-bit build in
    `model_dir`, served by vLLM as `serve` says (`generate`); return its description (quantgate.recorded).

    Raises QuantgateError (before any server starts) on a bad prompt file or team file, and after generation
    if fewer than `p.samples` conversations reach `p.min_tokens`; ServerStartError if the server does not
    start; ServerDied (quantgate.serving.Server.death's reason) if it dies while it answers.
    """
    import datetime

    from transformers import AutoTokenizer

    prompts, _, strings = _checked(model_dir, evals, p)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    log = LOG_DIR / "calibrate_server.log"
    with vllm_server(serve, model_dir.resolve(), model_dir.resolve().name, log) as server, server.deaths():
        print(f"calibrate: the 16-bit build answers prompts of {p.prompts} at {server.base_url}", flush=True)
        made, left_out = generate(tokenizer, server.base_url, server.name, prompts, strings, p)
    if left_out:
        print(f"calibrate: left out {left_out} empty answers or answers quoting an eval document", flush=True)
    if len(made) < p.samples:
        raise QuantgateError(
            f"calibrate: only {len(made)} conversations of at least {p.min_tokens} tokens from {len(prompts)} "
            f"prompts in {p.prompts}; add topics or tasks there, or lower calibrate.samples or calibrate.min_tokens"
        )
    platform = probe(serve.python)
    where = {
        "machine": platform.kind,
        "dtype": resolve_dtype(serve.dtype, platform)[0],
        "recorded": datetime.date.today().isoformat(),
    }
    return write_record(Path(p.recorded), [m for m, _ in made], made_with(p, prompts), model_identity(model_dir), where)


USAGE = "usage: python -m pipeline.calibrate MODEL_DIR EVALS_DIR OUT_JSONL | record MODEL_DIR EVALS_DIR"


def main() -> None:
    p = load_block("calibrate", CalibrateParams)
    if len(sys.argv) == 4 and sys.argv[1] == "record":
        d = record(Path(sys.argv[2]), Path(sys.argv[3]), p, load_block("evaluate.serve", ServeParams))
        print(
            f"calibrate: recorded {d['conversations']} conversations in {p.recorded}.jsonl (sha256 "
            f"{d['sha256'][:12]}); commit it with {p.recorded}.json",
            flush=True,
        )
        return
    if len(sys.argv) != 4:
        raise QuantgateError(USAGE)
    model_dir, evals, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    n = calibrate(model_dir, evals, out, p)
    sources = [json.loads(line)["source"] for line in out.read_text(encoding="utf-8").splitlines()]
    recorded = sum(s.startswith(f"{p.recorded}.jsonl:") for s in sources)
    print(
        f"calibrate: wrote {n} conversations to {out}: {n - recorded} of the teams' own "
        f"({evals}/<team>/calibration.jsonl), {recorded} recorded (>= {p.min_tokens} tokens each)",
        flush=True,
    )


if __name__ == "__main__":
    run_main(main, log="calibrate")
