"""The vLLM canary fleet: weighted router, policy, step analysis and load (see canary/README.md)."""
