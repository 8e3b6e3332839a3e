"""PromptDataset from Hugging Face datasets (the datasets extra): a Dataset or local files, renamed columns, seeded order, resume."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmcollect.data import keys
from lmcollect.envs import ChatEnv, MathAnswerReward, PromptDataset

datasets = pytest.importorskip("datasets")  # the optional extra; make test installs it

RECORDS = [{"question": f"What is {i} + {i}?", "solution": str(2 * i), "level": i % 3} for i in range(12)]


def test_a_dataset_becomes_rows_with_its_columns_renamed() -> None:
    rows = PromptDataset.from_hf(datasets.Dataset.from_list(RECORDS), columns={"question": "prompt", "solution": "answer"})
    assert len(rows) == 12 and rows[3] == {"prompt": "What is 3 + 3?", "answer": "6", "level": 0}
    with pytest.raises(ValueError, match=r"columns names \['problem'\], which the dataset lacks; its columns"):
        PromptDataset.from_hf(datasets.Dataset.from_list(RECORDS), columns={"problem": "prompt"})
    with pytest.raises(ValueError, match="no 'prompt' key"):
        PromptDataset.from_hf(datasets.Dataset.from_list(RECORDS))  # nothing became the prompt
    with pytest.raises(TypeError, match="pass one split, e.g. dataset\\['train'\\]"):
        PromptDataset.from_hf(datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS)}))


def test_local_dataset_files_are_read_without_a_download(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS), encoding="utf-8")
    datasets.Dataset.from_list(RECORDS).to_parquet(str(tmp_path / "train.parquet"))
    columns = {"question": "prompt", "solution": "answer"}
    from_jsonl = PromptDataset.from_hf(path, columns=columns, shuffle=False)
    from_parquet = PromptDataset.from_hf([tmp_path / "train.parquet"], columns=columns, shuffle=False)
    assert from_jsonl.rows == from_parquet.rows == PromptDataset.from_hf(datasets.Dataset.from_list(RECORDS), columns=columns, shuffle=False).rows
    with pytest.raises(ValueError, match="pass file_format"):
        PromptDataset.from_hf(tmp_path / "train.txt")


def test_the_order_is_seeded_and_the_position_resumes_from_the_state() -> None:
    make = lambda seed: PromptDataset.from_hf(  # noqa: E731
        datasets.Dataset.from_list(RECORDS), columns={"question": "prompt", "solution": "answer"}, seed=seed
    )
    first = make(7)
    order = [first.next_index() for _ in range(5)]
    same_seed, other_seed = make(7), make(8)
    assert order == [same_seed.next_index() for _ in range(5)]
    assert order != [other_seed.next_index() for _ in range(5)]
    state = first.state_dict()
    resumed = make(0)
    resumed.load_state_dict(state)
    assert [resumed.next_index() for _ in range(20)] == [first.next_index() for _ in range(20)]  # across an epoch


def test_an_env_runs_on_a_hf_dataset() -> None:
    dataset = PromptDataset.from_hf(datasets.Dataset.from_list(RECORDS), columns={"question": "prompt", "solution": "answer"})
    env = ChatEnv(dataset, reward_fn=MathAnswerReward(), batch_size=4, repeats=2, seed=0)
    td = env.reset()
    td[keys.HISTORY_FULL] = [p.append("assistant", s["answer"]) for p, s in zip(td[keys.HISTORY_PROMPT], env.current_samples)]
    assert env.step(td)["next", keys.REWARD].flatten().tolist() == [1.0] * 4
