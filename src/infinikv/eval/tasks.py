"""Synthetic long-context retrieval tasks, generated locally with fixed seeds.

The passkey test (Mohtashami & Jaggi, 2023, https://arxiv.org/abs/2305.16300) and the RULER task families
(Hsieh et al., 2024, https://arxiv.org/abs/2404.06654) rebuilt from their published descriptions:

* ``passkey``: a 5-digit key in repeated filler text; exact match.
* ``niah_single_1/2/3``: one needle "One of the special magic numbers for <key> is: <value>." in filler
  (1) or essays (2, 3); word key, number value (1, 2) or UUID value (3).
* ``niah_multikey_1/2/3``: the queried needle among distractor needles with other keys: 3 distractors in
  essays (1); a haystack made entirely of needles (2, numbers; 3, UUID keys and values).
* ``niah_multivalue``: four values for the same key, all to be recalled.
* ``niah_multiquery``: four keys asked at once.
* ``vt``: variable tracking, a chain ``VAR A = 12345``, ``VAR B = VAR A`` ... hidden in filler; name every
  variable that holds the value.
* ``cwe``: common-words extraction, a numbered list where ten words repeat often and the rest rarely.
* ``fwe``: frequent-words extraction, coded words drawn from a Zipf distribution; name the three most
  frequent.

A sample's text is sized to the requested context in the model's own tokens (prompt plus the answer it may
generate). The queried needle sits at the requested depth (fraction of the haystack, at a sentence
boundary); other needles sit at seeded random places. Everything is a function of (task, context, depth,
seed), so runs are reproducible.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

from ..data import load_corpus
from ..errors import InputError
from .wordlists import ADJECTIVES, NOUNS

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@dataclass(frozen=True)
class Sample:
    """One prompt. ``context`` is fed by prefill; ``question`` goes through the decode path; the model then
    continues after ``answer_prefix``. ``answers`` are the reference strings for ``metric``."""

    task: str
    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    metric: str  # "passkey_exact", "string_match_all" or "string_match_part"
    max_new_tokens: int
    depth: float | None
    seed: int
    needle_offsets: tuple[int, ...] = field(default=(), compare=False)  # where the queried needles start


# -- building blocks -----------------------------------------------------------------------------------------
def _word_key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


@cache
def essay_sentences() -> tuple[str, ...]:
    """The essay corpus split into sentences (haystack units)."""
    text = re.sub(r"\s+", " ", load_corpus("essays"))
    return tuple(s for s in re.split(r"(?<=[.!?]) ", text) if s)


@cache
def essay_words() -> tuple[str, ...]:
    """Distinct lowercase words of 4 to 10 letters from the essays (the vocabulary of ``cwe``)."""
    return tuple(sorted({w.lower() for w in re.findall(r"\b[a-zA-Z]{4,10}\b", load_corpus("essays"))}))


def _coded_word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 6)))


class _Fitter:
    """Finds the largest haystack (in units) whose full prompt, with room for the answer, fits the context."""

    def __init__(self, count_tokens: Callable[[str], int], context: int, overhead: int):
        self.count_tokens = count_tokens
        self.context = context
        self.overhead = overhead

    def largest(self, render: Callable[[int], str], limit: int, tail: str, answer_tokens: int) -> int:
        """``render(n)``: the prompt with n haystack units; ``tail``: question and answer prefix."""
        budget = self.context - self.overhead - answer_tokens

        def fits(n: int) -> bool:
            return self.count_tokens(render(n) + tail) <= budget

        if not fits(0):
            raise InputError(f"a context of {self.context} tokens is too small for this task")
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo


def _insert(units: list[str], needles: list[tuple[float, str]]) -> tuple[str, list[int]]:
    """Join ``units`` with spaces, inserting each (depth, needle) at the unit boundary nearest its depth.
    Returns the text and the character offset of each needle, in the order given."""
    slots: dict[int, list[int]] = {}
    for i, (depth, _) in enumerate(needles):
        slots.setdefault(round(depth * len(units)), []).append(i)
    pieces: list[str] = []
    offsets = [0] * len(needles)
    length = 0
    for position in range(len(units) + 1):
        for i in slots.get(position, []):
            offsets[i] = length
            pieces.append(needles[i][1])
            length += len(needles[i][1]) + 1
        if position < len(units):
            pieces.append(units[position])
            length += len(units[position]) + 1
    return " ".join(pieces), offsets


# -- task families -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Niah:
    haystack: str  # "noise", "essay" or "needles"
    key: str  # "word" or "uuid"
    value: str  # "number" or "uuid"
    keys: int = 1  # needles with different keys (the first is queried)
    values: int = 1  # values for the queried key
    queries: int = 1  # keys asked about
    passkey: bool = False


NIAH_TASKS: dict[str, _Niah] = {
    "passkey": _Niah("noise", "word", "number", passkey=True),
    "niah_single_1": _Niah("noise", "word", "number"),
    "niah_single_2": _Niah("essay", "word", "number"),
    "niah_single_3": _Niah("essay", "word", "uuid"),
    "niah_multikey_1": _Niah("essay", "word", "number", keys=4),
    "niah_multikey_2": _Niah("needles", "word", "number"),
    "niah_multikey_3": _Niah("needles", "uuid", "uuid"),
    "niah_multivalue": _Niah("essay", "word", "number", values=4),
    "niah_multiquery": _Niah("essay", "word", "number", keys=4, queries=4),
}


def _niah(name: str, spec: _Niah, fitter: _Fitter, depth: float, rng: random.Random, seed: int) -> Sample:
    if spec.passkey:
        value = _number(rng, 5)
        intro = (
            "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
            "I will quiz you about the important information there.\n"
        )
        needles = [(depth, f"The pass key is {value}. Remember it. {value} is the pass key.")]
        question, prefix = "\nWhat is the pass key?", "The pass key is"
        return _fill(
            name, fitter, intro, [NOISE] * 2000, needles, question, prefix, (value,), 12, depth, seed
        )

    make_key = _uuid if spec.key == "uuid" else _word_key
    make_value = _uuid if spec.value == "uuid" else _number
    kind = "uuids" if spec.value == "uuid" else "numbers"
    keys: list[str] = []
    while len(keys) < max(spec.keys, spec.queries):
        key = make_key(rng)
        if key not in keys:
            keys.append(key)
    queried = keys[: spec.queries]
    answers = [make_value(rng) for _ in range(spec.values * spec.queries)]
    # The first queried needle at the requested depth; the others at seeded random depths.
    needles: list[tuple[float, str]] = []
    for q, key in enumerate(queried):
        for v in range(spec.values):
            where = depth if q == v == 0 else rng.random()
            needles.append(
                (where, f"One of the special magic {kind} for {key} is: {answers[q * spec.values + v]}.")
            )
    for key in keys[spec.queries :]:
        needles.append((rng.random(), f"One of the special magic {kind} for {key} is: {make_value(rng)}."))
    if spec.haystack == "noise":
        units = [NOISE] * 2000
    elif spec.haystack == "essay":
        units = list(essay_sentences())
    else:  # a haystack of needles with other keys
        units = []
        while len(units) < 3000:
            key = make_key(rng)
            if key not in keys:
                units.append(f"One of the special magic {kind} for {key} is: {make_value(rng)}.")
    intro = (
        f"Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
        f"I will quiz you about the {kind} afterwards.\n"
    )
    asked = ", ".join(queried[:-1]) + (f", and {queried[-1]}" if len(queried) > 1 else queried[0])
    if spec.values > 1 or spec.queries > 1:
        question = f"\nWhat are all the special magic {kind} for {asked} mentioned in the provided text?"
        prefix = f"The special magic {kind} for {asked} mentioned in the provided text are"
    else:
        question = f"\nWhat is the special magic {kind[:-1]} for {asked} mentioned in the provided text?"
        prefix = f"The special magic {kind[:-1]} for {asked} mentioned in the provided text is"
    budget = 32 + 24 * (len(answers) - 1) if spec.value == "number" else 48 * len(answers)
    return _fill(name, fitter, intro, units, needles, question, prefix, tuple(answers), budget, depth, seed)


def _fill(
    name: str,
    fitter: _Fitter,
    intro: str,
    units: list[str],
    needles: list[tuple[float, str]],
    question: str,
    prefix: str,
    answers: tuple[str, ...],
    answer_tokens: int,
    depth: float,
    seed: int,
) -> Sample:
    """Size the haystack to the context and place the needles (the first ``len(answers)`` are queried,
    except for ``vt``, whose chain's first link is recorded)."""
    tail = question + " " + prefix
    n = fitter.largest(lambda k: intro + _insert(units[:k], needles)[0], len(units), tail, answer_tokens)
    text, offsets = _insert(units[:n], needles)
    metric = "passkey_exact" if name == "passkey" else "string_match_all"
    queried = tuple(o + len(intro) for o in offsets[: len(answers)])
    return Sample(name, intro + text, question, prefix, answers, metric, answer_tokens, depth, seed, queried)


def _vt(fitter: _Fitter, depth: float, rng: random.Random, seed: int) -> Sample:
    hops = 4
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    value = _number(rng, 5)
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i + 1]} = VAR {names[i]}." for i in range(hops)]
    # The chain starts at the requested depth; its later links follow, spread over the rest of the haystack.
    needles = [(depth + (1 - depth) * i / (hops + 1), link) for i, link in enumerate(chain)]
    intro = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    question = (
        f"\nQuestion: Find all variables that are assigned the value {value} in the text above. "
        "List them all."
    )
    prefix = (
        f"Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} variables "
        f"are assigned the value {value}, they are:"
    )
    return _fill(
        "vt", fitter, intro, [NOISE] * 2000, needles, question, prefix, tuple(names), 30, depth, seed
    )


def _cwe(fitter: _Fitter, rng: random.Random, seed: int) -> Sample:
    pool = list(essay_words())
    rng.shuffle(pool)
    common, rare = pool[:10], pool[10:]
    intro = (
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n"
    )

    def render(n: int) -> str:
        chosen = common * 30 + rare[:n] * 3
        random.Random(seed).shuffle(chosen)
        return intro + " ".join(f"{i + 1}. {w}" for i, w in enumerate(chosen))

    question = "\nQuestion: What are the 10 most common words in the above list?"
    prefix = "Answer: The top 10 words that appear most often in the list are:"
    n = fitter.largest(render, len(rare), question + " " + prefix, 120)
    return Sample("cwe", render(n), question, prefix, tuple(common), "string_match_all", 120, None, seed)


def _fwe(fitter: _Fitter, rng: random.Random, seed: int) -> Sample:
    vocabulary: list[str] = []
    while len(vocabulary) < 1000:
        word = _coded_word(rng)
        if word not in vocabulary:
            vocabulary.append(word)
    weights = [1 / (rank + 1) ** 2 for rank in range(len(vocabulary))]  # Zipf, exponent 2
    stream = rng.choices(vocabulary, weights, k=20000)
    intro = (
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words.\n"
    )
    question = "\nQuestion: What are the three most frequently appeared words in the above coded text?"
    prefix = "Answer: According to the coded text above, the three most frequently appeared words are:"
    n = fitter.largest(lambda k: intro + " ".join(stream[:k]), len(stream), question + " " + prefix, 50)
    counts: dict[str, int] = {}
    for word in stream[:n]:
        counts[word] = counts.get(word, 0) + 1
    top = sorted(counts, key=lambda w: (-counts[w], w))[:3]
    text = intro + " ".join(stream[:n])
    return Sample("fwe", text, question, prefix, tuple(top), "string_match_all", 50, None, seed)


TASKS: tuple[str, ...] = (*NIAH_TASKS, "vt", "cwe", "fwe")
DEPTH_TASKS = frozenset((*NIAH_TASKS, "vt"))  # tasks with a needle depth


def generate(
    task: str,
    context: int,
    count_tokens: Callable[[str], int],
    depth: float = 0.5,
    seed: int = 0,
    overhead: int = 0,
) -> Sample:
    """One sample of ``task`` whose prompt plus answer budget is at most ``context`` tokens.

    ``count_tokens`` counts a text's tokens in the model's tokenizer; ``overhead`` is the tokens the prompt
    format adds around context + question + answer prefix (a chat template)."""
    if task not in TASKS:
        raise InputError(f"unknown task '{task}'; available: {', '.join(TASKS)}")
    if not 0 <= depth <= 1:
        raise InputError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(f"{task}/{context}/{depth}/{seed}")
    fitter = _Fitter(count_tokens, context, overhead)
    if task in NIAH_TASKS:
        return _niah(task, NIAH_TASKS[task], fitter, depth, rng, seed)
    if task == "vt":
        return _vt(fitter, depth, rng, seed)
    if task == "cwe":
        return _cwe(fitter, rng, seed)
    return _fwe(fitter, rng, seed)
