"""The serving gateway `quantgate serve` runs: router, limits, samples, admin endpoint, webhook and the fleet of
vLLM servers that follows the registry aliases (see gateway/README.md). It imports nothing from canary/."""
