"""params.yaml's `calibrate` block (the calibration conversations) and its prompt file, read by the calibrate
stage and checked by validate before any stage runs."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from quantgate.errors import QuantgateError
from quantgate.hashing import digest_json
from quantgate.params import Frozen, parse, read_yaml


class CalibrateParams(Frozen):
    prompts: str = "recipes/calibration/prompts.yaml"
    samples: int = Field(default=256, gt=0)  # conversations
    min_tokens: int = Field(default=512, gt=0)  # per conversation, chat template included
    max_answer_tokens: int = Field(default=256, gt=0)
    temperature: float = Field(default=0.7, ge=0)  # > 0: varied answers, as traffic is
    seed: int = Field(default=0, ge=0, le=2**32 - 1)  # prompt i's request seed is seed + i; vLLM takes 64-bit seeds
    concurrency: int = Field(default=16, gt=0)  # requests in flight; vLLM batches them
    recorded: str = "recipes/calibration/recorded"  # the recorded set: <recorded>.jsonl and <recorded>.json


class PromptSet(Frozen):
    topics: list[str] = Field(min_length=1)
    tasks: list[str] = Field(min_length=1)

    @field_validator("tasks")
    @classmethod
    def _has_topic(cls, tasks: list[str]) -> list[str]:
        if bad := [t for t in tasks if "{topic}" not in t]:
            raise ValueError(f"every task must contain {{topic}}; {bad[0]!r} does not")
        return tasks


def load_prompts(path: Path) -> list[str]:
    """Every task applied to every topic of the prompt file at `path`, tasks varying fastest.

    Raises QuantgateError naming the file (and field) if it is missing or malformed.
    """
    if not path.is_file():
        raise QuantgateError(f"{path}: calibration prompt file not found (calibrate.prompts)")
    spec = parse(PromptSet, read_yaml(path), str(path), path)
    return [task.replace("{topic}", topic) for topic in spec.topics for task in spec.tasks]


def made_with(p: CalibrateParams, prompts: list[str]) -> dict:
    """The settings a recorded set depends on: the prompts' content (their digest) and the packing and
    sampling settings. `samples` is not one of them: a record of N serves any samples <= N."""
    return {
        "prompts_sha256": digest_json(prompts),
        "min_tokens": p.min_tokens,
        "max_answer_tokens": p.max_answer_tokens,
        "temperature": p.temperature,
        "seed": p.seed,
    }
