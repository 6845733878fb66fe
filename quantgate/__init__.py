"""quantgate's shared kernel: errors, params, hashing, manifests, serving (vLLM lifecycle), precision,
the gate statistics and Verdict, the team eval-set schema (teams, checks, templates, sandbox, scaffold),
and the CLI, the only module that imports pipeline/, registry/ and canary/."""
