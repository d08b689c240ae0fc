"""``niah``: RULER-style needle retrieval, generated locally (no downloads).

Variants (RULER's names in brackets):
- ``noise``: one needle in a haystack of repeated filler sentences [niah_single_1];
- ``essay``: one needle in real text, from ``--haystack`` files or the built-in evaluation text [niah_single_2];
- ``multikey``: needles for several different keys; each is asked in turn, the others are distractors
  [niah_multikey_1]; one prefill serves every question (the filled cache is copied per question);
- ``multivalue``: several values for one key, all asked for at once; the score is the fraction
  recalled [niah_multivalue].

The context (chat header, instruction, haystack with needles) is prefilled in chunks; the question is
its own call after it, so it reads the stored (quantized) cache. Decoding is greedy; scoring is exact
match of the 7-digit values. Each needle's token span is located so depths that fall into the bf16 sink
or recent window are marked.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

from rotkv.eval.protocol import fork, forward, greedy, prefill

VARIANTS = ("noise", "essay", "multikey", "multivalue")
PROMPT_VERSION = 2  # part of the results cache fingerprint: bump when the prompt changes
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "One of the special magic numbers for {key} is: {value}."
INSTRUCTION = ("Some special magic numbers are hidden within the following text. "
               "Make sure to memorize them. I will quiz you about the numbers afterwards.\n\n")
QUESTION = "\n\nWhat is the special magic number for {key} mentioned in the provided text? Answer with the number only."
QUESTION_ALL = ("\n\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
                "Answer with the numbers only.")
# RULER appends the start of the answer after the assistant header, so the model continues with the value
ANSWER = "The special magic number for {key} mentioned in the provided text is"
ANSWER_ALL = "The special magic numbers for {key} mentioned in the provided text are:"
_ADJ = ["amber", "brave", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly", "keen", "lively",
        "mellow", "noble", "odd", "proud", "quiet", "rapid", "silent", "tidy", "upbeat", "vivid", "witty", "young"]
_NOUN = ["anchor", "badger", "canyon", "dolphin", "ember", "falcon", "glacier", "harbor", "island", "jungle",
         "kettle", "lantern", "meadow", "nectar", "orchard", "pepper", "quarry", "river", "saddle", "tunnel"]


@dataclass
class Sample:
    variant: str
    length: int  # requested context length
    context: torch.Tensor  # [1, n] chat header + instruction + haystack with needles
    questions: list[tuple[torch.Tensor, list[str], float | None, tuple[int, int]]]
    # per question: (ids [1, m], expected values, depth or None, needle token span (start, end) or (-1, -1))


def _keys(rng: random.Random, n: int) -> list[str]:
    out: set[str] = set()
    while len(out) < n:
        out.add(f"{rng.choice(_ADJ)}-{rng.choice(_NOUN)}")
    keys = sorted(out)
    rng.shuffle(keys)
    return keys


def _value(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _split_template(tokenizer, user_text: str) -> tuple[str, str]:
    """(everything before the end of the user text, the rest: end of turn + assistant header)."""
    marker = "\x00Q\x00"
    if getattr(tokenizer, "chat_template", None):
        full = tokenizer.apply_chat_template([{"role": "user", "content": user_text + marker}], tokenize=False,
                                             add_generation_prompt=True)
    else:
        full = user_text + marker + "\nAnswer: "
    head, tail = full.split(marker)
    return head, tail


def _insert(body: str, needles: list[tuple[float, str]]) -> tuple[str, list[int]]:
    """Insert needle sentences at sentence boundaries nearest the depths; (text, char offset of each needle)."""
    cuts = []
    for depth, _ in needles:
        pos = int(len(body) * depth)
        cut = body.rfind(". ", 0, pos)
        cuts.append(0 if cut < 0 or depth == 0.0 else cut + 2)
    order = sorted(range(len(needles)), key=lambda i: cuts[i])
    text, offsets, last = "", [0] * len(needles), 0
    for i in order:
        text += body[last:cuts[i]]
        offsets[i] = len(text)
        text += needles[i][1] + " "
        last = cuts[i]
    return text + body[last:], offsets


def _haystack(tokenizer, variant: str, n_tokens: int, essay_ids: list[int], rng: random.Random) -> str:
    if variant == "noise":
        reps = n_tokens // max(1, len(tokenizer(NOISE, add_special_tokens=False).input_ids)) + 2
        ids = tokenizer(NOISE * reps, add_special_tokens=False).input_ids[:n_tokens]
    else:
        if len(essay_ids) < n_tokens:
            raise ValueError(f"the haystack text has {len(essay_ids)} tokens, fewer than {n_tokens}: pass longer --haystack files")
        start = rng.randint(0, len(essay_ids) - n_tokens)
        ids = essay_ids[start:start + n_tokens]
    return tokenizer.decode(ids)


def make_sample(tokenizer, variant: str, length: int, depths: list[float], essay_ids: list[int], seed: int) -> Sample:
    """One haystack of about ``length`` context tokens with needles at ``depths`` (one needle for the
    single variants, one per depth for multikey / multivalue)."""
    if variant not in VARIANTS:
        raise ValueError(f"`variant` has to be one of {list(VARIANTS)} but got {variant!r}")
    rng = random.Random(seed)
    single = variant in ("noise", "essay")
    keys = _keys(rng, 1 if variant != "multikey" else len(depths))
    if variant == "multikey":
        needles = [(d, k, _value(rng)) for d, k in zip(depths, keys)]
    else:
        needles = [(d, keys[0], _value(rng)) for d in (depths[:1] if single else depths)]
    sentences = [(d, NEEDLE.format(key=k, value=v)) for d, k, v in needles]
    head0, _ = _split_template(tokenizer, INSTRUCTION)
    overhead = len(tokenizer(head0, add_special_tokens=False).input_ids)
    overhead += sum(len(tokenizer(s + " ", add_special_tokens=False).input_ids) for _, s in sentences)
    body = _haystack(tokenizer, "noise" if variant == "noise" else "essay", max(16, length - overhead), essay_ids, rng)
    text, offsets = _insert(body, sentences)
    head, tail = _split_template(tokenizer, INSTRUCTION + text)
    ctx = tokenizer(head, add_special_tokens=False, return_tensors="pt").input_ids
    base = head.index(INSTRUCTION) + len(INSTRUCTION)
    spans = []
    for off, (_, s) in zip(offsets, sentences):
        a = len(tokenizer(head[: base + off], add_special_tokens=False).input_ids)
        b = len(tokenizer(head[: base + off + len(s)], add_special_tokens=False).input_ids)
        spans.append((a, b))
    qs = []
    if variant == "multivalue":
        q = tokenizer(QUESTION_ALL.format(key=keys[0]) + tail + ANSWER_ALL.format(key=keys[0]), add_special_tokens=False, return_tensors="pt").input_ids
        qs.append((q, [v for _, _, v in needles], None, (-1, -1)))
    else:
        for (d, k, v), span in zip(needles, spans):
            q = tokenizer(QUESTION.format(key=k) + tail + ANSWER.format(key=k), add_special_tokens=False, return_tensors="pt").input_ids
            qs.append((q, [v], d, span))
    return Sample(variant, length, ctx, qs)


def tier_of(span: tuple[int, int], context_len: int, sink: int, window: int) -> str:
    """'sink' or 'window' when the needle overlaps the bf16 tiers at question time, else ''."""
    a, b = span
    if a < 0:
        return ""
    if a < sink:
        return "sink"
    if b > context_len - window:
        return "window"
    return ""


def score_answer(text: str, expected: list[str]) -> float:
    """Fraction of the expected values found as whole numbers in the answer (exact match for one value)."""
    found = set(re.findall(r"\d+", text))
    if len(expected) == 1:
        nums = re.findall(r"\d+", text)
        return float(bool(nums) and nums[0] == expected[0])
    return sum(v in found for v in expected) / len(expected)


def run_sample(model, tokenizer, method, sample: Sample, chunk: int, max_new: int) -> tuple[list[dict], dict]:
    """Prefill the context once, then ask each question on a copy of the filled cache."""
    cache = method.build(model, context_length=sample.context.shape[1] + max_new)  # the haystack and its answer
    prefill(model, cache, sample.context, chunk)
    stop = {t for t in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")) if isinstance(t, int)}
    out, mem = [], None
    for i, (q, expected, depth, span) in enumerate(sample.questions):
        c = cache if i == len(sample.questions) - 1 else fork(cache)
        logp = forward(model, q, c)[-1]
        if mem is None:
            mem = method.measure(c, model)
        new = greedy(model, c, logp, max_new * len(expected), stop)
        answer = tokenizer.decode(new, skip_special_tokens=True)
        out.append({"depth": depth, "span": span, "expected": expected, "answer": answer.strip(),
                    "score": score_answer(answer, expected)})
    return out, mem
