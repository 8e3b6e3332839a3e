"""The rollout report: dialogs from turn rows, one self-contained page, its data, and `lmcollect view`."""
from __future__ import annotations

import json
import random
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from lmcollect.cli.main import main
from lmcollect.cli.rollouts import write_records
from lmcollect.viewer import group_dialogs, read_rollout_records, write_rollout_report
from lmcollect.viewer.report import DATA_ELEMENT_ID

BIG_ID = (1 << 62) + 5  # collectors number ids in 2**32 blocks: often past 2**53, where JavaScript numbers lose digits
SYSTEM = "<|im_start|>user\nGuess a number.<|im_end|>\n<|im_start|>assistant\n"
REPLY = "<|im_end|>\n<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n"


def turn_row(traj_id: int, step: int, prompt: str, response: str, **overrides: Any) -> dict[str, Any]:
    """A row as `lmcollect collect` writes it, with one response token per character."""
    row = {
        "prompt": prompt, "response": response, "tokens_prompt": list(range(len(prompt))),
        "tokens_response": [ord(c) for c in response], "log_probs": [-0.5] * len(response),
        "reward": 0.0, "done": False, "policy_version": 3, "traj_id": traj_id, "step": step,
        "prompt_id": 0, "group_id": BIG_ID,
    }
    return {**row, **overrides}


def guessing_rows() -> list[dict[str, Any]]:
    """A three-turn dialog (versions 3 then 4, reward at the end) and a one-turn dialog, shuffled."""
    first = SYSTEM + "5"
    second = first + REPLY + "9"
    rows = [
        turn_row(BIG_ID, 0, SYSTEM, "5"),
        turn_row(BIG_ID, 1, first + REPLY, "9", policy_version=4),
        turn_row(BIG_ID, 2, second + REPLY, "12", policy_version=4, reward=1.0, done=True),
        turn_row(BIG_ID + 1, 0, SYSTEM, "3", reward=-1.0, done=True, group_id=BIG_ID + 1, prompt_id=1),
    ]
    random.Random(0).shuffle(rows)
    return rows


class _PageParser(HTMLParser):
    """The page's elements that could load anything, and the text of each script element."""

    def __init__(self) -> None:
        super().__init__()
        self.loading_attrs: list[tuple[str, str]] = []
        self.scripts: list[tuple[dict[str, str | None], str]] = []
        self._in_script: dict[str, str | None] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.loading_attrs += [(tag, name) for name, _ in attrs if name in ("src", "href", "srcset", "data")]
        if tag == "link":
            self.loading_attrs.append((tag, "link"))
        if tag == "script":
            self._in_script = dict(attrs)
            self.scripts.append((self._in_script, ""))

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = None

    def handle_data(self, data: str) -> None:
        if self._in_script is not None:
            attrs, text = self.scripts[-1]
            self.scripts[-1] = (attrs, text + data)


def parse_page(path: Path) -> _PageParser:
    parser = _PageParser()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def page_data(path: Path) -> dict[str, Any]:
    scripts = [text for attrs, text in parse_page(path).scripts if attrs.get("id") == DATA_ELEMENT_ID]
    assert len(scripts) == 1
    return json.loads(scripts[0])


# ---------------------------------------------------------------------------------------- dialogs
def test_turns_are_grouped_by_trajectory_and_ordered_by_step() -> None:
    dialogs = {d.traj_id: d for d in group_dialogs(guessing_rows())}
    assert sorted(dialogs) == [BIG_ID, BIG_ID + 1]
    long = dialogs[BIG_ID]
    assert [t.step for t in long.turns] == [0, 1, 2]
    assert [t.response for t in long.turns] == ["5", "9", "12"]
    assert (long.reward, long.policy_versions, long.done, long.group_id) == (1.0, [3, 4], True, BIG_ID)
    assert (long.num_prompt_tokens, long.num_response_tokens) == (len(SYSTEM), 4)
    assert dialogs[BIG_ID + 1].reward == -1.0


def test_later_turns_show_only_the_prompt_text_they_add() -> None:
    turns = next(d for d in group_dialogs(guessing_rows()) if d.traj_id == BIG_ID).turns
    assert (turns[0].prompt_text, turns[0].prompt_is_continuation) == (SYSTEM, False)
    assert [(t.prompt_text, t.prompt_is_continuation) for t in turns[1:]] == [(REPLY, True), (REPLY, True)]


def test_a_prompt_that_does_not_extend_the_previous_turn_is_shown_whole() -> None:
    rows = [turn_row(1, 0, "first prompt", "a"), turn_row(1, 1, "a fresh prompt", "b")]
    turns = group_dialogs(rows)[0].turns
    assert (turns[1].prompt_text, turns[1].prompt_is_continuation) == ("a fresh prompt", False)


def test_the_tokenizer_gives_each_response_token_its_text(tiny_model_and_tokenizer) -> None:
    _, tokenizer = tiny_model_and_tokenizer
    response = "Higher or lower? I guess 12, then 7.\nDone"
    tokens = tokenizer.encode(response, add_special_tokens=False)
    row = turn_row(1, 0, SYSTEM, response, tokens_response=tokens, log_probs=[-1.0] * len(tokens))
    turn = group_dialogs([row], tokenizer=tokenizer)[0].turns[0]
    assert len(turn.token_texts) == len(tokens) > 1
    assert "".join(turn.token_texts) == response
    assert group_dialogs([row])[0].turns[0].token_texts is None  # no tokenizer: the page shows ids


def test_token_versions_are_carried_when_the_file_has_them() -> None:
    rows = [turn_row(1, 0, SYSTEM, "ab", token_versions=[3, 4]), turn_row(2, 0, SYSTEM, "c")]
    first, second = group_dialogs(rows)
    assert (first.turns[0].token_versions, second.turns[0].token_versions) == ([3, 4], None)


def test_missing_columns_are_named(tmp_path: Path) -> None:
    path = tmp_path / "rollouts.jsonl"
    path.write_text(json.dumps({"traj_id": 1, "step": 0, "response": "x"}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"missing columns \['tokens_response', 'log_probs', 'reward'\]"):
        read_rollout_records(path)


# ---------------------------------------------------------------------------------------- the page
def test_the_page_is_one_file_that_loads_nothing(tmp_path: Path) -> None:
    path = write_rollout_report(guessing_rows(), tmp_path / "report.html", title="guessing")
    page = parse_page(path)
    assert page.loading_attrs == []  # no src, href, <link>: no CDN, no server
    assert [attrs.get("src") for attrs, _ in page.scripts] == [None, None]
    text = path.read_text(encoding="utf-8")
    assert "@import" not in text and "url(" not in text and "<title>guessing</title>" in text


def test_the_data_keeps_ids_exact_and_every_turn(tmp_path: Path) -> None:
    data = page_data(write_rollout_report(guessing_rows(), tmp_path / "report.html"))
    by_traj = {d["traj"]: d for d in data["dialogs"]}
    assert sorted(by_traj) == [str(BIG_ID), str(BIG_ID + 1)]  # strings: exact in JavaScript
    long = by_traj[str(BIG_ID)]
    assert (long["group"], long["reward"], long["versions"], long["done"]) == (str(BIG_ID), 1.0, [3, 4], True)
    assert [t["response"] for t in long["turns"]] == ["5", "9", "12"]
    assert long["turns"][2]["tokens"] == [ord("1"), ord("2")] and long["turns"][2]["log_probs"] == [-0.5, -0.5]
    assert (data["has_token_texts"], data["has_token_versions"], data["num_dialogs_in_source"]) == (False, False, 2)


def test_text_that_looks_like_markup_stays_data(tmp_path: Path) -> None:
    nasty = "</script><script>alert(1)</script> <!-- {{script}} & {{data}}"
    rows = [turn_row(1, 0, nasty, nasty, reward=float("nan"), log_probs=[float("-inf")] + [-0.5] * (len(nasty) - 1))]
    path = write_rollout_report(rows, tmp_path / "report.html", title="<b>{{style}}</b>")
    page = parse_page(path)
    assert len(page.scripts) == 2  # the data element and the page's script, nothing injected
    turn = page_data(path)["dialogs"][0]["turns"][0]
    assert turn["response"] == nasty and turn["prompt"] == nasty
    assert (turn["reward"], turn["log_probs"][0]) == (None, None)  # JSON has no NaN or -inf
    assert "<title>&lt;b&gt;{{style}}&lt;/b&gt;</title>" in path.read_text(encoding="utf-8")


def test_parquet_and_jsonl_files_give_the_same_dialogs(tmp_path: Path) -> None:
    rows = guessing_rows()
    reports = []
    for suffix in (".parquet", ".jsonl"):
        source = write_records(rows, tmp_path / f"rollouts{suffix}")
        data = page_data(write_rollout_report(source, tmp_path / f"report{suffix}.html"))
        assert data["source"] == source.name
        reports.append(data["dialogs"])
    assert reports[0] == reports[1] == page_data(write_rollout_report(rows, tmp_path / "r.html"))["dialogs"]


def test_max_dialogs_keeps_the_last_dialogs(tmp_path: Path) -> None:
    rows = [turn_row(traj_id, 0, SYSTEM, "1") for traj_id in range(10)]
    data = page_data(write_rollout_report(rows, tmp_path / "report.html", max_dialogs=3))
    assert [d["traj"] for d in data["dialogs"]] == ["7", "8", "9"]
    assert data["num_dialogs_in_source"] == 10


# ---------------------------------------------------------------------------------------- lmcollect view
def test_view_writes_the_report_next_to_the_rollouts(tmp_path: Path, capsys) -> None:
    source = write_records(guessing_rows(), tmp_path / "rollouts.parquet")
    assert main(["view", "--rollouts", str(source)]) == 0
    assert f"wrote {tmp_path / 'rollouts.html'}" in capsys.readouterr().out
    assert len(page_data(tmp_path / "rollouts.html")["dialogs"]) == 2


def test_view_decodes_tokens_with_the_model_folders_tokenizer(tmp_path: Path, tiny_model_path: Path) -> None:
    source = write_records(guessing_rows(), tmp_path / "rollouts.jsonl")
    out = tmp_path / "out" / "page.html"
    assert main(["view", "--rollouts", str(source), "--model", str(tiny_model_path), "--output", str(out)]) == 0
    data = page_data(out)
    assert data["has_token_texts"] is True
    assert all(len(t["token_texts"]) == len(t["tokens"]) for d in data["dialogs"] for t in d["turns"])


def _view_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["view", *argv])
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_view_reports_bad_input(tmp_path: Path, capsys) -> None:
    assert "--rollouts is required" in _view_error([], capsys)
    assert "--rollouts must be a .parquet or .jsonl file" in _view_error(["--rollouts", "x.csv"], capsys)
    assert f"--rollouts {tmp_path / 'nope.jsonl'}: no such file" in _view_error(["--rollouts", str(tmp_path / "nope.jsonl")], capsys)
    assert "--output must end with .html" in _view_error(["--rollouts", "x.jsonl", "--output", "x.png"], capsys)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    assert f"--rollouts {empty}: no rows" in _view_error(["--rollouts", str(empty)], capsys)
    assert "no such folder" in _view_error(["--rollouts", str(write_records(guessing_rows(), tmp_path / "r.jsonl")),
                                            "--model", str(tmp_path / "missing")], capsys)
