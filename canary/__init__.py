"""The vLLM canary fleet (not built yet; see canary/README.md)."""
