"""What the test modules share, so that no test module imports another: `cli` (specx run as the
tests run it, their home folder), `models` (a tiny random Llama and trees for it), `decoding` (fake
drafters and draft makers), `servers` (a real `specx serve` on a free port), `logs` (fixture logs
to ingest), `stores` (healthy stores and one-line errors). Pytest fixtures live in conftest.py."""
