import pytest


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh $ORCHESTRATOR_HOME per test."""
    path = tmp_path / "home"
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(path))
    return path
