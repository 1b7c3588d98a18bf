"""A reward module that draws from `random` as it is imported, as some installed packages do at import
(tests/rewards/test_workers.py: a worker's calls draw from its seed whatever its imports drew)."""

import random

TABLE = [random.random() for _ in range(3)]  # drawn once, at import


def drawn_after_import(prompts, completions, **kwargs):
    return [random.random() for _ in completions]


def table_entry(prompts, completions, **kwargs):
    return [TABLE[0]] * len(completions)
