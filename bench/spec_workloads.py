"""Input-grounded chat workloads for speculative decoding benchmarks (no data files needed).

Each workload builds its own prompts, deterministic from a seed, where a good answer copies
much of its input, as batch jobs often do:

    copy_edit       fix the spelling in a paragraph (the answer is the paragraph, fixed)
    extraction      pull a record's fields out of a short report as JSON
    summarization   summarize a passage, quoting it (partly copied)
    code_edit       rename a function's variable and return the whole function
    records         the same JSON schema row after row (a structured job; rows differ)
    open_chat       questions with nothing to copy (bench/prompts.py), the control
    random_text     random letters in random words, to continue (nothing to copy or to learn)

    from bench.spec_workloads import WORKLOADS
    conversations = WORKLOADS["copy_edit"](64)
"""

from __future__ import annotations

import random
from collections.abc import Callable

from bench.prompts import chat_prompts

Conversation = list[dict[str, str]]

_NAMES = ["Ada Park", "Bruno Diaz", "Chen Wei", "Dana Okafor", "Eli Novak", "Farah Haddad"]
_CITIES = ["Lisbon", "Osaka", "Nairobi", "Toronto", "Lyon", "Perth", "Quito", "Oslo"]
_ITEMS = ["solar panels", "bicycles", "coffee beans", "laptops", "wool coats", "tea sets"]
_SENTENCES = [
    "The committee met on {day} to review the budget for the new library in {city}.",
    "{name} presented the plan, which includes a reading room and a small cafe.",
    "Several members asked how the project would be funded over the next five years.",
    "The answer was a mix of city grants, private donations and a modest fee for events.",
    "After a long discussion the committee approved the first phase of construction.",
    "Work is expected to start in the spring and to finish before the end of next year.",
    "Local schools will be invited to help design the children's section of the library.",
    "The next meeting will decide on the architect and on the order of the remaining work.",
]
_TYPOS = {
    "the": "teh",
    "which": "wich",
    "budget": "budjet",
    "library": "libary",
    "committee": "commitee",
    "expected": "expectd",
    "before": "befor",
    "design": "desing",
}
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]


def _paragraph(rng: random.Random, sentences: int) -> str:
    picked = rng.sample(_SENTENCES, sentences)
    fill = {"day": rng.choice(_DAYS), "city": rng.choice(_CITIES), "name": rng.choice(_NAMES)}
    return " ".join(s.format(**fill) for s in picked)


def copy_edit(n: int, seed: int = 0) -> list[Conversation]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = _paragraph(rng, rng.randint(3, 6))
        words = [_TYPOS.get(w, w) if rng.random() < 0.6 else w for w in text.split(" ")]
        ask = (
            "Fix the spelling mistakes in this paragraph. Reply with the corrected paragraph only."
        )
        out.append([{"role": "user", "content": f"{ask}\n\n{' '.join(words)}"}])
    return out


def extraction(n: int, seed: int = 0) -> list[Conversation]:
    rng = random.Random(seed + 1)
    out = []
    for i in range(n):
        name, city, item = rng.choice(_NAMES), rng.choice(_CITIES), rng.choice(_ITEMS)
        qty, price = rng.randint(2, 400), rng.randint(5, 900)
        report = (
            f"Order {1000 + i} was placed by {name} from {city} on {rng.choice(_DAYS)}. "
            f"The customer ordered {qty} {item} at {price} dollars each and asked for delivery "
            f"to the {city} warehouse. Contact: {name.split()[0].lower()}@example.com."
        )
        ask = (
            "Extract the order as JSON with the keys order_id, customer, city, item, quantity, "
            "unit_price and email. Reply with the JSON only."
        )
        out.append([{"role": "user", "content": f"{ask}\n\n{report}"}])
    return out


def summarization(n: int, seed: int = 0) -> list[Conversation]:
    rng = random.Random(seed + 2)
    ask = "Summarize this passage in two sentences, reusing its own words where you can."
    return [
        [{"role": "user", "content": f"{ask}\n\n{_paragraph(rng, rng.randint(5, 8))}"}]
        for _ in range(n)
    ]


_CODE = '''def {fn}({arg}, limit):
    """Return the {what} of the values in {arg} that are below limit."""
    total = 0
    count = 0
    for value in {arg}:
        if value < limit:
            total += value
            count += 1
    if count == 0:
        return 0
    return {ret}
'''


def code_edit(n: int, seed: int = 0) -> list[Conversation]:
    rng = random.Random(seed + 3)
    out = []
    for _ in range(n):
        fn = rng.choice(["small_mean", "low_average", "mean_below", "filtered_mean"])
        arg, new = rng.sample(["values", "items", "numbers", "data", "samples", "xs"], 2)
        what = rng.choice(["mean", "average"])
        code = _CODE.format(fn=fn, arg=arg, what=what, ret="total / count")
        ask = (
            f"Rename the parameter {arg} to {new} in this function. Reply with the whole function."
        )
        out.append([{"role": "user", "content": f"{ask}\n\n```python\n{code}```"}])
    return out


# The JSON schema the records workload asks for (bench/speculative.py --structured makes
# every row's output follow it).
RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "city", "age", "hobbies", "employed"],
    "additionalProperties": False,
}


def records(n: int, seed: int = 0) -> list[Conversation]:
    rng = random.Random(seed + 4)
    ask = (
        'Describe this person as JSON with exactly these keys: {"name": str, "city": str, '
        '"age": int, "hobbies": [str], "employed": bool}. Reply with the JSON only.'
    )
    out = []
    for _ in range(n):
        person = (
            f"{rng.choice(_NAMES)} is {rng.randint(19, 80)} and lives in {rng.choice(_CITIES)}. "
            f"They enjoy {rng.choice(['chess', 'hiking', 'painting', 'running'])} and "
            f"{rng.choice(['cooking', 'reading', 'music', 'gardening'])}."
        )
        out.append([{"role": "user", "content": f"{ask}\n\n{person}"}])
    return out


def open_chat(n: int, seed: int = 0) -> list[Conversation]:
    return chat_prompts(n, seed)


def random_text(n: int, seed: int = 0) -> list[Conversation]:
    rng = random.Random(seed + 5)
    letters = "abcdefghijklmnopqrstuvwxyz"
    out = []
    for _ in range(n):
        words = ("".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(40))
        out.append([{"role": "user", "content": "Continue this text: " + " ".join(words)}])
    return out


WORKLOADS: dict[str, Callable[[int], list[Conversation]]] = {
    "copy_edit": copy_edit,
    "extraction": extraction,
    "summarization": summarization,
    "code_edit": code_edit,
    "records": records,
    "open_chat": open_chat,
    "random_text": random_text,
}
