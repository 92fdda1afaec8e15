"""Passwords and tokens written into URLs (``https://user:password@host/...``) are never shown.

fsspec takes credentials in a URL's userinfo; a user who puts them there still expects
error files, messages, logs and the report to leave them out, as they leave out
``storage_options``. ``hide_url_secrets`` masks the secret part of every URL in a text:
``user:password@`` becomes ``user:***@`` and a lone token (``token@``) ``***@``; an object
store's ``key:secret@`` becomes ``***@``. Object stores' clients (s3fs, gcsfs, adlfs) take no
credentials there, nor do local files: ``url_credentials_refusal`` says so before one tries
(s3fs took ``key:secret@bucket`` for a bucket name and repeated it, unmasked, in its error).

An HTTP(S) URL's query string is a credential too: a presigned URL carries its signature, the
access key and often an STS session token there (``?X-Amz-Signature=...&X-Amz-Security-Token
=...``; GCS's ``X-Goog-Signature``, an Azure SAS's ``sig``). Every value in it is shown as
``***``, names kept (``?X-Amz-Signature=***``), so a message still says which file and which
kind of URL. Other schemes' "?" is part of a file or object name and stays.
"""

from __future__ import annotations

import logging
import re

# ``:/+``: a URL that went through a path's normalization keeps one slash (https:/user:pw@h).
_SCHEME = re.compile(r"\b(?P<name>[A-Za-z][A-Za-z0-9+.-]*):/+")
# Not in a userinfo's user part (nor in a lone token): what starts a path, a query or a
# fragment, white space and quotes. A secret may hold any of them (an AWS secret key holds
# "/", a password a quote or an "@"), so a secret runs to the "@" before the host.
_NOT_IN_USER = re.compile(r"[/?#\s'\"]")

# Schemes whose query strings carry credentials (presigned URLs, SAS tokens).
_QUERY_SCHEMES = ("http", "https")
# Where a URL's text ends in a message: white space or a quote.
_URL_END = re.compile(r"[\s'\"]")
# One query parameter's value: up to the next "&" or "#", or a row source's ":<line>:" suffix
# (``...?sig=abc:3: bad row``; a signature, a key id or a token holds no unencoded ":").
_QUERY_VALUE = re.compile(r"=[^&#]*?(?=[&#]|:\d+:|$)")
_BARE_TOKEN = re.compile(r"^.+?(?=:\d+:|$)")

# Schemes whose fsspec clients read credentials only from their options or the environment
# (object stores), or take none at all (local files).
_NO_URL_CREDENTIALS = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "file", "local")


def _userinfo_end(text: str, start: int) -> int | None:
    """The index in ``text`` of the "@" that ends the userinfo (``user:secret`` or a lone
    token) of the URL whose ``scheme://`` ends at ``start``, or None when it has none: the
    last "@" before the first "/", "?" or "#" that follows its first "@"
    (``alice:p@ss@host/x``, ``KEY:SEC/RET@bucket/x``), with no path character or white space
    before its first ":" (``s3://bucket/a@b.jsonl`` is a key with an "@" in it)."""
    first = text.find("@", start)
    if first < 0:
        return None
    ends = [i for i in (text.find(c, first) for c in "/?#") if i >= 0]
    at = text.rfind("@", start, min(ends, default=len(text)))
    colon = text.find(":", start, at)
    return None if _NOT_IN_USER.search(text, start, at if colon < 0 else colon) else at


def _masked(scheme: str, info: str) -> str:
    """A userinfo with its secret as ``***``; an object store's whole (its "user" is an
    access key id)."""
    user, colon, _ = info.partition(":")
    if colon and scheme.lower() not in _NO_URL_CREDENTIALS:
        return f"{user}:***"
    return "***"


def url_credentials_refusal(key: str, url: str) -> str | None:
    """The error for ``url`` (the job spec's ``key``) when it is an object store's or a
    local file's URL with credentials in it; None when it is not."""
    match = _SCHEME.match(url)
    if match is None or match["name"].lower() not in _NO_URL_CREDENTIALS:
        return None
    if _userinfo_end(url, match.end()) is None:
        return None
    scheme = match["name"]
    section = key.split(".")[0]
    shown = f"{key} {hide_url_secrets(url)!r} carries credentials in the URL, which {scheme}://"
    if scheme.lower() in ("file", "local"):
        return f"{shown} does not take (a local file has none); remove them"
    return (
        f"{shown} does not take; remove them and put them in {section}.storage_options (key, "
        "secret) or the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...)"
    )


def hide_url_secrets(text: str) -> str:
    """``text`` with the userinfo secret of every URL in it, and every query value of an
    HTTP(S) URL in it, replaced by ``***``."""
    return _hide_query_values(_hide_userinfo(text))


def _hide_userinfo(text: str) -> str:
    """``text`` with the userinfo secret of every URL in it replaced by ``***``."""
    if "@" not in text:
        return text
    out, done = [], 0
    for match in _SCHEME.finditer(text):
        if match.start() < done:
            continue  # (inside a secret already masked)
        at = _userinfo_end(text, match.end())
        if at is None:
            continue
        out += [text[done : match.end()], _masked(match["name"], text[match.end() : at])]
        done = at
    return "".join(out) + text[done:]


def without_query(url: str) -> str:
    """``url`` without its query string and fragment where it is an HTTP(S) URL (a presigned
    URL's signature and token), for names built from it: a row's id. Other URLs whole."""
    match = _SCHEME.match(url)
    if match is None or match["name"].lower() not in _QUERY_SCHEMES:
        return url
    return url.split("?", 1)[0].split("#", 1)[0]


def _hide_query_values(text: str) -> str:
    """``text`` with every query value of its HTTP(S) URLs as ``***`` (a part with no "=",
    a bare token, as ``***`` whole)."""
    if "?" not in text:
        return text
    out, done = [], 0
    for match in _SCHEME.finditer(text):
        if match["name"].lower() not in _QUERY_SCHEMES or match.start() < done:
            continue
        end = _URL_END.search(text, match.end())
        stop = len(text) if end is None else end.start()
        start = text.find("?", match.end(), stop)
        if start < 0:
            continue
        out += [text[done : start + 1], _masked_query(text[start + 1 : stop])]
        done = stop
    return "".join(out) + text[done:]


def _masked_query(query: str) -> str:
    """A query string (and what follows it up to the URL's end) with its values as ``***``."""
    fragment = query.find("#")
    tail = ""
    if fragment >= 0:
        query, tail = query[:fragment], query[fragment:]
    parts = []
    for part in query.split("&"):
        if "=" in part:
            parts.append(_QUERY_VALUE.sub("=***", part, count=1))
        elif part:  # a bare token (a row source's ":<line>:" suffix kept)
            parts.append(_BARE_TOKEN.sub("***", part, count=1))
        else:
            parts.append(part)
    return "&".join(parts) + tail


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
