"""Logs for ingest: the fixture logs of every format family (`FIXTURES`), those without bad
records as one folder (`good_logs`), and a file of prompt/completion pairs (`write_pairs`)."""

import json
import shutil
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "formats"


def write_pairs(path: Path, n: int = 6) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"How many rows in table t{i}?", "completion": f"SELECT count(*) FROM t{i};"}) + "\n")
    return path


def good_logs(tmp_path: Path) -> Path:
    """Fixture logs without bad records, one per format family, plus a pairs file."""
    root = tmp_path / "logs"
    (root / "swe_agent").mkdir(parents=True)
    for name in ["aider.chat.history.md", "claude_code.jsonl", "mmsql_multiagent.json", "openai_conversation.json",
                 "opendevin_output.jsonl"]:
        shutil.copy(FIXTURES / name, root / name)
    for name in ["demo__repo-1.traj", "metadata.yaml"]:
        shutil.copy(FIXTURES / "swe_agent" / name, root / "swe_agent" / name)
    write_pairs(root / "pairs.jsonl")
    return root
