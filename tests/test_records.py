"""`record` (gateway/records.py) behaves as the frozen slots dataclass it is to the type
checker, but for refusing assignment at run time: same equality, hash, repr and replace."""

from __future__ import annotations

import dataclasses

from gateway.records import record


@record
class Rec:
    a: int
    b: str = "x"
    c: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Frozen:
    a: int
    b: str = "x"
    c: tuple[int, ...] = ()


def test_a_record_equals_hashes_and_prints_as_a_frozen_dataclass() -> None:
    r, f = Rec(1, "y", (2,)), Frozen(1, "y", (2,))
    assert r == Rec(1, "y", (2,)) and r != Rec(2)
    assert hash(r) == hash(f)  # both hash the tuple of their fields
    assert {r: 1}[Rec(1, "y", (2,))] == 1
    assert repr(r) == repr(f).replace("Frozen", "Rec")
    assert dataclasses.replace(r, a=3) == Rec(3, "y", (2,))
    assert dataclasses.astuple(r) == dataclasses.astuple(f)
    assert not hasattr(r, "__dict__")  # slots: no per-instance dict


def test_the_request_path_records_are_records() -> None:
    from gateway.admission.decision import Decision
    from gateway.pipeline.inbound import Inbound
    from gateway.state.base import Lease
    from gateway.upstream.forward import Upstream

    for cls in (Decision, Inbound, Lease):
        params = cls.__dataclass_params__  # type: ignore[attr-defined]
        assert not params.frozen and params.unsafe_hash and "__slots__" in vars(cls)
    # Upstream is not a record: its body is emptied once an engine has answered (a long
    # prompt's bytes are not held for its stream's life), so it is a mutable slots dataclass,
    # and unhashable, so nothing can key a dict on a value that changes.
    params = Upstream.__dataclass_params__  # type: ignore[attr-defined]
    assert not params.frozen and not params.unsafe_hash and "__slots__" in vars(Upstream)
    assert Upstream.__hash__ is None
