"""Code and setup on a node before it runs anything: the synced tree (orchestrator/sync.py)
shipped by content, then the setup commands (once per node and key, on the agent's side:
agents/cache.py).

A preparation runs on a thread of a small pool (sending files is blocking work), talks to
the node through its channel's requests (orchestrator/channel.py), and posts what happened
to the controller's event loop: ``SyncProgress`` while blobs travel, then ``Prepared``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agents import commands as C
from agents import protocol as P
from orchestrator import events as E
from orchestrator import sync
from orchestrator.attempt import Failure
from orchestrator.channel import Channel, R, ask
from orchestrator.errors import LaunchError, OrchestratorError
from orchestrator.loop import EventLoop
from orchestrator.plan import plan_attempt
from orchestrator.spec import JobSpec
from orchestrator.state import FailureCause
from orchestrator.store import Store

log = logging.getLogger("orchestrator.controller")

SYNC_TIMEOUT = 120.0  # seconds for one sync request to be answered
SETUP_ANSWER_MARGIN = 60.0  # seconds past setup_timeout before a silent agent is given up
IN_FLIGHT = 8  # chunks of a blob sent before their replies are awaited


class ChannelEnded(Exception):
    """The node's channel ended under a preparation: it is prepared again once back."""


class Preparer:
    """Ships the job's tree to nodes and runs its setup there, a node per thread."""

    def __init__(self, job_id: str, spec: JobSpec, spec_dir: str, store: Store,
                 loop: EventLoop):
        self.job_id, self.spec, self.spec_dir, self.store = job_id, spec, spec_dir, store
        self.loop = loop
        self.needed = bool(spec.setup) or (spec.sync is not None and any(
            not n.is_local for n in spec.nodes))
        self._manifest: sync.Manifest | None = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(16, thread_name_prefix="prepare")

    def tree(self) -> sync.Manifest:
        """The job's tree: hashed once (at submit) and kept with the job, so that a resumed
        controller ships the same tree as the one the running workers got."""
        with self._lock:
            if self._manifest is None:
                assert self.spec.sync is not None
                root = os.path.join(self.spec_dir, os.path.expanduser(self.spec.sync.path))
                saved = self.store.job_dir(self.job_id) / sync.MANIFEST_FILE
                if saved.exists():
                    self._manifest = sync.Manifest.load(saved, root)
                else:
                    self._manifest = sync.build_manifest(root, self.spec.sync.exclude,
                                                         self.spec.sync.max_bytes)
                    self._manifest.save(saved)
            return self._manifest

    @property
    def tree_name(self) -> str | None:
        return self._manifest.tree if self._manifest is not None else None

    def start(self, node_index: int, host: str, is_local: bool, channel: Channel) -> None:
        """Prepare one node in the background; ``Prepared`` tells how it went."""
        self._pool.submit(self._prepare, node_index, host, is_local, channel)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _prepare(self, index: int, host: str, is_local: bool, channel: Channel) -> None:
        try:
            tree = None
            if self.spec.sync is not None:
                tree = self.tree().tree
                if not is_local:
                    self._push(index, host, channel)
            failure = self._setup(index, host, channel, tree) if self.spec.setup else None
            self.loop.post(E.Prepared(index, failure))
        except ChannelEnded:
            self.loop.post(E.Prepared(index, interrupted=True))
        except OrchestratorError as exc:
            self.loop.post(E.Prepared(index, Failure(
                FailureCause.LAUNCH_FAILED, str(exc), node_index=index, host=host)))
        except Exception as exc:  # a bug, or the channel broke under us: say which node
            if channel.closed:
                self.loop.post(E.Prepared(index, interrupted=True))
            else:
                self.loop.post(E.Prepared(index, Failure(
                    FailureCause.LAUNCH_FAILED, f"{host}: preparing failed: {exc!r}",
                    node_index=index, host=host)))

    def _setup(self, index: int, host: str, channel: Channel, tree: str | None
               ) -> Failure | None:
        # The node's own env and workdir, as its workers will have them (per-rank
        # placeholders have no value here: those variables are left out).
        node_plan = plan_attempt(self.spec, self.job_id, node_indices=[index],
                                 spec_dir=self.spec_dir, sync_tree=tree).nodes[0]
        env = {k: node_plan.env[k] for k in self.spec.env if k in node_plan.env}
        # Once per node: its name is in the key (nodes may share a home, and with it the
        # agents' marker directory; the agent adds the machine).
        key = hashlib.sha256(json.dumps([self.spec.setup_script, tree, node_plan.workdir,
                                         env, self.spec.nodes[index].host]).encode())
        limit = self.spec.setup_timeout
        # The agent stops the setup at the limit; the controller waits a little longer for
        # it to say so (the stop itself, a slow link).
        reply = ask(channel, C.RunSetup(key.hexdigest()[:32], self.spec.setup_script,
                                        node_plan.workdir, env, limit),
                    None if limit is None else limit + SETUP_ANSWER_MARGIN)
        if reply is None and not channel.closed:
            return Failure(FailureCause.SETUP_FAILED,
                           f"setup on {host} did not answer within {limit:g}s (setup_timeout)",
                           node_index=index, host=host)
        if reply is None:
            raise ChannelEnded()
        if isinstance(reply, P.Failed):
            raise LaunchError(f"{host}: setup: {reply.error}")
        if reply.timed_out:
            return Failure(FailureCause.SETUP_FAILED,
                           f"setup on {host} did not finish within {limit:g}s (setup_timeout): "
                           "stopped", node_index=index, host=host,
                           stderr_tail=list(reply.tail))
        if reply.exit_code != 0:
            return Failure(FailureCause.SETUP_FAILED,
                           f"setup failed on {host} with exit code {reply.exit_code}",
                           node_index=index, host=host, exit_code=reply.exit_code,
                           stderr_tail=list(reply.tail))
        return None

    def _ask(self, host: str, channel: Channel, request: C.Request[R]) -> R:
        reply = ask(channel, request, SYNC_TIMEOUT)
        if reply is None:
            raise ChannelEnded() if channel.closed else \
                LaunchError(f"{host}: no answer to {request.OP} within {SYNC_TIMEOUT:g}s")
        if isinstance(reply, P.Failed):
            raise LaunchError(f"{host}: sync: {reply.error}")
        return reply

    def _push(self, index: int, host: str, channel: Channel) -> None:
        """Send the blobs the node lacks (pipelined chunks), then have it build the tree."""
        manifest = self.tree()
        assert self.spec.sync is not None
        by_sha = {e.sha256: e for e in manifest.entries}
        reply = self._ask(host, channel, C.MissingBlobs(tuple(sorted(by_sha))))
        missing = [sha for sha in reply.missing if sha in by_sha]
        progress: dict[str, Any] = {
            "tree": manifest.tree, "files": len(manifest.entries),
            "bytes": manifest.total_bytes, "blobs_sent": 0, "bytes_sent": 0,
            "to_send": sum(by_sha[s].size for s in missing), "done": False}
        self.loop.post(E.SyncProgress(index, dict(progress)))
        last_report = time.monotonic()
        for sha in missing:
            entry = by_sha[sha]
            with open(manifest.root / entry.path, "rb") as f:
                offset, in_flight = 0, []
                while True:
                    data = f.read(sync.CHUNK)
                    if not data and offset < entry.size:
                        raise LaunchError(f"sync: {entry.path} changed since the tree was "
                                          "hashed (submit again to ship the new version)")
                    last = offset + len(data) >= entry.size
                    in_flight.append(channel.request(C.PutChunk(
                        sha, offset, base64.b64encode(data).decode(), last)))
                    offset += len(data)
                    progress["bytes_sent"] += len(data)
                    if len(in_flight) >= IN_FLIGHT or last:  # a few chunks in flight
                        for future in in_flight:
                            put = future.result(SYNC_TIMEOUT)
                            if put is None:
                                raise ChannelEnded()
                            if isinstance(put, P.Failed) or not put.ok:
                                raise LaunchError(f"{host}: sync: {put.error}")
                        in_flight = []
                    if last:
                        break
            progress["blobs_sent"] += 1
            if time.monotonic() - last_report > 0.2:  # a bar, not a message per file
                last_report = time.monotonic()
                self.loop.post(E.SyncProgress(index, dict(progress)))
        self._ask(host, channel, C.BuildTree(manifest.tree, manifest.to_command(),
                                             self.spec.sync.keep))
        progress["done"] = True
        self.loop.post(E.SyncProgress(index, dict(progress)))
