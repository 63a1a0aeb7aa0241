import pytest


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh $ORCHESTRATOR_HOME per test. Afterwards, jobs a failed test left running are
    cancelled, and no process of any job of the test may be left on the machine."""
    path = tmp_path / "home"
    monkeypatch.setenv("ORCHESTRATOR_HOME", str(path))
    yield path
    if not (path / "state.db").exists():
        return
    import orchestrator
    from tests.helpers import assert_no_job_processes

    for job in orchestrator.list_jobs():
        if job["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
            orchestrator.cancel(job["job_id"], wait_seconds=30)
    for job in orchestrator.list_jobs():
        assert_no_job_processes(job["job_id"], within=15)
