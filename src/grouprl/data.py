"""Prompt datasets: loading, validation, the seeded prompt sampler, and prompt formatting.

A dataset is any table with a `prompt` column holding a string or a list of chat messages
(`[{"role": ..., "content": ...}]`); every other column travels with the prompt and reaches the
reward functions as a keyword argument, one value per completion (TRL's convention).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pandas as pd
import pyarrow as pa
import torch
from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict

from grouprl.config import ConfigError, did_you_mean
from grouprl.config.io import HUB_PREFIX, split_hub_source


def _read_csv(path: str) -> Dataset:
    """Every CSV cell as its text, an empty cell as None: type inference would turn the answer "007"
    into 7, "3.10" into 3.1 and "NA" into None (pandas' missing values). A reward that wants a number
    converts it (`float(answer)`), as with JSON Lines strings."""
    frame = pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""])
    return Dataset.from_pandas(frame.astype(object).where(frame.notna(), None), preserve_index=False)


_READERS = {
    ".jsonl": Dataset.from_json,
    ".json": Dataset.from_json,
    ".csv": _read_csv,
    ".parquet": Dataset.from_parquet,
}


logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
"""The roles a chat message may have: the ones every chat template renders."""

RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "completion_lengths")
"""The keyword arguments the trainer itself passes to reward functions: a dataset column of one of
these names would be replaced by them (or replace them) without a word, so it is refused."""

_EVAL_SPLITS = ("test", "validation")  # the splits of a DatasetDict given as eval data, in TRL's examples


class DataError(ValueError):
    """A dataset is missing, unreadable or has a malformed row; the message names the row and the fix."""


def load_prompts(source: str | Path | Dataset | DatasetDict | IterableDataset | pd.DataFrame | list[dict], *,
                 prompt_column: str = "prompt", name: str = "train_data", reward_funcs: tuple[str, ...] = ()
                 ) -> Dataset:
    """Load and validate a prompt dataset from a file, `builtin:NAME`, a `datasets.Dataset` (or a
    DatasetDict: its train split, or for eval_data its test or validation split; or an IterableDataset,
    read whole), a pandas DataFrame or rows. `reward_funcs`: the names of the functions that read its
    columns (named when the file is missing)."""
    if isinstance(source, (DatasetDict, IterableDatasetDict)):
        source = _pick_split(source, name)
    if isinstance(source, IterableDataset):
        logger.info("%s is an IterableDataset: reading all its rows into memory (the prompt sampler shuffles "
                    "by index); for part of a large stream pass `dataset.take(n)`", name)
        source = list(source)
    if isinstance(source, pd.DataFrame):
        source = Dataset.from_pandas(source, preserve_index=False)
    if isinstance(source, Path):
        source = str(source)
    if isinstance(source, Dataset):
        ds = source
    elif isinstance(source, list):
        ds = rows_dataset(source, name)
    elif not isinstance(source, str):
        raise DataError(f"{name} is a {type(source).__name__}: give a file path, 'builtin:NAME', a datasets.Dataset "
                        "(or DatasetDict, IterableDataset), a pandas DataFrame or a list of rows (dicts)")
    elif source.startswith(HUB_PREFIX):
        ds = hub_dataset(source, name)
    elif source.startswith("builtin:"):
        from grouprl.tasks import builtin_dataset

        try:
            ds = Dataset.from_list(builtin_dataset(source.removeprefix("builtin:")))
        except ValueError as e:
            raise DataError(f"{name}={source!r}: {e}") from None
    else:
        check_data_source(name, source, prompt_column=prompt_column, reward_funcs=reward_funcs)
        path = Path(source).expanduser()
        if path.is_dir():  # before the file type: a folder's is "" ("unsupported file type ''")
            raise DataError(f"{name}={source!r} is a folder: name the data file in it (or, for a folder a "
                            f"datasets loader reads, hf:{source})")
        if not path.is_file():  # a pipe (--train_data <(...)) or a device: the readers need a file they can reopen
            raise DataError(f"{name}={source!r} is not a regular file (a pipe or a device): write the data to a "
                            ".jsonl, .json, .csv or .parquet file and name it")
        reader = _READERS.get(path.suffix.lower())
        if reader is None:
            raise DataError(f"{name}={source!r}: unsupported file type {path.suffix!r}; "
                            f"use one of {', '.join(_READERS)}")
        if not _has_rows(path):  # the readers' own error is StopIteration, "no data" or DatasetGenerationError
            raise DataError(f"{name}={source!r} has no rows: it needs at least one prompt")
        suffix = path.suffix.lower()
        problem = (_text_problem(path, _jsonl_line_problem if suffix == ".jsonl" else None)
                   if suffix in (".jsonl", ".json", ".csv") else None)
        if problem:  # datasets' own error names no line
            raise DataError(f"{name}={source!r}: {problem}")
        try:
            ds = reader(str(path))
        except Exception as e:  # noqa: BLE001 - the reader's own error is the useful part
            raise DataError(f"{name}={source!r} could not be read as {path.suffix}: "
                            f"{type(e).__name__}: {e}") from None
        if suffix in (".json", ".jsonl") and _pandas_columns(ds):  # else "row 1: 'prompt' is dict {'0': ...}"
            column = ds.column_names[0]
            raise DataError(f"{name}={source!r} is one JSON object of columns, each keyed by row number "
                            f"({{{column!r}: {{'0': ..., '1': ...}}, ...}}), as pandas' DataFrame.to_json() writes "
                            "by default (orient='columns'): write one object per row, df.to_json(path, "
                            "orient='records') for .json, or df.to_json(path, orient='records', lines=True) "
                            "for .jsonl")
        # named with the file and its rows as the file counts them, as the pre-scan's messages are
        validate_prompts(ds, prompt_column=prompt_column, name=f"{name}={source!r}", row=_file_rows(path))
        return ds
    validate_prompts(ds, prompt_column=prompt_column, name=name)
    return ds


def _file_rows(path: Path) -> Callable[[int], str]:
    """How a row of the file at `path` is named in messages, given its index in the dataset read from it:
    a JSON Lines file's line number (its reader skips blank lines, so the index alone would point at
    the wrong line), else the row counted from 1, as a reader of the file counts."""
    suffix = path.suffix.lower()
    after = " after the header" if suffix == ".csv" else ""

    def counted(i: int) -> str:
        return f"row {i + 1}{after} (counting from 1)"

    if suffix == ".jsonl":
        return lambda i: f"line {line}" if (line := _jsonl_line(path, i)) else counted(i)
    return counted


def _jsonl_line(path: Path, index: int) -> int | None:
    """The line of a JSON Lines file holding the row at `index` of the dataset read from it: its
    `index + 1`-th line that is not blank (blank as `_jsonl_line_problem` has it). Read only when a row
    is named, so a file that loads is not read a second time."""
    with open(path, "rb") as f:
        rows = (number for number, raw in enumerate(f, start=1) if raw.decode("utf-8", "replace").strip())
        return next((number for i, number in enumerate(rows) if i == index), None)


def hub_dataset(source: str, name: str) -> Dataset:
    """`hf:NAME[:CONFIG][@SPLIT]`: `datasets.load_dataset(NAME, CONFIG, split=SPLIT)`: a dataset on the
    Hugging Face hub (cached, so HF_HUB_OFFLINE=1 reads it once downloaded) or a local folder of data
    files. Without SPLIT, the split the role means (`_pick_split`: train, or test/validation for
    eval_data); SPLIT takes datasets' own forms (`train[:1000]`)."""
    from datasets import load_dataset

    path, config, split = split_hub_source(source)
    if not path:
        raise DataError(f"{name}={source!r} names no dataset: write hf:NAME, hf:NAME:CONFIG or hf:NAME:CONFIG@SPLIT "
                        "(e.g. hf:openai/gsm8k:main@train)")
    try:
        ds = load_dataset(path, config or None, split=split or None)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; its message is the useful part
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if Path(path).expanduser().is_dir():  # read where it is: hub and network advice would not apply
            splits, unsplit = _split_names(path, config), HUB_PREFIX + path + (f":{config}" if config else "")
            named = (f"one of its splits {splits} (e.g. {unsplit}@{_example_split(splits, name)})" if splits
                     else "a split it has")
            raise DataError(f"{name}={source!r}: datasets could not load it ({type(e).__name__}: {first}); {path} is "
                            f"a local folder, read where it is: @SPLIT must name {named} or be left out "
                            f"for the split {name} means, a folder with several configurations needs one "
                            "(hf:FOLDER:CONFIG), and its data files must be readable") from None
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        where = ("HF_HUB_OFFLINE is set, so only a copy in the cache can be read: load it once online (`hf "
                 f"download --repo-type dataset {path}`)" if offline else "check the name and the network")
        raise DataError(f"{name}={source!r}: datasets could not load it ({type(e).__name__}: {first}); {where}; a "
                        "dataset with several configurations needs one (hf:NAME:CONFIG), and @SPLIT picks a split "
                        "(train, test, train[:1000])") from None
    if isinstance(ds, (DatasetDict, IterableDatasetDict)):
        try:
            ds = _pick_split(ds, name)
        except DataError:
            both = [s for s in _EVAL_SPLITS if s in ds] if name == "eval_data" else []
            if len(both) > 1:  # the held-out set is the user's call: neither is the evident one
                raise DataError(f"{name}={source!r} has both a test and a validation split ({list(ds)}), so which one "
                                f"{name} means is ambiguous: name it after @, {source}@test or {source}@validation"
                                ) from None
            raise DataError(f"{name}={source!r} has the splits {list(ds)}, and none is the one {name} means: name "
                            f"one after @, e.g. {source}@{_example_split(list(ds), name)}") from None
    if isinstance(ds, IterableDataset):
        ds = Dataset.from_list(list(ds))
    return ds


def _split_names(path: str, config: str) -> list[str]:
    """The splits of a local dataset folder, as datasets finds them (from its files' names); [] where it
    cannot tell (the folder is what failed to load)."""
    from datasets import get_dataset_split_names

    try:
        return list(get_dataset_split_names(path, config or None))
    except Exception:  # noqa: BLE001 - the load's own error is already in the message
        return []


def _example_split(splits: list[str], name: str) -> str:
    """The split to show in an example for `name`: for eval_data a held-out one, never the train split
    (its rows are the ones trained on) unless there is no other."""
    if name != "eval_data":
        return "train" if "train" in splits else splits[0]
    return next((s for s in (*_EVAL_SPLITS, *splits) if s in splits and s != "train"), splits[0])


def _pick_split(splits: DatasetDict | IterableDatasetDict, name: str) -> Dataset | IterableDataset:
    """The split of a DatasetDict (`load_dataset` without `split=`) that `name` means: "train" for the
    training data, "test" or "validation" for eval_data, or the only split there is."""
    wanted = _EVAL_SPLITS if name == "eval_data" else ("train",)
    found = [s for s in wanted if s in splits] or (list(splits) if len(splits) == 1 else [])
    if len(found) != 1:
        raise DataError(f"{name} is a DatasetDict with the splits {list(splits)}: pass one split, e.g. "
                        f"dataset[{(found or list(splits))[0]!r}] (or load_dataset(..., split=...))")
    logger.info("%s is a DatasetDict with the splits %s: using its %r split", name, list(splits), found[0])
    return splits[found[0]]


def rows_dataset(rows: list[Any], name: str = "rows") -> Dataset:
    """A Dataset of rows (dicts) with every column any row has (None where a row lacks it):
    `Dataset.from_list` takes the columns of the first row only. A column mixing types (5 and "x")
    is a DataError naming it, not pyarrow's error, which names neither column nor row."""
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None:
        raise DataError(f"{name} row {bad} is a {type(rows[bad]).__name__}, not a dict of columns")
    columns = {k: [r.get(k) for r in rows] for k in dict.fromkeys(k for r in rows for k in r)}
    try:
        return Dataset.from_dict(columns)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        for k, values in columns.items():
            try:
                pa.array(values)
            except (pa.ArrowInvalid, pa.ArrowTypeError) as column_error:
                first: dict[str, int] = {}  # type -> the first row with it
                for i, v in enumerate(values):
                    if v is not None:
                        first.setdefault(type(v).__name__, i)
                what = (f"mixes types ({', '.join(f'{t} in row {i}' for t, i in first.items())})" if len(first) > 1
                        else f"cannot be one column ({column_error})")
                raise DataError(f"{name}: column {k!r} {what}: give it one type in every row, e.g. all strings"
                                ) from None
        raise DataError(f"{name}: the rows cannot be made into a table: {e}") from None


def _pandas_columns(ds: Dataset) -> bool:
    """A dataset read from a JSON file written by pandas' `DataFrame.to_json()` as it writes by default
    (orient="columns"): one row, every column a dict keyed by row number ("0", "1", ...; none for no rows)."""
    if len(ds) != 1:
        return False
    row = ds.with_format(None)[0]
    return all(isinstance(v, dict) and all(isinstance(k, str) and k.isdigit() for k in v)
               for v in row.values())


def _has_rows(path: Path) -> bool:
    """A JSON Lines file has a line that is not blank, a Parquet file a row (its metadata says, without
    reading the data), a JSON file more than an empty array or object; another file is not empty."""
    suffix = path.suffix.lower()
    if suffix == ".json" and 0 < path.stat().st_size <= 4096:  # `[]`: the reader says "corresponds to no data"
        try:
            value = json.loads(path.read_text(encoding="utf-8", errors="replace"))
        except ValueError:  # not JSON: the reader's error names it
            return True
        return not (isinstance(value, (list, dict)) and not value)
    if suffix == ".parquet" and path.stat().st_size > 0:
        import pyarrow.parquet as pq

        try:
            return pq.read_metadata(path).num_rows > 0
        except pa.ArrowException:  # not Parquet: the reader's error names it
            return True
    if suffix != ".jsonl":
        return path.stat().st_size > 0
    with open(path, encoding="utf-8", errors="replace") as f:
        return any(line.strip() for line in f)


def _text_problem(path: Path, line_problem: Callable[[int, str], str | None] | None = None) -> str | None:
    """The first line of a text file that is not UTF-8, or that `line_problem` finds wrong, named by
    number, in one pass. The readers keep bytes that are not UTF-8 in the columns they do not decode,
    so such a row failed only when a step drew it (a latin-1 "é" in an answer, step 40), naming
    neither the file nor the line."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return (f"line {number} is not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the "
                        "line): re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)")
            problem = line_problem(number, line) if line_problem is not None else None
            if problem:
                return problem
    return None


def _jsonl_line_problem(number: int, line: str) -> str | None:
    """What is wrong with line `number` of a JSON Lines file, if it is not blank and not one JSON object."""
    if not line.strip():
        return None
    try:
        row = json.loads(line.rstrip())
    except json.JSONDecodeError as e:
        where = f"{e.msg} column {e.colno}" if e.msg.endswith(" at") else f"{e.msg} at column {e.colno}"
        return (f"line {number} is not valid JSON ({where}): "
                f"{line.strip()[:80]!r}; each line must be one JSON object, e.g. {{\"prompt\": \"...\"}}")
    if not isinstance(row, dict):
        return (f"line {number} is a JSON {type(row).__name__}, not an object: each line must be one "
                "JSON object with the prompt column, e.g. {\"prompt\": \"...\"}")
    return None


def check_data_source(name: str, value: str, *, prompt_column: str = "prompt",
                      reward_funcs: tuple[str, ...] = ()) -> None:
    """A data file must exist; `builtin:` names are checked when loaded. The ConfigError names the
    field, where relative paths start, and what the file must hold (the format, the columns)."""
    if value.startswith(("builtin:", HUB_PREFIX)) or Path(value).expanduser().exists():
        return
    readers = f"the reward functions ({', '.join(reward_funcs)})" if reward_funcs else "your reward functions"
    raise ConfigError(
        f"{name}={value!r} does not exist: check the path (relative paths are resolved from {os.getcwd()}), "
        f"or make the file. It holds the {'eval' if name == 'eval_data' else 'training'} prompts: .jsonl (one JSON "
        f"object per line), .json, .csv or .parquet, with a {prompt_column!r} column (a string, or chat messages "
        f'[{{"role": "user", "content": "..."}}]) and the columns {readers} read, e.g. '
        f'{{"{prompt_column}": "What is 6 times 7?", "answer": "42"}} for math_accuracy (docs/rewards.md lists '
        "the columns of each built-in reward)")


def validate_prompts(ds: Dataset, *, prompt_column: str = "prompt", name: str = "train_data",
                     row: Callable[[int], str] | None = None) -> None:
    """A dataset has rows, a prompt column and well-formed prompts of one form. `row` names the row at
    an index in messages ("line 4" of a file); by default "row i", the index itself (`ds[i]`)."""
    row = row or (lambda i: f"row {i}")
    if len(ds) == 0:
        raise DataError(f"{name} has no rows: it needs at least one prompt")
    if prompt_column not in ds.column_names:
        if prompt_column == "prompt":
            raise DataError(f"{name} has no {prompt_column!r} column (columns: {ds.column_names}); "
                            f"rename the prompt column to {prompt_column!r} or set prompt_column")
        # set by the user already: "or set prompt_column" told them to do what they had done
        raise DataError(f"{name} has no {prompt_column!r} column, which prompt_column names; its columns are "
                        f"{ds.column_names}{did_you_mean(prompt_column, set(ds.column_names))}: set prompt_column "
                        f"to the one that holds the prompts, or give the data a {prompt_column!r} column")
    check_reserved(ds.column_names, prompt_column, name)
    first: dict[bool, int] = {}  # string prompt or not -> the first row of that form
    for i, prompt in enumerate(ds[prompt_column]):
        problem = _prompt_problem(prompt)
        if problem:
            raise DataError(f"{name} {row(i)}: {prompt_column!r} {problem}; a prompt is a non-empty "
                            "string or a list of {'role': ..., 'content': ...} messages")
        first.setdefault(isinstance(prompt, str), i)
    if len(first) > 1:  # a batch's completions are strings or messages as its first prompt is
        raise DataError(f"{name} mixes prompt forms: {row(first[True])} is a string, {row(first[False])} chat "
                        "messages; give every prompt one form (a string s as [{'role': 'user', 'content': s}])")


def check_reserved(columns: list[str], prompt_column: str, name: str) -> None:
    """A column named like an argument the trainer passes to reward functions itself is refused."""
    reserved = [c for c in columns if c in RESERVED_COLUMNS and c != prompt_column]
    if reserved:
        raise DataError(f"{name} has a column named {reserved[0]!r}, a keyword argument the trainer passes to reward "
                        f"functions itself ({', '.join(RESERVED_COLUMNS)}): rename the column (in the file, "
                        f"or ds.rename_column({reserved[0]!r}, 'dataset_{reserved[0]}'))")


def _prompt_problem(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return None if prompt else "is an empty string"
    if isinstance(prompt, list) and prompt:
        for m in prompt:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                return f"has a malformed message {m!r}"
            if m["role"] not in ROLES:
                return f"has a message with role {m['role']!r}, which is not one of {', '.join(ROLES)}"
        return None
    return f"is {type(prompt).__name__} {prompt!r}"


def split_eval(ds: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """Hold out `fraction` of the rows (seeded) as an eval set."""
    n_eval = max(1, round(len(ds) * fraction))
    if n_eval >= len(ds):
        raise DataError(f"eval_fraction={fraction} leaves no training rows out of {len(ds)}")
    perm = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed)).tolist()
    return ds.select(sorted(perm[n_eval:])), ds.select(sorted(perm[:n_eval]))


class PromptSampler:
    """Draws prompt indices epoch by epoch, each epoch a fresh seeded permutation. Its state is
    (epoch, position, the epoch's seed), saved in checkpoints so a resumed run sees the same prompts.
    A run resumed with another `seed` finishes the epoch it is in with the permutation it began (a
    new one from the old position repeated some prompts of the epoch and skipped as many); the
    epochs after it follow the new seed."""

    def __init__(self, num_rows: int, seed: int):
        self.num_rows, self.seed = num_rows, seed
        self.epoch, self.pos = 0, 0
        self._epoch_seed = seed  # the seed of the epoch's permutation
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self._epoch_seed * 1_000_003 + epoch)
        return torch.randperm(self.num_rows, generator=g).tolist()

    def next(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if self.pos == self.num_rows:
                self.epoch, self.pos, self._epoch_seed = self.epoch + 1, 0, self.seed
                self._perm = self._permutation(self.epoch)
            take = min(k - len(out), self.num_rows - self.pos)
            out += self._perm[self.pos:self.pos + take]
            self.pos += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos, "num_rows": self.num_rows, "seed": self._epoch_seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_rows"] != self.num_rows:
            raise DataError(f"the checkpoint was made with {state['num_rows']} training rows, the "
                            f"data now has {self.num_rows}: resume with the same train_data")
        self.epoch, self.pos = state["epoch"], state["pos"]
        self._epoch_seed = state.get("seed", self.seed)  # the epoch goes on as it began (class docstring)
        self._perm = self._permutation(self.epoch)


@dataclass
class PromptBatch:
    """B prompts with their token ids and the other columns of their rows."""

    prompts: list[Any]            # [B] str or list of messages
    prompt_ids: list[list[int]]   # [B][P_b]
    columns: dict[str, list[Any]]  # column -> [B]
    indices: list[int] | None = None  # [B] their rows in the dataset they came from

    @property
    def conversational(self) -> bool:
        return bool(self.prompts) and not isinstance(self.prompts[0], str)


@dataclass(frozen=True)
class ChatForm:
    """chat_prompts and system_prompt: string prompts as a user message each, and a system message first
    in every prompt that has none (applied where prompts load, so that every stage, reward functions and
    multi-turn drivers included, sees the chat messages the model is shown)."""

    chat: bool = False
    system: str | None = None

    @classmethod
    def of(cls, cfg) -> ChatForm:
        return cls(bool(cfg.chat_prompts), cfg.system_prompt)

    def prompt(self, prompt: Any) -> Any:
        """One prompt in the run's form."""
        if isinstance(prompt, str) and (self.chat or self.system is not None):
            prompt = [{"role": "user", "content": prompt}]
        if self.system is not None and not (prompt and prompt[0].get("role") == "system"):
            prompt = [{"role": "system", "content": self.system}, *prompt]
        return prompt

    def dataset(self, ds: Dataset, prompt_column: str) -> Dataset:
        """`ds` with its prompt column in the run's form (itself where nothing changes)."""
        if not self.chat and self.system is None:
            return ds
        from datasets.utils import logging as datasets_logging

        shown = datasets_logging.is_progress_bar_enabled()  # a bar for a column's rewrite is noise
        datasets_logging.disable_progress_bar()
        try:
            return ds.map(lambda row: {prompt_column: self.prompt(row[prompt_column])}, keep_in_memory=True)
        finally:
            if shown:
                datasets_logging.enable_progress_bar()


class PromptFormatter:
    """Turns prompts into token ids: strings as they are, messages through the chat template."""

    def __init__(self, tokenizer, *, max_prompt_length: int | None = None, tools: list[dict] | None = None,
                 template_kwargs: dict[str, Any] | None = None, chat: ChatForm | None = None):
        self.tokenizer = tokenizer
        self.chat = chat or ChatForm()  # rows given to `rows` are put in the run's form, as its datasets are
        self.max_prompt_length = max_prompt_length
        self.tools = tools or None  # tool schemas the chat template shows the model
        self.template_kwargs = dict(template_kwargs or {})  # chat_template_kwargs: e.g. enable_thinking
        self._warned_cut = False  # the first prompt cut to max_prompt_length is logged, the others not

    def checked(self, *datasets: Dataset | None, prompt_column: str = "prompt") -> PromptFormatter:
        """Itself, once the first prompt of each data set given renders (a chat template for chat messages,
        chat messages where tools are set): a run learns of a mismatch before its models load."""
        for ds in datasets:
            if ds is not None and len(ds):
                self.text(ds[0][prompt_column])
        return self

    def text(self, prompt: Any) -> str:
        """A string as it is; messages through the chat template, opening the assistant's turn, or, when the
        last message is the assistant's (a prefill such as "<think>"), continuing it, as TRL does."""
        if isinstance(prompt, str):
            if self.tools:  # a string goes to the model as it is: the tools' schemas would never reach it
                raise DataError(f"a prompt is a plain string ({prompt[:60]!r}) and tools are set: the model learns "
                                "of the tools from the chat template, which renders chat messages only; give the "
                                "prompts as [{'role': 'user', 'content': '...'}]")
            return prompt
        if not getattr(self.tokenizer, "chat_template", None):
            name = getattr(self.tokenizer, "name_or_path", None)
            tokenizer = f"the tokenizer {name!r}" if name else "the tokenizer"
            made = [field for field, on in (("chat_prompts", self.chat.chat), ("system_prompt", self.chat.system
                                                                                is not None)) if on]
            if made:  # the run made the messages: the prompts themselves may be plain strings
                fields = " and ".join(made)
                raise DataError(f"{fields} {'make' if len(made) > 1 else 'makes'} chat messages of the prompts, and "
                                f"{tokenizer} has no chat template to render them: leave {fields} unset to give the "
                                "model the prompts as they are, or set tokenizer to one with a chat template")
            raise DataError(f"a prompt is a list of chat messages but {tokenizer} has no chat template: give "
                            "prompts as plain strings, or set tokenizer to one with a chat template")
        prefill = bool(prompt) and prompt[-1].get("role") == "assistant"
        return self.tokenizer.apply_chat_template(prompt, tools=self.tools, add_generation_prompt=not prefill,
                                                  continue_final_message=prefill, tokenize=False,
                                                  **self.template_kwargs)

    def encode(self, prompt: Any) -> list[int]:
        ids = self.tokenizer(self.text(prompt), add_special_tokens=False)["input_ids"]
        if self.max_prompt_length is not None and len(ids) > self.max_prompt_length:
            if not self._warned_cut:
                logger.warning("a prompt of %d tokens is longer than max_prompt_length=%d: its first %d tokens "
                               "(the left) are dropped, and so for every longer prompt (logged once); raise "
                               "max_prompt_length or set it to null to keep prompts whole",
                               len(ids), self.max_prompt_length, len(ids) - self.max_prompt_length)
                self._warned_cut = True
            ids = ids[-self.max_prompt_length:]  # keep the end: it holds the question
        if not ids:
            raise DataError(f"prompt {prompt!r} encodes to no tokens")
        return ids

    def batch(self, ds: Dataset, indices: list[int], prompt_column: str) -> PromptBatch:
        # every column as Python objects, whatever format the dataset was given; read by index: a
        # `select(...).to_dict()` builds an indices mapping first (1.2 ms against 0.2 for two rows)
        rows = ds.with_format(None)[list(indices)]
        prompts = rows.pop(prompt_column)
        return PromptBatch(prompts, [self.encode(p) for p in prompts], rows, list(indices))

    def rows(self, rows: Dataset | list[Any], prompt_column: str) -> PromptBatch:
        """Every row of a dataset, or of a list of rows with the prompt column, or of prompts
        (strings or chat messages), tokenised."""
        if not isinstance(rows, Dataset):
            rows = rows_dataset([r if isinstance(r, dict) else {prompt_column: r} for r in rows])
        rows = self.chat.dataset(rows, prompt_column)
        check_reserved(rows.column_names, prompt_column, "rows")
        return self.batch(rows, list(range(len(rows))), prompt_column)


def completion_objects(texts: list[str], conversational: bool) -> list[Any]:
    """Completions as reward functions receive them: strings, or TRL's assistant-message lists."""
    if conversational:
        return [[{"role": "assistant", "content": t}] for t in texts]
    return list(texts)


def reward_readers(cfg) -> tuple[str, ...]:
    """The names of a config's reward functions, which read a data set's columns (named when it is missing)."""
    return tuple(spec if isinstance(spec, str) else str(spec.get("name")) for spec in cfg.reward_funcs)


def load_datasets(cfg, train_dataset: Dataset | None = None, eval_dataset: Dataset | None = None
                  ) -> tuple[Dataset, Dataset | None]:
    """The train and eval prompts of a run: in-memory datasets when given, else the config's
    `train_data`/`eval_data`; without eval data, `eval_fraction` of the train rows is held out;
    `max_eval_samples` caps the eval set. `cfg` is a TrainConfig (read, not imported)."""
    readers = reward_readers(cfg)
    chat = ChatForm.of(cfg)
    train = chat.dataset(load_prompts(train_dataset if train_dataset is not None else cfg.train_data,
                                      prompt_column=cfg.prompt_column, name="train_data", reward_funcs=readers),
                         cfg.prompt_column)
    evaluation = None
    if eval_dataset is not None or cfg.eval_data:
        evaluation = chat.dataset(load_prompts(eval_dataset if eval_dataset is not None else cfg.eval_data,
                                               prompt_column=cfg.prompt_column, name="eval_data",
                                               reward_funcs=readers), cfg.prompt_column)
    elif cfg.eval_fraction:
        train, evaluation = split_eval(train, cfg.eval_fraction, cfg.seed)
    if evaluation is not None and cfg.max_eval_samples:
        evaluation = evaluation.select(range(min(cfg.max_eval_samples, len(evaluation))))
    return train, evaluation
