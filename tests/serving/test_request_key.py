"""A request's radix key: its prompt but the last token, packed as 32-bit words when the ids fit,
so the tree copies it instead of converting each token every time the scheduler looks."""

from __future__ import annotations

from array import array

import pytest

from hicache.errors import InvalidTokenError
from hicache.radix.packing import pack_key
from hicache.serving.request import ServeRequest


def _request(prompt: list[int]) -> ServeRequest:
    return ServeRequest("r", prompt, 4, arrival_s=0.0, namespace="tenant")


def test_the_key_is_the_prompt_but_its_last_token_as_words() -> None:
    request = _request([5, 6, 7, 8, 9])
    key = request.key
    assert isinstance(key.token_ids, array) and key.token_ids.typecode == "I"
    assert list(key.token_ids) == [5, 6, 7, 8] and key.extra_key == "tenant"
    assert request.key is key  # built once
    assert pack_key(key, 2) == (array("I", [5, 6, 7, 8]).tobytes(), 4)


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_an_id_that_does_not_fit_keeps_the_trees_own_error(bad: int) -> None:
    key = _request([1, bad, 3]).key
    assert key.token_ids == [1, bad]
    with pytest.raises(InvalidTokenError):
        pack_key(key, 1)
