"""quantgate pipeline: exactly the DVC stages of dvc.yaml (validate, prepare, calibrate, search, quantize,
evaluate, gate, register) and their private helpers."""
