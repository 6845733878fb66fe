"""The MLflow registry contract: model versions with lineage and evidence, aliases, approvals."""
