"""File names under results/eval/<build>/<team>/: written by the evaluate stage, read by the gate
stage, the CLI and the benchmarks, so no stage imports another for a name."""

SCORES = "scores.json"  # the team's status, per-sample scores and aggregates for one build
SAMPLES = "samples.jsonl"  # lm-eval's per-sample log, one JSON object per line
