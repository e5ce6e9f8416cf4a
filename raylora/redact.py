"""What of a run's config may be written down: checkpoints, logs and metric sinks travel, secrets must not."""

from __future__ import annotations

import os
import re
from typing import Any

_SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|(^|_)KEY($|_))", re.IGNORECASE)


def redact(data: Any) -> Any:
    """A copy of plain config data safe to save: no URI credentials, no values of secret env variables.

    Checkpoints and logs travel; a token pasted into a storage URI (`s3://KEY:SECRET@bucket`,
    `?access_key=...`) or read from the environment must not travel with them.
    """
    secrets = {v for k, v in os.environ.items() if _SECRET_NAME.search(k) and len(v) >= 8}

    def clean(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        if not isinstance(value, str):
            return value
        value = re.sub(r"^([a-zA-Z][\w+.-]*://)[^/@]*@", r"\1***@", value)
        value = re.sub(
            r"([?&][^=&]*(?:key|secret|token|password|signature)[^=&]*=)[^&]*",
            r"\1***",
            value,
            flags=re.IGNORECASE,
        )
        for secret in secrets:
            value = value.replace(secret, "***")
        return value

    return clean(data)
