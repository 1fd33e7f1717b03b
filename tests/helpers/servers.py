"""Real `specx serve` processes for the tests: `Server` on a free loopback port (ready once /health
answers), the requests the tests send it (`post`, `ask`), the built-in model's name and the API key."""

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from specx.bench.task_servers import free_port, stop_process

from helpers.cli import specx_test_home

MODEL = "smollm2-135m"
KEY = "test-key"
COUNTING = "1, 2, 3, 4, 5,"  # the model goes on counting: a long, predictable output


def specx_home(tmp_path_factory) -> str:
    """The tests' SPECX_HOME (helpers.cli.specx_test_home) as a server's environment takes it."""
    return str(specx_test_home(tmp_path_factory))


class Server:
    """`python -m specx serve` on a free loopback port, ready once /health answers."""

    def __init__(self, home: str, db: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.db = db
        self.log_path = db.with_suffix(f".{self.port}.log")
        env = {**os.environ, "SPECX_HOME": home}
        env.pop("SPECX_API_KEY", None)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "specx", "serve", "--port", str(self.port), "--db",
                                         str(db), *args], stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"specx serve exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise AssertionError(f"specx serve did not become ready:\n{self.log()[-3000:]}")

    def client(self, api_key: str = KEY, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120, **kwargs)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        request = urllib.request.Request(self.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(request, timeout=10) as r:
            lines = r.read().decode().splitlines()
        return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line and not line.startswith("#"))}

    def stop(self) -> int:
        """SIGTERM; the exit status is -SIGTERM (uvicorn re-raises the signal after a clean shutdown)."""
        return stop_process(self.proc)


def post(url: str, data: bytes, key: str | None = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def ask(client, content: str, max_tokens: int = 16, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                          max_tokens=max_tokens, temperature=0, **kwargs)
