"""A save that goes on beside the training: ``save(step, state, wait=False)`` returns once the
copy is set up, and the copy runs on a thread of this process while the training computes
(the next step's forward and backward read the state, and only its optimizer step changes it:
on a GPU the copy engine and the host's cores are free meanwhile). ``wait()`` returns once
the copy is done; the script calls it before anything writes to the state's tensors. The
next ``save``, a ``load`` and the interpreter's exit wait for it too (a thread not a daemon:
a save begun is never lost to a normal exit).

The time a save holds the training is then its set-up plus what ``wait()`` waited for it;
the copy's thread adds the two up as it finishes (``held``), for the save's description.
Stdlib only: part of ``orchestrator_checkpoint`` on workers' PYTHONPATH.
"""

import threading
import time


class InFlight:
    """The one save of this process still being copied (or none)."""

    def __init__(self):
        self._thread = None
        self._error = None
        self._after = None  # run by wait() on the training's thread (a planned move's hold)
        self._set_up = 0.0  # seconds save() held the training for it
        self._waited_from = None  # when wait() began to wait for it (perf_counter)

    def start(self, work, set_up, after=None):
        """Run ``work()`` on a thread; ``set_up`` seconds were held so far; ``after()`` is
        called by ``wait()`` once the copy is done."""
        self._error, self._after = None, after
        self._set_up, self._waited_from = set_up, None
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=False,
                                        name="orchestrator-checkpoint-save")
        self._thread.start()

    def _run(self, work):
        try:
            work()
        except BaseException as exc:  # raised on the training's thread, by wait()
            self._error = exc

    def held(self):
        """Seconds the training has been held for this save: its set-up, and ``wait()``'s
        wait until now (called by the copy as it finishes)."""
        waited_from = self._waited_from
        return self._set_up + (time.perf_counter() - waited_from if waited_from else 0.0)

    def wait(self):
        """Seconds waited for the copy in flight (0.0 when none); raises what the copy
        raised."""
        thread = self._thread
        if thread is None:
            return 0.0
        started = self._waited_from = time.perf_counter()
        thread.join()
        waited = time.perf_counter() - started
        self._thread = None
        error, after, self._error, self._after = self._error, self._after, None, None
        if error is not None:
            raise error
        if after is not None:
            after()
        return waited
