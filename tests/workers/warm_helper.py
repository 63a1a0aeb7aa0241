"""A module beside tests/workers/warm_world.py, as a two-file project has."""


def fail(what):
    raise ValueError("failed on purpose in " + what)
