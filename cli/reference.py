"""Placeholder until the reference adapter is written."""
def available() -> bool:
    return False
def why_unavailable() -> str:
    return "not installed"
