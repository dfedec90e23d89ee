"""The allocator interface the serving loop drives (issue 18 §3): what an allocator that
implements only the abstract methods gets by default, that the loop asks every allocator the
same way (no manager import, no probing), the public accessors of ``Server`` that ``simulate``
uses, the progress callback, and the memory sizing ``simulate`` and ``fleet`` share."""
from __future__ import annotations

import ast
import inspect
from typing import Sequence

import pytest

from pagedkv.cli import main
from pagedkv.sim import scheduler
from pagedkv.sim.baselines import Breakdown, KVAllocator, PagedAllocator, ReservationAllocator
from pagedkv.sim.costmodel import CostModel
from pagedkv.sim.fleet import ReplicaAllocator
from pagedkv.sim.request import Request
from pagedkv.sim.samples import SampleAllocator
from pagedkv.sim.scheduler import Guards, Server, simulate
from pagedkv.sim.tiered import TieredAllocator

FREE = CostModel(kv_bytes_per_token=1, weight_bytes=0, overhead_s=1.0)  # every iteration: ~1 s


def req(rid: str, prompt: int, output: int, arrival: float = 0.0, **kw) -> Request:
    return Request(rid, arrival, ((hash(rid) & 0xFFFF, prompt),), output, **kw)


class Slots(KVAllocator):
    """The smallest allocator: ``capacity`` token slots, a request takes prompt + output at
    admission. Only the abstract methods; everything else is the interface's default."""

    def __init__(self, capacity: int) -> None:
        self.name, self.capacity = "slots", capacity
        self.held: dict[str, tuple[int, int]] = {}  # req_id -> (reserved, length)

    def admit(self, req: Request, generated: int = 0) -> bool:
        if sum(r for r, _ in self.held.values()) + req.total_len > self.capacity:
            return False
        self.held[req.req_id] = (req.total_len, req.prompt_len + generated)
        return True

    def step(self, req_ids: Sequence[str]) -> int:
        for r in req_ids:
            size, n = self.held[r]
            self.held[r] = (size, n + 1)
        return len(req_ids)

    def release(self, req_id: str) -> None:
        del self.held[req_id]

    def num_seqs(self, req_id: str) -> int:
        return 1

    def breakdown(self, blocked: Request | None = None) -> Breakdown:
        used = sum(n for _, n in self.held.values())
        reserved = sum(r for r, _ in self.held.values())
        return Breakdown(used, reserved - used, 0, 0, self.capacity - reserved)

    @property
    def kv_tokens(self) -> int:
        return sum(n for _, n in self.held.values())


def test_the_defaults_describe_an_allocator_without_blocks_host_or_sharing():
    a = Slots(100)
    assert (a.block_size, a.num_blocks, a.num_free_blocks, a.copies, a.coalesces) == (1, 0, 0, 0, False)
    assert a.admit(req("r", 10, 5))
    assert a.freeable_blocks("r") is None  # frees its whole range
    assert a.swap_out("r") is False and "r" in a.held  # declined: nothing changed
    with pytest.raises(ValueError, match="not swapped out"):
        a.swap_in("r")
    assert a.take_transfer_seconds(0.5) == 0.0
    assert a.max_steps(["r"], 4) == 0  # no stretch: the loop steps one at a time
    assert a.step_n(["r"], 3) == 3 and a.kv_tokens == 13
    with pytest.raises(ValueError, match="n must be an int"):
        a.step_n(["r"], -1)
    assert a.sharing() == (0, 0) and a.usage() is None


def test_an_allocator_with_only_the_abstract_methods_runs_under_every_guard():
    reqs = [req(f"r{i}", 10, 5) for i in range(6)]  # 15 slots each; 40 slots hold two
    for guards in (Guards(), Guards.all_on(), Guards.all_off()):
        res = simulate(reqs, Slots(40), FREE, guards=guards)
        assert res.completed and res.finished == 6 and res.preemptions == 0
        assert res.block_size == 1 and res.copies == 0
        assert int(res.steps.batch.max()) == 2  # the watermark guard counts blocks: off here
    with pytest.raises(ValueError, match="coalesce"):
        Server(Slots(40), record_steps=False, coalesce=True)


def test_manager_backed_allocators_report_their_blocks():
    for a in (PagedAllocator(50, 16), SampleAllocator(50, 16), ReplicaAllocator(50, 16), TieredAllocator(50, 16, 8)):
        assert (a.block_size, a.num_blocks, a.capacity) == (16, 50, 800)
        assert a.num_free_blocks == a.m.num_free_blocks == 50
        assert a.admit(req("a", 40, 4))  # 3 blocks, none shared
        assert a.num_free_blocks == 47 and a.freeable_blocks("a") == 3
        a.check()
    assert ReplicaAllocator(50, 16).coalesces and not PagedAllocator(50, 16).coalesces
    assert ReservationAllocator(800, "oracle").num_blocks == 0


def test_the_loop_imports_no_manager_and_probes_no_allocator():
    tree = ast.parse(inspect.getsource(scheduler))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m and "manager" in m for m in imported), imported
    probes = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
              and n.func.id in ("hasattr", "getattr") and not (n.args and isinstance(n.args[0], ast.Name)
                                                              and n.args[0].id in ("s", "self"))]
    assert probes == [], probes  # getattr(s, name) in request_log reads the loop's own records


def test_server_accessors_and_request_order():
    s = Server(PagedAllocator(20, 4), FREE, request_order=["b", "a", "never"])
    s.submit(req("a", 4, 2))
    s.submit(req("b", 4, 2, arrival=5.0))
    assert (s.num_pending, s.num_done) == (2, 0)
    assert s.step() and s.num_pending == 1  # a arrived and ran its first iteration
    assert s.status().startswith("t=") and "batch=1" in s.status()
    assert "0 of 2 finished" in s.stall_report()  # an id ordered but never submitted is skipped
    s.drain()
    assert (s.num_pending, s.num_done) == (0, 2)
    assert "within 7 iterations" in s.cap_report(7, 2)


def test_progress_takes_a_callback_and_the_loop_draws_nothing(capsys):
    seen = []
    simulate([req("a", 4, 3), req("b", 4, 3, arrival=10.0)], PagedAllocator(10, 4), FREE,
             progress=lambda done, status, final: seen.append((done, status.split()[0][:2], final)))
    assert seen[-1] == (2, "t=", True) and all(not f for _, _, f in seen[:-1]) and len(seen) > 2
    assert capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="progress must be"):
        simulate([req("a", 4, 3)], PagedAllocator(10, 4), FREE, progress="yes")


def test_fleet_refuses_a_replica_whose_slot_ids_overflow_int32(capsys):
    """Before: only the block count was capped for the fleet, so 300,000 GiB in blocks of
    1,024 tokens (2,343,750 blocks, 2.4 billion slots) went on to build replicas whose slot
    ids cannot be int32. Now it is refused as ``simulate`` refuses it."""
    rc = main(["fleet", "--kv-gib", "300000", "--block-size", "1024", "--num-requests", "10"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "blocks per replica; the simulator holds at most 2,097,151" in err
