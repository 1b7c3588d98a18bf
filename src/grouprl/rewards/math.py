"""Math answer correctness on top of math-verify: `verify_math` and the `math_accuracy` reward.

Answer extraction, in order: the last <answer>...</answer>, the last \\boxed{...} (or \\fbox), the text
after GSM8K's last "####", else the whole text. Whole text is read by its final answer: the first
math segment ($...$, \\(...\\), \\[...\\]) or number after its last "answer is" / "answer:", else
the later of its last math segment and its last number. Never by the first expression in it: "83 + 26
equals 87." restates the question and then answers 87, and scoring the restated "83 + 26" (what
math-verify's free-text parse picks) was a reward a policy learnt to hack. For the same reason a
reply that is arithmetic on plain numbers ("83 + 26", "2 + 2 = 5", \\boxed{6 \\times 7}) is read by
its last number, not evaluated; any other expression is (\\boxed{2^{10}} = 1024).
Text is prose when it has a word of 3+ letters or a short word like "is", "it", "so" ("It is 42"
is 42, not I*t*i*s*42). A number in prose is read with the bare math around it, up to the nearest
prose word, "=" or sentence break: "the answer is \\frac{3}{4}" is 3/4 and "10^{3}" is 1000, never
the 3 or the 4 (a reward for any digit inside the LaTeX could be learnt); such LaTeX that math-verify
cannot parse is no answer. The minus sign U+2212 (and U+FE63, U+FF0D) reads as "-".
The same extraction runs on the gold answer, so a GSM8K solution ("... #### 72") or a MATH
solution with \\boxed{} can be given as gold directly.

Plain numbers (integers, decimals, thousands separators "," "{,}" "\\," "\\ ", simple fractions a/b) are
compared exactly with `fractions.Fraction` without calling math-verify: the trainer's default task
scores bare numbers on every step. Everything else goes to math-verify (LaTeX, expressions, sets, intervals).

Percentages: "50%" (also "50\\%", "50 percent", in a box or in prose) matches gold 50 and gold 0.5
(either reading is accepted).

math-verify guards parse/verify with signal.alarm, which only works on the main thread; off the main
thread (a thread pool, the trainer's reward timeout) we call it with its timeouts disabled and the
caller's timeout applies instead (`score_completions(timeout_s=...)`).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from fractions import Fraction
from typing import Any

from .text import column, completion_text

_NUMBER = re.compile(r"^[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?$")
# a word of 3+ letters, or a short word only prose uses ("It is 42", "So 42"; not "xy", "AB", "cm", "no")
_SHORT_WORDS = "is it so we as at be by if in of on or to an am do he me my us up".split()
_WORD = r"(?<![\\a-zA-Z])(?:[a-zA-Z]{3,}|" + "|".join(w + "|" + w.capitalize() for w in _SHORT_WORDS) + r")(?![a-zA-Z])"
_PROSE = re.compile(_WORD)
_FRACTION = re.compile(r"^([-+]?\d+)\s*/\s*(\d+)$")
_LAST_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|[-+]?\.\d+")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_PERCENT = re.compile(r"\s*(\\?%|\\percent|percent)\s*$")
_ANSWER_PHRASE = re.compile(r"\banswer\s*(?:is\b|:|=)", re.IGNORECASE)
_MATH_SEGMENT = re.compile(r"\$\$(.+?)\$\$|\$([^$]+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
_ARITHMETIC = re.compile(r"^(?=.*\d\s*(?:[-+*/×÷·=]|\\times|\\cdot|\\div))"
                         r"(?:[\s\d.,()+\-*/×÷·=]|\\times|\\cdot|\\div)+$")
# what ends the bare math around a number in free text: a sentence or clause break, "=", a math
# delimiter, a prose word (but not "percent", which belongs to the number)
_RUN_BREAK = re.compile(r"\n|[.?](?=\s|$)|[,;:](?=\s)|=|\$|\\[()\[\]]|(?!percent\b)" + _WORD)
_TEXT_GROUP = re.compile(r"\\(?:text|mathrm|textbf|mbox)\s*\{[^{}]*\}")
_LATEX = re.compile(r"\\[a-zA-Z]|[{}^_]")
_MINUS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})  # minus sign, small and full-width hyphen-minus
_THOUSANDS = re.compile(r"(?<=\d)(?:\\,|\\ )(?=\d)")  # LaTeX thin and normal spaces: 1\,000, 1\ 000
_TIMEOUT_S = 5


class _DropTimeoutNotice(logging.Filter):
    """math-verify logs a warning on every call made with its timeouts disabled; we disable them on
    purpose off the main thread (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader", "math_verify"):
    logging.getLogger(_name).addFilter(_DropTimeoutNotice())


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...}, with balanced braces; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        rest = text[start + len("\\boxed"):].strip()  # "\boxed 5"
        return rest.split()[0].rstrip("$.") if rest else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def extract_answer(text: str) -> tuple[str, bool]:
    """(answer text, anchored): the anchored answer (tag, box, ####) or the whole text and False."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        inner = tags[-1]
        boxed = _last_boxed(inner)
        return (boxed if boxed is not None else inner).strip(), True
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip(), True
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        return (after.splitlines()[0].strip() if after else ""), True
    return text.strip(), False


def _plain_number(s: str) -> Fraction | None:
    """Exact value of a plain number ("1,250", "-3.50", ".5", "3/4", "$12", "12."), else None."""
    s = s.strip().strip("$").strip()
    s = _THOUSANDS.sub(",", s.replace("\\$", "").replace("\\!", "").replace("{,}", ",")).strip()
    if s.endswith(".") and not s.endswith(".."):
        s = s[:-1]
    m = _FRACTION.match(s)
    if m:
        den = int(m.group(2))
        return Fraction(int(m.group(1)), den) if den else None
    if not s or not _NUMBER.match(s):
        return None
    try:
        return Fraction(s.replace(",", ""))
    except (ValueError, ZeroDivisionError):  # what the pattern lets through and Fraction refuses: no number
        return None


def _candidates(s: str) -> tuple[list[Fraction], str]:
    """Exact values the answer may mean (two for a percentage) and the text left for math-verify."""
    m = _PERCENT.search(s)
    if m:
        core = s[: m.start()]
        value = _plain_number(core)
        return ([value, value / 100] if value is not None else []), core
    value = _plain_number(s)
    return ([value] if value is not None else []), s


def _mv_parse(text: str, anchored: bool) -> list:
    """math-verify's parse of `text`, remembered: its LaTeX grammar takes ~4 ms a call on a CPU, and the
    same answers come back (a group's completions often agree; gold answers recur every epoch)."""
    return list(_mv_parse_cached(text, anchored))


@functools.lru_cache(maxsize=8192)
def _mv_parse_cached(text: str, anchored: bool) -> tuple:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    timeout = _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    if anchored:  # an extracted answer: read it as one math expression
        parsed = parse(f"${text}$", configs, parsing_timeout=timeout)
        if parsed:
            return tuple(parsed)
    return tuple(parse(text, configs, parsing_timeout=timeout))


def _mv_verify(gold: list, pred: list) -> bool:
    from math_verify import verify

    timeout = _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    return bool(verify(gold, pred, timeout_seconds=timeout))


def _looks_like_prose(s: str) -> bool:
    """Words outside LaTeX commands ("The total is 12 apples"): read as text, not as one expression."""
    return bool(_PROSE.search(s))


def read_answer(text: str) -> tuple[list[Fraction], list | None]:
    """The answer of `text` as the reward reads it: exact values (fast path) and, when no exact value
    is found, math-verify's parse of the answer (what maj@k votes with, evaluation.py)."""
    answer, anchored = extract_answer(text.translate(_MINUS))
    values, core = _candidates(answer)
    if values or not core:
        return values, None
    if not _looks_like_prose(core) and not _ARITHMETIC.match(core):
        # one expression: "\\frac{1}{2}", "(1, 2)", an anchored "2^{10}"
        parsed = _mv_parse(core, anchored=True)
        if parsed or anchored:
            return [], parsed
    return _read_final(answer)  # with its "%": "The answer is 5%"


def _read_final(text: str) -> tuple[list[Fraction], list | None]:
    """Free text by its final answer: the first math segment or number after its last "answer is",
    else the later of its last math segment and its last number (module docstring)."""
    phrases = list(_ANSWER_PHRASE.finditer(text))
    tail = text[phrases[-1].end():] if phrases else text
    items = [m for m in _MATH_SEGMENT.finditer(tail) if not _looks_like_prose(_segment(m))]
    items += list(_LAST_NUMBER.finditer(tail))
    if not items:
        return [], None
    item = min(items, key=lambda m: m.start()) if phrases else max(items, key=lambda m: m.end())
    if item.re is _LAST_NUMBER:
        return _read_bare(tail, item)
    inner = _segment(item).strip()
    values, core = _candidates(inner)
    if values:
        return values, None
    if not _ARITHMETIC.match(core):
        parsed = _mv_parse(core, anchored=True)
        if parsed:
            return [], parsed
    numbers = _LAST_NUMBER.findall(inner)  # "$83 + 26 = 109$": what the computation comes to
    return (_candidates(numbers[-1])[0] if numbers else []), None


def _read_bare(text: str, number: re.Match) -> tuple[list[Fraction], list | None]:
    """A number in free text with the bare math around it, up to the nearest break (`_RUN_BREAK`):
    "5%" is a percentage, "1\\,000" one number, and "\\frac{3}{4}", "10^{3}" or "\\sqrt{2}" are read by
    math-verify as a whole (nothing if it cannot), never by the 3, 10 or 2 in them. Else the number itself."""
    blank = _TEXT_GROUP.sub(lambda m: " " * len(m.group()), text)  # "\\frac{3}{4} \\text{ cups}": same offsets
    if blank[number.start()] == " ":  # the number is inside \\text{...}: words around it, not math
        return _candidates(number.group())[0], None
    text = blank
    breaks = list(_RUN_BREAK.finditer(text))
    start = max((m.end() for m in breaks if m.end() <= number.start()), default=0)
    end = min((m.start() for m in breaks if m.start() >= number.end()), default=len(text))
    values, core = _candidates(text[start:end].strip())
    if values:
        return values, None
    if _ARITHMETIC.match(core) and text.startswith("=", end):  # "83 + 26 = 109": what the computation comes to
        after = _LAST_NUMBER.search(text, end + 1)
        if after is not None and not any(end < b.start() < after.start() for b in breaks):
            return _read_bare(text, after)
    if _LATEX.search(core) and not _ARITHMETIC.match(core):
        return [], _mv_parse(core, anchored=True)  # unparsed: no answer, rather than a digit inside it
    return _candidates(number.group())[0], None


def _segment(m: re.Match) -> str:
    return next(g for g in m.groups() if g is not None)


def _as_parsed(values: list[Fraction], parsed: list | None) -> list:
    if parsed:
        return parsed
    return _mv_parse(str(values[0]), anchored=True) if values else []


def verify_math(completion: str, gold: str) -> float | None:
    """1.0 if the completion's final answer equals the gold answer, 0.0 if not, None when the gold
    answer cannot be parsed (the row is skipped, never scored 0)."""
    gold_values, gold_parsed = read_answer(str(gold))
    if not gold_values and not gold_parsed:
        return None
    pred_values, pred_parsed = read_answer(completion)
    if not pred_values and not pred_parsed:
        return 0.0
    if gold_values and pred_values:  # fast path: exact comparison of plain numbers
        return 1.0 if set(gold_values) & set(pred_values) else 0.0
    gold_mv = _as_parsed(gold_values, gold_parsed)
    if not gold_mv:
        return None
    # A percentage is also tried as value / 100 (the second exact value).
    for pred_mv in ([_as_parsed(pred_values, pred_parsed)]
                    + [_as_parsed(pred_values[1:], None)] * (len(pred_values) > 1)):
        if pred_mv and _mv_verify(gold_mv, pred_mv):
            return 1.0
    return 0.0


def math_accuracy(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
    """1.0 / 0.0 per completion against the gold column `answer` (or `solution`); None where the gold
    answer cannot be parsed. Completions may be strings or chat message lists."""
    golds = column(kwargs, ("answer", "solution"), len(completions), "math_accuracy")
    return [None if g is None else verify_math(completion_text(c), str(g)) for c, g in zip(completions, golds)]


math_accuracy.rowwise = True  # scored row by row: the reward workers may cut a group
math_accuracy.needs_column = ("answer", "solution")  # one of them: checked when the data loads
