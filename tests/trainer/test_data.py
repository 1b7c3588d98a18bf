"""Prompt datasets: every file format, the eval split, and the sampler's resumable order."""

import json
import os
import re

import pytest
from datasets import Dataset

from grouprl.config import ConfigError
from grouprl.data import DataError, PromptSampler, load_prompts, split_eval

ROWS = [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_each_file_format_loads_the_same_rows(tmp_path, suffix):
    path = tmp_path / f"rows{suffix}"
    ds = Dataset.from_list(ROWS)
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif suffix == ".csv":
        ds.to_csv(str(path), index=False)
    else:
        ds.to_parquet(str(path))
    loaded = load_prompts(str(path))
    assert loaded["prompt"] == [r["prompt"] for r in ROWS]
    assert [str(a) for a in loaded["answer"]] == [r["answer"] for r in ROWS]


def test_unsupported_or_unreadable_files_name_the_problem(tmp_path):
    bad = tmp_path / "rows.txt"
    bad.write_text("hello")
    with pytest.raises(DataError, match="unsupported file type '.txt'"):
        load_prompts(str(bad))
    broken = tmp_path / "rows.jsonl"
    broken.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(DataError, match=r"rows.jsonl': line 2 is not valid JSON \(Expecting value at column 11\)"):
        load_prompts(str(broken))
    for folder in (tmp_path / "rows_dir.jsonl", tmp_path / "rows_dir"):  # without a suffix it was "unsupported
        folder.mkdir()                                                    # file type ''"
        with pytest.raises(DataError, match=f"train_data='{folder}' is a folder: name the data file in it"):
            load_prompts(str(folder))
    fifo = tmp_path / "rows_pipe.jsonl"  # what the shell's <(...) gives: it was called a folder
    os.mkfifo(fifo)
    with pytest.raises(DataError, match=f"train_data='{fifo}' is not a regular file \\(a pipe or a device\\)"):
        load_prompts(str(fifo))


def test_a_missing_file_names_the_field_where_relative_paths_start_and_what_the_file_holds(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_prompts("nope.txt", name="eval_data", reward_funcs=("math_accuracy", "my.rewards:short"))  # before
    assert str(err.value) == (  # its file type is judged
        f"eval_data='nope.txt' does not exist: check the path (relative paths are resolved from {tmp_path}), or "
        "make the file. It holds the eval prompts: .jsonl (one JSON object per line), .json, .csv or .parquet, "
        "with a 'prompt' column (a string, or chat messages [{\"role\": \"user\", \"content\": \"...\"}]) and "
        "the columns the reward functions (math_accuracy, my.rewards:short) read, e.g. {\"prompt\": \"What is "
        "6 times 7?\", \"answer\": \"42\"} for math_accuracy (docs/rewards.md lists the columns of each built-in "
        "reward)")


def test_split_eval_is_disjoint_and_seeded():
    ds = Dataset.from_list(ROWS)
    train, held = split_eval(ds, 0.3, seed=1)
    assert len(held) == 3 and len(train) == 7
    assert not set(train["prompt"]) & set(held["prompt"])
    assert split_eval(ds, 0.3, seed=1)[1]["prompt"] == held["prompt"]


def test_sampler_covers_each_epoch_and_resumes_mid_epoch():
    a = PromptSampler(10, seed=3)
    first = a.next(10)
    assert sorted(first) == list(range(10))
    a.next(4)
    state = a.state_dict()
    b = PromptSampler(10, seed=3)
    b.load_state_dict(state)
    assert a.next(9) == b.next(9)  # crosses into the next epoch identically
    with pytest.raises(DataError, match="same train_data"):
        PromptSampler(11, seed=3).load_state_dict(state)



def test_a_run_resumed_with_another_seed_finishes_the_epoch_it_began():
    """seed 0 -> 1 on resume, mid-epoch: the epoch goes on with its permutation (a new permutation from
    the old position drew 47 distinct prompts of 64 in a review's run), the next epochs follow seed 1,
    and a second resume in the same epoch goes on the same way."""
    a = PromptSampler(64, seed=0)
    first = a.next(32)
    b = PromptSampler(64, seed=1)
    b.load_state_dict(a.state_dict())
    rest = b.next(16)
    c = PromptSampler(64, seed=1)
    c.load_state_dict(b.state_dict())  # resumed again, still in epoch 0
    rest += c.next(16)
    assert sorted(first + rest) == list(range(64))
    assert c.next(64) == PromptSampler(64, seed=1)._permutation(1)  # epoch 1: seed 1's


@pytest.mark.parametrize("fmt", [None, "torch", "columns"])
def test_prompt_batch_reads_the_drawn_rows_as_python_objects_whatever_the_format(fmt):
    """The drawn rows in the drawn order (a row drawn twice comes twice), every column as Python
    objects: a dataset given a torch format, or one showing only some columns, reads as a plain one."""
    from grouprl.data import PromptFormatter
    from grouprl.tasks.testing import build_char_tokenizer

    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i), "ids": [i, i + 1]} for i in range(6)]
    ds = Dataset.from_list(rows)
    if fmt == "torch":
        ds = ds.with_format("torch")
    elif fmt == "columns":
        ds = ds.with_format(None, columns=["prompt"])
    formatter = PromptFormatter(build_char_tokenizer())
    formatter.encode = lambda prompt: [len(prompt[0]["content"])]  # this tokenizer has no chat template
    batch = formatter.batch(ds, [4, 1, 4], "prompt")
    assert batch.prompts == [rows[4]["prompt"], rows[1]["prompt"], rows[4]["prompt"]]
    assert batch.columns == {"answer": ["4", "1", "4"], "ids": [[4, 5], [1, 2], [4, 5]]}
    assert batch.indices == [4, 1, 4] and batch.prompt_ids == [[2], [2], [2]]


def test_a_chat_message_with_an_unknown_role_is_refused_at_load_naming_the_row_and_the_roles():
    """A role no template knows passed the load and failed mid-run ("encodes to no tokens"), or, with
    a permissive template, rendered as nothing."""
    rows = [{"prompt": [{"role": "user", "content": "q0"}]},
            {"prompt": [{"role": "system", "content": "s"}, {"role": "bot", "content": "q1"}]}]
    with pytest.raises(DataError, match="train_data row 1: 'prompt' has a message with role 'bot', which is not one "
                                        "of system, user, assistant, tool"):
        load_prompts(rows)
    roles = ["system", "user", "assistant", "tool"]
    assert len(load_prompts([{"prompt": [{"role": r, "content": "x"} for r in roles]}])) == 1


@pytest.mark.parametrize("name, text", [("rows.jsonl", ""), ("rows.jsonl", "\n  \n"), ("rows.json", ""),
                                        ("rows.json", "[ ]\n"), ("rows.json", "{}"), ("rows.csv", ""),
                                        ("rows.parquet", None)])
def test_an_empty_file_has_no_rows(tmp_path, name, text):
    """Was "could not be read as .jsonl: StopIteration" (or the csv reader's DatasetGenerationError, as
    for a Parquet file with columns and no rows)."""
    path = tmp_path / name
    if name.endswith(".parquet"):
        Dataset.from_dict({"prompt": []}).to_parquet(str(path))
    else:
        path.write_text(text)
    with pytest.raises(DataError, match=f"eval_data='{path}' has no rows: it needs at least one prompt"):
        load_prompts(str(path), name="eval_data")


def test_a_prompt_cut_to_max_prompt_length_is_logged_once(caplog):
    from grouprl.data import PromptFormatter
    from grouprl.tasks.testing import build_char_tokenizer

    formatter = PromptFormatter(build_char_tokenizer(), max_prompt_length=3)
    with caplog.at_level("WARNING", logger="grouprl.data"):
        assert formatter.encode("abc") == formatter.encode("xxabc") == formatter.encode("yyyyyabc")
    assert [r.getMessage() for r in caplog.records] == [
        "a prompt of 5 tokens is longer than max_prompt_length=3: its first 2 tokens (the left) are dropped, and so "
        "for every longer prompt (logged once); raise max_prompt_length or set it to null to keep prompts whole"]


def test_a_datasetdict_gives_its_train_split_or_for_eval_its_test_split(caplog):
    """`load_dataset(name)` without `split=` is a DatasetDict; it reached `source.startswith` (AttributeError)."""
    from datasets import DatasetDict

    splits = DatasetDict(train=Dataset.from_list(ROWS[:6]), test=Dataset.from_list(ROWS[6:]))
    with caplog.at_level("INFO", logger="grouprl.data"):
        assert load_prompts(splits)["prompt"] == [r["prompt"] for r in ROWS[:6]]
        assert load_prompts(splits, name="eval_data")["prompt"] == [r["prompt"] for r in ROWS[6:]]
    assert "train_data is a DatasetDict with the splits ['train', 'test']: using its 'train' split" in caplog.text
    both = DatasetDict(train=splits["train"], validation=splits["test"], test=splits["test"])
    with pytest.raises(DataError, match=r"eval_data is a DatasetDict with the splits \['train', 'validation', "
                                        r"'test'\]: pass one split, e.g. dataset\['test'\]"):
        load_prompts(both, name="eval_data")
    with pytest.raises(DataError, match=r"train_data is a DatasetDict with the splits \['a', 'b'\]: pass one split"):
        load_prompts(DatasetDict(a=splits["train"], b=splits["test"]))


def test_a_dataframe_an_iterable_dataset_or_a_path_load_and_anything_else_is_named(tmp_path):
    expected = [r["prompt"] for r in ROWS]
    assert load_prompts(Dataset.from_list(ROWS).to_pandas())["prompt"] == expected
    assert load_prompts(Dataset.from_list(ROWS).to_iterable_dataset())["prompt"] == expected
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert load_prompts(path)["prompt"] == expected
    with pytest.raises(DataError, match="train_data is a dict: give a file path, 'builtin:NAME', a datasets.Dataset"):
        load_prompts({"prompt": ["q"]})


def test_csv_cells_keep_their_text(tmp_path):
    """Type inference read the answer "007" as 7, "3.10" as 3.1 and "NA" as None; an empty cell stays a
    missing value (None), as before."""
    path = tmp_path / "rows.csv"
    path.write_text('prompt,answer\n"code?","007"\n"pi?","3.10"\n"sodium?","NA"\n"none?",\n')
    assert load_prompts(str(path))["answer"] == ["007", "3.10", "NA", None]


def test_rows_keep_every_column_and_a_mixed_column_is_named():
    """Dataset.from_list took the columns of the first row only, and a column of 5 and "x" raised pyarrow's
    ArrowInvalid, which names no column."""
    from grouprl.data import PromptFormatter
    from grouprl.tasks.testing import build_char_tokenizer

    rows = [{"prompt": "What is 2 + 3?"}, {"prompt": "What is 7 + 8?", "answer": "15"}]
    assert load_prompts(rows)["answer"] == [None, "15"]
    assert PromptFormatter(build_char_tokenizer()).rows(rows, "prompt").columns == {"answer": [None, "15"]}
    with pytest.raises(DataError, match=r"train_data: column 'answer' mixes types \(int in row 0, str in row 2\)"):
        load_prompts([{"prompt": "a", "answer": 5}, {"prompt": "b"}, {"prompt": "c", "answer": "x"}])


@pytest.mark.parametrize("column", ["prompts", "completions", "completion_ids", "completion_lengths"])
def test_a_column_named_like_an_argument_of_the_reward_functions_is_refused(column):
    """It replaced the trainer's own argument (prompts, completions) or was replaced by it, without a word."""
    with pytest.raises(DataError, match=f"train_data has a column named '{column}', a keyword argument the trainer "
                                        "passes to reward functions itself .*: rename the column"):
        load_prompts([{"prompt": "q", column: "x"}])
    assert len(load_prompts([{column: "q"}], prompt_column=column)) == 1  # the prompt column itself is not passed


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_file_that_is_not_utf8_is_refused_when_it_loads_naming_the_line(tmp_path, suffix):
    """A latin-1 "é" in the answer of the 101st row: the readers keep such bytes in columns they do not
    decode, so the run failed at the step that drew the row, naming neither the file nor the line."""
    path = tmp_path / f"data{suffix}"
    good = [json.dumps({"prompt": f"q{i}", "answer": "a"}) if suffix == ".jsonl" else f"q{i},a" for i in range(100)]
    bad = '{"prompt": "q", "answer": "caf\xe9"}' if suffix == ".jsonl" else "q,caf\xe9"
    header = [] if suffix == ".jsonl" else ["prompt,answer"]
    path.write_bytes("\n".join(header + good).encode() + b"\n" + bad.encode("latin-1") + b"\n")
    line = 101 + len(header)
    with pytest.raises(DataError, match=f"line {line} is not UTF-8 .byte 0xe9 at byte .* re-save the file as UTF-8"):
        load_prompts(str(path))


def test_prompts_of_both_forms_are_refused(tmp_path):
    """A batch's completions are strings or messages as its first prompt is: a JSON Lines file mixing the
    forms (which its reader takes) gave one form or the other depending on which row came first."""
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"prompt": [{"role": "user", "content": "x"}]}\n{"prompt": "a"}\n')
    with pytest.raises(DataError, match="mixes prompt forms: line 2 is a string, line 1 chat messages"):
        load_prompts(str(path))


def test_chat_template_kwargs_reach_the_template(make_cfg, tmp_path, tiny_model_dir):
    """chat_template_kwargs ({enable_thinking: false}, Qwen3's switch) render the trainer's prompts; the
    arguments grouprl sets itself are refused."""
    from grouprl.config import ConfigError
    from grouprl.tasks.testing import build_char_tokenizer
    from grouprl.trainer import Trainer

    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and "
                         "not enable_thinking %}[no think]{% endif %}{% endif %}")
    tok.save_pretrained(tmp_path / "tok")
    question = [[{"role": "user", "content": "6*7?"}]]
    texts = {}
    for kwargs in ({}, {"enable_thinking": False}):
        trainer = Trainer(make_cfg(tokenizer=str(tmp_path / "tok"), chat_template_kwargs=kwargs))
        texts[str(kwargs)] = trainer.tokenizer.decode(trainer.prompts(question).prompt_ids[0])
    assert texts == {"{}": "<user>6*7?<assistant>", "{'enable_thinking': False}": "<user>6*7?<assistant>[no think]"}
    with pytest.raises(ConfigError, match="chat_template_kwargs sets add_generation_prompt, tools, which grouprl "
                                          "sets itself"):
        make_cfg(chat_template_kwargs={"tools": [], "add_generation_prompt": False}).validate()


def test_a_prompt_ending_with_the_assistant_continues_its_message():
    """A prefill ("<think>") was closed and a new assistant turn opened after it; TRL continues it."""
    from grouprl.data import PromptFormatter
    from grouprl.tasks.testing import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</>\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    formatter = PromptFormatter(tok)
    question = [{"role": "user", "content": "6*7?"}]
    assert formatter.text(question) == "<user>6*7?</>\n<assistant>"
    prefilled = question + [{"role": "assistant", "content": "<think>"}]
    assert formatter.text(prefilled) == "<user>6*7?</>\n<assistant><think>"


def test_a_datasets_dataset_by_name_gives_the_split_its_role_means_or_the_one_named(tmp_path, monkeypatch):
    """`hf:NAME[:CONFIG][@SPLIT]` (here a local folder of data files, which datasets reads offline as it
    reads the hub's cache): the train split for train_data, the test split for eval_data, or the split
    named, in datasets' own forms; a dataset that cannot be loaded is named with the fix."""
    folder = tmp_path / "qa"
    folder.mkdir()
    for split, n in (("train", 5), ("test", 3)):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({"question": f"{split} {i}", "answer": str(i)}) + "\n"
                                                      for i in range(n)))
    source = f"hf:{folder}"
    train = load_prompts(source, prompt_column="question")
    assert train["question"] == [f"train {i}" for i in range(5)]
    held_out = load_prompts(source, name="eval_data", prompt_column="question")
    assert held_out["question"] == [f"test {i}" for i in range(3)]
    assert load_prompts(f"{source}@train[:2]", prompt_column="question")["answer"] == ["0", "1"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match=r"train_data='hf:no-such-org/no-such-set': datasets could not load it \(.*\); "
                                        r"HF_HUB_OFFLINE is set, so only a copy in the cache can be read: load it once "
                                        r"online \(`hf download --repo-type dataset no-such-org/no-such-set`\)"):
        load_prompts("hf:no-such-org/no-such-set")
    with pytest.raises(DataError, match="names no dataset: write hf:NAME"):
        load_prompts("hf:")
    from grouprl.config.io import absolute_paths

    monkeypatch.chdir(tmp_path)  # a run's config.yaml names a local folder from anywhere; hub names stay as they are
    assert absolute_paths({"train_data": "hf:qa@train[:2]", "eval_data": "hf:openai/gsm8k:main"}) == {
        "train_data": f"hf:{folder}@train[:2]", "eval_data": "hf:openai/gsm8k:main"}
    other = tmp_path / "other" / "data"  # two splits, neither named train or test
    other.mkdir(parents=True)
    for split in ("alpha", "beta"):
        (other / f"{split}-00000-of-00001.jsonl").write_text(json.dumps({"question": split}) + "\n")
    with pytest.raises(DataError, match=r"has the splits \['alpha', 'beta'\], and none is the one train_data "
                                        r"means: name one after @, e.g. hf:.*other@alpha"):
        load_prompts(f"hf:{other.parent}", prompt_column="question")


def test_chat_prompts_and_a_system_prompt_put_every_prompt_in_chat_form(make_cfg, tmp_path):
    """A dataset of string prompts (GSM8K's `question`) for an instruct model: a string went to the model as
    it is, without the chat template. chat_prompts makes each a user message; system_prompt puts a system
    message first, in string and chat prompts alike, unless a prompt starts with one of its own."""
    from grouprl.data import ChatForm, PromptFormatter, load_datasets

    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in ("one?", "two?")))
    user = [[{"role": "user", "content": q}] for q in ("one?", "two?")]
    plain = make_cfg(train_data=str(path), prompt_column="question", eval_data=str(path))
    assert load_datasets(plain)[0]["question"] == ["one?", "two?"]  # as it was
    train, held_out = load_datasets(make_cfg(**{**plain.to_dict(), "chat_prompts": True}))
    assert train["question"] == user and held_out["question"] == user
    system = {"role": "system", "content": "Think, then answer."}
    train, _ = load_datasets(make_cfg(**{**plain.to_dict(), "system_prompt": "Think, then answer."}))
    assert train["question"] == [[system, *m] for m in user]
    own = {"role": "system", "content": "Mine."}
    chat = ChatForm(system="Think, then answer.")
    assert chat.prompt([own, *user[0]]) == [own, *user[0]] and chat.prompt(user[1]) == [system, *user[1]]

    class Template:  # what the formatter renders: the messages it is given
        chat_template = "x"

        def apply_chat_template(self, messages, **kwargs):
            return repr(messages)

        def __call__(self, text, **kwargs):
            return {"input_ids": [len(text)]}

    rows = PromptFormatter(Template(), chat=chat).rows(["one?"], "prompt")  # Trainer.prompts: as in training
    assert rows.prompts == [[system, *user[0]]]


@pytest.mark.parametrize("overrides, fields", [({"chat_prompts": True}, "chat_prompts makes"),
                                               ({"system_prompt": "Think."}, "system_prompt makes"),
                                               ({"chat_prompts": True, "system_prompt": "Think."},
                                                "chat_prompts and system_prompt make")])
def test_chat_prompts_for_a_tokenizer_without_a_chat_template_fail_before_any_model_loads(make_cfg, no_model_loading,
                                                                                          overrides, fields):
    """The test's character tokenizer has no chat template: prompts made chat messages cannot be shown to
    the model, which a run learned at its first step, after the policy (and a teacher) had loaded. The
    prompts are plain strings: the fields that made them messages are named (the error said to give plain
    strings)."""
    from grouprl.trainer import Trainer

    cfg = make_cfg(**overrides)
    setting = fields.rpartition(" ")[0]
    with pytest.raises(DataError, match=re.escape(
            f"{fields} chat messages of the prompts, and the tokenizer '{cfg.model}' has no chat template to render "
            f"them: leave {setting} unset to give the model the prompts as they are, or set tokenizer to one with "
            "a chat template")):
        Trainer(cfg)


def test_chat_message_prompts_for_a_tokenizer_without_a_chat_template_name_the_tokenizer(make_cfg, no_model_loading,
                                                                                         tmp_path):
    from grouprl.trainer import Trainer

    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1?"}]}) + "\n")
    cfg = make_cfg(train_data=str(data))
    with pytest.raises(DataError, match=re.escape(f"a prompt is a list of chat messages but the tokenizer "
                                                  f"'{cfg.model}' has no chat template: give prompts as plain "
                                                  "strings, or set tokenizer to one with a chat template")):
        Trainer(cfg)


def test_an_eval_dataset_by_name_with_a_test_and_a_validation_split_asks_which(tmp_path, monkeypatch):
    """eval_data: hf:NAME with both held-out splits said "none is the one eval_data means" and suggested
    @train (its first split), the rows trained on; a local folder's unknown @SPLIT was told to download the
    folder from the hub (`hf download --repo-type dataset /tmp/...`)."""
    folder = tmp_path / "qa"
    folder.mkdir()
    for split in ("train", "validation", "test"):
        (folder / f"{split}.jsonl").write_text(json.dumps({"prompt": split}) + "\n")
    with pytest.raises(DataError, match=r"eval_data='hf:.*qa' has both a test and a validation split \(\['train', "
                                        r"'validation', 'test'\]\), so which one eval_data means is ambiguous: name "
                                        r"it after @, hf:.*qa@test or hf:.*qa@validation$"):
        load_prompts(f"hf:{folder}", name="eval_data")
    assert load_prompts(f"hf:{folder}@validation", name="eval_data")["prompt"] == ["validation"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match=r"eval_data='hf:.*qa@bogus': datasets could not load it \(ValueError: Unknown "
                                        r"split \"bogus\".*\); .*qa is a local folder, read where it is: @SPLIT must "
                                        r"name one of its splits \['train', 'validation', 'test'\] \(e.g. "
                                        r"hf:.*qa@test\) or be left out") as err:
        load_prompts(f"hf:{folder}@bogus", name="eval_data")
    assert "hf download" not in str(err.value) and "HF_HUB_OFFLINE" not in str(err.value)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_a_malformed_row_of_a_file_is_named_as_the_file_counts_it(tmp_path, suffix):
    """"row 1" was the 0-based index in the dataset, while the pre-scan's "line N" counts from 1, and the
    JSON Lines reader skips blank lines: the empty prompt on line 4 below was "row 1"."""
    path = tmp_path / f"rows{suffix}"
    rows = [{"prompt": "a"}, {"prompt": None}]
    if suffix == ".jsonl":
        path.write_text('\n  \n{"prompt": "a"}\n{"prompt": ""}\n')
        where = "line 4: 'prompt' is an empty string"
    elif suffix == ".csv":
        path.write_text("prompt\na\n\"\"\n")
        where = r"row 2 after the header \(counting from 1\): 'prompt' is NoneType None"
    else:
        Dataset.from_list(rows).to_parquet(str(path))
        where = r"row 2 \(counting from 1\): 'prompt' is NoneType None"
    with pytest.raises(DataError, match=f"train_data='{path}' {where}; a prompt is a non-empty string"):
        load_prompts(str(path))
    with pytest.raises(DataError, match="train_data row 1: 'prompt' is NoneType None"):  # rows in memory: the index
        load_prompts(rows)


def test_a_json_file_pandas_wrote_by_columns_is_named_with_how_to_write_it_by_rows(tmp_path):
    """pandas' `df.to_json(path)` writes {"prompt": {"0": "a", "1": "b"}}, which read as one row whose
    prompt is a dict: "row 0: 'prompt' is dict {'0': 'a', '1': 'b'}"."""
    import pandas as pd

    frame = pd.DataFrame({"prompt": ["a", "b"], "answer": ["1", "2"]})
    path = tmp_path / "rows.json"
    frame.to_json(path)
    with pytest.raises(DataError, match=rf"train_data='{path}' is one JSON object of columns, each keyed by row "
                                        r"number .* as pandas' DataFrame.to_json\(\) writes by default "
                                        r"\(orient='columns'\): write one object per row, df.to_json\(path, "
                                        r"orient='records'\) for .json, or .*lines=True\) for .jsonl"):
        load_prompts(str(path))
    frame.to_json(path, orient="records")
    assert load_prompts(str(path)).to_list() == frame.to_dict("records")
    one = tmp_path / "one.jsonl"  # one row with a dict column keyed by numbers is a row
    one.write_text('{"prompt": "q", "meta": {"0": "x"}}\n')
    assert load_prompts(str(one))["meta"] == [{"0": "x"}]
