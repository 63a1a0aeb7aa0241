"""The nodes table and each node's history (``node_events``): a job's nodes as submitted,
their state changes (checked against the node transition table, many nodes in one
statement), what the controller last heard of each and how far their messages are kept, and
the nodes as a status reads them (the last HISTORY changes of each, and counts of all).

Functions over a connection (or the transaction ``orchestrator.store`` opened); the clock is
the caller's (``now``), and so is ``batch`` (``storedb.update_rows``). May call ``storedb``,
``records``, ``state`` and ``errors``.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from orchestrator import storedb
from orchestrator.errors import JobNotFoundError
from orchestrator.records import NodeEvent, NodeRecord
from orchestrator.state import NodeState, check_node_transition

HISTORY = 10  # node changes a status shows per node (NodeRecord.entered counts them all)


def insert(db: sqlite3.Connection, job_id: str, hosts: list[str]) -> None:
    """A new job's nodes, PENDING."""
    db.executemany(
        "INSERT INTO nodes (job_id, node_index, host, state) VALUES (?, ?, ?, ?)",
        [(job_id, i, h, NodeState.PENDING.value) for i, h in enumerate(hosts)],
    )


def set_hosts(db: sqlite3.Connection, job_id: str, hosts: list[str]) -> None:
    """The nodes' host names, in node order (once Slurm granted them)."""
    db.executemany("UPDATE nodes SET host = ? WHERE job_id = ? AND node_index = ?",
                   [(h, job_id, i) for i, h in enumerate(hosts)])


def set_nodes(db: sqlite3.Connection, job_id: str,
              changes: list[tuple[int, NodeState, str | None, dict[str, Any]]],
              now: float, batch: bool) -> None:
    """Changes of nodes' states and fields, in order (see Store.set_nodes)."""
    states = _states(db, job_id, batch)
    rows: dict[int, dict[str, Any]] = {}
    events: list[list[Any]] = []
    for node_index, state, message, given in changes:
        if node_index not in states:
            raise JobNotFoundError(job_id)
        fields = dict(given)
        if "info" in fields:
            fields["info_json"] = json.dumps(fields.pop("info"))
        current = states[node_index]
        check_node_transition(current, state)
        states[node_index] = state
        merged = rows.setdefault(node_index, {})
        merged.pop("state", None)  # the state goes last: columns keep one order
        merged.update(fields, state=state.value)
        if current != state:
            events.append([node_index, now, state.value, message])
    storedb.update_rows(db, "nodes", "node_index", rows, batch, job_id=job_id)
    if events and not batch:
        db.executemany("INSERT INTO node_events (job_id, node_index, at, state, message)"
                       " VALUES (?, ?, ?, ?, ?)", [(job_id, *e) for e in events])
    elif events:
        db.execute("INSERT INTO node_events (job_id, node_index, at, state, message) "
                   "SELECT ?, json_extract(value, '$[0]'), json_extract(value, '$[1]'), "
                   "json_extract(value, '$[2]'), json_extract(value, '$[3]') "
                   "FROM json_each(?)", (job_id, json.dumps(events)))


def _states(db: sqlite3.Connection, job_id: str, batch: bool) -> dict[int, NodeState]:
    if batch:  # one row back, not one per node (see storedb.update_rows for why that matters)
        row = db.execute("SELECT json_group_object(node_index, state) AS states FROM nodes "
                         "WHERE job_id = ?", (job_id,)).fetchone()
        pairs = json.loads(row["states"]).items()
    else:
        pairs = db.execute("SELECT node_index, state FROM nodes WHERE job_id = ?",
                           (job_id,)).fetchall()
    return {int(k): NodeState(v) for k, v in pairs}


def heard(db: sqlite3.Connection, job_id: str, nodes: dict[int, float],
          silences: dict[int, float], batch: bool) -> None:
    """When each node was last heard, and the longest it went unheard (where given)."""
    storedb.update_rows(db, "nodes", "node_index", {
        i: {"heard_at": t, **({"longest_silence": silences[i]} if i in silences
                              else {})} for i, t in nodes.items()}, batch, job_id=job_id)


def acked(db: sqlite3.Connection, job_id: str, seqs: dict[int, int], batch: bool) -> None:
    """How far each node's messages are kept (its last sequence number in a checkpoint)."""
    storedb.update_rows(db, "nodes", "node_index",
                        {i: {"acked_seq": seq} for i, seq in seqs.items()}, batch,
                        job_id=job_id)


def read(db: sqlite3.Connection, job_id: str) -> list[NodeRecord]:
    """A job's nodes as a status shows them, in node order."""
    nodes = [
        NodeRecord(r["node_index"], r["host"], r["node_rank"], NodeState(r["state"]),
                   json.loads(r["info_json"] or "{}"), r["acked_seq"], r["heard_at"],
                   r["longest_silence"])
        for r in db.execute(
            "SELECT * FROM nodes WHERE job_id = ? ORDER BY node_index", (job_id,))
    ]
    # The last HISTORY changes of each node, and how often it entered each state:
    # a restart a day for a week must not make every status read them all.
    for r in db.execute(
            "SELECT * FROM (SELECT rowid AS id, node_index, at, state, message,"
            " ROW_NUMBER() OVER (PARTITION BY node_index ORDER BY at DESC, rowid DESC)"
            " AS n FROM node_events WHERE job_id = ?) WHERE n <= ? ORDER BY at, id",
            (job_id, HISTORY)):
        nodes[r["node_index"]].history.append(
            NodeEvent(r["at"], NodeState(r["state"]), r["message"]))
    for r in db.execute(
            "SELECT node_index, state, COUNT(*) FROM node_events WHERE job_id = ?"
            " GROUP BY node_index, state", (job_id,)):
        nodes[r[0]].entered[r[1]] = r[2]
    return nodes
