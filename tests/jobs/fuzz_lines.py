"""Generating fuzzed job input: good rows and malformed lines, each tagged with why it is bad.

    _Fuzzer(seed) ──► Line(data, kind, category, ...) ──► write_input ──► in/a.jsonl,
        in/b.jsonl.gz, in/c.ndjson (rows in that order; line 1 of each is good)

Every malformed line is built to be invalid for one clear reason; blank lines are not rows. A
row claims its id even when it is bad, so a later row with that id is a duplicate.
"""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
FILES = ("a.jsonl", "b.jsonl.gz", "c.ndjson")
MAX_TOKENS = 4
BLANKS = (b"", b" ", b"\t", b"\r", b" \t\r\x0b\x0c ")  # bytes.strip() leaves nothing: not rows

# Text the generators draw from: controls, RTL marks, emoji with joiners, combining marks, a
# BOM, line separators JSON does not escape, noncharacters. No surrogates: those are added
# on purpose, one at a time, so they are always unpaired.
ODD_CHARS = (
    "\x00\x01\x1f\x7f\t\r\n\x85 \u00a0\u200b\u200d\u200e\u200f\u202a\u202e\u2066\u061c"
    "\u2028\u2029\ufeff\ufffd\uffff\U0010ffff\u05d0\u0627e\u0301\u4e2d\U0001f600"
    "\U0001f3f3\ufe0f\u200d\U0001f308\U0001f469\u200d\U0001f467"
)
LONE_SURROGATES = ("\ud800", "\udfff", "\udbff", "\udc00", "\udc00\ud800")
INVALID_UTF8 = (b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xe2\x82")
ROLES = ("system", "user", "assistant", "tool")


class Raw(str):
    """JSON text written as it is (5000-digit numbers, 1e999, NaN)."""


@dataclass(frozen=True)
class Line:
    data: bytes  # without the line break
    kind: str  # "good" | "bad" | "blank"
    category: str
    row_id: str | None = None  # good rows: the id the output carries
    topic: Any = None  # good rows: the passthrough value the output carries


class Fuzzer:
    """Builds lines for a plain chat job (``batch`` False) or an OpenAI Batch job.

    ``empty_objects`` allows {} inside good rows' passthrough values (Parquet cannot store
    them yet: see test_parquet_passthrough_empty_object_is_written).
    """

    def __init__(self, seed: int, batch: bool, empty_objects: bool = True) -> None:
        self.rng = random.Random(seed)
        self.batch = batch
        self.empty_objects = empty_objects
        self.good_ids: list[Any] = []  # the JSON values good rows used as ids
        self.good_keys: set[str] = set()  # the same as output ids
        self.claimed: list[str] = []  # ids of bad rows that certainly claimed them
        self.serial = 0
        self.topic_shape = "any"  # any | records | scalars: see topic()
        self.scalar_kind = 0

    # -- text ----------------------------------------------------------------------------

    def text(self, n: int) -> str:
        pool = ODD_CHARS if self.rng.random() < 0.5 else 'abcxyz0129 {}[]":,\\'
        return "".join(self.rng.choice(pool) for _ in range(self.rng.randrange(n + 1)))

    def lone(self) -> str:
        s, at = self.text(6), self.rng.randrange(7)
        return s[:at] + self.rng.choice(LONE_SURROGATES) + s[at:]

    def dumps(self, value: Any) -> str:
        """JSON text with random JSON whitespace; surrogates come out as \\uXXXX escapes."""
        ws = self.rng.choice(("", "", " ", "\t", "\r", " \r\t"))
        if isinstance(value, Raw):
            return str(value)
        if isinstance(value, dict):
            items = [f"{self.dumps(str(k))}{ws}:{ws}{self.dumps(v)}" for k, v in value.items()]
            return "{" + ws + f"{ws},{ws}".join(items) + ws + "}"
        if isinstance(value, list):
            return "[" + ws + f"{ws},{ws}".join(self.dumps(v) for v in value) + ws + "]"
        if isinstance(value, str):
            try:
                value.encode("utf-8")
                return json.dumps(value, ensure_ascii=self.rng.random() < 0.3)
            except UnicodeEncodeError:
                return json.dumps(value)  # ensure_ascii: lone surrogates as escapes
        return json.dumps(value)  # numbers (NaN, Infinity), booleans, null

    def line(self, value: Any) -> bytes:
        data = self.dumps(value).encode("utf-8")
        return data + b"\r" if self.rng.random() < 0.1 else data  # CRLF line ends

    def odd_value(self, depth: int = 0, surrogate: bool = False) -> Any:
        """Any JSON value; with ``surrogate``, one lone surrogate somewhere inside."""
        r = self.rng
        kind = r.randrange(10 if depth < 6 else 6)
        if surrogate and (kind < 6 or depth > 8):
            return self.lone() if r.random() < 0.7 else {self.lone(): 1}
        choices: list[Any] = [
            None,
            r.choice([True, False]),
            r.choice([0, -1, 2**63, -(2**64), 10**100, int("7" * r.randrange(1, 1000))]),
            r.choice([0.5, -0.0, 1e308, 5e-324, float("inf"), float("-inf"), float("nan")]),
            self.text(12),
            Raw(r.choice(["1e999", "-1E400", "NaN", "Infinity", "1.0e-400"])),
        ]
        if kind < 6:
            return choices[kind]
        n = r.randrange(4)
        slot = r.randrange(n) if surrogate and n else -1
        if kind < 8:
            items = [self.odd_value(depth + 1, surrogate and i == slot) for i in range(n)]
            return items if items or not surrogate else [self.odd_value(depth + 1, True)]
        obj = {self.text(4) + str(i): self.odd_value(depth + 1, i == slot) for i in range(n)}
        if surrogate and not n:
            obj = {"k": self.odd_value(depth + 1, True)}
        if not obj and not self.empty_objects:
            return {"k": None}
        return obj

    def topic(self) -> Any:
        """A passthrough value. Values of one shape across a shard let Arrow infer a real
        type (struct, int64, ...) instead of falling back to JSON strings for the column."""
        r = self.rng
        if r.random() < 0.15:
            return None
        if self.topic_shape == "records":
            keys = r.sample(["a", "b", "", "\x00", "\u202e"], r.randrange(6))
            record = {
                k: [r.randrange(9)] * r.randrange(3) if k == "b" else self.text(5) for k in keys
            }
            return record if record or self.empty_objects else {"a": None}
        if self.topic_shape == "scalars":
            if self.scalar_kind == 0:
                past_int64 = r.random() < 0.03  # the column falls back to strings
                return 2**63 if past_int64 else r.choice([0, -(2**63), 2**63 - 1, r.randrange(99)])
            if self.scalar_kind == 1:
                return r.choice([0.5, float("nan"), float("-inf"), -0.0, 1e308])
            if self.scalar_kind == 2:
                return self.text(12)
            if self.scalar_kind == 3:
                return r.choice([True, False])
            return [r.randrange(-5, 5) for _ in range(r.randrange(4))]
        return self.odd_value()

    def messages(self) -> list[dict[str, Any]]:
        out = []
        for _ in range(self.rng.randrange(1, 4)):
            m: dict[str, Any] = {"role": self.rng.choice(ROLES), "content": self.text(40)}
            if self.rng.random() < 0.2:
                m["name"] = self.text(5)
            if self.rng.random() < 0.2:
                m["tool_call_id"] = None  # null keys are dropped
            out.append(m)
        return out

    # -- good rows -----------------------------------------------------------------------

    def new_id(self) -> tuple[Any, str]:
        """A fresh good id: (its JSON value, the id the output shows)."""
        self.serial += 1
        n, r = self.serial, self.rng
        choice = r.randrange(6) if not self.batch else 0
        if choice == 1:
            return 7_000_000 + n, str(7_000_000 + n)
        if choice == 2:
            return float(8_000_000 + n), str(8_000_000 + n)
        if choice == 3:  # integer ids up to Python's 4300-digit limit are fine
            digits = str(r.randrange(1, 10)) + "".join(
                r.choices("0123456789", k=r.randrange(300, 4000))
            )
            return Raw(digits), digits
        if choice == 4:  # an escaped surrogate *pair* is one valid character
            return Raw(f'"g{n}-\\ud83d\\ude00"'), f"g{n}-\U0001f600"
        key = f"{'c' if self.batch else 'g'}{n}-{self.text(6)}"
        return key, key

    def good_row(self, row_id: Any) -> dict[str, Any]:
        r = self.rng
        if self.batch:
            return self.good_batch(row_id)
        row: dict[str, Any] = {"id": row_id, "messages": self.messages()}
        if r.random() < 0.8:
            row["topic"] = self.topic()
        if r.random() < 0.3:
            row["prompt"] = self.odd_value()  # not read: messages_column is set
        if r.random() < 0.3:
            row[self.text(5) + "x"] = self.odd_value()
        return dict(r.sample(list(row.items()), len(row)))

    def good_batch(self, custom_id: Any) -> dict[str, Any]:
        r = self.rng
        url = CHAT if r.random() < 0.7 else COMPLETIONS
        body: dict[str, Any] = {}
        if url == CHAT:
            body["messages"] = self.messages()
            if r.random() < 0.3:
                body["logprobs"] = True
                body["top_logprobs"] = r.randrange(21)
        else:
            body["prompt"] = "p" + self.text(30)
            if r.random() < 0.3:
                body["logprobs"] = r.randrange(21)
        options: dict[str, Any] = {
            "model": self.odd_value(surrogate=r.random() < 0.3),  # ignored fields
            "user": self.text(8),
            "metadata": self.odd_value(),
            "store": r.choice([True, False]),
            "stream": False,
            "n": r.choice([1, 1.0]),
            "best_of": 1,
            "tools": [],
            "logit_bias": {},
            "response_format": {"type": "text"},
            "max_tokens": r.randrange(1, MAX_TOKENS + 1),
            "temperature": r.choice([0, 0.7, 2, 1e30, 5e-324]),
            "top_p": r.choice([1, 0.5, 1e-300]),
            "presence_penalty": r.choice([-2, 0, 2]),
            "frequency_penalty": r.uniform(-2, 2),
            "seed": r.choice([0, -1, 2**63 - 1, -(2**63)]),
            "stop": r.choice(["\x00", ["\u202e", "\U0001f600"], []]),
            self.text(6) + "_unknown": None,  # null fields are skipped
        }
        for key in r.sample(sorted(options), r.randrange(len(options) + 1)):
            body[key] = options[key]
        if "max_tokens" in body and r.random() < 0.3 and url == CHAT:
            body["max_completion_tokens"] = body["max_tokens"]
        line = {"custom_id": custom_id, "method": "POST", "url": url, "body": body}
        if r.random() < 0.3:
            line["topic"] = self.odd_value()
        return dict(r.sample(list(line.items()), len(line)))

    def good(self) -> Line:
        value, key = self.new_id()
        while key in self.good_keys:
            value, key = self.new_id()
        self.good_ids.append(value)
        self.good_keys.add(key)
        row = self.good_row(value)
        topic = None if self.batch else json.loads(self.dumps(row.get("topic")))
        return Line(self.line(row), "good", "good", key, topic)

    # -- malformed rows ------------------------------------------------------------------

    def bad(self) -> Line:
        categories = list(RAW_CATEGORIES) + list(
            BATCH_CATEGORIES if self.batch else PLAIN_CATEGORIES
        )
        while True:
            category = self.rng.choice(categories)
            made = getattr(self, "_" + category)()
            if made is not None:
                data, claim = made
                if claim is not None:
                    self.claimed.append(claim)
                return Line(data, "bad", category)

    def bad_id(self) -> str:
        self.serial += 1
        return f"b{self.serial}-{self.text(4)}"

    def ok_row(self, row_id: Any) -> dict[str, Any]:
        """A row that would be good but for ``row_id`` or one field a caller then spoils."""
        return self.good_row(row_id)

    # Lines that are not readable JSON objects; the same in every format.
    def _invalid_utf8(self) -> tuple[bytes, None]:
        data = bytearray(self.line(self.ok_row(self.bad_id())))
        at = self.rng.randrange(len(data) + 1)
        data[at:at] = self.rng.choice(INVALID_UTF8)
        return bytes(data), None

    def _random_bytes(self) -> tuple[bytes, None]:
        pool = bytes(b for b in range(256) if b != 0x0A)
        data = bytes(self.rng.choices(pool, k=self.rng.randrange(1, 200)))
        if self.rng.random() < 0.2:
            data = b"\xef\xbb\xbf" + data
        return (data if data.strip() else data + b"#"), None

    def _nul_byte(self) -> tuple[bytes, None]:
        data = self.line(self.ok_row(self.bad_id())).rstrip(b"\r")
        at = self.rng.randrange(len(data) + 1)
        return data[:at] + b"\x00" + data[at:], None  # NUL is never valid JSON text

    def _bom_not_line_one(self) -> tuple[bytes, None]:
        # A mark before a good row is dropped (files joined with cat); alone, or before a
        # line bad for another reason, the line is a bad row.
        text = self.dumps(self.ok_row(self.bad_id()))
        cut = self.rng.choice((0, self.rng.randrange(1, len(text))))
        return b"\xef\xbb\xbf" + text[:cut].encode("utf-8"), None

    def _not_json_whitespace(self) -> tuple[bytes, None]:
        # Space to str.isspace() but not to bytes.strip() (so a row), and never to JSON.
        space = self.rng.choice(("\x1c", "\x1f", "\u2028", "\u00a0", "\x85", "\u3000"))
        if self.rng.random() < 0.5:
            return (space * 3).encode("utf-8"), None
        lead = self.rng.choice((space, "\x0b", "\x0c"))  # \x0b, \x0c alone would be blank
        return lead.encode("utf-8") + self.line(self.ok_row(self.bad_id())), None

    def _truncated(self) -> tuple[bytes, None]:
        text = self.dumps(self.ok_row(self.bad_id()))
        return text[: self.rng.randrange(1, len(text))].encode("utf-8"), None

    def _trailing_garbage(self) -> tuple[bytes, None]:
        tail = self.rng.choice(("x", "}", ",", "{}", '{"id": 1}', "]", "\x00", "// c"))
        return (self.dumps(self.ok_row(self.bad_id())) + " " + tail).encode("utf-8"), None

    def _huge_number(self) -> tuple[bytes, None]:
        digits = "9" * self.rng.choice((4301, 5000, 20000))
        return self.line(self.rng.choice([Raw(digits), {"id": Raw(digits)}])), None

    def _json_not_object(self) -> tuple[bytes, None]:
        value = self.odd_value(surrogate=self.rng.random() < 0.3)
        if isinstance(value, dict):
            value = [value]
        return self.line(value), None

    def _deep_nesting(self) -> tuple[bytes, None]:
        n = self.rng.choice((50, 500, 990, 1000, 5000, 100_000))
        r = self.rng.random()
        if r < 0.4:
            text = "[" * n + "]" * n
        elif r < 0.6:
            text = "[" * n  # never closed
        else:  # an object without an id (or messages), if it parses at all
            text = '{"a":' * n + "1" + "}" * n
        return text.encode(), None

    # Plain rows with a bad id, bad messages or text that cannot be written.
    def _id_wrong_type(self) -> tuple[bytes, None]:
        bad = self.rng.choice(
            [[1], ["g1"], {"id": "x"}, True, False, 1.5, 1e-5, None, "", float("nan"),
             Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e999"), "absent"]
        )  # fmt: skip
        row = self.ok_row("x")
        if bad == "absent":
            del row["id"]
        else:
            row["id"] = bad
        return self.line(row), None

    def _id_surrogate(self) -> tuple[bytes, None]:
        # Not claimed: test_row_refused_for_surrogates_still_claims_its_id.
        return self.line(self.ok_row(self.lone())), None

    def _messages_wrong(self) -> tuple[bytes, str]:
        row_id = self.bad_id()
        row = self.ok_row(row_id)
        row["messages"] = self.bad_messages()
        if row["messages"] == "absent":
            del row["messages"]
        return self.line(row), row_id

    def bad_messages(self) -> Any:
        r = self.rng
        good = self.messages()
        at = r.randrange(len(good) + 1)
        spoiled = [
            self.text(10), 5, None, {}, [], True, "absent", {"role": "user", "content": "x"},
            [1, "x", None, []], [["user", "x"]],
            good[:at] + [{"role": r.choice(["User", "Developer", "function", "", " user",
                                             "user\x00", None, 5, ["user"], self.lone()]),
                          "content": "x"}] + good[at:],
            good[:at] + [{"role": "user", "content": r.choice([None, 5, 1.5, True, [], {},
                          [{"type": "image_url"}], [{"type": "text"}], float("nan")])}]
                         + good[at:],
            good[:at] + [{"content": "x"}] + good[at:],
            good[:at] + [{"role": "user"}] + good[at:],
        ]  # fmt: skip
        return r.choice(spoiled)

    def _content_surrogate(self) -> tuple[bytes, str]:
        row_id = self.bad_id()
        row = self.ok_row(row_id)
        messages = row["messages"] if not self.batch else row["body"].get("messages")
        if messages is None:
            row["body"]["prompt"] = self.lone()
        else:
            messages[self.rng.randrange(len(messages))]["content"] = self.lone()
        return self.line(row), row_id

    def _message_key_surrogate(self) -> tuple[bytes, str]:
        row_id = self.bad_id()
        row = self.ok_row(row_id)
        key, value = (self.lone(), "x") if self.rng.random() < 0.5 else ("name", self.lone())
        row["messages"][0][key] = value
        return self.line(row), row_id

    def _passthrough_surrogate(self) -> tuple[bytes, str]:
        row_id = self.bad_id()
        row = self.ok_row(row_id)
        if self.rng.random() < 0.2:  # deeper than the reader walks messages, shallower than
            depth = self.rng.randrange(201, 900)  # json's recursion limit
            row["topic"] = Raw("[" * depth + json.dumps(self.lone()) + "]" * depth)
        else:
            row["topic"] = self.odd_value(surrogate=True)  # at most ~10 levels deep
        return self.line(row), row_id

    def _prompt_too_long(self) -> tuple[bytes, str]:
        row_id = self.bad_id()
        row = self.ok_row(row_id)
        long = "x" * self.rng.randrange(1100, 3000)  # over the model's 1024 positions
        target = row if not self.batch else row["body"]
        if "messages" in target:
            target["messages"][-1]["content"] = long
        else:
            target["prompt"] = long
        return self.line(row), row_id

    def _duplicate_of_good(self) -> tuple[bytes, None] | None:
        if not self.good_ids:
            return None
        row_id = self.rng.choice(self.good_ids)
        if isinstance(row_id, int) and self.rng.random() < 0.5:
            row_id = self.rng.choice([str(row_id), float(row_id)])  # the same id
        elif isinstance(row_id, float):
            row_id = self.rng.choice([str(int(row_id)), int(row_id)])
        return self.line(self.ok_row(row_id)), None

    def _duplicate_of_bad(self) -> tuple[bytes, None] | None:
        if not self.claimed:
            return None
        return self.line(self.ok_row(self.rng.choice(self.claimed))), None

    # OpenAI Batch lines with a bad envelope or body.
    def _custom_id_wrong(self) -> tuple[bytes, None]:
        row = self.ok_row("x")
        bad = self.rng.choice([None, "", 5, 5.0, True, [], {}, ["c"], Raw("9" * 50), "absent"])
        if bad == "absent":
            del row["custom_id"]
        else:
            row["custom_id"] = bad
        return self.line(row), None

    def _custom_id_surrogate(self) -> tuple[bytes, None]:
        return self.line(self.ok_row(self.lone())), None

    def _envelope_wrong(self) -> tuple[bytes, str]:
        row_id = self.bad_id()
        row = self.ok_row(row_id)
        key = self.rng.choice(["method", "url", "body"])
        bad = {
            "method": ["GET", "post", "", None, 1, ["POST"], "POST ", "absent"],
            "url": ["/v1/embeddings", "", None, 5, CHAT + "/", "/V1/CHAT/COMPLETIONS",
                    " " + COMPLETIONS, "https://api.openai.com" + CHAT, "absent"],
            "body": [None, [], "{}", 5, True, "absent"],
        }[key]  # fmt: skip
        row[key] = self.rng.choice(bad)
        if row[key] == "absent":
            del row[key]
        return self.line(row), row_id

    def _body_field_wrong(self) -> tuple[bytes, str]:
        row_id = self.bad_id()
        row = self.ok_row(row_id)
        body, chat = row["body"], row["url"] == CHAT
        choices: list[tuple[str, Any]] = [
            ("temprature", 0.5), ("functions", []), (self.lone(), 1), ("", 0), ("echo", True),
            ("prompt" if chat else "messages", "x"), ("n", 129), ("n", True), ("n", 0),
            ("n", 2.5), ("best_of", 0), ("best_of", 129), ("best_of", True),
            ("prompt_logprobs", 21), ("prompt_logprobs", -1), ("tools", [{"type": "function"}]),
            ("logit_bias", {"5": 101}), ("logit_bias", {"x": 1}), ("logit_bias", [5]),
            ("response_format", {"type": "xml"}), ("stream", True), ("stream", 0),
            ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", "4"),
            ("max_tokens", True), ("max_tokens", Raw("1e999")),
            ("temperature", -0.01), ("temperature", "hot"), ("temperature", True),
            ("temperature", 1e308),
            ("temperature", Raw("NaN")), ("temperature", Raw("Infinity")), ("temperature", []),
            ("top_p", 0), ("top_p", -0.5), ("top_p", 1.0000001), ("top_p", Raw("NaN")),
            ("top_p", "1"), ("presence_penalty", 2.01), ("frequency_penalty", -2.5),
            ("presence_penalty", Raw("-1e999")), ("frequency_penalty", "0"),
            ("seed", 1.5), ("seed", "1"), ("seed", True), ("seed", Raw("NaN")), ("seed", 2**64),
            ("seed", -(2**63) - 1), ("seed", 10**40),
            ("stop", ""), ("stop", [""]), ("stop", [1]), ("stop", ["a", None]), ("stop", {}),
            ("stop", 5), ("stop", self.lone()), ("stop", ["ok", self.lone()]),
        ]  # fmt: skip
        if chat:
            choices += [
                ("logprobs", 1), ("logprobs", "true"), ("logprobs", 0), ("logprobs", []),
                ("top_logprobs", 21), ("top_logprobs", -1), ("top_logprobs", 1.5),
                ("max_completion_tokens", 0), ("max_completion_tokens", "2"),
            ]  # fmt: skip
        else:
            choices += [("logprobs", 21), ("logprobs", -1), ("logprobs", True), ("logprobs", 1.5),
                        ("max_completion_tokens", 2), ("top_logprobs", 2)]  # fmt: skip
        name, value = self.rng.choice(choices)
        body[name] = value
        if chat and name == "top_logprobs":
            body["logprobs"] = True
        if self.rng.random() < 0.2 and chat:  # one of the two ways the pair is refused
            body.pop("max_completion_tokens", None)
            if self.rng.random() < 0.5:
                body.update(max_tokens=2, max_completion_tokens=3)
            else:
                body.update(top_logprobs=3, logprobs=self.rng.choice([False, None]))
        if name == "stop" and not encodable(value):
            return self.line(row), row_id  # refused as unwritable, and claimed
        return self.line(row), row_id

    def _body_messages_wrong(self) -> tuple[bytes, str]:
        row_id = self.bad_id()
        row = self.ok_row(row_id)
        if row["url"] == CHAT:
            row["body"]["messages"] = self.bad_messages()
            if row["body"]["messages"] == "absent":
                del row["body"]["messages"]
        else:
            row["body"]["prompt"] = self.rng.choice(
                [[1, -2], ["a", "b"], "", None, 5, {}, True, [1.5]]
            )
        return self.line(row), row_id


RAW_CATEGORIES = (
    "invalid_utf8", "random_bytes", "nul_byte", "bom_not_line_one", "not_json_whitespace",
    "truncated", "trailing_garbage", "huge_number", "json_not_object", "deep_nesting",
)  # fmt: skip
PLAIN_CATEGORIES = (
    "id_wrong_type", "id_surrogate", "messages_wrong", "content_surrogate",
    "message_key_surrogate", "passthrough_surrogate", "prompt_too_long",
    "duplicate_of_good", "duplicate_of_bad",
)  # fmt: skip
BATCH_CATEGORIES = (
    "custom_id_wrong", "custom_id_surrogate", "envelope_wrong", "body_field_wrong",
    "body_field_wrong", "body_messages_wrong", "content_surrogate", "prompt_too_long",
    "duplicate_of_good", "duplicate_of_bad",
)  # fmt: skip


def write_input(folder: Path, fuzzer: Fuzzer, n_good: int, n_bad: int) -> dict[str, list[Line]]:
    """Write FILES into ``folder``: good and bad rows in random order, blank lines between.

    Line 1 of each file is a good row (JSONL files take their columns from the first object);
    in b.jsonl.gz it starts with a byte-order mark, which the reader drops on line 1 only.
    """
    rng = fuzzer.rng
    slots = ["good"] * (n_good - len(FILES)) + ["bad"] * n_bad
    rng.shuffle(slots)
    third = len(slots) // 3
    cut = [third + rng.randrange(-9, 9), 2 * third + rng.randrange(-9, 9)]
    chunks = [slots[a:b] for a, b in zip([0, *cut], [*cut, len(slots)], strict=True)]
    plan: dict[str, list[Line]] = {}
    for name, chunk, shape in zip(FILES, chunks, ("any", "records", "scalars"), strict=True):
        fuzzer.topic_shape, fuzzer.scalar_kind = shape, rng.randrange(5)
        first = fuzzer.good()
        if name.endswith(".gz"):
            first = replace(first, data=b"\xef\xbb\xbf" + first.data)
        lines = [first]
        for slot in chunk:
            if rng.random() < 0.05:
                lines.append(Line(rng.choice(BLANKS), "blank", "blank"))
            lines.append(fuzzer.good() if slot == "good" else fuzzer.bad())
        plan[name] = lines
        data = b"\n".join(line.data for line in lines) + b"\n"
        path = folder / name
        path.write_bytes(gzip.compress(data, mtime=0) if name.endswith(".gz") else data)
    return plan


def encodable(value: Any) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
