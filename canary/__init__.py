"""The canary control loop: policy, persisted status, controller, analysis, plan, forecast, render
(see canary/README.md). It moves traffic through the gateway (gateway/), never carries it."""
