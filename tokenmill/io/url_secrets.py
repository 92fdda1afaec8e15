"""Passwords and tokens written into URLs (``https://user:password@host/...``) are never shown.

fsspec takes credentials in a URL's userinfo; a user who puts them there still expects
error files, messages, logs and the report to leave them out, as they leave out
``storage_options``. ``hide_url_secrets`` masks the secret part of every URL in a text:
``user:password@`` becomes ``user:***@`` and a lone token (``token@``) ``***@``.
Object stores' clients (s3fs, gcsfs, adlfs) take no credentials there: ``url_credentials_refusal``
says so before one tries (s3fs took ``key:secret@bucket`` for a bucket name and repeated it,
unmasked, in its error).
"""

from __future__ import annotations

import logging
import re

# ``:/+``: a URL that went through a path's normalization keeps one slash (https:/user:pw@h).
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*:/+)(?P<info>[^/?#@\s'\"]+)@")


def _masked(match: re.Match[str]) -> str:
    user, colon, _ = match["info"].partition(":")
    return f"{match['scheme']}{user}:***@" if colon else f"{match['scheme']}***@"


# Schemes whose fsspec clients read credentials only from their options or the environment.
_OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl")


def url_credentials_refusal(key: str, url: str) -> str | None:
    """The error for ``url`` (the job spec's ``key``) when it is an object store's URL with
    credentials in it; None when it is not."""
    match = _USERINFO.match(url)
    scheme = "" if match is None else match["scheme"].split(":")[0]
    if scheme.lower() not in _OBJECT_STORES:
        return None
    section = key.split(".")[0]
    return (
        f"{key} {hide_url_secrets(url)!r} carries credentials in the URL, which {scheme}:// "
        f"does not take; remove them and put them in {section}.storage_options (key, "
        "secret) or the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...)"
    )


def hide_url_secrets(text: str) -> str:
    """``text`` with the userinfo secret of every URL in it replaced by ``***``."""
    return _USERINFO.sub(_masked, text) if "@" in text else text


class HideUrlSecrets(logging.Filter):
    """A log handler's filter: records leave with the URL secrets in their text masked."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        hidden = hide_url_secrets(message)
        if hidden != message:
            record.msg, record.args = hidden, None
        if record.exc_info and record.exc_info[1] is not None:  # another handler may have
            text = record.exc_text or logging.Formatter().formatException(record.exc_info)
            record.exc_text = hide_url_secrets(text)  # formatted it already
        return True
