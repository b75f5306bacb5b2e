"""A worker without the key (``Plain``) never hands ciphertext to a handler: it refuses the task
(``Unopened``), tells its claims (``met``), and logs it once per name, not once per task."""

from __future__ import annotations

import asyncio
import logging

import pytest
from bson.binary import Binary

from mtask.security.encryption import MARK
from mtask.worker.running.sealing import NO_KEY, Plain, Unopened


def test_a_worker_without_the_key_refuses_encrypted_params_and_says_so_once_per_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    met: list[bool] = []
    plain = Plain(lambda: met.append(True))
    sealed = {MARK: Binary(b"\x02" + bytes(40), 6)}
    caplog.set_level(logging.WARNING, logger="mtask.worker.running.sealing")
    for key, name in (("a", "charge"), ("b", "charge"), ("c", "refund")):
        with pytest.raises(Unopened) as refused:
            asyncio.run(plain.params({"_id": key, "name": name, "params": sealed}))
        assert refused.value.why == NO_KEY
    assert met == [True, True, True]  # each refusal tells the claims (setting a flag)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "`charge`" in said[0] and "`refund`" in said[1], said
    # a plain task, and one whose params merely hold the mark's name, go to the handler
    assert asyncio.run(plain.params({"params": {"a": 1}})) == {"a": 1}
    lookalike = {MARK: "not ciphertext"}
    assert asyncio.run(plain.params({"params": lookalike})) == lookalike
    assert asyncio.run(plain.params({"params": None})) == {}
