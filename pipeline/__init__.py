"""quantgate pipeline: exactly the DVC stages of dvc.yaml (validate, prepare, quantize, evaluate, gate,
register) and their private helpers."""
