"""quantgate pipeline: one module per DVC stage (prepare, quantize, evaluate, gate, register) and the CLI."""
