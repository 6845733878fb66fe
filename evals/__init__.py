"""Team eval sets: one folder per team (lm-eval task YAMLs + JSONL data + team.yaml policy)."""
