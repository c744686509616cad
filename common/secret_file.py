"""Secrets come from files or the inherited environment, never from a command line (`ps` shows argv).

    resolve_secret(flag, argv_value, path, env_var) -> str | None
        --X-file PATH   read PATH (stripped); a file others can read is logged, an empty one refused
        --X VALUE       still accepted (SGLang's flag names) but logged: it is visible in `ps`
        $ENV_VAR        inherited from the parent, never on a command line
A flag and its --X-file together are refused. Used by the router for --api-key and
--admin-api-key; the cluster secret has its own loader (common.cluster_secret).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

logger = logging.getLogger("pdserve.secrets")


class SecretFileError(ValueError):
    """A secret file is missing, unreadable or empty, or a secret was given twice."""


def read_secret_file(path: str, flag: str) -> str:
    p = Path(path)
    try:
        value = p.read_text().strip()
        mode = p.stat().st_mode
    except (OSError, UnicodeDecodeError) as e:
        raise SecretFileError(f"cannot read {flag} {path}: {getattr(e, 'strerror', None) or e}") from None
    if not value:
        raise SecretFileError(f"{flag} {path} is empty")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("%s %s is readable by other users; chmod 600 it", flag, path)
    return value


def resolve_secret(flag: str, argv_value: str | None, path: str | None, env_var: str) -> str | None:
    """The secret from `--X-file` (`path`), else `--X` (`argv_value`), else $env_var, else None."""
    if argv_value is not None and path is not None:
        raise SecretFileError(f"give {flag} or {flag}-file, not both")
    if path is not None:
        return read_secret_file(path, flag + "-file")
    if argv_value is not None:
        logger.warning("%s on the command line is visible to every user in `ps`; use %s-file or $%s",
                       flag, flag, env_var)
        return argv_value
    return os.environ.get(env_var) or None


__all__ = ["SecretFileError", "read_secret_file", "resolve_secret"]
