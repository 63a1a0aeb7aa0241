import pytest


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh $ORCHESTRATOR_HOME per test; jobs a failed test left running are cancelled."""
    path = tmp_path / "home"
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(path))
    yield path
    if (path / "state.db").exists():
        import orchestrator

        for job in orchestrator.list_jobs():
            if job["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
                orchestrator.cancel(job["job_id"], wait_seconds=30)
