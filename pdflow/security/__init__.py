"""Who may speak to a pipeline: its secret and derived keys (:mod:`.keys`), CURVE on the control
plane (:mod:`.curve`), the data plane's proof of the secret (:mod:`.handshake`)."""

from pdflow.security.keys import (
    PipelineKeys,
    SecretError,
    StageKeys,
    identity,
    load_api_key,
    load_pipeline_secret,
    parse_identity,
    pipeline_keys,
)

__all__ = ["PipelineKeys", "SecretError", "StageKeys", "identity", "load_api_key", "load_pipeline_secret",
           "parse_identity", "pipeline_keys"]
