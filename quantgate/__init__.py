"""quantgate's shared kernel: errors, params, hashing, manifests, serving (vLLM lifecycle), precision,
the gate statistics and Verdict, the team eval-set schema (teams, checks, templates, sandbox, scaffold).
It imports no other folder of the project; the CLI that imports them all is cli/, on top."""
