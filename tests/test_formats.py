"""Agent-log readers: hand-made fixtures with exact Calls, then the real logs in ../shared/agent-data."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from specx.store.formats import FORMATS, Call, ParseError, detect, read_calls
from specx.store.formats._source import HEAD_BYTES, head_text

FIXTURES = Path(__file__).parent / "fixtures" / "formats"
AGENT_DATA = Path(__file__).parents[2] / "shared" / "agent-data"


def read_all(path: Path, format: str | None = None) -> tuple[list[Call], list[ParseError]]:
    calls, errors = [], []
    for item in read_calls(path, format):
        (errors if isinstance(item, ParseError) else calls).append(item)
    return calls, errors


def messages(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in pairs]


# --- detection ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("openhands_output.jsonl", "openhands"),
        ("opendevin_output.jsonl", "openhands"),
        ("openhands_runtime.json", "openhands"),
        ("openhands_logs", "openhands"),
        ("openhands_logs/prompt_001.log", "openhands"),
        ("openhands_logs/response_002.log", "openhands"),
        ("openhands_logs/prompt_003.log", None),  # no response beside it
        ("swe_agent/demo__repo-1.traj", "swe-agent"),
        ("swe_agent/truncated.traj", "swe-agent"),  # claimed from its head; reading it fails
        ("swe_agent/metadata.yaml", None),
        ("swe_agent", None),
        ("openai_chat.jsonl", "openai-chat"),
        ("openai_conversation.json", "openai-chat"),
        ("mmsql_multiagent.json", "text2sql-multiagent"),
        ("mmsql_oneshot.json", "text2sql-multiagent"),
        ("mmsql_dataset.json", None),  # the dataset: gold answers, no predictions
        ("predictions.sql.txt", "sql-lines"),
        ("prose.txt", None),
        ("pairs.jsonl", "jsonl-pairs"),
        ("aider.chat.history.md", "aider"),
        ("claude_code.jsonl", "claude-code"),
        ("empty.jsonl", None),
        ("latin1.json", None),
    ],
)
def test_detect_fixtures(name: str, expected: str | None) -> None:
    assert detect(FIXTURES / name) == expected


def test_detect_ignores_file_names(tmp_path: Path) -> None:
    misnamed = tmp_path / "notes.traj"
    misnamed.write_text("just some notes\nnothing else\n")
    renamed = tmp_path / "data.txt"
    renamed.write_bytes((FIXTURES / "swe_agent" / "demo__repo-1.traj").read_bytes())
    assert detect(misnamed) is None
    assert detect(renamed) == "swe-agent"


def test_head_text_forgives_a_character_cut_at_the_head_end() -> None:
    head = ("é" * HEAD_BYTES).encode()[:HEAD_BYTES - 1]
    assert head_text(head) is not None
    assert head_text(b"\x00\x01binary") is None
    assert head_text(bytes(range(128, 256)) * 4) is None


def test_sql_sniff_is_strict(tmp_path: Path) -> None:
    mostly_prose = tmp_path / "a.txt"
    mostly_prose.write_text("SELECT 1\n" + "some prose line\n" * 3)
    capitalised = tmp_path / "b.txt"
    capitalised.write_text("Select the best answer from the list.\nSelect one.\n")
    assert detect(mostly_prose) is None
    assert detect(capitalised) is None


# --- errors for whole files --------------------------------------------------------------------


def test_unknown_format_names_the_file() -> None:
    with pytest.raises(ParseError, match="prose.txt: unknown log format"):
        read_calls(FIXTURES / "prose.txt")


def test_forced_unknown_format_lists_known_names() -> None:
    with pytest.raises(ValueError, match="known formats: openhands, swe-agent"):
        read_calls(FIXTURES / "prose.txt", format="nope")


def test_empty_file() -> None:
    with pytest.raises(ParseError, match="empty file"):
        read_calls(FIXTURES / "empty.jsonl")
    for name in FORMATS:
        with pytest.raises(ParseError, match="empty file"):
            list(read_calls(FIXTURES / "empty.jsonl", name))


def test_truncated_json_document() -> None:
    with pytest.raises(ParseError, match=r"truncated\.traj:\d+: truncated JSON document"):
        list(read_calls(FIXTURES / "swe_agent" / "truncated.traj"))


def test_not_utf8_json_document() -> None:
    with pytest.raises(ParseError, match="not UTF-8"):
        list(read_calls(FIXTURES / "latin1.json", "text2sql-multiagent"))


def test_json_lines_with_no_readable_line_raise_after_the_line_errors(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"{oops\n\xff\xfe\n")
    items = []
    with pytest.raises(ParseError, match="no readable JSON line"):
        for item in read_calls(path, "jsonl-pairs"):
            items.append(item)
    assert [(e.line, e.message.split(" (")[0]) for e in items] == [(1, "invalid JSON: Expecting property name enclosed in double quotes"), (2, "not UTF-8 text")]


# --- openhands ---------------------------------------------------------------------------------


def test_openhands_output_jsonl() -> None:
    calls, errors = read_all(FIXTURES / "openhands_output.jsonl")
    first_output = 'Look first.\n{"command": "ls"}\n{"command": "view", "path": "/a"}'
    system_user = messages(("system", "You are a helper."), ("user", "Fix it."))
    assert calls == [
        Call(
            session_id="demo__repo-1",
            position=0,
            output_text=first_output,
            prompt_messages=system_user,
            model="tiny-llm",
            ended_at="2025-01-01T00:00:02",
            line=1,
            meta={"response_id": "r1", "tool_names": ["execute_bash", "str_replace_editor"], "completion_tokens": 9},
        ),
        Call(
            session_id="demo__repo-1",
            position=1,
            output_text='{"message": "done"}',
            prompt_messages=system_user + messages(("assistant", first_output), ("tool", "a.txt")),
            model="tiny-llm",
            ended_at="2025-01-01T00:00:04",
            line=1,
            meta={"response_id": "r2", "tool_names": ["finish"]},
        ),
    ]
    assert [(e.line, e.message.split(":")[0]) for e in errors] == [
        (2, "invalid JSON"),
        (4, "not an OpenHands run (no history list)"),
        (5, "not UTF-8 text (bad byte at column 21)"),
    ]


def test_opendevin_pairs() -> None:
    calls, errors = read_all(FIXTURES / "opendevin_output.jsonl")
    assert errors == []
    assert calls == [
        Call("Q_1", 0, "Let me compute.\nprint(1)", messages(("user", "Answer.")), model="gpt-old",
             ended_at="2024-05-29T10:00:01", line=1, meta={"action": "run_ipython"}),
        Call("Q_1", 1, "It is 1.", messages(("user", "Answer."), ("assistant", "Let me compute.\nprint(1)"), ("user", "1")),
             model="gpt-old", ended_at="2024-05-29T10:00:02", line=1, meta={"action": "message"}),
    ]  # fmt: skip


def test_openhands_runtime_list_with_repr_metadata() -> None:
    calls, errors = read_all(FIXTURES / "openhands_runtime.json")
    first = 'Running it.\n{"command": "python app.py"}'
    assert calls == [
        Call("openhands_runtime", 0, first, messages(("user", "Run the app.")), model="tiny-llm",
             ended_at="2025-01-27T22:45:13", meta={"response_id": "rt1", "tool_names": ["execute_bash"]}),
        Call("openhands_runtime", 1, "Done: it printed hello.",
             messages(("user", "Run the app."), ("assistant", first), ("tool", "hello")), ended_at="2025-01-27T22:45:15"),
    ]  # fmt: skip
    # The repr string holds a call, not a literal: refused, never evaluated.
    assert [e.message for e in errors] == ["openhands_runtime: event 4: neither JSON nor a Python literal (ValueError)"]


def test_openhands_completion_log_folder_and_files() -> None:
    folder = FIXTURES / "openhands_logs"
    calls, errors = read_all(folder)
    first = Call(folder.name, 0, "Hi!\n<execute_bash>\necho hi\n", prompt_text="SYSTEM: be brief\n----------\nUSER: say hi\n",
                 meta={"log_number": 1})  # fmt: skip
    assert calls[0] == first
    assert (calls[1].position, calls[1].output_text) == (1, "Done.\n<finish></finish>")
    assert [e.message for e in errors] == ["no matching response_003.log"]
    # Either file of a pair reads as that same pair.
    assert read_all(folder / "prompt_001.log")[0] == [first]
    assert read_all(folder / "response_001.log")[0] == [first]


# --- swe-agent ---------------------------------------------------------------------------------


def test_swe_agent_traj() -> None:
    calls, errors = read_all(FIXTURES / "swe_agent" / "demo__repo-1.traj")
    before = messages(("system", "SETTING: a shell."), ("user", "Here is a demonstration."), ("assistant", "DEMO reply"),
                      ("user", "ISSUE: fix a.py"))  # fmt: skip
    first = "DISCUSSION\nList files.\n```\nls\n```"
    assert errors == []
    assert calls == [
        Call("demo__repo-1", 0, first, before, model="tiny-model", meta={"step": 0}),
        Call("demo__repo-1", 1, "DISCUSSION\nDone.\n```\nsubmit\n```",
             before + messages(("assistant", first), ("user", "a.py")), model="tiny-model", meta={"step": 1}),
    ]  # fmt: skip


# --- openai-chat -------------------------------------------------------------------------------


def test_openai_chat_jsonl() -> None:
    calls, errors = read_all(FIXTURES / "openai_chat.jsonl")
    terse = messages(("system", "Be terse."), ("user", "List files."))
    assert calls == [
        Call("req-1", 0, '{"cmd": "ls"}', terse, model="tiny-chat", line=1,
             meta={"choice": 0, "tool_names": ["bash"], "completion_tokens": 7}),
        Call("line-2", 0, "Hello.", messages(("user", "Hi")), line=2, meta={"turn": 1}),
        Call("line-2", 1, "4", messages(("user", "Hi"), ("assistant", "Hello."), ("user", "2+2?")), line=2, meta={"turn": 3}),
        Call("line-5", 0, "A", messages(("user", "Pick")), line=5, meta={"choice": 0}),
        Call("line-5", 1, "B", messages(("user", "Pick")), line=5, meta={"choice": 1}),
    ]  # fmt: skip
    assert [(e.line, e.message.split(":")[0]) for e in errors] == [(3, "invalid JSON"), (4, "line-4")]


def test_openai_conversation_with_object_arguments() -> None:
    calls, errors = read_all(FIXTURES / "openai_conversation.json")
    first = 'Let me look.\n{"command": "ls db"}'
    start = messages(("system", "You are a SQL agent."), ("user", "Count rows."))
    assert errors == []
    assert calls == [
        Call("sf_1#0", 0, first, start, meta={"turn": 2, "tool_names": ["execute_bash"]}),
        Call("sf_1#0", 1, '{"sql": "SELECT count(*) FROM t"}', start + messages(("assistant", first), ("tool", "t.csv")),
             meta={"turn": 4, "tool_names": ["execute_sql"]}),
    ]  # fmt: skip


# --- text2sql ----------------------------------------------------------------------------------


def test_text2sql_multiagent() -> None:
    calls, errors = read_all(FIXTURES / "mmsql_multiagent.json")
    turn1 = messages(("user", "How many items?"))
    turn3 = turn1 + messages(("assistant", "SELECT count(*) FROM items"), ("user", "Top one"))
    best = "SELECT name FROM items ORDER BY price DESC LIMIT 1"
    detector = '{"answerable": "ambiguous", "type": "ambiguous", "answer": "Do you mean the most expensive item?"}'
    decomposer = "Subquestion 1: count items.\nSQL ```sql SELECT count(*) FROM items```\nQuestion Solved."
    meta1, meta3 = {"db_name": "shop", "turn": 1}, {"db_name": "shop", "turn": 3}
    assert errors == []
    assert calls == [
        Call("7", 0, "YES", turn1, agent="Detector", meta=meta1),
        Call("7", 1, decomposer, turn1, agent="Decomposer", meta=meta1),  # from a Python-repr string
        Call("7", 2, best, turn3, agent="Rewriter", meta=meta3),  # the empty rewritten output is skipped
        Call("7", 3, detector, turn3, agent="Detector", meta=meta3),
        Call("7", 4, best, turn3, agent="Refiner", meta=meta3),  # the Decomposer's process was empty
    ]


def test_text2sql_one_shot() -> None:
    calls, errors = read_all(FIXTURES / "mmsql_oneshot.json")
    assert calls == [
        Call("3", 0, "```sql\nSELECT count(*) FROM items\n```", messages(("user", "How many items?")),
             meta={"db_name": "shop", "turn": 1}),
    ]  # fmt: skip
    assert [e.message for e in errors] == ["dialogue 1 has no turns list"]


def test_sql_lines() -> None:
    calls, errors = read_all(FIXTURES / "predictions.sql.txt")
    name = "predictions.sql.txt"
    assert calls == [
        Call(name, 0, "SELECT count(*) FROM singer", line=1),
        Call(name, 1, "SELECT name FROM singer ORDER BY age", line=2),
        Call(name, 4, "SELECT avg(age) FROM singer", line=5),  # position = line index: line 3 is blank
    ]
    assert [(e.line, e.message) for e in errors] == [(4, "not UTF-8 text (bad byte at column 12)")]


# --- generic pairs, aider, claude code ---------------------------------------------------------


def test_jsonl_pairs() -> None:
    calls, errors = read_all(FIXTURES / "pairs.jsonl")
    assert calls == [
        Call("line-1", 0, " 4", prompt_text="2+2=", model="tiny", line=1),
        Call("x7", 0, "cat", prompt_text="Translate: chat", line=2),
    ]
    assert [(e.line, e.message.split(":")[0]) for e in errors] == [(3, "invalid JSON"), (4, "expected prompt/completion or input/output keys")]


def test_instruction_records_are_pairs_not_openhands_runs(tmp_path: Path) -> None:
    path = tmp_path / "alpaca.jsonl"
    path.write_text(json.dumps({"instruction": "Greet.", "input": "Bob", "output": "Hi Bob", "history": [["q", "a"]]}) + "\n")
    assert detect(path) == "jsonl-pairs"
    assert read_all(path) == ([Call("line-1", 0, "Hi Bob", prompt_text="Greet.\n\nBob", line=1)], [])


def test_aider_history() -> None:
    calls, errors = read_all(FIXTURES / "aider.chat.history.md")
    change = 'Here is the change:\n\nhello.py\n```python\ndef hello():\n    return "hi"\n```'
    first, second = "2024-08-05 10:11:12", "2024-08-06 09:00:00"
    assert errors == []
    assert calls == [
        Call(first, 0, change, messages(("user", "add a hello function")), model="gpt-4o", started_at="2024-08-05T10:11:12", line=10),
        Call(first, 1, "Done: `main()` calls `hello()`.",
             messages(("user", "add a hello function"), ("assistant", change), ("user", "now call it\nfrom main")),
             model="gpt-4o", started_at="2024-08-05T10:11:12", line=24),
        Call(second, 0, "Hello! How can I help?", messages(("user", "hi")), started_at="2024-08-06T09:00:00", line=30),
    ]  # fmt: skip


def test_claude_code_stream_json() -> None:
    calls, errors = read_all(FIXTURES / "claude_code.jsonl")
    first = 'Listing.\n{"command": "ls"}'
    assert errors == []
    assert calls == [
        Call("s1", 0, first, messages(("user", "List files")), model="claude-tiny-1", line=3,
             meta={"message_id": "m1", "tool_names": ["Bash"]}),
        Call("s1", 1, "One file: a.py.", messages(("user", "List files"), ("assistant", first), ("tool", "a.py")),
             model="claude-tiny-1", line=7, meta={"message_id": "m2"}),
    ]  # fmt: skip


# --- one huge line -----------------------------------------------------------------------------

# VmHWM is this process image's own peak: ru_maxrss would also count the forked parent's pages
# (Linux carries the high-water mark across exec), and pytest's process can be large by then.
_PEAK_SCRIPT = """
import json, sys
from pathlib import Path
from specx.store.formats import detect, read_calls
path = Path(sys.argv[1])
sizes = [len(call.output_text) + len(call.prompt_text) for call in read_calls(path)]
peak_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps([detect(path), sizes, peak_kib]))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="reads the peak from /proc/self/status")
def test_100mb_single_line_keeps_memory_bounded(tmp_path: Path) -> None:
    path = tmp_path / "huge.jsonl"
    chunk_mib = 1 << 20
    with path.open("w") as f:  # written in 1 MiB chunks: the test itself stays small
        f.write('{"prompt": "')
        for _ in range(50):
            f.write("a" * chunk_mib)
        f.write('", "completion": "')
        for _ in range(50):
            f.write("b" * chunk_mib)
        f.write('"}\n')
    result = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    fmt, sizes, peak_kib = json.loads(result.stdout)
    assert (fmt, sizes) == ("jsonl-pairs", [100 * chunk_mib])
    # Bytes, decoded text and parsed strings each hold ~100 MB at worst; 5x would mean copies pile up.
    assert peak_kib < 500 * 1024


# --- the real logs in ../shared/agent-data -----------------------------------------------------

needs_agent_data = pytest.mark.skipif(not AGENT_DATA.is_dir(), reason="../shared/agent-data is not here")

# Every real file and folder that is a log, with its format; everything else must be unclaimed.
REAL_FORMATS = {
    "openhands/multi_swe_bench_example_output.jsonl": "openhands",
    "openhands/prontoqa_codeact_v1.5_gpt-4o_output.jsonl": "openhands",
    "openhands/runtime_traj_basic.json": "openhands",
    "text2sql-mmsql/multi-agent_gemini-w.json": "text2sql-multiagent",
    "text2sql-mmsql/one-shot_gpt-4-turbo.json": "text2sql-multiagent",
    "text2sql-spider-dail-spider2/dail-sql_gpt-4_spider-dev_pred.sql.txt": "sql-lines",
    "text2sql-spider-dail-spider2/dail-sql_gpt-4-self-consistency_spider-dev_pred.sql.txt": "sql-lines",
    "text2sql-spider-dail-spider2/spider2-agent-tc_claude-3-7-sonnet_sf_bq024.json": "openai-chat",
}


def _expected_real_format(path: Path) -> str | None:
    relative = path.relative_to(AGENT_DATA).as_posix()
    if path.suffix == ".traj":
        return "swe-agent"
    if "integration_mock/" in relative and (path.suffix == ".log" or path.name.startswith("test_")):
        return "openhands"  # the test_* folders and their prompt/response files
    return REAL_FORMATS.get(relative)


@needs_agent_data
def test_detect_every_real_file() -> None:
    wrong = {}
    for path in sorted(AGENT_DATA.rglob("*")):
        expected = _expected_real_format(path)
        if detect(path) != expected:
            wrong[path.relative_to(AGENT_DATA).as_posix()] = (detect(path), expected)
    assert wrong == {}


def _count(path: Path) -> tuple[int, int]:
    calls, errors = read_all(path)
    return len(calls), len(errors)


@needs_agent_data
def test_real_swe_agent_trajectories() -> None:
    trajs = sorted(AGENT_DATA.glob("swe-agent-multi-swe-bench-java/trajs/*/*.traj"))
    assert len(trajs) == 45
    by_model: Counter[str | None] = Counter()
    for path in trajs:
        calls, errors = read_all(path)
        steps = json.loads(path.read_text())["trajectory"]
        assert (len(calls), errors) == (len(steps), [])
        by_model[calls[0].model] += len(calls)
        # The prompt of step i ends just before the i-th assistant message of the history.
        assert calls[-1].prompt_messages[-2]["role"] == "assistant"
    assert sum(by_model.values()) == 1154
    assert by_model == {"doubao-pro-128k": 442, "deepseek-coder-v2": 205, "gpt-4o-mini-2024-07-18": 191,
                        "deepseek-chat-v2": 176, "gpt-4o-2024-05-13": 140}  # fmt: skip


@needs_agent_data
def test_real_openhands() -> None:
    calls, errors = read_all(AGENT_DATA / "openhands" / "multi_swe_bench_example_output.jsonl")
    assert errors == []
    assert Counter(call.session_id for call in calls) == {"ponylang__ponyc-4595": 23, "ponylang__ponyc-4593": 33, "ponylang__ponyc-4588": 49}
    assert len({call.meta["response_id"] for call in calls}) == 105  # README: 105 LLM calls
    assert calls[0].prompt_messages[0]["role"] == "system"
    assert _count(AGENT_DATA / "openhands" / "prontoqa_codeact_v1.5_gpt-4o_output.jsonl") == (17, 0)
    assert _count(AGENT_DATA / "openhands" / "runtime_traj_basic.json") == (2, 0)
    mock = AGENT_DATA / "openhands" / "integration_mock"
    folders = {f"{p.parent.name}/{p.name}": _count(p) for p in sorted(mock.glob("*/*"))}
    assert folders == {
        "CodeActAgent/test_edits": (5, 0),
        "CodeActAgent/test_ipython": (3, 0),
        "CodeActAgent/test_write_simple_script": (4, 0),
        "CodeActSWEAgent/test_edits": (5, 0),
    }


@needs_agent_data
def test_real_text2sql() -> None:
    calls, errors = read_all(AGENT_DATA / "text2sql-mmsql" / "multi-agent_gemini-w.json")
    assert errors == []
    assert len({call.session_id for call in calls}) == 149
    assert Counter(call.agent for call in calls) == {"Detector": 808, "Decomposer": 649, "Rewriter": 247, "Refiner": 29}
    assert _count(AGENT_DATA / "text2sql-mmsql" / "one-shot_gpt-4-turbo.json") == (813, 0)  # 819 turns, 6 without predict
    spider = AGENT_DATA / "text2sql-spider-dail-spider2"
    for name in ("dail-sql_gpt-4_spider-dev_pred.sql.txt", "dail-sql_gpt-4-self-consistency_spider-dev_pred.sql.txt"):
        calls, errors = read_all(spider / name)
        assert (len(calls), errors, calls[-1].position) == (1034, [], 1033)
    calls, errors = read_all(spider / "spider2-agent-tc_claude-3-7-sonnet_sf_bq024.json")
    assert (len(calls), errors) == (25, [])
    assert Counter(name for call in calls for name in call.meta["tool_names"]) == {"execute_bash": 24, "execute_snowflake_sql": 1}
