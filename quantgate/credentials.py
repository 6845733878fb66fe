"""Registry and cloud credentials a stage that renders team files never needs (least privilege).

Team eval sets are input from outside the pipeline: lm-eval renders their templates (in the sandbox of
quantgate/sandbox.py). The evaluate stage, and every Ray task that scores or screens teams
(quantgate/remote.py), runs without these in its environment; the vLLM server it starts inherits that.
"""

from __future__ import annotations

from collections.abc import MutableMapping

# Credentials the evaluate stage never needs (lm-eval's client and vLLM read local files and talk
# to a server it starts): the registry's, the clouds', the hub's. OPENAI_API_KEY stays: it is
# the key lm-eval's client sends to a remote evaluation endpoint.
CREDENTIAL_PREFIXES = (
    "MLFLOW_",
    "AWS_",
    "BOTO_",
    "GOOGLE_",
    "GCLOUD_",
    "CLOUDSDK_",
    "GCP_",
    "AZURE_",
    "ARM_",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "PGPASSWORD",
    "DATABASE_URL",
)
CREDENTIAL_WORDS = ("SECRET", "PASSWORD", "CREDENTIALS")
KEEP = frozenset({"OPENAI_API_KEY", "VLLM_API_KEY"})


def drop_credentials(environ: MutableMapping[str, str]) -> list[str]:
    """Remove registry and cloud credentials (CREDENTIAL_PREFIXES, and any name holding one of
    CREDENTIAL_WORDS) from `environ`, in place; return the names removed, sorted."""
    gone = sorted(
        k
        for k in environ
        if k not in KEEP
        and (k.upper().startswith(CREDENTIAL_PREFIXES) or any(w in k.upper() for w in CREDENTIAL_WORDS))
    )
    for k in gone:
        del environ[k]
    return gone
